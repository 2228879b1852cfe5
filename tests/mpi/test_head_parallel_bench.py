"""``ringmpi bench --sweep head-parallel`` and ``--head-parallel`` under real mpirun, tiny sizes.

No timed assertions on speed: the byte counts are exact identities.
"""

import json
import sys

import pytest

from mpi_util import DRIVERS, case_records, mpirun, mpirun_env
from test_bench import RINGMPI

pytestmark = pytest.mark.mpi

P, N, H, D = 4, 64, 4, 16


def test_sweep_reports_every_u_with_exact_byte_split(tmp_path):
    out, png = tmp_path / "hp.json", tmp_path / "hp.png"
    rc, stdout, stderr, _ = mpirun(P, RINGMPI + [
        "bench", "--sweep", "head-parallel", "--n", N, "--heads", H, "--dim", D, "--backward", "--causal",
        "--layout", "zigzag", "--repeat", "1", "--warmup", "0",
        "--json", out, "--plot", png], 180, env=mpirun_env(RINGMPI_NODE_SIZE=2))
    assert rc == 0, f"exit {rc}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    report = json.loads(out.read_text())
    assert png.stat().st_size > 0
    # auto: the cost model's choice on this machine's measured links among U = 1, 2 (issue 53)
    assert report["nodes"] == [0, 0, 1, 1] and report["auto"] in (1, 2)
    assert [pt["head_parallel"] for pt in report["points"]] == [1, 2, 4]
    rows = N // P  # every rank holds N/P tokens (zigzag, N % 2P == 0)
    for pt in report["points"]:
        u, groups = pt["head_parallel"], pt["groups"]
        assert groups == P // u
        fwd, bwd = pt["forward"], pt["backward"]
        # the ring: (groups - 1) hops of this group's K and V (H/U heads, U*rows tokens, float32)
        # plus their int64 positions; the backward adds groups hops of float32 dK, dV
        kv = 2 * (H // u) * (u * rows) * D * 4 + 8 * u * rows
        grad = 2 * (H // u) * (u * rows) * D * 4
        assert fwd["bytes_sent_inter_group"] == [(groups - 1) * kv] * P
        # (a lone group finishes its dK, dV where they are computed: no hop)
        assert bwd["bytes_sent_inter_group"] == [(groups - 1) * kv + (groups * grad if groups > 1 else 0)] * P
        # the all-to-alls: q, k, v in and o, lse out (forward); q, do, k, v, lse, Dv in, dq, dk, dv out
        # (backward) -- each rank keeps 1/U of its shard and sends the rest
        share = (u - 1) / u
        fwd_a2a = share * rows * (3 * H * D * 4 + H * D * 4 + H * 4)
        bwd_a2a = share * rows * (4 * H * D * 4 + 2 * H * 4 + 3 * H * D * 4)
        assert fwd["bytes_sent_intra_group"] == [pytest.approx(fwd_a2a)] * P
        assert bwd["bytes_sent_intra_group"] == [pytest.approx(bwd_a2a)] * P
    assert "* = the U that head_parallel='auto' picks" in stdout


def test_bench_head_parallel_single_and_bad_choices(tmp_path):
    out = tmp_path / "one.json"
    args = RINGMPI + ["bench", "--n", N, "--heads", H, "--dim", D, "--repeat", "1", "--warmup", "0"]
    rc, stdout, stderr, _ = mpirun(P, args + ["--head-parallel", "auto", "--json", out], 120,
                                   env=mpirun_env(RINGMPI_NODE_SIZE=2))
    assert rc == 0, stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["head_parallel"] == "auto"
    steps = report["forward"]["timeline"]["steps"][0]
    # auto chose U by predicted cost (issue 53): 2, a ring of 2 groups between the all-to-alls, or the flat ring
    u = report["head_parallel_chosen"]
    assert [s.get("stage") for s in steps] == (["a2a in", None, None, "a2a out"] if u == 2 else [None] * 4)
    choice = report["forward"]["choice"]
    assert choice["chosen"] == ("head x ring, U=2" if u == 2 else "ring") and choice["predicted_s"] > 0
    assert choice["runner_up_s"] >= choice["predicted_s"]
    assert f"(chosen by auto: {choice['chosen']}, predicted " in stdout
    bad = {"not-dividing-P": (["--head-parallel", "3"], "head_parallel=3 must divide the number of ranks (4)"),
           "not-a-number": (["--head-parallel", "x"], "--head-parallel: head_parallel must be a positive"),
           "with-strong": (["--head-parallel", "2", "--sweep", "strong"], "use --sweep head-parallel")}
    cases = [{"id": name, "argv": [str(a) for a in args[len(RINGMPI):]] + extra}
             for name, (extra, _) in bad.items()]
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    rc, stdout, stderr, _ = mpirun(P, [sys.executable, DRIVERS / "cli_cases.py", path], 120)
    results = case_records(stdout)
    assert rc == 0 and set(results) == set(bad), (rc, sorted(results), stderr[-3000:])
    for name, (_, message) in bad.items():
        rcs, errs = results[name]["rc"], results[name]["stderr"]
        assert rcs == [2] * P, (name, rcs, errs)
        assert message in errs[0], (name, errs)
