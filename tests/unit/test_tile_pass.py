"""The CPU backend's float32 tile pass (:mod:`ringmpi.backends.tile_pass`) on every path:
the compiled sweep (``ringmpi._ext._fused``, built by ``pip install``) on each vector path
this CPU runs, and the NumPy passes it replaces.

In-process, one rank: the pass itself (accuracy of its ``exp``, non-finite values),
then forward and gradients of masks, windows, segments, GQA, ALiBi and dropout against
the float64 dense reference under the tolerance rule, and the same bits on repeat,
with the tiles small enough that every block spans several (shifted, exact and
partly hidden tiles).  The multi-rank tests run the compiled path where it is built."""

import warnings

import numpy as np
import pytest

import reference
from random_inputs import attention_inputs
import ringmpi
from ringmpi.backends import numpy_backend, tile_pass as tp

NUMPY = ringmpi.RingContext(backend="numpy")


def _compiled_paths():
    """``compiled-<vector path>`` for each path of the built pass this CPU runs."""
    try:
        from ringmpi._ext import _fused
    except ImportError:
        return ("compiled",)  # skipped, visibly, by the fixture
    return tuple(f"compiled-{path}" for path in _fused.paths())



PATHS = _compiled_paths() + ("numpy",)


@pytest.fixture(params=PATHS)
def tile_pass(request, monkeypatch):
    fused = tp.compiled
    if request.param.startswith("compiled"):
        if fused is None:
            pytest.skip("ringmpi._ext._fused was not built (or RINGMPI_CPU_KERNEL=numpy)")
    else:
        monkeypatch.setattr(tp, "compiled", None)
    monkeypatch.setattr(numpy_backend, "TILE_Q", 16)
    monkeypatch.setattr(numpy_backend, "TILE_KV", 24)
    monkeypatch.setattr(numpy_backend, "BAND_Q", 8)
    before = None if fused is None else fused.path()
    if request.param.startswith("compiled-"):
        fused.use(request.param.split("-", 1)[1])
    assert tp.implementation() == request.param.split("-")[0]
    yield request.param
    if before is not None:
        fused.use(before)


def test_exp_pass_accuracy_and_nonfinite(tile_pass):
    rng = np.random.default_rng(1)
    s = (rng.standard_normal((64, 96)) * 30).astype(np.float32)
    s[0, :7] = [np.inf, -np.inf, np.nan, 88.8, -104.0, -87.5, 0.0]
    bias = np.where(rng.random(s.shape) < 0.2, -np.inf, 0).astype(np.float32)
    shift = rng.standard_normal(64).astype(np.float32)
    with np.errstate(all="ignore"):
        x64 = (s * np.float32(0.7) + bias - shift[:, None]).astype(np.float64)  # float32 steps, as documented
        want = np.exp(x64)
        numpy_way = np.exp(x64.astype(np.float32))
        got = s.copy()
        tp.exp_pass(got, np.float32(0.7), bias, shift)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got == 0, numpy_way == 0)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(numpy_way))
    normal = np.isfinite(want) & (want > 1.2e-38) & (want < 3e38)
    rel = np.abs(got[normal] - want[normal]) / want[normal]
    assert rel.max() <= 4 * np.finfo(np.float32).eps


@pytest.mark.parametrize("cols", [5, 16, 37, 512])
def test_exp_pass_row_sums(tile_pass, cols):
    """The row sums the pass returns are those of its result (a tail of fewer than 16 columns
    adds only its own elements), deterministic, with NaN/Inf as a sum gives them."""
    rng = np.random.default_rng(cols)
    s = rng.standard_normal((9, cols)).astype(np.float32)
    s[3, 0] = np.nan
    s[4, -1] = np.inf
    bias = np.where(rng.random(s.shape) < 0.3, -np.inf, 0).astype(np.float32)
    shift = rng.standard_normal(9).astype(np.float32)
    runs = []
    for _ in range(2):
        got, sums = s.copy(), np.full(9, -1.0, dtype=np.float32)
        with np.errstate(all="ignore"):
            tp.exp_pass(got, np.float32(0.5), bias, shift, sums)
        runs.append((got, sums))
    got, sums = runs[0]
    assert np.array_equal(runs[1][1], sums, equal_nan=True)
    want = got.astype(np.float64).sum(axis=1)
    np.testing.assert_array_equal(np.isnan(sums), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(sums), np.isinf(want))
    fine = np.isfinite(want)
    np.testing.assert_allclose(sums[fine], want[fine], rtol=cols * np.finfo(np.float32).eps)


