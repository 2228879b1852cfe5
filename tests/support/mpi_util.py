"""Launch real ``mpirun`` from pytest, in a new process session, under a deadline."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVERS = ROOT / "tests" / "mpi"  # the rank-side scripts mpirun starts
HAVE_MPIRUN = shutil.which("mpirun") is not None
# RINGMPI_TEST_DEADLINE_CAP (seconds) lowers every launch's deadline: tests/gpu/device_check.sh
# sets it so that one hung launch fails its test, not the whole timed check
DEADLINE_CAP = float(os.environ.get("RINGMPI_TEST_DEADLINE_CAP", "inf"))


def mpirun_env(**extra):
    """Environment for a local, oversubscribed, root-friendly Open MPI run."""
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
        # containers often forbid the ptrace-based single-copy path
        "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
        "OMPI_MCA_btl": "self,vader,tcp",
        "OMPI_MCA_btl_tcp_if_include": "lo",
        "OMPI_MCA_oob_tcp_if_include": "lo",
        "OMPI_MCA_mpi_yield_when_idle": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env.update({k: str(v) for k, v in extra.items()})
    return env


def mpirun(nprocs, args, timeout, env=None, cwd=None):
    """Run ``mpirun -n nprocs <args>``; kill the whole session on the deadline.

    Returns (returncode, stdout, stderr, seconds).  A run past its deadline
    fails the calling test.
    """
    if not HAVE_MPIRUN:
        pytest.fail("mpirun not found: run scripts/setup.sh first")
    cmd = ["mpirun", "-n", str(nprocs), "--oversubscribe"] + [str(a) for a in args]
    return run_deadline(cmd, timeout, env=env or mpirun_env(), cwd=cwd)


def run_deadline(cmd, timeout, env=None, cwd=None, on_deadline=None, error=None):
    """Run ``cmd`` in a new process session; kill the whole session on the deadline.

    Returns (returncode, stdout, stderr, seconds).  Past its deadline, after the kill,
    ``on_deadline()`` ends what lives outside the session (a job's processes on other hosts,
    a Slurm job), then the calling test fails -- or, given ``error`` (an exception class, for
    the cluster harnesses), ``error(message)`` is raised.
    """
    timeout = min(timeout, DEADLINE_CAP)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd or ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        if on_deadline is not None:
            on_deadline()
        out, err = proc.communicate()
        message = (f"{' '.join(map(str, cmd))} passed its {timeout} s deadline "
                   f"(hung?)\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}")
        if error is not None:
            raise error(message) from None
        pytest.fail(message)
    return proc.returncode, out, err, time.monotonic() - start


def launch_cache(launch):
    """A lazy per-launch cache: ``get(key, *args, **kwargs)`` runs ``launch(key, *args, **kwargs)``
    (one mpirun with many cases) the first time a test asks for ``key`` and returns the same
    results afterwards (the arguments of later calls are not used), so a ``-k`` selection starts
    only the launches it needs.  The one cache of the suite's launches: in a module fixture, or
    at module level where tests of several modules share a launch (``tmp_path_factory`` then
    among the arguments)."""
    cache = {}

    def get(key, *args, **kwargs):
        if key not in cache:
            cache[key] = launch(key, *args, **kwargs)
        return cache[key]
    return get


def run_cases(nprocs, cases, tmp_path, timeout, env=None, driver="ring_cases.py"):
    """Run cases on ``nprocs`` ranks in one launch of ``tests/mpi/<driver>``; return {id: (ok, msg)}."""
    path = tmp_path / f"cases_{nprocs}.json"
    path.write_text(json.dumps(cases))
    rc, out, err, _ = mpirun(nprocs, [sys.executable, DRIVERS / driver, path], timeout, env=env)
    return case_results(cases, rc, out, err)


def case_records(out):
    """{id: record} from a driver's ``CASE {json}`` lines (a record is the whole json object)."""
    records = {}
    for line in out.splitlines():
        if line.startswith("CASE "):
            rec = json.loads(line[5:])
            records[rec["id"]] = rec
    return records


def case_results(cases, rc, out, err):
    """{id: (ok, msg)} from a driver's ``CASE {json}`` lines; fails unless the launch
    exited 0 and every case reported."""
    results = {id_: (rec["ok"], rec["msg"]) for id_, rec in case_records(out).items()}
    missing = [c["id"] for c in cases if c["id"] not in results]
    assert rc == 0 and not missing, (f"mpirun exit {rc}, {len(missing)} case(s) without a result "
                                     f"(first: {missing[:3]})\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}")
    return results


class CaseLaunches:
    """A driver's cases, grouped in launches (one mpirun each), each case its own pytest item.

    ``launches`` are the launch keys: P, or a tuple whose first item is P; ``cases_for(launch)``
    gives a launch's cases; ``env(launch)`` its environment (None: ``mpirun_env()``).
    ``params()`` feeds ``@pytest.mark.parametrize("launch,case", ...)`` with the case ids as
    test ids; ``fixture()`` makes the module fixture whose value ``results`` answers
    ``results(launch) -> {id: (ok, msg)}``, running the launch the first time a test asks (so a
    ``-k`` selection starts only the launches it needs), and ``results.where(launch)``, the
    directory of that launch's cases file, where its driver writes its files.
    """

    def __init__(self, driver, launches, cases_for, timeout, env=None):
        self.driver, self.launches, self.cases_for, self.timeout = driver, launches, cases_for, timeout
        self.env = env or (lambda launch: None)

    def params(self):
        return [pytest.param(launch, case, id=case["id"]) for launch in self.launches
                for case in self.cases_for(launch)]

    def fixture(self):
        @pytest.fixture(scope="module")
        def results(tmp_path_factory):
            return _LaunchResults(self, tmp_path_factory)
        return results


class _LaunchResults:
    def __init__(self, launches, tmp_path_factory):
        self.launches, self.tmp_path_factory, self.done = launches, tmp_path_factory, {}

    def __call__(self, launch):
        if launch not in self.done:
            spec = self.launches
            nprocs = launch[0] if isinstance(launch, tuple) else launch
            where = self.tmp_path_factory.mktemp(f"{spec.driver[:-3]}-{nprocs}")
            self.done[launch] = (run_cases(nprocs, spec.cases_for(launch), where, spec.timeout,
                                           env=spec.env(launch), driver=spec.driver), where)
        return self.done[launch][0]

    def where(self, launch):
        self(launch)
        return self.done[launch][1]
