"""A real one-node Slurm cluster for the tests, started and stopped by this process.

Debian's ``slurm-wlm`` (22.05) and ``munge``, installed with ``apt-get`` when
missing (root only).  ``munged``, ``slurmctld`` and ``slurmd`` run in the
foreground as children of this process; configuration, key, state, spool,
logs, PID files and sockets live in one temporary directory; the daemons
listen on 127.0.0.1 only.  The node has this machine's CPUs.  ``stop()`` ends
every daemon it started by its PID, checks that no process of the cluster is
left, and removes the directory.

    reason = install()                 # None, or why Slurm cannot be had here
    cluster = SlurmCluster(workdir)
    cluster.start()
    job = cluster.sbatch(["jobs/slurm-cpu.sbatch", "in.h5", "out.h5"], cwd=..., env=...)
    job.state, job.exit_code, job.output
    cluster.stop()

Every wait has a deadline; a daemon that dies or does not come up raises
:class:`ClusterError` with the end of its log.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from mpi_util import run_deadline
from netns_cluster import kill_all

PACKAGES = ("slurm-wlm", "munge")
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue")
SBIN = ("/usr/sbin", "/sbin")
NODE = "ringmpi-node"
PARTITION = "ringmpi"


class ClusterError(RuntimeError):
    """The test cluster could not be installed, started or stopped cleanly."""


def _which(program: str) -> Optional[str]:
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    return shutil.which(program, path=path)


def missing_programs() -> List[str]:
    return [p for p in PROGRAMS if _which(p) is None]


def require_installed() -> None:
    """:func:`install`, as a test's verdict: skipped with the reason, or failed where installing broke."""
    import pytest
    try:
        reason = install()
    except ClusterError as exc:
        pytest.fail(str(exc))
    if reason is not None:
        pytest.skip(reason)


