"""``ringmpi bench --linear`` under real mpirun at a tiny size: the report holds what it promises.

No timed assertions: the bytes each rank receives are deterministic (the scans' messages: at
P = 3 every rank receives two maps per forward + backward call, whatever N), and the report
has its points.
"""

import json
import sys

import pytest

from mpi_util import mpirun

pytestmark = pytest.mark.mpi


def test_bench_linear_bytes_are_flat_in_n(tmp_path):
    out = tmp_path / "gdn.json"
    b, h, k, v = 2, 2, 8, 6
    rc, stdout, stderr, _ = mpirun(3, [sys.executable, "-m", "ringmpi", "bench", "--linear", "gdn", "--n", 512,
                                       "--batch", b, "--heads", h, "--dim", k, "--dim-v", v, "--repeat", 1,
                                       "--warmup", 0, "--backward", "--json", out], 120)
    assert rc == 0, f"exit {rc}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    report = json.loads(out.read_text())
    one_map = (k * k + k * v) * 4 * b * h  # a dense map, float32
    assert [pt["n"] for pt in report["bytes"]] == [32, 64, 128, 256, 512]
    for pt in report["bytes"]:
        assert pt["bytes_received_max"] == pt["bytes_received_min"] == 2 * one_map
    for key in ("strong", "weak"):
        assert [pt["world_size"] for pt in report[key]] == [1, 2, 3]
        assert all(pt["median_s"] > 0 and pt["local_median_s"] > 0 and pt["cpu_median_s"] > 0 for pt in report[key])
    assert report["strong"][0]["bytes_received_max"] == 0  # one rank: nothing to scan
    # beside each P > 1 of the weak sweep: its ranks' one-rank calls, all at once
    assert [("alone_median_s" in pt) for pt in report["weak"]] == [False, True, True]
    assert all(pt["alone_median_s"] > 0 for pt in report["weak"][1:])
    assert "alone/tP" in stdout
    assert "bytes received per rank per call" in stdout
