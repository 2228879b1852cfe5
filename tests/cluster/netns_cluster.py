"""A test cluster on one machine: hosts as Linux network namespaces, real TCP between them.

Each host is a network namespace with its own hostname (UTS namespace), its
own ``/etc/hosts`` (``/etc/netns/<ns>/hosts`` bound over it) and its own
``/tmp`` (a mount namespace), held open by one ``sleep`` process per host.
Every host's ``eth0`` is one end of a veth pair whose other end sits on a
bridge in a namespace of its own (the "switch"): the machine's own namespace
and interfaces are never connected to it.  Addresses come from 198.18.0.0/15
(the benchmarking range), and only when no interface of this machine uses an
address there.  No route leads out of the cluster.

``mpirun`` runs inside the first host; Open MPI reaches the others through a
small remote-shell agent (``plm_rsh_agent``) that enters the named host's
namespaces and runs the command words with ``sh -c``, as ssh would.  Between
hosts, MPI traffic goes over TCP through the veth links (``btl
self,vader,tcp``, TCP restricted to the cluster's subnet).

    reason = unavailable()                  # None, or why this machine cannot have one
    cluster = NetnsCluster(hosts=3).start()
    cluster.mpirun(4, [python, "script.py"], hosts=2, timeout=60)
    cluster.shape("h2", "200mbit"); cluster.link("h2", up=False); cluster.counters("h2")
    cluster.stop()                          # raises if anything is left

Teardown is by PID and by namespace deletion: every process whose network
namespace is one of the cluster's is killed, then the namespaces, the hosts
files and the directory are removed; ``leftovers()`` names whatever remains.
A cluster whose creator died without tearing down (SIGKILL) is removed by the
next ``start()``.  The library knows nothing of any of this: it sees hosts, as
on a real cluster.

Run as a program, it rehearses a multi-node job (see docs/multinode.md)::

    python tests/cluster/netns_cluster.py --hosts 2 [--rate 1gbit] -- \\
        mpirun -n 4 --map-by node ringmpi run in.h5 -o out.h5
"""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # also when run as a program
from mpi_util import run_deadline  # noqa: E402

RANGE = ipaddress.ip_network("198.18.0.0/15")
SUBNET = ipaddress.ip_network("198.18.0.0/24")
PREFIX = "ringmpi-"               # namespace names: ringmpi-<creator pid>-<cluster>-<host>
PROGRAMS = ("ip", "tc", "nsenter", "unshare", "mpirun", "sleep")
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21
RUN_NETNS = Path("/run/netns")
LAUNCHER_VARIABLES = ("PMIX_", "ORTE_", "OMPI_APP_", "OMPI_COMM_", "OMPI_MCA_ess", "OMPI_MCA_orte_launch",
                      "OMPI_MCA_pmix", "OMPI_MCA_orte_ess_", "OMPI_MCA_orte_precondition", "OMPI_MCA_orte_hnp")
_SERIAL = itertools.count(1)
ETC_NETNS = Path("/etc/netns")


class ClusterError(RuntimeError):
    """The namespace cluster could not be started or stopped cleanly."""


def _caps() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def range_in_use() -> List[str]:
    """Interfaces of this machine (its own network namespace) with an address in 198.18.0.0/15."""
    out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True, check=True).stdout
    used = []
    for link in json.loads(out or "[]"):
        for info in link.get("addr_info", []):
            if info.get("family") == "inet" and ipaddress.ip_address(info["local"]) in RANGE:
                used.append(f"{link['ifname']} {info['local']}/{info['prefixlen']}")
    return used


