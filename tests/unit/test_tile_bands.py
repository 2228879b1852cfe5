"""Partly hidden tiles run as row bands cut to their visible columns (issue 15).

The NumPy backend computes a tile the mask hides in part as bands of
``BAND_Q`` rows, each over the columns between its first and last visible
key (on a causal diagonal tile, 5/8 of the scores instead of all).  The bands
must cover exactly the tile's visible scores, and calls whose partly hidden
tiles all run banded must still meet the float64 dense reference under the
tolerance rule, forward and backward, for every mask kind.
"""

import numpy as np
import pytest
import reference
from random_inputs import attention_inputs

import ringmpi
from ringmpi.backends import numpy_backend as nb

NUMPY = ringmpi.RingContext(backend="numpy")

TILE_ROWS, TILE_COLS = slice(100, 113), slice(40, 51)


def _tile_vis(kind, rng):
    i = np.arange(13)[:, None] + 3
    j = np.arange(11)[None, :]
    if kind == "causal":
        return j <= i
    if kind == "window":
        return (j <= i) & (j >= i - 4)
    if kind == "segments":
        seg_q, seg_kv = np.sort(rng.integers(0, 3, 13)), np.sort(rng.integers(0, 3, 11))
        return seg_q[:, None] == seg_kv[None, :]
    vis = rng.random((13, 11)) < 0.2  # scattered, with rows and bands that see nothing
    vis[4:9] = False
    return vis


@pytest.mark.parametrize("band", [1, 3, 13, 512])
@pytest.mark.parametrize("kind", ["causal", "window", "segments", "scattered"])
def test_bands_cover_exactly_the_visible_scores(kind, band):
    vis = _tile_vis(kind, np.random.default_rng(7))
    covered = np.zeros_like(vis)
    seen_rows = []
    for rows, cols, v in nb._bands(vis, TILE_ROWS, TILE_COLS, band):
        r = slice(rows.start - TILE_ROWS.start, rows.stop - TILE_ROWS.start)
        c = slice(cols.start - TILE_COLS.start, cols.stop - TILE_COLS.start)
        assert 0 < r.stop - r.start <= band and 0 <= c.start < c.stop <= vis.shape[1]
        assert r.start % band == 0, "bands start on band boundaries"
        np.testing.assert_array_equal(v, vis[r, c])
        assert v[:, 0].any() and v[:, -1].any(), "cut to the first and last visible key"
        covered[r, c] = v
        seen_rows.append(r.start)
    assert seen_rows == sorted(set(seen_rows)), "bands come once each, top to bottom"
    np.testing.assert_array_equal(covered, vis)


B, N, H, HKV, D = 2, 40, 4, 2, 16
SEG = np.broadcast_to(np.arange(N) * 3 // N, (B, N)).astype(np.int64)
CASES = {
    "causal": dict(causal=True),
    "causal window": dict(causal=True, window=(9, -1)),
    "two-sided window": dict(window=(5, 7)),
    "causal segments": dict(causal=True, segments=True),
}
VARIANTS = {"plain": {}, "softcap": dict(softcap=2.5), "dropout": dict(dropout_p=0.2, dropout_seed=77)}


@pytest.fixture
def banded(monkeypatch):
    """8 x 8 tiles in bands of 3 rows; yields the band counts of every banded tile.  The BLAS
    tiles run even where the compiled block ops would (``RINGMPI_CPU_BLOCK=tiles``): the bands
    are theirs, and they still serve every call the compiled ops do not take."""
    monkeypatch.setenv("RINGMPI_CPU_BLOCK", "tiles")
    monkeypatch.setattr(nb, "TILE_Q", 8)
    monkeypatch.setattr(nb, "TILE_KV", 8)
    monkeypatch.setattr(nb, "BAND_Q", 3)
    tiles = []
    real = nb._bands

    def counted(vis, rows, cols, band):
        tiles.append([])
        for item in real(vis, rows, cols, band):
            tiles[-1].append(item[1].stop - item[1].start)
            yield item
    monkeypatch.setattr(nb, "_bands", counted)
    return tiles


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES)
def test_banded_tiles_match_the_dense_reference(banded, case, variant):
    kw = dict(CASES[case], **VARIANTS[variant])
    seg = SEG if kw.pop("segments", False) else None
    if seg is not None:
        kw.update(segment_ids=seg)
    q, k, v, do = attention_inputs(3, B, N, H, HKV, D, dtype=np.float32)
    o, lse, _ = ringmpi.ring_attention(q, k, v, context=NUMPY, **kw)
    grads = ringmpi.ring_attention_backward(do, q, k, v, (o, lse), context=NUMPY, **kw)[:3]
    assert any(len(widths) > 1 for widths in banded), "no tile ran as several bands"
    assert any(w < 8 for widths in banded for w in widths), "no band was cut to its visible columns"

    vis = reference.visible(N, N, kw.get("causal", False), kw.get("window"), seg, seg)
    scale = 1 / np.sqrt(D)
    extra = dict(softcap=kw.get("softcap"))
    if "dropout_p" in kw:
        extra["drop"] = reference.dropout_factors(kw["dropout_seed"], kw["dropout_p"], B, H, N, N)
    ref_o, ref_lse = reference.dense_forward(q, k, v, vis, scale, np.float64, **extra)
    naive_o, naive_lse = reference.dense_forward(q, k, v, vis, scale, np.float32, **extra)
    checks = [reference.tolerance_check("o", o, ref_o, naive_o),
              reference.tolerance_check("lse", lse, ref_lse, naive_lse)]
    ref_g = reference.dense_backward(do, q, k, v, vis, scale, np.float64, **extra)
    naive_g = reference.dense_backward(do, q, k, v, vis, scale, np.float32, **extra)
    checks += [reference.tolerance_check(name, got, want, naive, gradient=True)
               for name, got, want, naive in zip(("dq", "dk", "dv"), grads, ref_g, naive_g)]
    assert all(ok for ok, _ in checks), "; ".join(msg for _, msg in checks)