def test_ds_pass_gives_numpys_bits(tile_pass):
    """The backward's dS pass is NumPy's two passes (subtract, multiply) bit for bit, strided
    rows, tails and non-finite values included."""
    rng = np.random.default_rng(2)
    p = rng.random((9, 40)).astype(np.float32)
    dp = rng.standard_normal((9, 40)).astype(np.float32)
    dvec = rng.standard_normal(9).astype(np.float32)
    dp[1, 3], p[2, 5], dvec[4], p[5, 0], dp[6, 7] = np.nan, np.inf, np.inf, 0.0, np.inf
    for cols in (1, 7, 16, 33, 40):
        wide = np.zeros((9, 64), np.float32)
        wide[:, :cols] = dp[:, :cols]
        got = wide[:, :cols]  # rows 64 floats apart
        want = dp[:, :cols].copy()
        with np.errstate(all="ignore"):
            tp.ds_pass(got, p[:, :cols], dvec)
            want -= dvec[:, None]
            want *= p[:, :cols]
        np.testing.assert_array_equal(got, want)


CASES = {
    "full": dict(),
    "causal-gqa": dict(causal=True, hkv=2),
    "window": dict(window=(9, 3)),
    "segments": dict(segments=True, causal=True),
    "alibi": dict(alibi=0.5, causal=True),
    # steep slopes, no mask: a later key tile raises a row's maximum by far more than exp's range,
    # so the speculative shifted tile overflows and is redone (its overflow must not warn)
    "alibi-steep": dict(alibi=16.0),
    "alibi-steep-dropout": dict(alibi=16.0, dropout=0.25),
    "softcap": dict(softcap=5.0, window=(20, 4)),
    "dropout": dict(dropout=0.25, hkv=2),
}


