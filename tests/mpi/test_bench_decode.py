"""``ringmpi bench --decode`` under real mpirun at a tiny size: the report is consistent.

No timed assertions: the checks are identities between reported numbers.
"""

import json
import sys

import pytest

from mpi_util import mpirun

pytestmark = pytest.mark.mpi


def test_bench_decode_report(tmp_path):
    out = tmp_path / "decode.json"
    rc, stdout, stderr, _ = mpirun(3, [sys.executable, "-m", "ringmpi", "bench", "--decode", "--cache", "50",
                                       "--new", "2", "--heads", "4", "--kv-heads", "2", "--dim", "8",
                                       "--repeat", "3", "--warmup", "1", "--layout", "striped",
                                       "--json", out], 120)
    assert rc == 0, f"exit {rc}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    report = json.loads(out.read_text())
    assert report["mode"] == "decode" and report["config"]["cache"] == 50 and report["config"]["new"] == 2
    assert [pt["world_size"] for pt in report["points"]] == [1, 2, 3]
    for pt in report["points"]:
        for name in ("decode", "ring"):
            s = pt[name]
            assert s["calls"] == 3 and 0 < s["min_s"] <= s["median_s"] <= s["p99_s"]
        d = pt["decode"]
        assert 0 < d["compute_median_s"] and 0 < d["merge_median_s"]
        assert pt["speedup_vs_ring"] == pytest.approx(pt["ring"]["median_s"] / d["median_s"])
    assert "speedup" in stdout and "decode med" in stdout
