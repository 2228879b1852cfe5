"""CupyBackend block kernels against a float64 dense reference (single rank).

The reference and the tolerance are the library's (:mod:`ringmpi.core.dense_reference`,
docs/design.md): max error <= 2x the error of a naive same-dtype dense
computation + 1e-6 for o / lse, 3x + 1e-5 for gradients.  Needs a CUDA GPU;
skipped, with the reason shown, where none is visible.  The host-side mask
helpers are checked without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from random_inputs import attention_inputs
from ringmpi.backends import gpu_available
from ringmpi.runtime.device import gpu_unavailable_reason
from ringmpi.backends.cupy_backend import mask_scalars, tile_bounds
from ringmpi.backends.numpy_backend import NumpyBackend
from ringmpi.core.dtypes import BFLOAT16, float64_to_bfloat16
from ringmpi.core.masks import FULL, SKIP, BlockMask, ScoreSpec
from ringmpi.core.dense_reference import DenseReference, tolerance

NO_GPU = f"no usable CUDA GPU: {gpu_unavailable_reason()}"


# ------------------------------------------------------------------ helpers
def round_to(x, dtype):
    """``x`` rounded to ``dtype``'s grid, returned as float64 (bf16: RNE, rounded once)."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "bfloat16":
        return float64_to_bfloat16(x).astype(np.float64)
    return x.astype(dtype).astype(np.float64)


def visibility(spec, q_pos, kv_pos, seg_q, seg_kv, batch):
    return np.stack([spec.visible(q_pos, kv_pos, None if seg_q is None else seg_q[b],
                                  None if seg_kv is None else seg_kv[b]) for b in range(batch)])


