"""A value head dim D_v different from the query/key head dim D (issue 13, part 3).

Multi-rank: one mpirun launch per world size runs every case of
``dv_cases.py`` (forward and backward against the float64 dense reference,
ring traffic counted with K and V at their own sizes; decode over a sharded
cache and ``KVCache``; ``ringmpi.torch`` against torch's SDPA), P = 1, 3, 4,
plus one launch at P = 3 with tiny tiles.  In-process: NaN in ``v`` (the careful tile
path), the CUDA planner's supported pairs and its refusal, P = 1 bitwise
equality of the D_v == D path with the same call through the old shapes.
"""

import importlib.util
import itertools

import numpy as np
import pytest

import reference
from mpi_util import CaseLaunches, mpirun_env
from random_inputs import attention_inputs

LAYOUTS = ("contiguous", "zigzag", "striped")
PAIRS = ((192, 128), (24, 40), (64, 8), (5, 13))   # (D, D_v): MLA, a small odd pair both ways
HEADS = ((4, 4), (8, 2), (4, 1))
SMALL_TILES = {"RINGMPI_TILE_Q": 16, "RINGMPI_TILE_KV": 24}
LAUNCHES = ((1, False), (3, False), (4, False), (3, True))
HAVE_TORCH = importlib.util.find_spec("torch") is not None  # the torch cases need the 'torch' extra


def cases_for(p, small_tiles=False):
    cases, spin = [], itertools.count()
    tag = f"P{p}t" if small_tiles else f"P{p}"

    def add(name, **kw):
        i = next(spin)
        d, dv = PAIRS[i % len(PAIRS)]
        h, hkv = HEADS[i % len(HEADS)]
        case = dict(id=f"{tag}-{name}", B=1, H=h, Hkv=hkv, D=d, Dv=dv, dtype="float32", seed=7000 * p + i)
        case.update(kw)
        cases.append(case)

    for layout, causal in itertools.product(LAYOUTS, (False, True)):
        mode = "causal" if causal else "full"
        add(f"n97-{layout}-{mode}", n_q=97, layout=layout, causal=causal, B=2)
        add(f"n2-{layout}-{mode}", n_q=2, layout=layout, causal=causal)  # N < P: empty shards
        add(f"mla-{layout}-{mode}", n_q=61, n_kv=83, layout=layout, causal=causal, D=192, Dv=128, H=8, Hkv=2)
        add(f"odd-{layout}-{mode}", n_q=50, layout=layout, causal=causal, D=24, Dv=40, H=4, Hkv=1)
    for layout in LAYOUTS:
        add(f"window-{layout}", n_q=120, layout=layout, causal=True, window=[9, 0])
        add(f"window-both-{layout}", n_q=80, n_kv=100, layout=layout, window=[6, 4])
        add(f"segments-{layout}", n_q=90, layout=layout, segments=4, B=2)
        add(f"segments-causal-{layout}", n_q=91, layout=layout, causal=True, segments=3)
        add(f"qlong-causal-{layout}", n_q=70, n_kv=30, layout=layout, causal=True)  # rows see nothing
        add(f"float64-{layout}", n_q=45, layout=layout, causal=True, dtype="float64", D=192, Dv=128)
        add(f"float16-{layout}", n_q=45, layout=layout, causal=True, dtype="float16")
        add(f"bfloat16-{layout}", n_q=45, layout=layout, window=[5, 5], dtype="bfloat16", D=24, Dv=40)
    add("errors", kind="errors", n_q=10, layout="zigzag", D=24, Dv=40)
    for layout, causal in zip(LAYOUTS if HAVE_TORCH else (), (True, False, True)):
        add(f"torch-{layout}", kind="torch", layout=layout, causal=causal, n_q=47, D=24, Dv=40, H=4, Hkv=2)
        add(f"torch-mla-{layout}", kind="torch", layout=layout, causal=causal, n_q=33, D=192, Dv=128)
    for layout in LAYOUTS:
        add(f"decode-{layout}", kind="decode", layout=layout, n=23, s_new=2, B=2, D=24, Dv=40)
        add(f"decode-mla-{layout}", kind="decode", layout=layout, n=40, s_new=1, D=192, Dv=128)
    return cases


