"""Failure handling under real mpirun (P = 4): nothing hangs, errors end the job.

Each test asserts the exit status and the message; faults are injected with
``RINGMPI_FAULT`` (a testing aid, see ringmpi.runtime.faults).  Nothing is timed: where
only the failure path may end a job, the ring's own timeout (600 s) lies far past
mpirun's deadline (60 s), and a job still running at the deadline fails its test.
"""

import re
import sys

import pytest

from mpi_util import DRIVERS, mpirun, mpirun_env

JOB = [sys.executable, DRIVERS / "fault_job.py"]
pytestmark = pytest.mark.mpi


def run_job(fault, *args, nprocs=4, deadline=60):
    env = mpirun_env(RINGMPI_FAULT=fault) if fault else mpirun_env()
    return mpirun(nprocs, JOB + list(args), timeout=deadline, env=env)


@pytest.mark.parametrize("fault,backward", [
    ("raise:0:2:fwd", False),
    ("raise:3:2:fwd", False),
    ("raise:0:1:bwd", True),
    ("raise:3:2:bwd", True),
])
def test_exception_on_one_rank_ends_the_job(fault, backward):
    rank = fault.split(":")[1]
    rc, out, err, _ = run_job(fault, *(["--backward"] if backward else []), "--timeout", "600")
    assert rc != 0
    assert f"[rank {rank}] ringmpi: InjectedFault: injected fault on rank {rank}" in err, err[-2000:]


def test_rank_that_exits_abruptly_ends_the_job():
    rc, out, err, _ = run_job("exit:1:1", "--timeout", "600")
    assert rc != 0


def test_hung_rank_is_caught_by_the_deadline():
    rc, out, err, _ = run_job("hang:2:1", "--timeout", "5")
    assert rc != 0
    match = re.search(r"\[rank (\d)\] ringmpi: RingTimeout: rank (\d): ring step (\d+) channel 'kv' "
                      r"did not complete within 5 s \((?:recv from|send to) rank (\d)", err)
    assert match, err[-3000:]
    assert match.group(1) == match.group(2) != "2"


def test_hung_rank_is_caught_by_the_deadline_of_the_routed_schedule():
    """A stuck rank under the routed schedule (point-to-point transfers): the job ends at the
    call's deadline, the waiting rank naming the step, the channel and the peer."""
    rc, out, err, _ = run_job("hang:2:1", "--timeout", "5", "--packed", "--backward")
    assert rc != 0
    match = re.search(r"\[rank (\d)\] ringmpi: RingTimeout: rank (\d): ring step (\d+) channel "
                      r"'(?:kv|grad)_(?:in|out)\d+' did not complete within 5 s \((?:recv from|send to) rank 2",
                      err)
    assert match, err[-3000:]
    assert match.group(1) == match.group(2) != "2"


def test_hung_rank_is_caught_by_the_deadline_of_the_allgather_schedule():
    """A stuck rank under the all-gather schedule (nonblocking collectives, issue 53): the job
    ends at the call's deadline, a waiting rank naming the step, the collective and its ranks.
    The rank hangs before it posts its pieces (once posted, small pieces leave eagerly)."""
    rc, out, err, _ = run_job("hang:2:0", "--timeout", "5", "--schedule", "allgather", "--backward")
    assert rc != 0
    match = re.search(r"\[rank (\d)\] ringmpi: RingTimeout: rank (\d): ring step (\d+) channel "
                      r"'(?:gather|return)\d+' did not complete within 5 s \((?:Iallgatherv|Ialltoallv) over "
                      r"all 4 ranks", err)
    assert match, err[-3000:]
    assert match.group(1) == match.group(2) != "2"


def test_the_ring_waits_take_the_watchdog_default():
    """No ``timeout=`` on the call: the ring's waits take the one deadline rule's default
    (``watchdog.set_default``, which ``ringmpi run --timeout`` sets), as every phase does."""
    rc, out, err, _ = run_job("hang:2:1", "--default-timeout", "5")
    assert rc != 0
    assert re.search(r"\[rank (\d)\] ringmpi: RingTimeout: rank \1: ring step \d+ channel 'kv' "
                     r"did not complete within 5 s", err), err[-3000:]


def test_repeated_runs_are_bitwise_identical():
    rc, out, err, _ = run_job(None, "--backward", "--repeat", "20", nprocs=3, deadline=180)
    assert rc == 0, err[-3000:]
    assert "IDENTICAL" in out