def dense(q, k, v, do, vis, scale, rnd=lambda x: x, work=np.float64):
    """Dense attention forward + backward, rounding every step with ``rnd``.

    q, do (B, Sq, H, D); k, v (B, Skv, Hkv, D); vis (B, Sq, Skv).
    Returns o, lse (B, H, Sq), dq, dk, dv, all float64.
    """
    heads, kv_heads = q.shape[2], k.shape[2]
    group = heads // kv_heads
    q, k, v, do = (rnd(x).astype(work) for x in (q, k, v, do))
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    s = rnd(np.einsum("bqhd,bkhd->bhqk", q, k) * work(scale))
    s = np.where(vis[:, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    seen = np.isfinite(m)
    m = np.where(seen, m, 0)
    e = rnd(np.exp(s - m))
    l = rnd(e.sum(-1, keepdims=True))
    p = rnd(e / np.where(seen, l, 1))
    o = rnd(np.einsum("bhqk,bkhd->bqhd", p, v))
    with np.errstate(divide="ignore"):
        lse = np.where(seen, rnd(m + np.log(np.where(seen, l, 1))), -np.inf)[..., 0]
    dvec = rnd(np.einsum("bqhd,bqhd->bhq", do, o))
    dp = rnd(np.einsum("bqhd,bkhd->bhqk", do, v))
    ds = rnd(p * (dp - dvec[..., None]))
    dq = rnd(np.einsum("bhqk,bkhd->bqhd", ds, k) * work(scale))
    dk = rnd(np.einsum("bhqk,bqhd->bkhd", ds, q) * work(scale))
    dv = rnd(np.einsum("bhqk,bqhd->bkhd", p, do))
    b, skv, _, d = dk.shape
    dk = dk.reshape(b, skv, kv_heads, group, d).sum(3)
    dv = dv.reshape(b, skv, kv_heads, group, d).sum(3)
    return tuple(np.asarray(x, dtype=np.float64) for x in (o, lse, dq, dk, dv))


def reference64(spec, q, k, v, do, seg_q, seg_kv, scale):
    """The library's float64 dense reference, batch entry by batch entry: o, lse (B, H, Sq), dq, dk, dv."""
    ref = DenseReference(spec, scale, np.float64)
    parts = [ref.compute(q[b], k[b], v[b], do[b], None if seg_q is None else seg_q[b],
                         None if seg_kv is None else seg_kv[b]) for b in range(q.shape[0])]
    return tuple(np.stack([part[name] for part in parts]) for name in ("o", "lse", "dq", "dk", "dv"))


def naive(q, k, v, do, vis, scale, dtype):
    """The naive dense computation in ``dtype`` (16-bit kinds: float32 math
    rounded to the dtype after every step)."""
    if dtype in ("float32", "float64"):
        return dense(q, k, v, do, vis, scale, work=np.dtype(dtype).type)
    return dense(q, k, v, do, vis, scale, rnd=lambda x: round_to(x, dtype), work=np.float32)


def max_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.array_equal(np.isneginf(a), np.isneginf(b)), "-inf pattern differs"
    fin = np.isfinite(b)
    assert np.all(np.isfinite(a[fin])), "NaN/Inf where the reference is finite"
    return float(np.max(np.abs(a[fin] - b[fin]), initial=0.0))


# ------------------------------------------------------------------ cases
CASES = {
    # name: (B, Sq, Skv, H, Hkv, spec kwargs, segments, q offset in positions)
    "plain": (2, 150, 130, 4, 4, {}, False),
    "causal": (2, 150, 150, 8, 2, {"causal": True}, False),
    "causal_sq_ne_skv": (1, 97, 200, 4, 1, {"causal": True, "offset": 103}, False),
    "masked_rows": (2, 120, 70, 4, 4, {"causal": True, "offset": -50}, False),
    "window": (2, 140, 140, 4, 2, {"window": (17, 5)}, False),
    "window_left_only": (1, 130, 130, 4, 4, {"causal": True, "window": (40, None)}, False),
    "segments": (2, 131, 131, 8, 2, {"causal": True}, True),
}


def make_case(name, d, dtype, seed=0):
    batch, sq, skv, heads, kv_heads, kw, with_seg = CASES[name]
    spec = ScoreSpec(**kw)
    rng = np.random.default_rng(seed)
    q, k, v, do = attention_inputs(rng, batch, sq, heads, kv_heads, d, n_kv=skv)
    # positions count from 0 on both sides; ScoreSpec.offset aligns them
    q_pos = np.arange(sq, dtype=np.int64)
    kv_pos = np.arange(skv, dtype=np.int64)
    seg_q = seg_kv = None
    if with_seg:
        seg_kv = np.sort(rng.integers(0, 4, size=(batch, skv)), axis=1)
        seg_q = seg_kv[:, :sq]
    # inputs on the dtype's grid, so every computation starts from the same values
    q, k, v, do = (round_to(x, dtype) for x in (q, k, v, do))
    return spec, q, k, v, do, q_pos, kv_pos, seg_q, seg_kv


def _to_host(cp, x, dtype):
    x = cp.asnumpy(x)
    if dtype == "bfloat16":
        assert x.dtype == BFLOAT16, x.dtype  # ml_dtypes.bfloat16 CuPy arrays, not uint16 bits
        return x.astype(np.float32).astype(np.float64)
    return x.astype(np.float64)


def _poison(cp, shapes_dtypes):
    """Leave NaN in the pool blocks the next allocations of these sizes get."""
    cp.cuda.Stream.null.synchronize()
    cp.get_default_memory_pool().free_all_blocks()
    held = [cp.full(shape, 0x7FC0, dtype=np.uint16) if np.dtype(dt) == BFLOAT16  # a bf16 NaN pattern
            else cp.full(shape, np.nan, dtype=dt) for shape, dt in shapes_dtypes]
    cp.cuda.Stream.null.synchronize()
    del held


def run_backend(case, d, dtype, n_blocks=2):
    import cupy as cp
    from ringmpi.backends.cupy_backend import CupyBackend, storage_dtype

    spec, q, k, v, do, q_pos, kv_pos, seg_q, seg_kv = case
    be = CupyBackend.instance()
    scale = 1.0 / np.sqrt(d)
    ct = be.compute_dtype(dtype)
    batch, sq, heads, _ = q.shape
    skv, kv_heads = k.shape[1], k.shape[2]
    qh = be.to_heads(cp.asarray(q), ct)
    kh, vh = be.to_heads(cp.asarray(k), dtype), be.to_heads(cp.asarray(v), dtype)
    o_acc = cp.zeros((batch, heads, sq, d), dtype=ct)
    m = cp.full((batch, heads, sq), -np.inf, dtype=ct)
    l = cp.zeros((batch, heads, sq), dtype=ct)
    cuts = np.linspace(0, skv, n_blocks + 1).astype(int)
    ticks = []
    blocks = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        mask = BlockMask(spec, q_pos, kv_pos[lo:hi], seg_q,
                         None if seg_kv is None else np.ascontiguousarray(seg_kv[:, lo:hi]))
        kb, vb = cp.ascontiguousarray(kh[:, :, lo:hi]), cp.ascontiguousarray(vh[:, :, lo:hi])
        blocks.append((lo, hi, mask, kb, vb))
        be.forward_block(qh, kb, vb, o_acc, m, l, scale, mask, tick=lambda: ticks.append(1))
    assert len(ticks) == n_blocks
    out_dtype = dtype
    _poison(cp, [((batch, sq, heads, d), storage_dtype(out_dtype)), ((batch, heads, sq), ct)])
    o, lse = be.finalize(o_acc, m, l, out_dtype)
    # backward, from the backend's own forward outputs
    oh = be.to_heads(o, ct)
    doh = be.to_heads(cp.asarray(do), ct)
    dvec = be.row_dot(doh, oh)
    dq = cp.zeros((batch, heads, sq, d), dtype=ct)
    dk = cp.zeros((batch, kv_heads, skv, d), dtype=ct)
    dv = cp.zeros((batch, kv_heads, skv, d), dtype=ct)
    for lo, hi, mask, kb, vb in blocks:
        dkb = cp.zeros((batch, kv_heads, hi - lo, d), dtype=ct)
        dvb = cp.zeros_like(dkb)
        be.backward_block(qh, doh, lse, dvec, kb, vb, dq, dkb, dvb, scale, mask)
        dk[:, :, lo:hi] = dkb
        dv[:, :, lo:hi] = dvb
    be.synchronize()
    return (_to_host(cp, o, out_dtype), cp.asnumpy(lse).astype(np.float64),
            cp.asnumpy(dq).transpose(0, 2, 1, 3) * scale,
            cp.asnumpy(dk).transpose(0, 2, 1, 3) * scale, cp.asnumpy(dv).transpose(0, 2, 1, 3))


def check(name, d, dtype):
    case = make_case(name, d, dtype)
    spec, q, k, v, do, q_pos, kv_pos, seg_q, seg_kv = case
    vis = visibility(spec, q_pos, kv_pos, seg_q, seg_kv, q.shape[0])
    scale = 1.0 / np.sqrt(d)
    ref = reference64(spec, q, k, v, do, seg_q, seg_kv, scale)
    base = naive(q, k, v, do, vis, scale, dtype)
    got = run_backend(case, d, dtype)
    labels = ("o", "lse", "dq", "dk", "dv")
    for i, label in enumerate(labels):
        err = max_err(got[i], ref[i])
        err_naive = max_err(base[i], ref[i])
        bound = tolerance(err_naive, gradient=i >= 2)
        assert err <= bound, (
            f"{label}: max err {err:.3e} > bound {bound:.3e} (naive {err_naive:.3e}) ({name}, D={d}, {dtype})")
    # rows that see nothing: o = 0, lse = -inf, zero dq
    dead = ~vis.any(-1)  # (B, Sq)
    if dead.any():
        assert np.all(got[0][dead] == 0)
        assert np.all(np.isneginf(got[1].transpose(0, 2, 1)[dead]))
        assert np.all(got[2][dead] == 0)


DTYPES = ("float16", "bfloat16", "float32", "float64")
MATRIX = (
    [("plain", d, dt) for d in (8, 59, 64, 128, 256) for dt in DTYPES]
    + [(name, d, dt) for name in CASES if name != "plain" for d in (59, 64, 128) for dt in DTYPES]
)


@pytest.mark.parametrize("name,d,dtype", MATRIX, ids=[f"{n}-D{d}-{t}" for n, d, t in MATRIX])
@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason=NO_GPU)
def test_block_kernels_match_dense(name, d, dtype):
    check(name, d, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason=NO_GPU)
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_scores(dtype):
    """Large logits: the online softmax must not overflow."""
    case = list(make_case("causal", 64, dtype))
    case[1] = round_to(case[1] * 40.0, dtype)
    spec, q, k, v, do, q_pos, kv_pos, seg_q, seg_kv = case
    vis = visibility(spec, q_pos, kv_pos, seg_q, seg_kv, q.shape[0])
    ref = reference64(spec, q, k, v, do, seg_q, seg_kv, 1 / 8)
    base = naive(q, k, v, do, vis, 1 / 8, dtype)
    got = run_backend(tuple(case), 64, dtype)
    for i in range(2):
        assert max_err(got[i], ref[i]) <= tolerance(max_err(base[i], ref[i]), gradient=False)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason=NO_GPU)
