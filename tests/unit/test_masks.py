"""masks.py, the one Python source of "which (query, key) pairs are visible":
the NumPy tiles' rule, the CuPy launch scalars and tile classes, against an
independent brute-force mask (tests/support/reference.py)."""

import itertools

import numpy as np
import pytest

from reference import visible as reference_visible
from ringmpi.core.masks import (FULL, PARTIAL, SKIP, WINDOW_OFF, ScoreSpec, classify_tiles, kernel_scalars,
                                tile_bounds, window_of, window_problem, window_sides)

SPECS = [dict(), dict(causal=True), dict(window=(3, 5)), dict(window=(None, 2)), dict(window=(4, None)),
         dict(causal=True, window=(6, None)), dict(causal=True, window=(2, 9)), dict(window=(0, 0))]
LENGTHS = [(13, 13), (9, 17), (17, 9)]


def _spec(kw, n_q, n_kv):
    return ScoreSpec(offset=n_kv - n_q, **kw)


@pytest.mark.parametrize("kw", SPECS)
@pytest.mark.parametrize("n_q, n_kv", LENGTHS)
def test_visible_matches_the_reference(kw, n_q, n_kv):
    rng = np.random.default_rng(1)
    seg_q = np.sort(rng.integers(0, 3, (2, n_q)), axis=1)
    seg_kv = np.sort(rng.integers(0, 3, (2, n_kv)), axis=1)
    spec = _spec(kw, n_q, n_kv)
    want = reference_visible(n_q, n_kv, spec.causal, spec.window)[0]
    assert np.array_equal(spec.visible(np.arange(n_q), np.arange(n_kv)), want)
    want_seg = reference_visible(n_q, n_kv, spec.causal, spec.window, seg_q, seg_kv)
    for b in range(2):
        assert np.array_equal(spec.visible(np.arange(n_q), np.arange(n_kv), seg_q[b], seg_kv[b]), want_seg[b])


@pytest.mark.parametrize("kw", SPECS)
def test_key_deltas_fold_the_rules(kw):
    spec = _spec(kw, 10, 14)
    lo, hi = spec.key_deltas()
    vis = spec.visible(np.arange(10), np.arange(14))
    i, j = np.meshgrid(np.arange(10), np.arange(14), indexing="ij")
    fold = np.ones_like(vis)
    if lo is not None:
        fold &= j >= i + lo
    if hi is not None:
        fold &= j <= i + hi
    assert np.array_equal(vis, fold)
    has_lo, lo_d, has_hi, hi_d = kernel_scalars(spec)
    assert (has_lo.dtype, lo_d.dtype, has_hi.dtype, hi_d.dtype) == (np.int32, np.int64, np.int32, np.int64)
    assert (bool(has_lo), bool(has_hi)) == (lo is not None, hi is not None)
    assert (lo_d, hi_d) == (lo or 0, hi or 0)


@pytest.mark.parametrize("kw", SPECS)
def test_classify_is_exact_for_skip_and_full(kw):
    """classify (the NumPy tiles' rule) never skips a visible pair or calls a masked tile full."""
    rng = np.random.default_rng(2)
    spec = _spec(kw, 40, 40)
    for _ in range(60):
        qp = np.sort(rng.choice(40, rng.integers(1, 8), replace=False))
        kp = np.sort(rng.choice(40, rng.integers(1, 8), replace=False))
        use_seg = rng.random() < 0.5
        sq = rng.integers(0, 2, len(qp)) if use_seg else None
        sk = rng.integers(0, 2, len(kp)) if use_seg else None
        vis = spec.visible(qp, kp, sq, sk)
        kind = spec.classify(qp, kp, sq, sk)
        assert kind != SKIP or not vis.any()
        assert kind != FULL or vis.all()
    assert spec.classify(np.array([], np.int64), np.arange(3)) == SKIP


def test_tile_bounds_layout():
    pos = np.array([0, 1, 5, 6, 9])
    seg = np.array([[0, 0, 1, 2, 2], [3, 3, 3, 3, 4]])
    got = tile_bounds(pos, seg, 2)
    assert got.dtype == np.int64
    assert got.tolist() == [0, 1, 5, 6, 9, 9] + [0, 0, 1, 2, 2, 2] + [3, 3, 3, 3, 4, 4]


@pytest.mark.parametrize("kw", SPECS)
@pytest.mark.parametrize("has_seg", [False, True])
def test_classify_tiles_is_conservative_and_counts_batch_entries(kw, has_seg):
    """The kernels' classification (host twin of classify_tile in common.cuh)."""
    rng = np.random.default_rng(3)
    n_q, n_kv, batch, tq, tk = 23, 31, 2, 4, 5
    spec = _spec(kw, n_q, n_kv)
    q_pos = np.sort(rng.choice(60, n_q, replace=False))
    kv_pos = np.sort(rng.choice(60, n_kv, replace=False))
    seg_q = np.sort(rng.integers(0, 3, (batch, n_q)), axis=1) if has_seg else None
    seg_kv = np.sort(rng.integers(0, 3, (batch, n_kv)), axis=1) if has_seg else None
    nqt, nkt = -(-n_q // tq), -(-n_kv // tk)
    classes = classify_tiles(spec, tile_bounds(q_pos, seg_q, tq), tile_bounds(kv_pos, seg_kv, tk),
                             nqt, nkt, batch, has_seg)
    assert classes.shape == ((batch if has_seg else 1), nqt, nkt)
    for b, qt, kt in itertools.product(range(classes.shape[0]), range(nqt), range(nkt)):
        rows, cols = slice(qt * tq, (qt + 1) * tq), slice(kt * tk, (kt + 1) * tk)
        vis = spec.visible(q_pos[rows], kv_pos[cols], None if seg_q is None else seg_q[b, rows],
                           None if seg_kv is None else seg_kv[b, cols])
        kind = classes[b, qt, kt]
        assert kind in (SKIP, PARTIAL, FULL)
        assert kind != SKIP or not vis.any()
        assert kind != FULL or vis.all()
    if kw == {"causal": True} and not has_seg:
        assert (classes == SKIP).any() and (classes == FULL).any()


def test_window_sides_must_be_non_negative():
    with pytest.raises(ValueError):
        ScoreSpec(window=(-1, 2))


def test_the_window_convention_has_one_home():
    # flash-attn's (left, right), -1 unbounded, as a ScoreSpec holds it (None unbounded) and back
    assert WINDOW_OFF == (-1, -1) and window_sides(WINDOW_OFF) is None and window_sides(None) is None
    assert window_sides((3, -1)) == (3, None) and window_sides((None, 0)) == (None, 0)
    assert window_sides(np.array([4, 0])) == (4, 0) and window_sides([4.0, np.int64(2)]) == (4, 2)
    assert all(type(w) is int for w in window_sides((np.int64(5), 2.0)))
    for window in ((-1, -1), (3, -1), (-1, 0), (5, 2)):
        assert window_of(window_sides(window)) == window
    assert window_of(None) == WINDOW_OFF and window_of((3, None)) == (3, -1)
    for good in (None, (0, 0), (-1, 7), (None, None), np.array([2, -1])):
        assert window_problem(good) is None, good
    for bad in ((-2, 0), (3,), (1, 2, 3), (1.5, 0), (True, 0), ("a", 0), "ab", "wide", 7):
        problem = window_problem(bad)
        assert problem == f"window must be (left, right), each an int >= 0 or -1 (unbounded), got {bad!r}", bad
        with pytest.raises(ValueError, match=r"window must be \(left, right\)"):
            window_sides(bad)
