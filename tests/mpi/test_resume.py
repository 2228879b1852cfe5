"""``ringmpi run --resume``: a job killed during pass k of n, resumed, gives the
same file as an uninterrupted run (bitwise at the same world size); a partial
file of a different job is refused with exit 2 naming the difference."""

import os

import h5py
import numpy as np
import pytest

from cli_util import RINGMPI, write_input
from mpi_util import mpirun, mpirun_env

OPTIONS = ["--backward", "--causal", "--heads-per-pass", "2"]
N_PASSES = 6  # 3 batch entries x 2 kv-head groups (RINGMPI_PASS_BYTES=1: one entry per pass)


def job(p, src, out, *extra, fault=None, timeout=60):
    env = mpirun_env(RINGMPI_PASS_BYTES=1, **({"RINGMPI_FAULT": fault} if fault else {}))
    return mpirun(p, [RINGMPI, "run", src, "-o", out] + OPTIONS + list(extra), timeout, env=env)


def partial(out):
    return out.parent / f".{out.name}.partial"


def load(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f}, {k: f.attrs[k] for k in f.attrs}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    where = tmp_path_factory.mktemp("resume")
    src = write_input(where / "in.h5", n=40, b=3)
    ref = where / "ref.h5"
    rc, _, err, _ = job(3, src, ref)
    assert rc == 0, err
    data, attrs = load(ref)
    assert list(attrs["ringmpi_passes_done"]) == [1] * N_PASSES
    return where, src, data, attrs


def kill(where, src, name, fault, passes_before):
    out = where / name
    rc, _, err, _ = job(3, src, out, fault=fault)
    assert rc != 0, err
    assert not out.exists(), sorted(os.listdir(where))
    if passes_before == 0:  # nothing finished: nothing kept
        assert not partial(out).exists(), sorted(os.listdir(where))
        return out
    assert partial(out).exists(), sorted(os.listdir(where))
    with h5py.File(partial(out), "r") as f:
        assert list(f.attrs["ringmpi_passes_done"]) == [1] * passes_before + [0] * (N_PASSES - passes_before)
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("fault,k", [("exit:1:3:pass", 3), ("raise:0:1:pass", 1), ("exit:2:2:bwd", 0)])
def test_killed_then_resumed_equals_uninterrupted(uninterrupted, fault, k):
    """A rank dies (exit) or fails (raise -> MPI_Abort) at the start of pass k, or dies in
    the first pass's backward ring (nothing kept): resuming finishes the job, bitwise identical."""
    where, src, ref, ref_attrs = uninterrupted
    out = kill(where, src, f"out-{fault.replace(':', '-')}.h5", fault, k)
    rc, _, err, _ = job(3, src, out, "--resume")
    assert rc == 0, err
    expect = f"--resume: {k} of {N_PASSES} pass(es) already complete" if k else "starting from the beginning"
    assert expect in err, err
    assert out.exists() and not partial(out).exists()
    data, attrs = load(out)
    assert sorted(data) == sorted(ref)
    for name in ref:
        assert data[name].dtype == ref[name].dtype and data[name].tobytes() == ref[name].tobytes(), name
    assert {k: str(v) for k, v in attrs.items()} == {k: str(v) for k, v in ref_attrs.items()}


@pytest.mark.mpi
def test_resume_on_another_world_size(uninterrupted):
    """Results do not depend on P: a job killed on 3 ranks finishes on 2, to rounding."""
    where, src, ref, _ = uninterrupted
    out = kill(where, src, "out-p2.h5", "exit:0:4:pass", 4)
    rc, _, err, _ = job(2, src, out, "--resume")
    assert rc == 0 and "written with 3 rank(s)" in err, err
    data, _ = load(out)
    for name in ref:
        np.testing.assert_allclose(data[name], ref[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.mpi
def test_resume_of_a_different_job_is_refused(uninterrupted):
    where, src, ref, _ = uninterrupted
    out = kill(where, src, "out-refused.h5", "exit:1:2:pass", 2)
    before = partial(out).read_bytes()
    env = mpirun_env(RINGMPI_PASS_BYTES=1)
    rc, _, err, _ = mpirun(2, [RINGMPI, "run", src, "-o", out, "--resume", "--backward", "--heads-per-pass", "2"],
                           60, env=env)
    assert rc == 2 and "belongs to a different job" in err and "option causal: True -> False" in err, err
    assert err.count("ringmpi: error:") == 1
    with h5py.File(src, "r+") as f:  # same shapes, other numbers
        f["q"][0, 0, 0, 0] += 1
    rc, _, err, _ = job(2, src, out, "--resume")
    assert rc == 2 and "input mtime_ns" in err, err
    assert partial(out).read_bytes() == before and not out.exists()
    # without --resume the partial file is simply replaced
    rc, _, err, _ = job(2, src, out)
    assert rc == 0 and out.exists() and not partial(out).exists(), err
    with h5py.File(src, "r+") as f:
        f["q"][0, 0, 0, 0] -= 1


@pytest.mark.mpi
def test_resume_without_partial_starts_afresh(uninterrupted, tmp_path):
    where, src, ref, _ = uninterrupted
    out = tmp_path / "fresh.h5"
    rc, _, err, _ = job(3, src, out, "--resume")
    assert rc == 0 and "starting from the beginning" in err, err
    data, _ = load(out)
    assert all(data[k].tobytes() == ref[k].tobytes() for k in ref)