@pytest.mark.parametrize("dtype,d", [("bfloat16", 64), ("float16", 128), ("bfloat16", 192), ("float32", 64),
                                     ("float64", 96)])
def test_backward_is_bitwise_repeatable(dtype, d):
    """Every key tile adds its terms to the same dq rows (atomics across CTAs); the tiles take
    turns in a fixed order, so dq, dk and dv are the same bits run after run (docs/design.md: bitwise
    repeatable at a fixed P).  Many key tiles per query tile: causal with 1000 keys, GQA, B = 2;
    MMA kernels (D <= 128, 16-bit) and SIMT kernels (D = 192, float32, float64)."""
    import cupy as cp
    from ringmpi.backends.cupy_backend import CupyBackend

    be = CupyBackend.instance()
    ct = be.compute_dtype(dtype)
    rng = np.random.default_rng(7)
    b, h, hkv, sq, skv = 2, 4, 2, 300, 1000
    qh, doh = (be.to_heads(cp.asarray(rng.standard_normal((b, sq, h, d))), ct) for _ in range(2))
    kh, vh = (be.to_heads(cp.asarray(rng.standard_normal((b, skv, hkv, d))), dtype) for _ in range(2))
    lse = cp.asarray(rng.standard_normal((b, h, sq)) + 4).astype(ct)
    dvec = cp.asarray(rng.standard_normal((b, h, sq))).astype(ct)
    mask = BlockMask(ScoreSpec(causal=True, offset=skv - sq), np.arange(sq), np.arange(skv), None, None)
    runs = []
    for _ in range(3):
        dq = cp.zeros((b, h, sq, d), ct)
        dk, dv = cp.zeros((b, hkv, skv, d), ct), cp.zeros((b, hkv, skv, d), ct)
        be.backward_block(qh, doh, lse, dvec, kh, vh, dq, dk, dv, 1 / np.sqrt(d), mask)
        be.synchronize()
        runs.append([cp.asnumpy(x) for x in (dq, dk, dv)])
    assert np.abs(runs[0][0]).max() > 0
    for other in runs[1:]:
        for name, first, again in zip(("dq", "dk", "dv"), runs[0], other):
            assert np.array_equal(first, again), f"{name} differs between two runs"


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason=NO_GPU)
def test_matches_numpy_backend_float64():
    case = make_case("segments", 59, "float64")
    spec, q, k, v, do, q_pos, kv_pos, seg_q, seg_kv = case
    nb = NumpyBackend()
    d = 59
    scale = 1 / np.sqrt(d)
    qh = nb.to_heads(q, np.float64)
    kh, vh = nb.to_heads(k, np.float64), nb.to_heads(v, np.float64)
    o_acc = np.zeros(qh.shape)
    m = np.full(qh.shape[:3], -np.inf)
    l = np.zeros(qh.shape[:3])
    nb.forward_block(qh, kh, vh, o_acc, m, l, scale, BlockMask(spec, q_pos, kv_pos, seg_q, seg_kv))
    o_ref, lse_ref = nb.finalize(o_acc, m, l, np.float64)
    got = run_backend(case, d, "float64", n_blocks=1)
    assert max_err(got[0], o_ref) <= 1e-10
    assert max_err(got[1], lse_ref) <= 1e-10


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason=NO_GPU)
@pytest.mark.parametrize("cuda_aware", [False, True])
def test_message_round_trip(cuda_aware):
    import cupy as cp
    from ringmpi.backends.cupy_backend import CupyBackend

    be = CupyBackend(cuda_aware=cuda_aware)
    msg = be.message(64 * 4)
    view = msg.view(0, (64,), np.float32)
    view[...] = cp.arange(64, dtype=cp.float32)
    msg.ready_to_send(dirty=True)
    host = cp.asnumpy(msg.mpi_buffer()).view(np.float32) if cuda_aware else np.asarray(msg.mpi_buffer()).view(np.float32)
    assert np.array_equal(host, np.arange(64, dtype=np.float32))
    if not cuda_aware:
        msg.mpi_buffer()[:] = np.arange(256, dtype=np.uint8)
        msg.arrived()
        be.synchronize()
        assert np.array_equal(cp.asnumpy(msg.view(0, (256,), np.uint8)), np.arange(256, dtype=np.uint8))
    assert msg.view(0, (8,), "bfloat16").dtype == BFLOAT16