def _case(case, n=53, b=2, h=4, d=16, seed=0):
    """A case's float32 inputs, its keywords and what the dense reference needs."""
    segments = 3 if case.get("segments") else None
    q, k, v, do, *seg = attention_inputs(seed, b, n, h, case.get("hkv", h), d, dtype=np.float32, segments=segments)
    kw = dict(causal=case.get("causal", False), window=case.get("window", (-1, -1)))
    seg = seg[0].astype(np.int32) if seg else None
    if seg is not None:
        kw.update(segment_ids=seg)
    alibi = None
    if case.get("alibi"):
        alibi = (case["alibi"] * 0.5 ** np.arange(h)).astype(np.float32)
        kw["alibi_slopes"] = alibi
    if case.get("softcap"):
        kw["softcap"] = case["softcap"]
    drop = None
    if case.get("dropout"):
        kw.update(dropout_p=case["dropout"], dropout_seed=77)
        drop = reference.dropout_factors(77, case["dropout"], b, h, n, n)
    vis = reference.visible(n, n, kw["causal"], kw["window"], seg, seg)
    return (q, k, v, do), kw, dict(vis=vis, alibi=alibi, drop=drop, softcap=case.get("softcap"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_against_float64_reference(tile_pass, name):
    """Each case against the float64 reference, with warnings as errors: an overflow the
    backend expects and handles (a shifted tile redone exactly) never reaches the user."""
    (q, k, v, do), kw, ref = _case(CASES[name])
    scale = 1 / np.sqrt(q.shape[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, lse, _ = ringmpi.ring_attention(q, k, v, context=NUMPY, **kw)
        grads = ringmpi.ring_attention_backward(do, q, k, v, (o, lse), context=NUMPY, **kw)[:3]
    dense = dict(vis=ref["vis"], scale=scale, drop=ref["drop"], alibi=ref["alibi"], softcap=ref["softcap"])
    wide = [x.astype(np.float64) for x in (q, k, v, do)]
    o64, lse64 = reference.dense_forward(*wide[:3], dtype=np.float64, **dense)
    o32, lse32 = reference.dense_forward(q, k, v, dtype=np.float32, **dense)
    g64 = reference.dense_backward(wide[3], *wide[:3], dtype=np.float64, **dense)
    g32 = reference.dense_backward(do, q, k, v, dtype=np.float32, **dense)
    checks = [reference.tolerance_check("o", o, o64, o32), reference.tolerance_check("lse", lse, lse64, lse32)]
    checks += [reference.tolerance_check(n, g, r, nv, gradient=True)
               for n, g, r, nv in zip(("dq", "dk", "dv"), grads, g64, g32)]
    assert all(ok for ok, _ in checks), "; ".join(msg for _, msg in checks)


def test_same_bits_on_repeat(tile_pass):
    (q, k, v, do), kw, _ = _case(CASES["causal-gqa"], seed=3)
    runs = []
    for _ in range(2):
        o, lse, _ = ringmpi.ring_attention(q, k, v, context=NUMPY, **kw)
        runs.append((o, lse) + tuple(ringmpi.ring_attention_backward(do, q, k, v, (o, lse), context=NUMPY, **kw)[:3]))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_every_vector_path_gives_the_same_bits():
    """The compiled passes' vector paths (AVX-512, AVX2, plain: as many as this CPU runs) do the
    same arithmetic in the same order: the same results and row sums, bit for bit, tails of
    every length under 16 columns, non-finite values and strided rows included (the exp pass
    and the backward's dS pass)."""
    fused = tp.compiled
    if fused is None:
        pytest.skip("ringmpi._ext._fused was not built (or RINGMPI_CPU_KERNEL=numpy)")
    rng = np.random.default_rng(5)
    wide = (rng.standard_normal((7, 80)) * 40).astype(np.float32)
    wide[2, [0, 17, 33]] = [np.nan, np.inf, -np.inf]
    # NaNs of both signs and other payloads, the clamps, the overflow and underflow edges
    wide[3, :4] = np.array([0xFFC00000, 0x7FC01234, 0xFFC0ABCD, 0x7F812345], dtype=np.uint32).view(np.float32)
    wide[4, :8] = [88.72283935546875, 88.72283172607422, 89.0, -104.0, -103.97207, -103.9721, -87.33655, -110.0]
    wide[5, :] = np.linspace(-104.5, 89, 80, dtype=np.float32) / np.float32(0.3)
    bias = np.where(rng.random(wide.shape) < 0.3, -np.inf, 0).astype(np.float32)
    shift = rng.standard_normal(7).astype(np.float32)
    before, results = fused.path(), {}
    try:
        for path in fused.paths():
            fused.use(path)
            got = []
            for cols in range(1, 50):
                s, sums = wide[:, :cols].copy(), np.empty(7, np.float32)
                strided = np.zeros((7, 80), np.float32)
                strided[:, :cols] = wide[:, :cols]
                view = strided[:, :cols]  # rows 80 floats apart
                with np.errstate(all="ignore"):
                    ds = wide[:, :cols] * np.float32(0.01)
                    fused.exp_tile(s, np.float32(0.3), bias[:, :cols].copy(), shift, sums)
                    fused.exp_tile(view, np.float32(0.3), None, shift)
                    fused.ds_tile(ds, s, shift)  # NaN in both operands where s has one
                got.append(s.tobytes() + sums.tobytes() + view.tobytes() + ds.tobytes())
            results[path] = got
    finally:
        fused.use(before)
    first = next(iter(results))
    for path, got in results.items():
        differ = [cols for cols, (a, b) in enumerate(zip(got, results[first]), 1) if a != b]
        assert not differ, f"the {path} path differs from the {first} path at {differ} columns"


def _block_paths():
    """The vector paths this CPU runs that have the compiled forward block op."""
    fused = tp.compiled
    if fused is None or tp.block_op() is None:
        return ()
    before, out = fused.path(), []
    try:
        for path in fused.paths():
            fused.use(path)
            if fused.has_block():
                out.append(path)
    finally:
        fused.use(before)
    return tuple(out)


# the block op's cases, forward and backward: every mask and option it holds
BLOCK_OP_CASES = [dict(causal=False), dict(causal=True), dict(window=(70, 5)), dict(causal=True, gqa=True),
                  dict(causal=True, segments=True), dict(causal=True, softcap=2.0),
                  dict(window=(70, 5), softcap=30.0, segments=True), dict(causal=True, alibi=True),
                  dict(window=(70, 5), softcap=5.0, alibi=True, gqa=True), dict(causal=True, dropout=0.25),
                  dict(softcap=5.0, dropout=0.5, segments=True)]
BLOCK_OP_IDS = ["full", "causal", "window", "causal-gqa", "causal-segments", "causal-softcap",
                "window-softcap-segments", "causal-alibi", "window-softcap-alibi-gqa", "causal-dropout",
                "softcap-dropout-segments"]


def _block_op_options(kw, rng, b: int, h: int, n: int):
    """A block-op case's keywords for the calls and what the reference needs of them: ``(opts,
    segment ids or None, ALiBi slopes or None, dropout factors or None)``."""
    opts = dict(causal=kw.get("causal", False), window=kw.get("window", (-1, -1)))
    seg = np.sort(rng.integers(0, 4, (b, n)), axis=1) if kw.get("segments") else None  # packed documents
    if seg is not None:
        opts["segment_ids"] = seg
    if kw.get("softcap"):
        opts["softcap"] = kw["softcap"]
    slopes = (2.0 ** -np.arange(1, h + 1)).astype(np.float32) if kw.get("alibi") else None  # geometric slopes
    if slopes is not None:
        opts["alibi_slopes"] = slopes
    drop = None
    if kw.get("dropout"):
        opts.update(dropout_p=kw["dropout"], dropout_seed=4321)
        drop = reference.dropout_factors(4321, kw["dropout"], b, h, n, n)
    return opts, seg, slopes, drop


@pytest.mark.parametrize("kw", BLOCK_OP_CASES, ids=BLOCK_OP_IDS)
def test_block_op_same_bits_on_every_path_and_against_float64(monkeypatch, kw):
    """The compiled forward block op (``_fused.fwd_chunk``: the common float32 forward) on every
    vector path that has it: the same bits on each (every score and output is one chain of fused
    multiply-adds in a fixed order, whatever the vector width), and within the tolerance rule of
    the float64 reference, with query strips, key panels and key chunks that end inside the rows
    (n = 173, chunks of 96 keys, D = 40, D_v = 24)."""
    paths = _block_paths()
    if not paths:
        pytest.skip("no compiled block op (not built, RINGMPI_CPU_KERNEL=numpy or RINGMPI_CPU_BLOCK=tiles)")
    monkeypatch.setattr(numpy_backend, "TILE_KV", 96)
    rng = np.random.default_rng(11)
    n, b, h = 173, 2, 4
    hkv = 2 if kw.get("gqa") else h
    q = rng.standard_normal((b, n, h, 40)).astype(np.float32)
    k = rng.standard_normal((b, n, hkv, 40)).astype(np.float32)
    v = rng.standard_normal((b, n, hkv, 24)).astype(np.float32)
    opts, seg, slopes, drop = _block_op_options(kw, rng, b, h, n)
    fused, before, runs = tp.compiled, tp.compiled.path(), {}
    try:
        for path in paths:
            fused.use(path)
            runs[path] = ringmpi.ring_attention(q, k, v, context=NUMPY, **opts)[:2]
    finally:
        fused.use(before)
    first = runs[paths[0]]
    for path, (o, lse) in runs.items():
        assert o.tobytes() == first[0].tobytes() and lse.tobytes() == first[1].tobytes(), \
            f"the {path} path's block op differs from the {paths[0]} path's"
    vis = reference.visible(n, n, opts["causal"], opts["window"], seg, seg)
    scale = 1 / np.sqrt(40)
    wide = [x.astype(np.float64) for x in (q, k, v)]
    cap = kw.get("softcap")
    o64, lse64 = reference.dense_forward(*wide, dtype=np.float64, vis=vis, scale=scale, softcap=cap, alibi=slopes,
                                         drop=drop)
    o32, lse32 = reference.dense_forward(q, k, v, dtype=np.float32, vis=vis, scale=scale, softcap=cap, alibi=slopes,
                                         drop=drop)
    checks = [reference.tolerance_check("o", first[0], o64, o32), reference.tolerance_check("lse", first[1], lse64, lse32)]
    assert all(ok for ok, _ in checks), "; ".join(msg for _, msg in checks)


@pytest.mark.parametrize("kw", BLOCK_OP_CASES, ids=BLOCK_OP_IDS)
def test_backward_block_op_same_bits_on_every_path_and_against_float64(monkeypatch, kw):
    """The compiled backward block op (``_fused.bwd_chunk``: the common float32 backward) on every
    vector path that has it: the same dq, dk, dv bits on each (every element one chain of fused
    multiply-adds in a fixed order), within the tolerance rule of the float64 reference, and
    different from nothing: the BLAS tiles' result agrees within the same rule.  Query strips, key
    panels, calls (chunks of 40 keys) and key tiles (96) end inside the rows (n = 173, D = 40,
    D_v = 24)."""
    paths = _block_paths()
    if not paths:
        pytest.skip("no compiled block op (not built, RINGMPI_CPU_KERNEL=numpy or RINGMPI_CPU_BLOCK=tiles)")
    monkeypatch.setattr(numpy_backend, "TILE_KV", 96)
    monkeypatch.setattr(numpy_backend, "BWD_CHUNK", 40)
    rng = np.random.default_rng(12)
    n, b, h = 173, 2, 4
    hkv = 2 if kw.get("gqa") else h
    q = rng.standard_normal((b, n, h, 40)).astype(np.float32)
    k = rng.standard_normal((b, n, hkv, 40)).astype(np.float32)
    v = rng.standard_normal((b, n, hkv, 24)).astype(np.float32)
    do = rng.standard_normal((b, n, h, 24)).astype(np.float32)
    opts, seg, slopes, drop = _block_op_options(kw, rng, b, h, n)
    calls = []
    real = numpy_backend._compiled_backward
    monkeypatch.setattr(numpy_backend, "_compiled_backward", lambda *a: calls.append(1) or real(*a))
    fused, before, runs = tp.compiled, tp.compiled.path(), {}
    try:
        for path in paths:
            fused.use(path)
            o, lse, _ = ringmpi.ring_attention(q, k, v, context=NUMPY, **opts)
            runs[path] = ringmpi.ring_attention_backward(do, q, k, v, (o, lse), context=NUMPY, **opts)[:3]
    finally:
        fused.use(before)
    assert len(calls) == len(paths), "the backward did not take the compiled block op"
    first = runs[paths[0]]
    for path, grads in runs.items():
        for name, g, f in zip(("dq", "dk", "dv"), grads, first):
            assert g.tobytes() == f.tobytes(), f"the {path} path's backward block op differs in {name}"
    vis = reference.visible(n, n, opts["causal"], opts["window"], seg, seg)
    scale = 1 / np.sqrt(40)
    wide = [x.astype(np.float64) for x in (q, k, v, do)]
    cap = kw.get("softcap")
    g64 = reference.dense_backward(wide[3], *wide[:3], dtype=np.float64, vis=vis, scale=scale, softcap=cap,
                                   alibi=slopes, drop=drop)
    g32 = reference.dense_backward(do, q, k, v, dtype=np.float32, vis=vis, scale=scale, softcap=cap, alibi=slopes,
                                   drop=drop)
    checks = [reference.tolerance_check(name, g, r, nv, gradient=True)
              for name, g, r, nv in zip(("dq", "dk", "dv"), first, g64, g32)]
    assert all(ok for ok, _ in checks), "; ".join(msg for _, msg in checks)


def test_block_op_softcap_tanh_within_4_ulp_and_the_same_bits_on_every_path():
    """The compiled block op's logit softcap: with one key k = 1 (D = 1), scale 1 and cap 1, a row's
    state m is tanh(q) as ``exp_rows.h``'s ``tanh_vec`` computes it: within 4 ulp of float64's tanh
    over both of its branches (below and above 0.3), exact at 0, +-1 at +-inf, the same bits on
    every path."""
    paths = _block_paths()
    if not paths:
        pytest.skip("no compiled block op (not built, RINGMPI_CPU_KERNEL=numpy or RINGMPI_CPU_BLOCK=tiles)")
    x = np.concatenate([np.linspace(-12, 12, 20011), np.geomspace(1e-30, 0.3, 4001), [0.0, np.inf, -np.inf]])
    x = x.astype(np.float32)
    kp = np.zeros((1, 32), np.float32)
    kp[0, 0] = 1.0
    vp = np.zeros((1, 16), np.float32)
    fused, before, out = tp.compiled, tp.compiled.path(), {}
    try:
        for path in paths:
            fused.use(path)
            m = np.full(x.size, -np.inf, np.float32)
            l = np.zeros(x.size, np.float32)
            o = np.zeros((x.size, 1), np.float32)
            fused.fwd_chunk(x[:, None].copy(), kp, vp, 1, o, m, l, 1.0, None, None, None, None, None, 1.0)
            out[path] = m
    finally:
        fused.use(before)
    first = out[paths[0]]
    for path, m in out.items():
        assert m.tobytes() == first.tobytes(), f"the {path} path's tanh differs"
    want = np.tanh(x.astype(np.float64))
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    err = np.abs(first - want) / ulp
    assert err.max() <= 4, f"tanh off by {err.max():.2f} ulp at {x[err.argmax()]}"
    assert first[-3] == 0 and first[-2] == 1 and first[-1] == -1


def test_block_op_takes_the_common_forward_only():
    """Which forwards take the compiled block op: float32 with every option (segment ids, the softcap,
    ALiBi whose distances float64 holds exactly, dropout); ``RINGMPI_CPU_BLOCK=tiles`` sends every one
    to the BLAS tiles."""
    from ringmpi.core.masks import BlockMask, ScoreSpec

    if tp.compiled is None or not tp.compiled.has_block():
        pytest.skip("no compiled block op on this path")
    pos = np.arange(8)
    plain = BlockMask(ScoreSpec(causal=True), pos, pos)
    assert numpy_backend.compiled_forward_ok(np.dtype(np.float32), 0.125, plain)
    assert not numpy_backend.compiled_forward_ok(np.dtype(np.float64), 0.125, plain)
    assert numpy_backend.compiled_forward_ok(np.dtype(np.float32), 0.125, BlockMask(ScoreSpec(softcap=5.0), pos, pos))
    seg = np.zeros((1, 8), np.int64)
    assert numpy_backend.compiled_forward_ok(np.dtype(np.float32), 0.125, BlockMask(ScoreSpec(), pos, pos, seg, seg))
    from ringmpi.core.modifiers import Alibi

    alibi = ScoreSpec(modifiers=(Alibi((0.5,)),))
    assert numpy_backend.compiled_forward_ok(np.dtype(np.float32), 0.125, BlockMask(alibi, pos, pos))
    far = pos + 2 ** 52  # distances no longer exact in float64: the BLAS tiles
    assert not numpy_backend.compiled_forward_ok(np.dtype(np.float32), 0.125, BlockMask(alibi, far, far))
    import os
    old = os.environ.get("RINGMPI_CPU_BLOCK")
    os.environ["RINGMPI_CPU_BLOCK"] = "tiles"
    try:
        assert not numpy_backend.compiled_forward_ok(np.dtype(np.float32), 0.125, plain)
    finally:
        if old is None:
            del os.environ["RINGMPI_CPU_BLOCK"]
        else:
            os.environ["RINGMPI_CPU_BLOCK"] = old
