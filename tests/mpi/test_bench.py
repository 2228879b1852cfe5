"""``ringmpi bench`` under real mpirun at tiny sizes: the report is consistent.

No timed assertions: the checks are identities between the reported numbers
(TFLOP/s = FLOPs / time, compute <= wall, fractions in [0, 1]) and the tile
counts, which are deterministic.
"""

import importlib.util
import json
import math
import sys

import pytest

from mpi_util import mpirun, mpirun_env

pytestmark = pytest.mark.mpi

RINGMPI = [sys.executable, "-m", "ringmpi"]
SMALL = ["--heads", "2", "--kv-heads", "1", "--dim", "16", "--repeat", "2", "--warmup", "1"]
PHASE_KEYS = ("tflops", "seconds_median", "compute_seconds", "wait_seconds", "exposed_comm_fraction",
              "overlap_efficiency", "imbalance", "peak_memory_bytes")


def run_bench(nprocs, args, tmp_path, name, env=None, timeout=90):
    out = tmp_path / f"{name}.json"
    rc, stdout, stderr, _ = mpirun(nprocs, RINGMPI + ["bench"] + SMALL + list(map(str, args)) + ["--json", out],
                                   timeout, env=env)
    assert rc == 0, f"exit {rc}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    return json.loads(out.read_text()), stdout


def check_phase(s, p, causal, n, batch=1, heads=2, dim=16, backward=False):
    for key in PHASE_KEYS:
        assert key in s, key
    flops = 4.0 * batch * heads * n * n * dim * (0.5 if causal else 1.0) * (2.5 if backward else 1.0)
    assert s["flops"] == pytest.approx(flops)
    assert s["tflops"] == pytest.approx(s["flops"] / s["seconds_median"] / 1e12, rel=1e-9)
    for key in ("compute_seconds", "wait_seconds", "rank_seconds", "peak_memory_bytes", "tiles_computed",
                "tiles_skipped", "bytes_sent", "overlap_efficiency_per_rank"):
        assert len(s[key]) == p, key
    assert len(s["timeline"]["steps"]) == p
    for c, w, wall in zip(s["compute_seconds"], s["wait_seconds"], s["rank_seconds"]):
        assert 0 <= c <= wall and 0 <= w <= wall  # medians over repeats, each bounded by the wall's
    tl = s["timeline"]  # one repeat: its steps fit in its wall time (to the few microseconds by which
    for steps, wall in zip(tl["steps"], tl["rank_seconds"]):  # the backward's last hop and step overlap)
        assert sum(st["compute_s"] + st["wait_s"] for st in steps) <= wall * (1 + 1e-3) + 1e-4
    assert max(s["rank_seconds"]) <= s["seconds_median"] * (1 + 1e-9)  # the job waits for its slowest rank
    assert s["seconds_min"] <= s["seconds_median"] <= s["seconds_max"]
    assert s["rank_seconds_min"] <= s["rank_seconds_median"] <= s["rank_seconds_max"]
    assert 0.0 <= s["overlap_efficiency"] <= 1.0
    assert all(0.0 <= e <= 1.0 for e in s["overlap_efficiency_per_rank"])
    assert 0.0 <= s["exposed_comm_fraction"] <= 1.0
    assert s["imbalance"] >= 1.0 - 1e-12 and s["tile_imbalance"] >= 1.0 - 1e-12
    assert all(m > 0 for m in s["peak_memory_bytes"])
    assert all(m > 0 for m in s["peak_alloc_bytes"])  # tracemalloc, numpy backend
    assert 0.0 <= s["instrumentation_overhead_fraction"] < 1.0
    # one record per ring step (the backward adds one for the final dK/dV hop)
    for steps in s["timeline"]["steps"]:
        assert [st["step"] for st in steps] == list(range(p + (1 if backward else 0)))
    # every byte sent around the ring is received; a lone rank sends nothing
    assert sum(s["bytes_sent"]) == sum(s["bytes_recv"])
    assert all(b > 0 for b in s["bytes_sent"]) if p > 1 else s["bytes_sent"] == [0]


def test_bench_single_run_report(tmp_path):
    report, stdout = run_bench(3, ["--n", 200, "--causal", "--layout", "zigzag", "--backward", "--batch", 2],
                               tmp_path, "single")
    assert report["world_size"] == 3 and report["backend"] == "numpy" and report["n"] == 200
    assert report["mode"] == "single"
    assert sum(report["s_local"]) == 200 and len(report["s_local"]) == 3
    check_phase(report["forward"], 3, True, 200, batch=2)
    check_phase(report["backward"], 3, True, 200, batch=2, backward=True)
    env = report["environment"]
    assert env["mpi_library"] and env["backend"] == "numpy"
    assert len(env["hostnames"]) == 3 and env["mpi4py"] and env["numpy"]
    # one (query tile, key tile) pair per step at this size, counted per batch entry
    for ph in ("forward", "backward"):
        s = report[ph]
        assert [c + k for c, k in zip(s["tiles_computed"], s["tiles_skipped"])] == [3 * 2] * 3
    assert "TFLOP/s" in stdout and "exposed comm" in stdout