# ------------------------------------------------------------ host-side only
def _classify_like_kernel(spec, qp, kp, sq, sk):
    """Python port of classify_tile (common.cuh) over the host bounds."""
    has_lo, lo_delta, has_hi, hi_delta = (int(x) for x in mask_scalars(spec))
    qb, kb = tile_bounds(qp, None, len(qp)), tile_bounds(kp, None, len(kp))
    qlo, qhi, klo, khi = qb[0], qb[1], kb[0], kb[1]
    if has_hi and qhi + hi_delta < klo:
        return SKIP
    if has_lo and qlo + lo_delta > khi:
        return SKIP
    state = FULL
    if (has_lo and qhi + lo_delta > klo) or (has_hi and qlo + hi_delta < khi):
        state = 1
    if sq is not None:
        if sq.max() < sk.min() or sq.min() > sk.max():
            return SKIP
        if not (sq.min() == sq.max() == sk.min() == sk.max()):
            state = 1
    return state


@pytest.mark.parametrize("spec", [ScoreSpec(), ScoreSpec(causal=True), ScoreSpec(causal=True, offset=37),
                                  ScoreSpec(window=(5, 9)), ScoreSpec(window=(None, 3)),
                                  ScoreSpec(causal=True, window=(12, None), offset=-20)])