def unavailable() -> Optional[str]:
    """None when this process can build a cluster, else the reason (for a test's skip)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    caps = _caps()
    if os.geteuid() != 0 or not caps >> CAP_NET_ADMIN & 1 or not caps >> CAP_SYS_ADMIN & 1:
        return ("the multi-node test cluster needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN "
                "(network, UTS and mount namespaces)")
    missing = [p for p in PROGRAMS if shutil.which(p, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]
    if missing:
        return f"the multi-node test cluster needs {', '.join(missing)} (iproute2, util-linux, Open MPI)"
    used = range_in_use()
    if used:
        return (f"198.18.0.0/15 is already used on this machine ({'; '.join(used)}): the test cluster "
                f"takes its addresses from that range only when nothing else uses it")
    return None


def _sh(args: Sequence, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(map(str, args))} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _netns_inode(ns: str) -> Optional[int]:
    try:
        return os.stat(RUN_NETNS / ns).st_ino
    except OSError:
        return None


def _pids_in(inodes: set) -> List[int]:
    """Processes whose network namespace is one of ``inodes``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.stat(entry / "ns" / "net").st_ino in inodes:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _our_namespaces(creator: Optional[int] = None) -> List[str]:
    out = _sh(["ip", "netns", "list"], check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]
    if creator is not None:
        names = [n for n in names if n.split("-")[1] == str(creator)]
    return names


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _paths_under_tmp() -> List[Path]:
    """The checkout and the Python environment running this, where they lie under /tmp (as in a
    fresh clone made by ``mktemp -d``): each host sees them at the same path; the outermost only."""
    found = []
    for p in sorted({Path(__file__).resolve().parents[2], Path(sys.prefix).resolve()}, key=lambda p: len(p.parts)):
        if p.is_relative_to("/tmp") and p != Path("/tmp") and not any(p.is_relative_to(q) for q in found):
            found.append(p)
    return found


@dataclass
class Host:
    """One host: ``name`` is its hostname, ``ns`` its network namespace, ``holder`` the PID
    holding its UTS and mount namespaces, ``tmp`` the directory that is its ``/tmp``."""

    name: str
    ns: str
    addr: str
    port: str          # its veth's name on the switch
    tmp: Path
    holder: Optional[subprocess.Popen] = None


