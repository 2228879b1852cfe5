"""Command-line mistakes: click's usage message and exit 2, printed once under
mpirun (the launcher's rank 0), no traceback, no MPI_Abort; the finiteness
check of ``run`` (on by default) and ``--no-check-finite``."""

import h5py
import numpy as np
import pytest

from cli_util import RINGMPI, write_input
from mpi_util import mpirun

MISTAKES = {
    "missing-argument": (["run"], "Missing argument 'IN.h5'"),
    "missing-option": (["run", "{src}"], "Missing option '-o'"),
    "unknown-option": (["run", "{src}", "-o", "{out}", "--casual"], "No such option '--casual'"),
    "not-a-choice": (["run", "{src}", "-o", "{out}", "--layout", "spiral"], "'spiral' is not one of"),
    "not-a-number": (["run", "{src}", "-o", "{out}", "--timeout", "soon"], "'soon' is not a valid float"),
    "window-needs-two": (["run", "{src}", "-o", "{out}", "--window", "3"], "requires 2 arguments"),
    "unknown-command": (["runn"], "No such command 'runn'"),
    "make-data-bad-choice": (["make-data", "{out}", "--dtype", "int8"], "'int8' is not one of"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_usage_error_once_exit_2(tmp_path, name):
    args, expect = MISTAKES[name]
    src = write_input(tmp_path / "in.h5")
    args = [a.replace("{src}", str(src)).replace("{out}", str(tmp_path / "out.h5")) for a in args]
    rc, out, err, secs = mpirun(2, [RINGMPI] + args, 60)
    assert rc == 2, err
    assert expect in err and err.count("Usage: ringmpi") <= 1 and err.count("Error:") == 1, err
    assert "Traceback" not in err and "MPI_ABORT" not in err.upper(), err
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.mpi
def test_finite_check_is_default_and_can_be_skipped(tmp_path):
    k = np.random.default_rng(0).standard_normal((1, 20, 2, 8)).astype("f4")
    k[0, 17, 1, 3] = np.nan
    src = write_input(tmp_path / "in.h5", k=k)
    out = tmp_path / "out.h5"
    rc, _, err, _ = mpirun(3, [RINGMPI, "run", src, "-o", out, "--causal"], 60)
    assert rc == 2 and err.count("ringmpi: error:") == 1, err
    assert "dataset k has a non-finite value (nan) at global index [0, 17, 1, 3]" in err, err
    assert "--no-check-finite" in err and not out.exists()
    rc, _, err, _ = mpirun(3, [RINGMPI, "run", src, "-o", out, "--causal", "--no-check-finite"], 60)
    assert rc == 0, err
    with h5py.File(out, "r") as f:
        o, lse = f["o"][()], f["lse"][()]
    # key 17 (kv head 1 = query heads 2, 3) is visible to causal queries 17..19 only
    bad = ~np.isfinite(o).all(axis=-1)
    assert sorted(map(tuple, np.argwhere(bad).tolist())) == [(0, i, h) for i in (17, 18, 19) for h in (2, 3)]
    assert np.isfinite(lse[0, :2]).all() and np.isfinite(lse[0, 2:, :17]).all()