def test_kernel_tile_classification_is_conservative(spec):
    """SKIP only when nothing is visible, FULL only when everything is
    (host port of the in-kernel rule, against ScoreSpec.visible)."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        q0, k0 = rng.integers(0, 200, size=2)
        qp = np.arange(q0, q0 + rng.integers(1, 40))
        kp = np.arange(k0, k0 + rng.integers(1, 40))
        with_seg = rng.random() < 0.5
        sq = np.sort(rng.integers(0, 3, len(qp))) if with_seg else None
        sk = np.sort(rng.integers(0, 3, len(kp))) if with_seg else None
        vis = spec.visible(qp, kp, sq, sk)
        kind = _classify_like_kernel(spec, qp, kp, sq, sk)
        if kind == SKIP:
            assert not vis.any()
        if kind == FULL:
            assert vis.all()


def test_tile_bounds_layout():
    pos = np.array([5, 3, 9, 1, 7], dtype=np.int64)
    seg = np.array([[0, 0, 1, 1, 2], [4, 4, 4, 5, 5]], dtype=np.int64)
    got = tile_bounds(pos, seg, 2)
    np.testing.assert_array_equal(got[:6], [3, 5, 1, 9, 7, 7])
    np.testing.assert_array_equal(got[6:].reshape(2, 3, 2), [[[0, 0], [1, 1], [2, 2]], [[4, 4], [4, 5], [5, 5]]])
