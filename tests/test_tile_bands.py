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

import ringmpi
from ringmpi.backends import numpy_backend as nb

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
    "causal window": dict(causal=True, window=(9, None)),
    "two-sided window": dict(window=(5, 7)),
    "causal segments": dict(causal=True, segments=True),
}


@pytest.mark.parametrize("case", CASES)
def test_banded_tiles_match_the_dense_reference(monkeypatch, case):
    kw = dict(CASES[case])
    seg = SEG if kw.pop("segments", False) else None
    if seg is not None:
        kw.update(segment_ids_q=seg, segment_ids_kv=seg)
    monkeypatch.setattr(nb, "TILE_Q", 8)
    monkeypatch.setattr(nb, "TILE_KV", 8)
    monkeypatch.setattr(nb, "BAND_Q", 3)
    bands = []
    real = nb._bands

    def counted(vis, rows, cols, band):
        for item in real(vis, rows, cols, band):
            bands.append((item[0].stop - item[0].start, item[1].stop - item[1].start))
            yield item
    monkeypatch.setattr(nb, "_bands", counted)

    rng = np.random.default_rng(3)
    q, do = rng.standard_normal((2, B, N, H, D)).astype(np.float32)
    k, v = rng.standard_normal((2, B, N, HKV, D)).astype(np.float32)
    o, lse = ringmpi.ring_attention(q, k, v, backend="numpy", **kw)
    grads = ringmpi.ring_attention_backward(do, q, k, v, o, lse, backend="numpy", **kw)
    assert any(r < 8 for r, _ in bands) and any(c < 8 for _, c in bands), "no tile ran banded"

    vis = reference.visible(N, N, kw.get("causal", False), kw.get("window"), seg, seg)
    scale = 1 / np.sqrt(D)
    ref_o, ref_lse = reference.dense_forward(q, k, v, vis, scale, np.float64)
    naive_o, naive_lse = reference.dense_forward(q, k, v, vis, scale, np.float32)
    checks = [reference.tolerance_check("o", o, ref_o, naive_o),
              reference.tolerance_check("lse", lse, ref_lse, naive_lse)]
    ref_g = reference.dense_backward(do, q, k, v, vis, scale, np.float64)
    naive_g = reference.dense_backward(do, q, k, v, vis, scale, np.float32)
    checks += [reference.tolerance_check(name, got, want, naive, gradient=True)
               for name, got, want, naive in zip(("dq", "dk", "dv"), grads, ref_g, naive_g)]
    assert all(ok for ok, _ in checks), "; ".join(msg for _, msg in checks)