@pytest.mark.parametrize("where", [("k", 21), ("v", 21), ("q", 30)])
def test_a_nan_under_bands_reaches_only_the_queries_that_see_it(banded, where):
    """Causal: a NaN in key or value ``j`` reaches the queries from ``j`` on (queries
    before it are bitwise the clean run's); a NaN in query ``j`` reaches that query only."""
    name, j = where
    clean = attention_inputs(5, B, N, H, HKV, D, dtype=np.float32)
    bad = [x.copy() for x in clean]
    bad["qkv".index(name)][1, j, 0, 3] = np.nan
    runs = []
    for q, k, v, do in (clean, bad):
        with np.errstate(invalid="ignore"):
            o, lse, _ = ringmpi.ring_attention(q, k, v, context=NUMPY, causal=True)
            dq, _, _, _ = ringmpi.ring_attention_backward(do, q, k, v, (o, lse), context=NUMPY, causal=True)
        runs.append((o, lse, dq))
    (o0, lse0, dq0), (o1, lse1, dq1) = runs
    hit = np.zeros(N, dtype=bool)
    hit[j:j + 1] = True
    if name != "q":
        hit[j:] = True
    np.testing.assert_array_equal(o1[:, ~hit], o0[:, ~hit])
    np.testing.assert_array_equal(lse1[:, :, ~hit], lse0[:, :, ~hit])
    np.testing.assert_array_equal(dq1[:, ~hit], dq0[:, ~hit])
    np.testing.assert_array_equal(o1[0], o0[0])  # the other batch entry
    heads = slice(0, 1) if name == "q" else slice(0, H // HKV)  # the query heads that read the bad head
    assert np.isnan(o1[1, hit, heads]).any(axis=-1).all()
    assert any(len(widths) > 1 for widths in banded)


@pytest.mark.parametrize("tiles", [(8, 12, 3), (5, 4, 2)])
def test_kv_done_reports_only_rows_no_later_band_changes(monkeypatch, tiles):
    """``kv_done(n)`` lets the ring send ``dk, dv`` rows ``[0, n)`` home early: no band
    may add to them afterwards, even one cut to start past its key tile's start."""
    from ringmpi.core.masks import BlockMask, ScoreSpec

    monkeypatch.setattr(nb, "TILE_Q", tiles[0])
    monkeypatch.setattr(nb, "TILE_KV", tiles[1])
    monkeypatch.setattr(nb, "BAND_Q", tiles[2])
    be = nb.NumpyBackend()
    q, k, v, do = attention_inputs(9, B, N, H, HKV, D, dtype=np.float32)
    qh, doh = be.to_heads(q, np.float32), be.to_heads(do, np.float32)
    kh, vh = be.to_heads(k, np.float32), be.to_heads(v, np.float32)
    rng = np.random.default_rng(1)
    lse = rng.standard_normal((B, H, N)).astype(np.float32) + 3
    dvec = rng.standard_normal((B, H, N)).astype(np.float32)
    seg = np.sort(rng.integers(0, 6, (B, N)), axis=1).astype(np.int64)
    mask = BlockMask(ScoreSpec(), np.arange(N), np.arange(N), seg, seg)
    dq, dk, dv = np.zeros_like(qh), np.zeros_like(kh), np.zeros_like(vh)
    reported = []
    be.backward_block(qh, doh, lse, dvec, kh, vh, dq, dk, dv, 0.3, mask,
                      kv_done=lambda n: reported.append((n, dk[:, :, :n].copy(), dv[:, :, :n].copy())))
    assert len(reported) > 2 and reported[-1][0] == N
    for n, dk_then, dv_then in reported:
        np.testing.assert_array_equal(dk_then, dk[:, :, :n])
        np.testing.assert_array_equal(dv_then, dv[:, :, :n])


def test_a_tile_size_that_is_not_positive_is_refused(monkeypatch):
    from ringmpi.runtime.env import positive_int

    for text in ("0", "-3", "many"):
        monkeypatch.setenv("RINGMPI_BAND_Q", text)
        with pytest.raises(ValueError, match="RINGMPI_BAND_Q"):
            positive_int("RINGMPI_BAND_Q", 128)
    monkeypatch.setenv("RINGMPI_BAND_Q", "64")
    assert positive_int("RINGMPI_BAND_Q", 128) == 64
    monkeypatch.delenv("RINGMPI_BAND_Q")
    assert positive_int("RINGMPI_BAND_Q", 128) == 128