def install(timeout: float = 600.0) -> Optional[str]:
    """Install ``slurm-wlm`` and ``munge`` when any program is missing.

    Returns None when everything is there (afterwards), or the reason the
    tests must be skipped: not root, or no ``apt-get``.  Raises
    :class:`ClusterError` when, as root with apt-get, the installation fails.
    """
    missing = missing_programs()
    if not missing:
        return None
    what = f"Slurm is not installed ({', '.join(missing)} not found)"
    if os.geteuid() != 0:
        return f"{what}; the tests install {' and '.join(PACKAGES)} with apt-get only when run as root"
    if _which("apt-get") is None:
        return f"{what} and there is no apt-get to install {' and '.join(PACKAGES)}"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    deadline = time.monotonic() + timeout
    log = ""
    # the packages' scripts must not start system-wide munge/slurm services: Debian's
    # policy-rc.d hook (as container images ship it) refuses, for the install only
    policy = Path("/usr/sbin/policy-rc.d")
    added_policy = not policy.exists()
    if added_policy:
        policy.write_text("#!/bin/sh\n# added by ringmpi's tests while apt-get installs Slurm\nexit 101\n")
        policy.chmod(0o755)
    try:
        # a fresh machine may have no package lists yet: update once and retry
        for attempt in (command, ["apt-get", "update", "-q"], command):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                proc = subprocess.run(attempt, capture_output=True, text=True, env=env, timeout=left)
            except subprocess.TimeoutExpired:
                raise ClusterError(f"{' '.join(attempt)} did not finish within {timeout:.0f} s")
            log += f"$ {' '.join(attempt)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            if attempt is command and proc.returncode == 0 and not missing_programs():
                return None
    finally:
        if added_policy:
            policy.unlink()
    raise ClusterError(f"could not install {' '.join(PACKAGES)}:\n{log}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


@dataclass
class Job:
    """A finished batch job as ``scontrol show job`` reported it."""

    id: int
    state: str           # COMPLETED, FAILED, CANCELLED, TIMEOUT, ...
    exit_code: int       # the batch script's exit status
    signal: int          # the signal that ended it, or 0
    fields: Dict[str, str]
    output: str          # the job's --output file (stdout and stderr)


class SlurmCluster:
    """One controller and one node (this machine) under ``root``, a temporary directory.

    ``hosts`` (e.g. a :class:`netns_cluster.NetnsCluster`): one node per host instead,
    each ``slurmd`` entered into its host (``hosts.command``), the controller and the
    clients on the first host; ``munged`` stays here (its socket is a path, seen by all).
    """

    def __init__(self, root: Path, cpus: Optional[int] = None, hosts=None):
        self.root = Path(root)
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.ports = {}
        self.daemons: Dict[str, subprocess.Popen] = {}
        self.hosts = hosts
        self.nodes = [NODE] if hosts is None else list(hosts.names)

    def _on(self, host: Optional[str], args: Sequence, cwd=None) -> List[str]:
        """``args`` as run on ``host`` (None: the controller's host; here without ``hosts``)."""
        args = [str(a) for a in args]
        if self.hosts is None:
            return args
        return self.hosts.command(host or self.nodes[0], args, cwd)

    # ---- environment for clients --------------------------------------------------

    def env(self, base: Optional[dict] = None, **extra) -> dict:
        """``base`` (default: this process's environment) pointed at this cluster."""
        env = dict(os.environ if base is None else base)
        for name in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            del env[name]  # never inherit an outer job's settings
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), *SBIN])
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def _client(self, args: Sequence[str], timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(self._on(None, args), capture_output=True, text=True, env=self.env(),
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"{' '.join(map(str, args))} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    # ---- start ----------------------------------------------------------------

    def _write_config(self) -> None:
        # munged wants its socket's directories searchable by all, its key readable by root only
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        for sub in ("munge", "ctld", "spool", "log"):
            (self.root / sub).mkdir(mode=0o755, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.ports = {"ctld": _free_port(), "slurmd": _free_port()}
        host = socket.gethostname().split(".")[0]
        r = self.root
        if self.hosts is None:
            ctld, nodes = f"{host}(127.0.0.1)", [f"NodeName={NODE} NodeHostname={host} NodeAddr=127.0.0.1 "
                                                 f"CPUs={self.cpus} State=UNKNOWN"]
        else:
            first = self.hosts.hosts[self.nodes[0]]
            ctld = f"{first.name}({first.addr})"
            nodes = [f"NodeName={h.name} NodeHostname={h.name} NodeAddr={h.addr} CPUs={self.cpus} State=UNKNOWN"
                     for h in self.hosts.hosts.values()]
        lines = [
            "ClusterName=ringmpi-test",
            f"SlurmctldHost={ctld}",
            f"SlurmctldPort={self.ports['ctld']}",
            f"SlurmdPort={self.ports['slurmd']}",
            "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny",  # listen on 127.0.0.1 only
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r / 'ctld'}",
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            f"PlugStackConfig={r / 'plugstack.conf'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/affinity",  # --cpu-bind works as on a cluster
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=batch_sched_delay=0",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MailProg=/bin/true",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "MessageTimeout=10",
            "KillWait=5",
            "MinJobAge=600",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            *nodes,
            f"PartitionName={PARTITION} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
        ]
        (r / "plugstack.conf").write_text("")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, args: List[str], host: Optional[str] = None, here: bool = False) -> None:
        log = open(self.root / "log" / f"{name}.stderr", "w")
        try:
            args = args if here else self._on(host, args)
            self.daemons[name] = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                  env=self.env(), cwd=self.root, start_new_session=True)
        finally:
            log.close()

    def _wait(self, what: str, ready, timeout: float, daemon: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.daemons[daemon].poll() is not None:
                raise ClusterError(f"{daemon} exited ({self.daemons[daemon].returncode}) before {what}:\n"
                                   + self.logs(daemon))
            if ready():
                return
            time.sleep(0.05)
        raise ClusterError(f"{what} not reached within {timeout} s:\n" + self.logs(daemon))

    def logs(self, daemon: str) -> str:
        return (_tail(self.root / "log" / f"{daemon}.stderr")
                + _tail(self.root / "log" / f"{daemon}.log"))

    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        """Write the configuration, start the three daemons and wait for an idle node."""
        self._write_config()
        try:
            r = self.root
            self._spawn("munged", [_which("munged"), "--foreground", f"--socket={self.munge_socket}",
                                   f"--key-file={r / 'munge' / 'munge.key'}",
                                   f"--pid-file={r / 'munge' / 'munged.pid'}",
                                   f"--seed-file={r / 'munge' / 'munged.seed'}",
                                   f"--log-file={r / 'log' / 'munged.log'}", "--num-threads=2"], here=True)
            self._wait("munged's socket", self.munge_socket.exists, timeout, "munged")
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._wait("slurmctld answering", lambda: self._client(["scontrol", "ping"], check=False).stdout
                       .find("is UP") >= 0, timeout, "slurmctld")
            for node in self.nodes:
                name = "slurmd" if self.hosts is None else f"slurmd-{node}"
                self._spawn(name, [_which("slurmd"), "-D", "-f", str(self.conf), "-N", node], host=node)
            for node in self.nodes:
                name = "slurmd" if self.hosts is None else f"slurmd-{node}"
                self._wait(f"node {node} idle", lambda: self.node_state(node) == "idle", timeout, name)
        except BaseException:
            self.stop()
            raise
        return self

    def node_state(self, node: str = NODE) -> str:
        proc = self._client(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], check=False)
        return proc.stdout.strip()

    # ---- jobs -------------------------------------------------------------------

    def job_fields(self, job_id: int) -> Dict[str, str]:
        """``scontrol show job -o`` as a dict (the last field, Command/WorkDir etc., as given)."""
        text = self._client(["scontrol", "show", "job", "-o", str(job_id)]).stdout.strip()
        fields = {}
        for token in text.split():
            key, sep, value = token.partition("=")
            if sep:
                fields[key] = value
        return fields

    def sbatch(self, args: Sequence, cwd: Path, env: Optional[dict] = None, timeout: float = 120.0) -> Job:
        """Submit ``sbatch args`` from ``cwd`` and wait for the job to end (cancelled at the deadline)."""
        proc = subprocess.run(self._on(None, ["sbatch", "--parsable", *args], cwd), capture_output=True, text=True,
                              cwd=cwd, env=self.env(env), timeout=30)
        if proc.returncode != 0:
            raise ClusterError(f"sbatch {' '.join(map(str, args))} refused: {proc.stderr.strip()}")
        job_id = int(proc.stdout.strip().split(";")[0])
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job_fields(job_id)
            if fields.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"):
                break
            if time.monotonic() > deadline:
                self._client(["scancel", str(job_id)], check=False)
                raise ClusterError(f"job {job_id} ({' '.join(map(str, args))}) still {fields.get('JobState')} "
                                   f"after {timeout} s: cancelled\n" + self._output(fields))
            time.sleep(0.1)
        code, _, sig = fields.get("ExitCode", "0:0").partition(":")
        return Job(job_id, fields["JobState"], int(code), int(sig or 0), fields, self._output(fields))

    @staticmethod
    def _output(fields: Dict[str, str]) -> str:
        path = fields.get("StdOut")
        return _tail(Path(path), 20000) if path else ""

    def srun(self, args: Sequence, cwd: Path, env: Optional[dict] = None, timeout: float = 120.0):
        """``srun args`` from ``cwd``: (returncode, stdout, stderr); the job is cancelled at the deadline."""
        name = f"ringmpi-test-{os.getpid()}-{time.monotonic_ns()}"
        cancel = lambda: self._client(["scancel", f"--name={name}"], check=False)  # noqa: E731
        rc, out, err, _ = run_deadline(self._on(None, ["srun", f"--job-name={name}", *args], cwd), timeout,
                                       env=self.env(env), cwd=cwd, on_deadline=cancel, error=ClusterError)
        return rc, out, err

    # ---- stop ---------------------------------------------------------------------

    def _leftover_pids(self) -> List[int]:
        """Processes of this cluster still alive: the daemons' sessions, and anything whose
        command line or environment names this cluster's directory (slurmstepd, job steps)."""
        mine = {p.pid for p in self.daemons.values()}
        marker = str(self.root).encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            pid = int(entry.name)
            try:
                if os.getsid(pid) in mine:
                    found.append(pid)
                    continue
                blob = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
            except (OSError, ProcessLookupError):
                continue
            if marker in blob:
                found.append(pid)
        return found

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is left, stop every daemon this object started (by PID, SIGTERM then
        SIGKILL at the deadline), end any process of the cluster, free the ports, remove the directory."""
        problems = []
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            try:
                self._client(["scancel", "--full", f"--partition={PARTITION}"], timeout=10, check=False)
            except subprocess.TimeoutExpired:
                problems.append("scancel did not answer")
        for name in [n for n in self.daemons if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            proc = self.daemons.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    problems.append(f"{name} (pid {proc.pid}) ignored SIGTERM for {timeout} s: killed")
                    proc.kill()
                    proc.wait(timeout=timeout)
        left = kill_all(self._leftover_pids, timeout)
        if left:
            problems.append(f"processes {left} survived SIGKILL")
        busy = [port for port in self.ports.values() if port_in_use(port)]
        shutil.rmtree(self.root, ignore_errors=True)
        if busy:
            problems.append(f"ports {busy} still in use")
        self.daemons.clear()
        if problems:
            raise ClusterError("; ".join(problems))
