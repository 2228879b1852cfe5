"""The distribution's MPICH beside the system Open MPI (issue 52): scripts/setup.sh, given MPICH's
``mpicc`` and parallel HDF5, builds a venv whose mpi4py and h5py load MPICH's library and no other,
and under ``mpirun.mpich`` at P = 4 the main job and ``ringmpi verify`` pass, a library case
matches the float64 reference, and a rank that dies ends the job with a clear error.

The venv is ``.venv-mpich`` in the checkout (git-ignored), built once and then reused: set-up is
idempotent and checks the stack again each time (seconds).  Its first build compiles mpi4py and
h5py (minutes), so it starts in the background as soon as the session has collected these tests
(``start_compiling``, as the NVRTC compiles do), beside the rest of the suite, and this module
runs last (``RUN_LAST``, see tests/conftest.py).  MPICH itself comes from apt-get
(scripts/mpich-system.sh, which keeps Open MPI the default ``mpirun``/``mpicc``) when root and
missing; elsewhere without it the tests are skipped, saying why.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from mpi_util import DRIVERS, ROOT, case_results, mpirun_env, run_deadline

pytestmark = pytest.mark.mpi
RUN_LAST = True

MPICC = "/usr/bin/mpicc.mpich"
MPIRUN = "/usr/bin/mpirun.mpich"
HDF5_DIR = f"/usr/lib/{os.uname().machine}-linux-gnu/hdf5/mpich"
VENV = ROOT / ".venv-mpich"
LOCK = ROOT / ".venv-mpich.lock"  # one build at a time per checkout
FLOCK = ["flock", str(LOCK)] if shutil.which("flock") else []
BUILD_DEADLINE = 1800  # a fresh build on a busy 2-core machine: ~10 min; this much is a hang
LAUNCH_DEADLINE = 120
SETUP_ENV = {"MPICC": MPICC, "HDF5_DIR": HDF5_DIR, "RINGMPI_VENV": str(VENV)}


def _unavailable():
    """Why MPICH cannot be had here, or None."""
    if os.path.exists(MPICC) and os.path.exists(MPIRUN) and os.path.isdir(HDF5_DIR):
        return None
    if shutil.which("apt-get") is None:
        return "no MPICH (mpich, libhdf5-mpich-dev) installed and no apt-get to install it"
    if os.geteuid() != 0:
        return "no MPICH (mpich, libhdf5-mpich-dev) installed; installing it needs root"
    return None


_build = {}  # "proc", "log" (path), "start": the background build of the MPI stack


def start_compiling(items=None):
    """Start MPICH's installation and the venv's mpi4py and h5py in the background (once, if the
    session runs these tests): at a lower CPU priority than the tests it runs beside."""
    if "proc" in _build or _unavailable() is not None:
        return
    if items is not None and not any(getattr(item, "module", None) is sys.modules[__name__] for item in items):
        return
    log = ROOT / ".venv-mpich.log"
    script = "bash scripts/mpich-system.sh && RINGMPI_SETUP_MPI_ONLY=1 bash scripts/setup.sh"
    # mpi4py and h5py compiled without optimisation: under half the CPU time (about 120 s against
    # 292 s with the default -O3), and what is tested here (which library each loads, the jobs'
    # results) does not depend on it
    env = dict(os.environ, **SETUP_ENV, CFLAGS="-O0 -g0")
    with open(log, "w") as out:
        _build["proc"] = subprocess.Popen(FLOCK + ["bash", "-c", script], cwd=ROOT, env=env,
                                          stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=lambda: os.nice(5))
    _build.update(log=log, start=time.monotonic())


def stop_compiling():
    """A build the session no longer waits for (a -k selection, a failed run) is ended; the next
    run's set-up redoes what it left half done."""
    proc = _build.get("proc")
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def mpich_venv():
    """The MPICH venv, complete: the background build awaited, then scripts/setup.sh run to its
    end (ringmpi installed editable, the one-MPI check); {"setup": its output}."""
    reason = _unavailable()
    if reason is not None:
        pytest.skip(reason)
    start_compiling()
    proc = _build["proc"]
    try:
        proc.wait(timeout=max(1.0, BUILD_DEADLINE - (time.monotonic() - _build["start"])))
    except subprocess.TimeoutExpired:
        stop_compiling()
        pytest.fail(f"the MPICH stack's build passed its {BUILD_DEADLINE} s deadline:\n"
                    f"{_build['log'].read_text()[-3000:]}")
    background = _build["log"].read_text()
    assert proc.returncode == 0, f"MPICH or the venv's mpi4py and h5py did not build:\n{background[-5000:]}"
    # ringmpi's editable install rewrites the compiled passes in src/ in place: here, when no other
    # test's ranks have them loaded, not in the background
    rc, out, err, seconds = run_deadline(FLOCK + ["bash", "scripts/setup.sh"], 600,
                                         env=dict(os.environ, **SETUP_ENV))
    assert rc == 0, f"scripts/setup.sh for MPICH failed:\n{out[-2000:]}\n{err[-5000:]}"
    return {"setup": background + err}