DV = CaseLaunches("dv_cases.py", LAUNCHES, lambda launch: cases_for(*launch), timeout=600,
                  env=lambda launch: mpirun_env(**SMALL_TILES) if launch[1] else None)
results = DV.fixture()


@pytest.mark.parametrize("launch,case", DV.params())
def test_dv_case(results, launch, case):
    ok, msg = results(launch)[case["id"]]
    assert ok, msg


# ----------------------------------------------------------------- in-process (P = 1)
def test_nan_in_v_reaches_only_its_column_and_the_queries_that_see_it():
    import ringmpi

    q, k, v, _ = attention_inputs(3, 1, 40, 4, 2, 24, dv=40)
    j, col = 17, 33
    bad = v.copy()
    bad[0, j, 1, col] = np.nan
    context = ringmpi.RingContext(backend="numpy")
    clean_o, clean_lse, _ = ringmpi.ring_attention(q, k, v, causal=True, context=context)
    o, lse, _ = ringmpi.ring_attention(q, k, bad, causal=True, context=context)
    ref_o, _ = reference.dense_forward(q, k, bad, reference.visible(40, 40, True), 1 / np.sqrt(24), np.float64)
    heads = [2, 3]  # the query heads of kv head 1
    assert np.array_equal(o[:, :j], clean_o[:, :j]) and np.array_equal(lse, clean_lse)
    assert np.array_equal(o[:, :, :2], clean_o[:, :, :2])
    assert np.isnan(o[0, j:, heads, col]).all()
    rest = np.delete(o[:, j:][:, :, heads], col, axis=-1)
    want = np.delete(ref_o[:, j:][:, :, heads], col, axis=-1)
    assert np.abs(rest - want).max() < 1e-5


