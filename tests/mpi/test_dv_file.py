"""The file job with a value head dim D_v != D: ``make-data --dim-v`` -> ``run`` -> ``verify``.

One mpirun launch per world size (``file_cases.py``) runs every case; each
output element is checked against the float64 dense reference by
``test_file_io.check_case`` (o and dv D_v wide, dq and dk D wide), and
``ringmpi verify`` passes the MLA-shaped result.  A file whose 'do' is D wide
while 'v' is narrower, or whose 'v' has other heads, is refused (exit 2).
"""

import json
import sys

import h5py
import pytest

from cli_util import RINGMPI
from file_check import check_case
from mpi_util import DRIVERS, launch_cache, mpirun

WORLD_SIZES = (1, 3)
NARROW = ["--n", "41", "--heads", "4", "--kv-heads", "2", "--dim", "24", "--dim-v", "8", "--with-do", "--seed", "5"]
CASES = [
    dict(id="narrow-v-causal", data=NARROW + ["--batch", "2"], run=["--causal", "--backward"]),
    dict(id="narrow-v-passes", data=NARROW + ["--batch", "2"], run=["--heads-per-pass", "2", "--backward",
                                                                    "--layout", "striped"],
         env={"RINGMPI_PASS_BYTES": 1}),
    dict(id="wide-v-3d", data=["--n", "30", "--heads", "2", "--dim", "5", "--dim-v", "13", "--with-do",
                               "--no-batch-axis"], run=["--backward", "--window", "4", "4"]),
    dict(id="mla", data=["--n", "33", "--n-kv", "40", "--heads", "2", "--kv-heads", "1", "--dim", "192",
                         "--dim-v", "128", "--with-do", "--dtype", "float16"], run=["--causal", "--backward"]),
    dict(id="forward-only", data=["--n", "20", "--heads", "2", "--dim", "16", "--dim-v", "12"], run=[]),
]


def _run(p, tmp_path_factory):
    where = tmp_path_factory.mktemp(f"dv_files_P{p}")
    spec = where / "cases.json"
    spec.write_text(json.dumps(CASES))
    return mpirun(p, [sys.executable, DRIVERS / "file_cases.py", spec, where], 240) + (where,)


_runs = launch_cache(_run)


def _launch(tmp_path_factory, p):
    rc, out, err, _, where = _runs(p, tmp_path_factory)
    assert rc == 0, f"mpirun -n {p} file_cases.py exit {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    return where, out


@pytest.mark.mpi
@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_dv_file_case(tmp_path_factory, p, case):
    where, _ = _launch(tmp_path_factory, p)
    check_case(case, where, p)
    with h5py.File(where / f"{case['id']}.out.h5", "r") as f, h5py.File(where / f"{case['id']}.in.h5", "r") as g:
        assert f["o"].shape[-1] == g["v"].shape[-1] != g["q"].shape[-1]
        if "dv" in f:
            assert f["dv"].shape == g["v"].shape and f["dk"].shape == g["k"].shape


@pytest.mark.mpi
def test_dv_summary_and_verify(tmp_path_factory):
    where, out = _launch(tmp_path_factory, 3)
    assert "ringmpi run: N=33 N_kv=40 B=1 H=2 H_kv=1 D=192 D_v=128 float16" in out, out[-3000:]
    rc, text, err, _ = mpirun(2, [RINGMPI, "verify", where / "mla.in.h5", where / "mla.out.h5"], 120)
    assert rc == 0 and text.count("PASS") == 1 and "\n  dv " in text, text + err


def test_mismatched_value_datasets_are_refused(tmp_path):
    import subprocess

    import numpy as np

    cases = {
        "do-D-wide": ({"v": (1, 9, 2, 4), "do": (1, 9, 2, 8)}, "expected o's shape (1, 9, 2, 4)"),
        "v-other-heads": ({"v": (1, 9, 1, 4), "do": (1, 9, 2, 4)}, "must have the same shape but for the last dim"),
    }
    for name, (shapes, want) in cases.items():
        path = tmp_path / f"{name}.h5"
        with h5py.File(path, "w") as f:
            f["q"] = np.zeros((1, 9, 2, 8), np.float32)
            f["k"] = np.zeros((1, 9, 2, 8), np.float32)
            for key, shape in shapes.items():
                f[key] = np.zeros(shape, np.float32)
        proc = subprocess.run([RINGMPI, "run", str(path), "-o", str(tmp_path / "out.h5"), "--backward"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and want in proc.stderr, (name, proc.stderr)
        assert not (tmp_path / "out.h5").exists()