def mpich(nprocs, args, env=None, deadline=LAUNCH_DEADLINE):
    return run_deadline([MPIRUN, "-n", str(nprocs)] + [str(a) for a in args], deadline, env=env or mpirun_env())


def test_setup_builds_one_mpich_stack(mpich_venv):
    libmpich = os.path.realpath(f"/usr/lib/{os.uname().machine}-linux-gnu/libmpich.so.12")
    assert f"one MPI library in mpi4py, h5py and ringmpi: {libmpich}" in mpich_venv["setup"], mpich_venv["setup"]
    rc, out, err, _ = mpich(4, [VENV / "bin" / "ringmpi", "info"])
    assert rc == 0, err[-3000:]
    assert "MPI: MPICH (MPICH Version: 4" in out and "world size: 4 rank(s)" in out, out
    assert f"MPI library files: mpi4py loaded {libmpich}, h5py loaded {libmpich}" in out, out
    assert "WARNING" not in out, out


def test_main_job_and_verify(mpich_venv, tmp_path):
    out_file = tmp_path / "sample_out.h5"
    rc, out, err, _ = run_deadline(
        ["jobs/local.sh", "-n", "4", "run", "data/sample.h5", "-o", out_file, "--causal", "--backward"],
        LAUNCH_DEADLINE, env=mpirun_env(MPIRUN=MPIRUN, RINGMPI_VENV=VENV))
    assert rc == 0, err[-5000:]
    rc, out, err, _ = run_deadline([VENV / "bin" / "ringmpi", "verify", "data/sample.h5", out_file],
                                   LAUNCH_DEADLINE, env=mpirun_env())
    assert rc == 0 and "PASS: every output within tolerance" in out, out + err[-3000:]


def test_library_cases(mpich_venv, tmp_path):
    cases = [dict(id="zigzag-causal", B=2, H=4, Hkv=2, D=32, n_q=97, layout="zigzag", causal=True,
                  dtype="float32", backward=True, seed=52),
             dict(id="striped-segments", B=2, H=4, Hkv=4, D=59, n_q=256, layout="striped", segments=5,
                  dtype="float64", backward=True, seed=53)]
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    rc, out, err, _ = mpich(4, [VENV / "bin" / "python", DRIVERS / "ring_cases.py", path])
    for case_id, (ok, msg) in case_results(cases, rc, out, err).items():
        assert ok, f"{case_id}: {msg}"


@pytest.mark.parametrize("fault,message,code", [
    # a rank that dies without a word (os._exit(3)): Hydra ends the job.  When its proxy kills the
    # others it prints its banner with the killed rank's code; when the others' MPI sees the dead
    # peer and they end first (a loaded machine), Hydra prints nothing and exits with the dead
    # rank's code, 3.  Either way the job ends at once, with a failing exit code
    ("exit:1:1", "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES", 3),
    ("raise:3:2:fwd", "[rank 3] ringmpi: InjectedFault: injected fault on rank 3", None),
])
def test_a_failing_rank_ends_the_job(mpich_venv, fault, message, code):
    rc, out, err, _ = mpich(4, [VENV / "bin" / "python", DRIVERS / "fault_job.py", "--timeout", "600"],
                            env=mpirun_env(RINGMPI_FAULT=fault), deadline=60)
    assert rc != 0
    assert message in out + err or rc == code, f"exit code {rc}\n{(out + err)[-3000:]}"


def test_a_mixed_stack_is_reported_not_crashed_on(mpich_venv, tmp_path):
    """The issue's venv: mpi4py on MPICH, h5py on Open MPI (this suite's own h5py, linked as the
    only h5py on the path); set-up's check names both libraries and exits 1."""
    import h5py

    (tmp_path / "h5py").symlink_to(os.path.dirname(h5py.__file__))
    rc, out, err, _ = run_deadline([VENV / "bin" / "python", ROOT / "src/ringmpi/runtime/mpi_library.py",
                                    "h5py", "ringmpi"], 60, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert rc == 1, (rc, out, err)
    assert "MISMATCH: 2 MPI libraries are mapped into one process" in out and "Open MPI" in out and "MPICH" in out, out