def test_default_path_unchanged_by_the_value_dim_plumbing():
    """D_v == D: the result is bitwise the one of the same call with D_v taken from v."""
    import ringmpi

    q, k, v, do = attention_inputs(3, 1, 40, 4, 2, 32, dv=32)
    context = ringmpi.RingContext(backend="numpy")
    o, lse, _ = ringmpi.ring_attention(q, k, v, causal=True, context=context)
    grads = ringmpi.ring_attention_backward(do, q, k, v, (o, lse), causal=True, context=context)
    ref_o, ref_lse = reference.dense_forward(q, k, v, reference.visible(40, 40, True), 1 / np.sqrt(32), np.float64)
    assert o.shape == q.shape and [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
    assert grads.dsinks is None
    assert np.abs(o - ref_o).max() < 1e-12 and np.abs(lse - ref_lse).max() < 1e-12


def test_cuda_value_dim_pairs_are_planned_and_listed():
    from ringmpi import kernels as K

    items = set(K.instantiations())
    for d, dv in ((192, 128), (150, 100), (100, 110), (24, 20), (64, 64)):
        assert K.value_dim_problem(d, dv) is None
        for kind in (K.F16, K.BF16, K.F32, K.F64):
            for kernel in K.forward_kernels(kind, d, dv) + K.backward_kernels(kind, d, dv):
                assert kernel.instantiation in items
    mla = K.forward_kernel(K.F32, 192, d_v=128)
    assert mla.expr.endswith(", 128>") and mla.smem < K.forward_kernel(K.F32, 192).smem
    assert K.backward_kernel(K.BF16, 192, d_v=128).smem < K.backward_kernel(K.BF16, 192).smem
    # the same-bucket pair runs the D == D kernels (the true D_v is a run-time argument)
    assert K.forward_kernel(K.F16, 100, d_v=110) == K.forward_kernel(K.F16, 100)
    for d, dv in ((24, 40), (128, 64), (256, 300)):
        assert "value head dim" in K.value_dim_problem(d, dv)


def test_gpu_refuses_unsupported_pairs_before_compute():
    from ringmpi.backends import value_dim_problem

    assert value_dim_problem("numpy", 24, 40) is None
    assert value_dim_problem("cupy", 192, 128) is None
    assert value_dim_problem("cupy", 64, 64) is None
    msg = value_dim_problem("cupy", 24, 40)
    assert "D=24" in msg and "D_v=40" in msg and "numpy" in msg


def test_bench_takes_dim_v(tmp_path):
    """``ringmpi bench --dim-v`` (ring and --decode) under mpirun: D_v in the report, FLOPs with D_v."""
    import json
    import sys

    from mpi_util import mpirun

    from ringmpi.core.flops import attention_flops

    common = ["-m", "ringmpi", "bench", "--n", "40", "--heads", "4", "--kv-heads", "2", "--dim", "24",
              "--dim-v", "40", "--repeat", "1", "--warmup", "0", "--backend", "numpy"]
    rc, out, err, _ = mpirun(2, [sys.executable] + common + ["--backward", "--json", tmp_path / "r.json"], 300)
    assert rc == 0 and "D=24 D_v=40 float32" in out, out + err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["dim_v"] == 40
    assert report["forward"]["flops"] == attention_flops(1, 4, 40, 40, 24, False, "forward", dim_v=40) == 4 * 4 * 40 * 40 * 32
    rc, out, err, _ = mpirun(2, [sys.executable] + common + ["--decode", "--cache", "30", "--new", "2"], 300)
    assert rc == 0 and "D=24 D_v=40 float32" in out, out + err


def test_flops_count_the_value_dim():
    from ringmpi.core.flops import attention_flops

    assert attention_flops(1, 2, 10, 10, 192, dim_v=128) == 2 * 2 * 10 * 10 * (192 + 128)
    assert attention_flops(1, 2, 10, 10, 64, dim_v=64) == attention_flops(1, 2, 10, 10, 64)


@pytest.mark.skipif(not HAVE_TORCH, reason="torch SDPA comparison needs the 'torch' extra")
def test_sdpa_comparison_takes_dim_v():
    from ringmpi.bench.sdpa import measure_sdpa

    res = measure_sdpa(1, 4, 2, 32, 24, "float32", True, True, 0, 1, 1, dim_v=40)
    assert res["available"] and res["forward_seconds"] > 0 and res["backward_seconds"] > 0, res


def test_file_job_boxes_and_spec_carry_the_value_dim():
    from ringmpi.filejob.hdf5 import InputSpec
    from ringmpi.filejob.pass_plan import Pass, bytes_per_batch_entry, pass_boxes

    def spec(dim_v):
        shapes = {"q": (2, 50, 4, 24), "k": (2, 60, 2, 24), "v": (2, 60, 2, dim_v), "do": (2, 50, 4, dim_v)}
        return InputSpec(path="in.h5", batch=2, n_q=50, n_kv=60, heads=4, kv_heads=2, dim=24, dtype="float32",
                         seg_q=None, seg_kv=None, shapes=shapes)

    narrow, same = spec(8), spec(24)
    assert narrow.dim_v == 8 and same.dim_v == 24
    boxes = pass_boxes(narrow, Pass(b0=1, b1=2, g0=1, g1=2))
    assert boxes["q"] == (1, [(1, 2), (0, 0), (2, 4), (0, 24)]) and boxes["kv"] == (1, [(1, 2), (0, 0), (1, 2), (0, 24)])
    assert boxes["o"] == (1, [(1, 2), (0, 0), (2, 4), (0, 8)]) and boxes["v"] == (1, [(1, 2), (0, 0), (1, 2), (0, 8)])
    assert bytes_per_batch_entry(narrow, 3, 2) < bytes_per_batch_entry(same, 3, 2)