class NetnsCluster:
    """``hosts`` hosts named ``h1``, ``h2``, ... on one bridge; see the module docstring."""

    def __init__(self, hosts: int = 2, root: Optional[Path] = None, slots: int = 2):
        if not 1 <= hosts <= 200:
            raise ValueError("1 to 200 hosts")
        self.root = Path(root or tempfile.mkdtemp(prefix="ringmpi-netns-", dir="/var/tmp"))
        self.tag = f"{PREFIX}{os.getpid()}-{next(_SERIAL)}"
        self.slots = slots
        self.switch = f"{self.tag}-sw"
        self.hosts: Dict[str, Host] = {}
        for i in range(1, hosts + 1):
            name = f"h{i}"
            self.hosts[name] = Host(name=name, ns=f"{self.tag}-{name}", addr=str(SUBNET[i]), port=name,
                                    tmp=self.root / "tmp" / name)
        self.shared = self.root / "shared"       # the job's directory, seen alike by every host
        self.agent = self.root / "rsh-agent"
        self.created: List[str] = []             # the namespaces this object made (and deletes)
        self.inodes: set = set()                 # their identities, which outlive their names
        self.started = False

    @property
    def names(self) -> List[str]:
        return list(self.hosts)

    # ---- start ----------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> "NetnsCluster":
        reason = unavailable()
        if reason is not None:
            raise ClusterError(reason)
        remove_stale()
        self.started = True
        try:
            self.shared.mkdir(parents=True, exist_ok=True)
            self.root.chmod(0o755)
            self.shared.chmod(0o1777)
            _sh(["ip", "netns", "add", self.switch])
            self.created.append(self.switch)
            self.inodes.add(_netns_inode(self.switch))
            (ETC_NETNS / self.switch).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / self.switch / "cluster-root").write_text(str(self.root))  # for remove_stale
            _sh(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _sh(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for host in self.hosts.values():
                self._add_host(host)
            for host in self.hosts.values():
                self._hold(host, timeout)
            self._write_agent()
        except BaseException:
            self.stop(check=False)
            raise
        return self

    def _add_host(self, host: Host) -> None:
        ns = host.ns
        _sh(["ip", "netns", "add", ns])
        self.created.append(ns)
        self.inodes.add(_netns_inode(ns))
        # the veth is born inside the host with its peer in the switch: it never exists here
        _sh(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", host.port,
             "netns", self.switch])
        _sh(["ip", "-n", self.switch, "link", "set", host.port, "master", "br0", "up"])
        _sh(["ip", "-n", ns, "addr", "add", f"{host.addr}/{SUBNET.prefixlen}", "dev", "eth0"])
        _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        _sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
        etc = ETC_NETNS / ns
        etc.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"] + [f"{h.addr} {h.name}" for h in self.hosts.values()]
        (etc / "hosts").write_text("\n".join(lines) + "\n")
        (etc / "hostname").write_text(host.name + "\n")
        host.tmp.mkdir(parents=True, exist_ok=True)
        host.tmp.chmod(0o1777)

    def _hold(self, host: Host, timeout: float) -> None:
        """One process per host holding its UTS and mount namespaces (hostname, hosts file, /tmp).

        Entered with ``nsenter --net`` (not ``ip netns exec``, which remounts /sys)."""
        # what runs on every host must stay visible under the host's own /tmp: a checkout or a
        # Python environment under /tmp is bound into the host's /tmp first (recursive bind)
        keep = "".join(f"mkdir -p {host.tmp / p.relative_to('/tmp')} && mount --bind {p} "
                       f"{host.tmp / p.relative_to('/tmp')} && " for p in _paths_under_tmp())
        script = (f"hostname {host.name} && mount --bind {ETC_NETNS / host.ns / 'hosts'} /etc/hosts && "
                  f"{keep}mount --rbind {host.tmp} /tmp && echo ready && exec sleep 2147483647")
        host.holder = subprocess.Popen(
            ["nsenter", f"--net={RUN_NETNS / host.ns}", "unshare", "--uts", "--mount", "--propagation",
             "private", "sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True)
        ready, _, _ = select.select([host.holder.stdout], [], [], timeout)
        if not ready or host.holder.stdout.readline().strip() != "ready":
            raise ClusterError(f"host {host.name} did not come up: {host.holder.stderr.read() if host.holder.poll() is not None else 'timeout'}")

    def _write_agent(self) -> None:
        cases = "\n".join(f"    {h.name}) pid={h.holder.pid} ;;" for h in self.hosts.values())
        self.agent.write_text(f"""#!/bin/sh
# Open MPI's plm_rsh_agent for the namespace cluster: <agent> [options] <host> <command words...>.
# Like ssh: the words are joined and run by sh -c, on the named host (its namespaces).
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case $host in
{cases}
    *) echo "rsh-agent: unknown host $host" >&2; exit 255 ;;
esac
exec nsenter --target "$pid" --net --uts --mount --wd="$PWD" -- sh -c "$*"
""")
        self.agent.chmod(0o755)

    # ---- running things on a host ----------------------------------------------------

    def command(self, host: str, args: Sequence, cwd: Optional[Path] = None) -> List[str]:
        """The command line that runs ``args`` on ``host`` (its namespaces), in ``cwd``."""
        pid = self.hosts[host].holder.pid
        return ["nsenter", f"--target={pid}", "--net", "--uts", "--mount",
                f"--wd={cwd or self.shared}", "--", *[str(a) for a in args]]

    def run(self, host: str, args: Sequence, timeout: float = 30.0, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, args, kwargs.pop("cwd", None)), capture_output=True,
                              text=True, timeout=timeout, **kwargs)

    def host_list(self, hosts=None, slots: Optional[int] = None) -> str:
        """``--host`` for mpirun: the first ``hosts`` hosts (or the named ones), ``slots`` each."""
        names = self.names[:hosts] if isinstance(hosts, int) or hosts is None else list(hosts)
        return ",".join(f"{n}:{slots or self.slots}" for n in names)

    def mpi_env(self, base: Optional[dict] = None, **extra) -> dict:
        """Open MPI settings that reach the other hosts through the agent, TCP on the cluster's subnet."""
        env = dict(os.environ if base is None else base)
        env.pop("RINGMPI_NODE_SIZE", None)  # nodes come from MPI, as on a real cluster
        for name in [k for k in env if k.startswith(LAUNCHER_VARIABLES)]:
            del env[name]  # left by an MPI initialised in the calling process (a singleton)
        env.update({
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_plm_rsh_agent": str(self.agent),
            "OMPI_MCA_plm_rsh_no_tree_spawn": "1",
            "OMPI_MCA_btl": "self,vader,tcp",
            "OMPI_MCA_btl_tcp_if_include": str(SUBNET),
            "OMPI_MCA_oob_tcp_if_include": str(SUBNET),
            "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
            "OMPI_MCA_rmaps_base_oversubscribe": "1",
            "OMPI_MCA_mpi_yield_when_idle": "1",
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        })
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def mpirun_command(self, nprocs: int, args: Sequence, hosts=None, slots=None, map_by: str = "slot",
                       cwd: Optional[Path] = None) -> List[str]:
        return self.command(self.names[0], ["mpirun", "-n", nprocs, "--host", self.host_list(hosts, slots),
                                            "--map-by", map_by, *args], cwd)

    def mpirun(self, nprocs: int, args: Sequence, timeout: float, hosts=None, slots=None, map_by: str = "slot",
               env: Optional[dict] = None, cwd: Optional[Path] = None):
        """``mpirun -n nprocs --host ... --map-by map_by args`` inside host 1, killed at the deadline.

        Returns (returncode, stdout, stderr, seconds); raises ClusterError past the deadline."""
        return run_deadline(self.mpirun_command(nprocs, args, hosts, slots, map_by, cwd), timeout,
                            env=env or self.mpi_env(), on_deadline=self.kill_jobs, error=ClusterError)

    # ---- the links -------------------------------------------------------------------

    def shape(self, host: str, rate: Optional[str]) -> None:
        """Limit ``host``'s link to ``rate`` (tc tbf, e.g. "1gbit", "200mbit") both ways; None lifts it."""
        h = self.hosts[host]
        for ns, dev in ((h.ns, "eth0"), (self.switch, h.port)):
            if rate is None:
                _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
            else:  # a bucket of 10 ms at the rate, so that the timer's granularity does not cap it
                _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                     "rate", rate, "burst", str(max(_bits_per_second(rate) // 800, 32 * 1024)),
                     "latency", "100ms"])

    def shape_all(self, rate: Optional[str]) -> None:
        for name in self.hosts:
            self.shape(name, rate)

    def link(self, host: str, up: bool) -> None:
        """Cut (``up=False``) or restore ``host``'s cable: its veth on the switch goes down or up."""
        _sh(["ip", "-n", self.switch, "link", "set", self.hosts[host].port, "up" if up else "down"])

    def counters(self, host: str) -> Dict[str, int]:
        """Bytes and packets through ``host``'s eth0 so far: ``{"rx": ..., "tx": ...}`` (bytes)."""
        out = _sh(["ip", "-n", self.hosts[host].ns, "-j", "-s", "link", "show", "dev", "eth0"]).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"rx": int(stats["rx"]["bytes"]), "tx": int(stats["tx"]["bytes"])}

    # ---- stop ------------------------------------------------------------------------

    def _namespaces(self) -> List[str]:
        return list(self.created)

    def processes(self) -> List[int]:
        """Every process living in one of the cluster's network namespaces (holders included)."""
        inodes = self.inodes - {None}
        return _pids_in(inodes) if inodes else []

    def kill_jobs(self, timeout: float = 10.0) -> List[int]:
        """SIGKILL every process on the hosts except the holders; returns the survivors."""
        holders = {h.holder.pid for h in self.hosts.values() if h.holder is not None}
        return kill_all(lambda: [p for p in self.processes() if p not in holders], timeout)

    def leftovers(self) -> List[str]:
        """What of this cluster still exists: namespaces, processes, hosts files, the directory."""
        left = [f"namespace {ns}" for ns in _our_namespaces(os.getpid()) if ns.startswith(self.tag + "-")]
        left += [f"process {pid}" for pid in self.processes()]
        left += [f"process {h.holder.pid} (holder of {h.name})" for h in self.hosts.values()
                 if h.holder is not None and h.holder.poll() is None]
        left += [f"hosts file {path}" for path in ETC_NETNS.glob(self.tag + "-*")] if ETC_NETNS.exists() else []
        here = _sh(["ip", "-j", "link", "show"]).stdout
        left += [f"interface {l['ifname']} here" for l in json.loads(here or "[]")
                 if l["ifname"] in [h.port for h in self.hosts.values()] or l["ifname"] == "br0"]
        if self.root.exists():
            left.append(f"directory {self.root}")
        return left

    def stop(self, check: bool = True) -> None:
        """Kill every process on the hosts by PID, delete the namespaces and hosts files and the
        directory; with ``check``, raise ClusterError naming whatever is left."""
        problems = []
        survivors = kill_all(self.processes, 10.0)
        if survivors:
            problems.append(f"processes {survivors} survived SIGKILL")
        for h in self.hosts.values():
            if h.holder is not None:
                try:
                    h.holder.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    problems.append(f"holder {h.holder.pid} of {h.name} did not end")
                for stream in (h.holder.stdout, h.holder.stderr):
                    stream.close()
        for ns in self._namespaces():
            if _netns_inode(ns) is not None:
                proc = _sh(["ip", "netns", "delete", ns], check=False)
                if proc.returncode != 0:
                    problems.append(f"ip netns delete {ns}: {proc.stderr.strip()}")
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        self.created.clear()
        if ETC_NETNS.exists() and not any(ETC_NETNS.iterdir()):
            try:
                ETC_NETNS.rmdir()
            except OSError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)
        self.started = False
        if check:
            problems += self.leftovers()
            if problems:
                raise ClusterError("namespace cluster not cleanly stopped: " + "; ".join(problems))

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop(check=exc[0] is None)
        return False