def test_bench_invariant_report(tmp_path):
    """``--invariant``: said in the header; the forward's timeline holds both passes (2P steps,
    maxima then sums) and the tile counts are 64-token tile pairs.  Zigzag at P = 2, N = 256:
    rank 0 holds tiles 0 and 3, rank 1 tiles 1 and 2, so causal each sees 5 of its 8 pairs."""
    report, stdout = run_bench(2, ["--n", 256, "--causal", "--layout", "zigzag", "--backward", "--invariant"],
                               tmp_path, "invariant")
    assert report["invariant"] is True and stdout.splitlines()[0].endswith(", invariant")
    fwd, bwd = report["forward"], report["backward"]
    assert [len(steps) for steps in fwd["timeline"]["steps"]] == [4, 4]
    assert fwd["tiles_computed"] == [10, 10] and fwd["tiles_skipped"] == [6, 6]
    assert bwd["tiles_computed"] == [5, 5] and bwd["tiles_skipped"] == [3, 3]
    for s in (fwd, bwd):
        assert s["tflops"] == pytest.approx(s["flops"] / s["seconds_median"] / 1e12, rel=1e-9)
    # shards that are not whole tiles (N / 2P = 50): one clear error, no report
    rc, stdout, stderr, _ = mpirun(2, RINGMPI + ["bench"] + SMALL + ["--n", "200", "--layout", "zigzag", "--invariant"],
                                   90)
    assert rc != 0 and "needs every shard made of whole 64-token tiles" in stdout + stderr


@pytest.mark.parametrize("kind", ["strong", "weak"])
def test_bench_sweeps(tmp_path, kind):
    n = 256 if kind == "strong" else 96
    report, stdout = run_bench(3, ["--n", n, "--sweep", kind, "--backward"], tmp_path, kind)
    assert report["sweep"] == kind and report["world_size"] == 3
    points = report["points"]
    assert [pt["world_size"] for pt in points] == [1, 2, 3]
    for pt in points:
        p = pt["world_size"]
        want_n = n * p if kind == "weak" else n
        assert pt["n"] == want_n and sum(pt["s_local"]) == want_n
        check_phase(pt["forward"], p, False, want_n)
        check_phase(pt["backward"], p, False, want_n, backward=True)
        for ph in ("forward", "backward"):
            eff = pt["efficiency"][ph]
            assert eff == pytest.approx(pt[ph]["tflops"] / (p * points[0][ph]["tflops"]), rel=1e-9)
    assert points[0]["efficiency"]["forward"] == pytest.approx(1.0)
    assert report["forward"] == points[-1]["forward"]
    assert "efficiency" in stdout


def test_causal_contiguous_is_less_balanced_than_zigzag(tmp_path):
    # small tiles so that skipping shows at a tiny size; compute dominates the ring time here
    env = mpirun_env(RINGMPI_TILE_Q=64, RINGMPI_TILE_KV=64)
    imbalance = {}
    for layout in ("contiguous", "zigzag"):
        report, _ = run_bench(4, ["--n", 2048, "--causal", "--layout", layout, "--heads", 4, "--dim", 32,
                                  "--repeat", 3], tmp_path, layout, env=env)
        s = report["forward"]
        check_phase(s, 4, True, 2048, heads=4, dim=32)
        imbalance[layout] = (s["tile_imbalance"], s["imbalance"])
    # 8 x 8 tiles per block: contiguous rank r computes 64 r + 36 tiles, every zigzag rank 132
    assert imbalance["contiguous"][0] == pytest.approx(228 / 132, rel=1e-12)
    assert imbalance["zigzag"][0] == pytest.approx(1.0, rel=1e-12)


def test_plot_without_matplotlib_says_how_to_install(tmp_path):
    if importlib.util.find_spec("matplotlib") is not None:
        # hide it from the children: a sitecustomize installs an import finder that refuses matplotlib
        hide = tmp_path / "hide"
        hide.mkdir()
        (hide / "sitecustomize.py").write_text(
            "import sys\n"
            "class _Refuse:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'matplotlib' or name.startswith('matplotlib.'):\n"
            "            raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, _Refuse())\n")
        env = mpirun_env(PYTHONPATH=hide)
    else:
        env = mpirun_env()
    rc, out, err, _ = mpirun(2, RINGMPI + ["bench", "--n", 8, "--plot", tmp_path / "t.png"], 60, env=env)
    assert rc != 0
    assert "pip install 'ringmpi[plot]'" in out + err
    assert not (tmp_path / "t.png").exists()


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
def test_plots_are_written(tmp_path):
    png = tmp_path / "timeline.png"
    report, _ = run_bench(2, ["--n", 64, "--backward", "--plot", png], tmp_path, "plot")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep_png = tmp_path / "sweep.png"
    run_bench(2, ["--n", 64, "--sweep", "strong", "--plot", sweep_png], tmp_path, "plot_sweep")
    assert sweep_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert math.isfinite(report["forward"]["tflops"])
