"""``ringmpi verify`` at a length it cannot check whole: N = 2^16, causal, forward and backward.

The result comes from ``ringmpi run`` on 2 ranks (H = 1, D = 8 keep it cheap: about 17 CPU
seconds); verify, on 2 ranks too, samples its rows because N is above ``--max-n`` and says
so, passes the good output, and fails a copy whose gradients are flipped in 2% of the query
rows (``dq``) and of the key rows (``dk``, ``dv``), naming each such dataset and a flipped
row as its worst, while ``o`` and ``lse`` (untouched) still pass.
"""

import re
import shutil

import h5py
import numpy as np
import pytest

from cli_util import RINGMPI
from mpi_util import mpirun
from ringmpi.cli.verify import sample_rows

N = 1 << 16
ROW = re.compile(r"^  (?P<name>\w+) +(?P<err>\S+) +\S+ +(?P<bound>\S+) +\S+  (?P<ok>yes|NO) +(?P<kind>token|key) "
                 r"(?P<row>\d+)$", re.M)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    where = tmp_path_factory.mktemp("verify_sample")
    src, out = where / "in.h5", where / "out.h5"
    rc, text, err, _ = mpirun(2, [RINGMPI, "make-data", src, "--n", N, "--heads", 1, "--dim", 8, "--with-do",
                                  "--seed", 11], 120)
    assert rc == 0, err[-3000:]
    rc, text, err, _ = mpirun(2, [RINGMPI, "run", src, "-o", out, "--causal", "--backward", "--quiet"], 400)
    assert rc == 0 and f"ringmpi run: N={N} " in text, err[-3000:]
    assert "% done" not in err and "1/2 forward" not in err, err[-3000:]  # --quiet
    return where, src, out


def rows_of(report):
    return {m["name"]: m for m in ROW.finditer(report)}


@pytest.mark.mpi
def test_a_good_output_passes_on_sampled_rows(result):
    where, src, out = result
    rc, text, err, _ = mpirun(2, [RINGMPI, "verify", src, out], 240)
    assert rc == 0 and text.count("PASS: every sampled row within tolerance") == 1, text + err[-3000:]
    assert f"N={N} is above --max-n 8192, too long to check whole" in text, text
    assert "a sample of 256 query rows and 256 key rows, seed 0 (--sample 256 --seed 0" in text, text
    rows = rows_of(text)
    assert sorted(rows) == ["dk", "dq", "dv", "lse", "o"], text
    assert all(r["ok"] == "yes" and 0 < float(r["err"]) <= float(r["bound"]) for r in rows.values()), text


@pytest.mark.mpi
def test_flipped_rows_fail_naming_the_dataset_and_the_row(result):
    where, src, out = result
    bad = where / "flipped.h5"
    shutil.copy(out, bad)
    rng = np.random.default_rng(2)
    flipped = {}
    with h5py.File(bad, "r+") as f:
        for name in ("dq", "dk", "dv"):
            rows = np.sort(rng.choice(N, N // 50, replace=False))
            f[name][0, rows] = -f[name][0, rows]
            flipped[name] = set(rows.tolist())
    sample, seed = 200, 5
    queries = set(sample_rows(N, sample, seed, 1, 0)[0].tolist())
    keys = set(sample_rows(N, sample, seed, 1, 1)[0].tolist())
    assert queries & flipped["dq"] and keys & flipped["dk"] and keys & flipped["dv"]  # the sample meets them
    rc, text, err, _ = mpirun(2, [RINGMPI, "verify", src, bad, "--sample", sample, "--seed", seed], 240)
    assert rc == 1 and "FAIL: some output is outside tolerance" in text, text + err[-3000:]
    rows = rows_of(text)
    assert rows["o"]["ok"] == "yes" and rows["lse"]["ok"] == "yes", text
    for name, kind in (("dq", "token"), ("dk", "key"), ("dv", "key")):
        assert rows[name]["ok"] == "NO" and rows[name]["kind"] == kind, text
        assert int(rows[name]["row"]) in flipped[name], (name, text)