def _bits_per_second(rate: str) -> int:
    """tc's rate spelling ("1gbit", "200mbit", "500kbit") in bits per second."""
    units = {"gbit": 10 ** 9, "mbit": 10 ** 6, "kbit": 10 ** 3, "bit": 1}
    for unit, factor in units.items():
        if rate.lower().endswith(unit):
            return int(float(rate[:-len(unit)]) * factor)
    raise ValueError(f"rate {rate!r}: use e.g. 1gbit, 200mbit")


def kill_all(find, timeout: float) -> List[int]:
    """SIGKILL what ``find()`` lists until it lists none alive or ``timeout`` passes; the survivors."""
    deadline = time.monotonic() + timeout
    left = find()
    while left and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
        left = [p for p in find() if _alive(p)]
    return left


def remove_stale() -> List[str]:
    """Tear down the namespaces of clusters whose creating process is gone (killed with SIGKILL)."""
    removed = []
    for ns in _our_namespaces():
        creator = ns.split("-")[1]
        if creator.isdigit() and not _alive(int(creator)):
            inode = _netns_inode(ns)
            if inode is not None:
                kill_all(lambda: _pids_in({inode}), 10.0)
            _sh(["ip", "netns", "delete", ns], check=False)
            root = ETC_NETNS / ns / "cluster-root"
            if root.exists() and Path(root.read_text()).name.startswith("ringmpi-netns-"):
                shutil.rmtree(root.read_text(), ignore_errors=True)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
            removed.append(ns)
    return removed


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Rehearse a multi-node job: start a cluster, run COMMAND in host h1, tear down on any exit."""
    parser = argparse.ArgumentParser(
        description="Run COMMAND on host h1 of a cluster of network namespaces (root); mpirun inside it "
                    "reaches h2, h3, ... over TCP (Open MPI settings and a hostfile are in the environment).",
        epilog="example: python tests/cluster/netns_cluster.py --hosts 2 -- mpirun -n 4 --map-by node "
               "ringmpi run in.h5 -o out.h5   (run it where in.h5 is; that directory is seen by every host)")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2, help="ranks per host in the hostfile (default 2)")
    parser.add_argument("--rate", help="shape every host link with tc tbf, e.g. 1gbit, 200mbit")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no COMMAND given")
    reason = unavailable()
    if reason is not None:
        print(f"netns_cluster: {reason}", file=sys.stderr)
        return 2
    if Path.cwd().resolve().is_relative_to("/tmp") and not any(
            Path.cwd().resolve().is_relative_to(p) for p in _paths_under_tmp()):
        print("netns_cluster: run it from a directory outside /tmp: every host has its own /tmp",
              file=sys.stderr)
        return 2
    # SIGTERM/SIGHUP end this process through the finally below, like Ctrl-C
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    cluster = NetnsCluster(hosts=args.hosts, slots=args.slots)
    try:
        cluster.start()
        if args.rate:
            cluster.shape_all(args.rate)
        hostfile = cluster.root / "hostfile"
        hostfile.write_text("".join(f"{n} slots={args.slots}\n" for n in cluster.names))
        env = cluster.mpi_env(OMPI_MCA_orte_default_hostfile=hostfile)
        print(f"netns_cluster: hosts {', '.join(cluster.names)} ({args.slots} slots each"
              f"{', links ' + args.rate if args.rate else ''}); running on h1 in {os.getcwd()}",
              file=sys.stderr, flush=True)
        return subprocess.call(cluster.command("h1", command, Path.cwd()), env=env)
    finally:
        cluster.stop(check=False)
        left = cluster.leftovers()
        if left:
            print(f"netns_cluster: left behind: {'; '.join(left)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
