"""The NumPy backend's block ops for ``invariant=True``: fixed tile pairs, order-free sums.

Every (query tile, key tile) pair -- tiles of 64 global positions
(:mod:`ringmpi.core.global_tiles`) -- is computed by the same BLAS calls on operands of the
same shape, strides and 64-byte alignment (tile copies), whichever rank holds it and
whatever else that rank holds.  Several pairs go into one stacked ``np.matmul`` (one
64 x 64 GEMM per pair) and one elementwise pass, which treat each pair alike, and each
pair's float partial sums are added into integer fixed point
(:mod:`ringmpi.core.fixed_point`), so no sum depends on the order of the pairs.

Forward, two ring passes.  :func:`max_block`: each row's largest visible score ``M``
(exact in any order).  :func:`forward_block`: with ``M`` as the shift, ``p = exp(s - M) <= 1``;
the pair's row sums and ``p @ v`` go into the integer ``l`` and ``o`` numerator.  Backward,
:func:`backward_block`: FlashAttention-2's formulas per pair (``P = exp(s - lse)``); ``dq``
into resident integer accumulators, ``dk, dv`` into the travelling integer partial sums.

Non-finite inputs (a documented simplification of the default's rule): rows (q, and in the
backward do, lse, dvec) and keys (k, v) holding NaN/Inf are zeroed in the tile copies and
flagged; a row that sees a flagged key, or is flagged and sees any key, is *poisoned* (its
outputs become NaN), and in the backward so is every key a flagged row sees.  Every other
row and key gets a clean run's bits: a masked key never reaches a row.  A partial beyond its
fixed-point grid (a bound that did not hold: in the backward, ``exp(s - lse)`` summing past
2 over a tile's keys, an ``lse`` that does not belong to these q and k) poisons its row and
the keys it sees likewise: never a wrapped integer.
"""

from __future__ import annotations

import numpy as np

from ..core import fixed_point
from ..core.global_tiles import TILE, Tiling, aligned
from ..core.masks import FULL, PARTIAL, classify_tiles
from .numpy_backend import _bad_rows, _cap, _exp_pass, _kv_precision


def _scratch(store: dict, key, shape, dtype) -> np.ndarray:
    """An aligned scratch array of ``shape`` (a view of one grown as needed), reused per call."""
    count = int(np.prod(shape, dtype=np.int64))
    buf = store.get(key)
    if buf is None or buf.size < count or buf.dtype != np.dtype(dtype):
        buf = store[key] = aligned((max(count, 1),), dtype)
    return buf[:count].reshape(shape)


def _tile_bounds(pos: np.ndarray, seg) -> np.ndarray:
    """``classify_tiles``' bounds of tiles ``pos (nt, TILE)`` (pads repeat a valid position) and
    segment ids ``seg (B, nt, TILE)`` or None."""
    parts = [np.stack([pos.min(axis=1), pos.max(axis=1)], axis=-1).ravel()]
    if seg is not None:
        parts.append(np.stack([seg.min(axis=2), seg.max(axis=2)], axis=-1).ravel())
    return np.concatenate(parts).astype(np.int64)


def _tiled_segments(tiling: Tiling, seg):
    """Segment ids ``(B, S)`` as ``(B, nt, TILE)``, pad slots repeating the tile's first id."""
    if seg is None:
        return None
    out = tiling.gather(np.asarray(seg, dtype=np.int64), axis=1)
    return np.where(tiling.valid[None], out, out[..., :1])


def _run(index: np.ndarray):
    """``slice`` when ``index`` is consecutive integers (a view, no copy), else ``index``."""
    if len(index) and index[-1] - index[0] == len(index) - 1:
        return slice(int(index[0]), int(index[-1]) + 1)
    return index


def _stack(src: np.ndarray, index, out: np.ndarray) -> np.ndarray:
    """``src[index]`` along axis 0: a view for a run, else a copy into the aligned ``out``."""
    if isinstance(index, slice):
        return src[index]
    return np.take(src, index, axis=0, out=out[:len(index)])


class Resident:
    """What one call derives from its resident query rows, once (the ``resident`` of these ops).

    ``q`` (and in the backward ``do``) head-major ``(B, H, S, D)`` in the compute dtype
    ``ct``, rounded to 16-bit K/V as the default ops do, become 64-byte aligned tile copies
    ``(B, H, nq, TILE, D)``; ``lse``, ``dvec (B, H, S)`` become ``(B, H, nq, TILE)`` with
    ``lse = -inf`` (a row that saw nothing) read as ``+inf`` (``P = 0``).  ``bad (B, H, nq,
    TILE)`` flags rows with NaN/Inf (zeroed in the copies; ``lse`` ``+inf``, ``dvec`` 0).
    """

    def __init__(self, positions, seg, q, kv_dtype, ct, spec, do=None, lse=None, dvec=None):
        self.tiling = Tiling.of(positions)
        self.ct, self.spec = np.dtype(ct), spec
        self.seg = _tiled_segments(self.tiling, seg)
        self.q = self.tiling.gather(_kv_precision(q, kv_dtype), axis=2, dtype=ct)
        bad = _bad_rows(self.q)
        self.do = self.lse = self.dvec = None
        if do is not None:
            self.do = self.tiling.gather(_kv_precision(do, kv_dtype), axis=2, dtype=ct)
            lse = np.where(np.isneginf(lse), np.inf, lse)
            self.lse = self.tiling.gather(lse, axis=2, dtype=ct)
            self.dvec = self.tiling.gather(dvec, axis=2, dtype=ct)
            bad |= _bad_rows(self.do) | np.isnan(self.lse) | ~np.isfinite(self.dvec)
            self.lse[..., ~self.tiling.valid] = np.inf  # pad rows: P = 0
        bad &= self.tiling.valid
        if bad.any():
            self.q[bad] = 0
            if do is not None:
                self.do[bad] = 0
                self.lse[bad] = np.inf
                self.dvec[bad] = 0
        self.bad = bad
        self.any_bad = bad.any(axis=(2, 3))  # (B, H)
        self.scratch: dict = {}


class _Block:
    """One visiting block against the resident rows: its key tiling, flagged keys and every
    pair's class (``SKIP``/``PARTIAL``/``FULL``, a pair with pad slots at most ``PARTIAL``)."""

    def __init__(self, res: Resident, mask, bad_keys):
        self.res, self.spec = res, res.spec
        self.tiling = Tiling.of(mask.kv_pos)
        self.seg = _tiled_segments(self.tiling, mask.seg_kv)
        self.bad = self.tiling.gather(bad_keys, axis=2) & self.tiling.valid  # (B, Hkv, nk, TILE)
        self.any_bad = self.bad.any(axis=(2, 3))
        q_t, k_t = res.tiling, self.tiling
        batch = res.q.shape[0]
        has_seg = res.seg is not None
        classes = classify_tiles(self.spec, _tile_bounds(q_t.pos, res.seg), _tile_bounds(k_t.pos, self.seg),
                                 q_t.count, k_t.count, batch, has_seg)
        padded = ~q_t.valid.all(axis=1)[:, None] | ~k_t.valid.all(axis=1)[None, :]
        self.classes = np.where((classes == FULL) & padded[None], PARTIAL, classes)

    def entry(self, b: int) -> int:
        """Row of :attr:`classes` for batch entry ``b``."""
        return b if self.res.seg is not None else 0

    def counts(self, batch: int):
        nonskip = int((self.classes != 0).sum())
        total = self.classes.size
        scale = 1 if self.res.seg is not None else batch
        return nonskip * scale, (total - nonskip) * scale

    def groups(self, classes_row):
        """``(index, partial)`` of the FULL and the PARTIAL tiles among ``classes_row``."""
        for kind, partial in ((FULL, False), (PARTIAL, True)):
            index = np.flatnonzero(classes_row == kind)
            if len(index):
                yield index, partial

    def visible(self, b: int, q_tiles, k_tiles) -> np.ndarray:
        """``(len(q_tiles) * TILE, len(k_tiles) * TILE)`` visibility of those tiles' slots."""
        res, kt = self.res, self.tiling
        qi, kj = np.atleast_1d(np.arange(res.tiling.count)[q_tiles]), np.atleast_1d(np.arange(kt.count)[k_tiles])
        segq = None if res.seg is None else res.seg[b, qi].ravel()
        segk = None if self.seg is None else self.seg[b, kj].ravel()
        vis = self.spec.visible(res.tiling.pos[qi].ravel(), kt.pos[kj].ravel(), segq, segk)
        return vis & res.tiling.valid[qi].ravel()[:, None] & kt.valid[kj].ravel()[None, :]


def _pair_stack(x: np.ndarray, n: int, q_major: bool) -> np.ndarray:
    """A ``(TILE * a, TILE * c)`` array over (query slots, key slots) as ``n`` pairs
    ``(n, TILE, TILE)``: ``q_major`` -- one query tile against ``n`` key tiles -- or one key
    tile against ``n`` query tiles."""
    if q_major:
        return x.reshape(TILE, n, TILE).transpose(1, 0, 2)
    return x.reshape(n, TILE, TILE)


class _Terms:
    """The additive terms of one stack of pairs: the mask's 0/-inf bias (PARTIAL pairs) plus the
    score modifiers' per-head terms, built once per stack and joined per head into ``full``
    (contiguous, the shape of the stack's scores), or None where there are none."""

    def __init__(self, blk: _Block, b: int, q_tiles, k_tiles, n: int, partial: bool, q_major: bool, ct):
        res, spec = blk.res, blk.spec
        self.n, self.q_major, self.ct = n, q_major, ct
        self.vis = None
        self.bias = None
        if partial:
            self.vis = _pair_stack(blk.visible(b, q_tiles, k_tiles), n, q_major)
            self.bias = np.where(self.vis, ct.type(0), ct.type(-np.inf))
        qi = np.atleast_1d(np.arange(res.tiling.count)[q_tiles])
        kj = np.atleast_1d(np.arange(blk.tiling.count)[k_tiles])
        self.terms = spec.modifier_terms(res.tiling.pos[qi].ravel(), blk.tiling.pos[kj].ravel(), ct)
        self.blk, self.b, self.q_tiles, self.k_tiles = blk, b, q_tiles, k_tiles

    def full(self, h: int, out: np.ndarray):
        if self.terms is None:
            return self.bias
        extra = _pair_stack(self.terms(h), self.n, self.q_major)
        if self.bias is None:
            np.copyto(out, extra)
        else:
            np.add(self.bias, extra, out=out)
        return out

    def visibility(self) -> np.ndarray:
        """``(n, TILE, TILE)`` bool visibility of the stack's pairs (pads excluded)."""
        if self.vis is None:
            self.vis = _pair_stack(self.blk.visible(self.b, self.q_tiles, self.k_tiles), self.n, self.q_major)
        return self.vis


def _drop(spec, b: int, h: int, q_pos: np.ndarray, k_pos: np.ndarray, n: int, q_major: bool, ct):
    """Dropout's factors of a stack (``(n, TILE, TILE)``), or None without dropout."""
    if spec.dropout is None:
        return None
    return _pair_stack(spec.dropout.multiplier(b, h, q_pos, k_pos, ct), n, q_major)


def _scores_for_pass(s, scale, softcap, full, t=None):
    """Turn the raw products ``s`` into what the exp pass reads: ``(pass_scale, pass_bias)``.
    With a softcap the scores are capped here (``s = c tanh(scale s / c) + full``; ``t``, when
    given, keeps ``tanh``, the backward's slope); else the pass scales and adds ``full`` itself."""
    if softcap is None:
        return scale, full
    np.multiply(s, scale, out=s)
    if t is not None:
        np.divide(s, softcap, out=t)
        np.tanh(t, out=t)
        np.multiply(t, softcap, out=s)
    else:
        _cap(s, softcap)
    if full is not None:
        s += full
    return s.dtype.type(1), None


def _row_max(s, scale, softcap, full) -> np.ndarray:
    """``(TILE,)`` the largest score of each query row over a query-major stack ``(n, TILE, TILE)``
    (scores exactly as the exp pass forms them: ``(s * scale) + full``)."""
    # the stack's elementwise maximum first, then along the rows: one vector pass (max is exact)
    if softcap is None and full is None and scale > 0:
        # a positive scale commutes with the maximum (rounding is monotonic): bitwise the same
        return s.max(axis=0).max(axis=1) * scale
    pass_scale, pass_bias = _scores_for_pass(s, scale, softcap, full)
    if pass_scale != 1:
        s *= pass_scale
    if pass_bias is not None:
        s += pass_bias
    return s.max(axis=0).max(axis=1)


def _poison_pairs(vis: np.ndarray, bad_rows: np.ndarray, bad_keys: np.ndarray):
    """``(rows, keys)`` poisoned by flagged rows/keys over a stack's visibility ``vis (n, r, k)``:
    a row that sees a flagged key or is flagged and sees any key, a key seen by a flagged row or
    flagged and seen by any row.  ``bad_rows (n, r)`` / ``(r,)``, ``bad_keys (n, k)`` / ``(k,)``
    broadcast against ``vis``."""
    rows = (vis & bad_keys[..., None, :]).any(axis=-1) | (bad_rows & vis.any(axis=-1))
    keys = (vis & bad_rows[..., :, None]).any(axis=-2) | (bad_keys & vis.any(axis=-2))
    return rows, keys


def _key_tiles(x, tiling: Tiling, ct, store: dict, key) -> np.ndarray:
    """One batch entry's ``x (H_kv, S, D)`` as aligned key tiles ``(H_kv, nk, TILE, D)`` in ``ct``."""
    shape = (x.shape[0], tiling.count, TILE, x.shape[2])
    return tiling.gather(x, axis=1, out=_scratch(store, key, shape, ct))


# ---------------------------------------------------------------------------- forward
def max_block(res: Resident, kh, m, poison, scale, mask, tick=None):
    """Pass 1: ``m (B, H, nq, TILE)`` becomes the elementwise maximum of itself and every visible
    score of this block (NaN propagates); rows seeing flagged keys are poisoned (``poison``
    uint8, same shape).  ``kh (B, H_kv, S_kv, D)`` the block's keys.  Returns tile counts."""
    batch, heads = res.q.shape[:2]
    kv_heads = kh.shape[1]
    if kh.shape[2] == 0 or res.tiling.rows == 0:
        return 0, 0
    ct, group = res.ct, heads // kv_heads
    scale = ct.type(scale)
    softcap = None if res.spec.softcap is None else ct.type(res.spec.softcap)
    blk = _Block(res, mask, _bad_rows(kh))
    nk = blk.tiling.count
    s_buf = _scratch(res.scratch, "s", (nk, TILE, TILE), ct)
    full_buf = _scratch(res.scratch, "full", (nk, TILE, TILE), ct)
    k_buf = _scratch(res.scratch, "k", (nk, TILE, kh.shape[3]), ct)
    for b in range(batch):
        kt = _key_tiles(kh[b], blk.tiling, ct, res.scratch, "kt")
        kt[blk.bad[b]] = 0
        for i in range(res.tiling.count):
            for index, partial in blk.groups(blk.classes[blk.entry(b), i]):
                run, n = _run(index), len(index)
                terms = _Terms(blk, b, i, run, n, partial, True, ct)
                for h in range(heads):
                    hkv = h // group
                    s = s_buf[:n]
                    np.matmul(res.q[b, h, i][None], _stack(kt[hkv], run, k_buf).swapaxes(1, 2), out=s)
                    row_max = _row_max(s, scale, softcap, terms.full(h, full_buf[:n]))
                    np.maximum(m[b, h, i], row_max, out=m[b, h, i])
                    if res.bad[b, h, i].any() or blk.bad[b, hkv, index].any():
                        rows, _ = _poison_pairs(terms.visibility(), res.bad[b, h, i], blk.bad[b, hkv, index])
                        poison[b, h, i] |= rows.any(axis=0)
                    if tick is not None:
                        tick()
    return blk.counts(batch)


def forward_block(res: Resident, kh, vh, shift, acc_l, acc_o, poison, grid_l, grid_o, limbs: int, scale, mask,
                  tick=None):
    """Pass 2: add this block's ``sum_j exp(s - shift)`` and ``sum_j exp(s - shift) v_j`` (dropout's
    factors on the latter) into the integer ``acc_l (B, H, nq, TILE, limbs)`` and ``acc_o (..., limbs
    * D_v)`` on the grids ``grid_l (1,)`` and ``grid_o (B, H_kv, D_v)``.  ``shift (B, H, nq, TILE)``:
    pass 1's maxima (0 where not finite).  ``poison`` as :func:`max_block` (flagged values)."""
    batch, heads = res.q.shape[:2]
    kv_heads, dim_v = kh.shape[1], vh.shape[3]
    if kh.shape[2] == 0 or res.tiling.rows == 0:
        return 0, 0
    ct, group, spec = res.ct, heads // kv_heads, res.spec
    scale = ct.type(scale)
    softcap = None if spec.softcap is None else ct.type(spec.softcap)
    blk = _Block(res, mask, _bad_rows(kh) | _bad_rows(vh))
    nk = blk.tiling.count
    s_buf = _scratch(res.scratch, "s", (nk, TILE, TILE), ct)
    full_buf = _scratch(res.scratch, "full", (nk, TILE, TILE), ct)
    k_buf = _scratch(res.scratch, "k", (nk, TILE, kh.shape[3]), ct)
    v_buf = _scratch(res.scratch, "v", (nk, TILE, dim_v), ct)
    pv_buf = _scratch(res.scratch, "pv", (nk, TILE, dim_v), ct)
    sums_buf = _scratch(res.scratch, "sums", (nk * TILE,), ct)
    shift_buf = _scratch(res.scratch, "shift", (nk * TILE,), ct)
    q_pos = res.tiling.pos
    for b in range(batch):
        kt = _key_tiles(kh[b], blk.tiling, ct, res.scratch, "kt")
        vt = _key_tiles(vh[b], blk.tiling, ct, res.scratch, "vt")
        kt[blk.bad[b]] = 0
        vt[blk.bad[b]] = 0
        for i in range(res.tiling.count):
            for index, partial in blk.groups(blk.classes[blk.entry(b), i]):
                run, n = _run(index), len(index)
                terms = _Terms(blk, b, i, run, n, partial, True, ct)
                k_pos = blk.tiling.pos[run].ravel()
                for h in range(heads):
                    hkv = h // group
                    s, sums, rows_shift = s_buf[:n], sums_buf[:n * TILE], shift_buf[:n * TILE]
                    np.matmul(res.q[b, h, i][None], _stack(kt[hkv], run, k_buf).swapaxes(1, 2), out=s)
                    pass_scale, pass_bias = _scores_for_pass(s, scale, softcap, terms.full(h, full_buf[:n]))
                    rows_shift.reshape(n, TILE)[...] = shift[b, h, i]
                    _exp_pass(s.reshape(n * TILE, TILE), pass_scale,
                              None if pass_bias is None else pass_bias.reshape(n * TILE, TILE), rows_shift, sums)
                    drop = _drop(spec, b, h, q_pos[i], k_pos, n, True, ct)
                    if drop is not None:
                        s *= drop
                    pv = pv_buf[:n]
                    np.matmul(s, _stack(vt[hkv], run, v_buf), out=pv)
                    bad = poison[b, h, i][None]
                    fixed_point.add(acc_o[b, h, i][None], pv, cols=grid_o[b, hkv], bad=bad, limbs=limbs)
                    fixed_point.add(acc_l[b, h, i][None], sums.reshape(n, TILE, 1), cols=grid_l, bad=bad,
                                    limbs=limbs)
                    if res.bad[b, h, i].any() or blk.bad[b, hkv, index].any():
                        rows, _ = _poison_pairs(terms.visibility(), res.bad[b, h, i], blk.bad[b, hkv, index])
                        poison[b, h, i] |= rows.any(axis=0)
                    if tick is not None:
                        tick()
    return blk.counts(batch)


# ---------------------------------------------------------------------------- backward
def backward_block(res: Resident, kh, vh, dq_acc, q_poison, dk, dv, grids, limbs: int, scale,
                   mask, tick=None, kv_need=None, kv_done=None):
    """Add one block's gradient terms in fixed point: ``dq_acc (B, H, nq, TILE, limbs * D)``
    (resident, poison ``q_poison (B, H, nq, TILE)`` uint8) and the block's travelling
    ``dk (B, H_kv, S_kv, limbs * D)``, ``dv (B, H_kv, S_kv, limbs * D_v + 1)`` (the last column:
    a poison count per key row), on ``grids`` (float64 powers of two: ``dq_rows (B, H, nq, TILE)``,
    ``dq_cols, dk_cols (B, H_kv, D)``, ``dv_cols (B, H_kv, D_v)``).  Unscaled: the caller
    multiplies by the softmax scale.  Key
    tiles are the outer loop; each tile's terms are summed in scratch, then added to its rows
    (``kv_need``/``kv_done`` as :meth:`ringmpi.backends.numpy_backend.NumpyBackend.backward_block`)."""
    batch, heads = res.q.shape[:2]
    kv_heads, skv, dim = kh.shape[1], kh.shape[2], kh.shape[3]
    dim_v = vh.shape[3]
    if skv == 0 or res.tiling.rows == 0:
        if kv_done is not None:
            kv_done(skv)
        return 0, 0
    ct, group, spec = res.ct, heads // kv_heads, res.spec
    scale = ct.type(scale)
    softcap = None if spec.softcap is None else ct.type(spec.softcap)
    blk = _Block(res, mask, _bad_rows(kh) | _bad_rows(vh))
    kt_tiling, nq = blk.tiling, res.tiling.count
    st = res.scratch
    s_buf, dp_buf = _scratch(st, "s", (nq, TILE, TILE), ct), _scratch(st, "dp", (nq, TILE, TILE), ct)
    full_buf = _scratch(st, "full", (nq, TILE, TILE), ct)
    t_buf = None if softcap is None else _scratch(st, "t", (nq, TILE, TILE), ct)
    q_buf, do_buf = _scratch(st, "qs", (nq, TILE, dim), ct), _scratch(st, "dos", (nq, TILE, dim_v), ct)
    out_d, out_v = _scratch(st, "outd", (nq, TILE, dim), ct), _scratch(st, "outv", (nq, TILE, dim_v), ct)
    sums_buf = _scratch(st, "sums", (nq * TILE,), ct)
    lse_buf, dvec_buf = _scratch(st, "lses", (nq, TILE), ct), _scratch(st, "dvecs", (nq, TILE), ct)
    kt = _scratch(st, "kj", (batch, kv_heads, TILE, dim), ct)
    vt = _scratch(st, "vj", (batch, kv_heads, TILE, dim_v), ct)
    tile_dk = _scratch(st, "tdk", (batch, kv_heads, TILE, limbs * dim), np.int64)
    tile_dv = _scratch(st, "tdv", (batch, kv_heads, TILE, limbs * dim_v), np.int64)
    tile_pk = _scratch(st, "tpk", (batch, kv_heads, TILE), np.uint8)
    order = kt_tiling.order
    if kv_need is not None and not kt_tiling.sorted:
        kv_need(skv)  # a tile's rows lie anywhere in the block
    first = 0
    q_pos = res.tiling.pos
    for j in range(kt_tiling.count):
        held = np.flatnonzero(kt_tiling.valid[j])
        count = len(held)
        rows = order[first:first + count]
        kt[...] = 0
        vt[...] = 0
        kt[:, :, held] = kh[:, :, rows]
        vt[:, :, held] = vh[:, :, rows]
        bad_j = blk.bad[:, :, j]
        kt[bad_j] = 0
        vt[bad_j] = 0
        tile_dk[...] = 0
        tile_dv[...] = 0
        tile_pk[...] = 0
        k_pos = kt_tiling.pos[j]
        for b in range(batch):
            for index, partial in blk.groups(blk.classes[blk.entry(b), :, j]):
                run, n = _run(index), len(index)
                terms = _Terms(blk, b, run, j, n, partial, False, ct)
                qp = q_pos[run].ravel()
                for h in range(heads):
                    hkv = h // group
                    s, dp, sums = s_buf[:n], dp_buf[:n], sums_buf[:n * TILE]
                    qs = _stack(res.q[b, h], run, q_buf)
                    dos = _stack(res.do[b, h], run, do_buf)
                    lse = _stack(res.lse[b, h], run, lse_buf)
                    dvec = _stack(res.dvec[b, h], run, dvec_buf)
                    np.matmul(qs, kt[b, hkv].T, out=s)
                    t = None if softcap is None else t_buf[:n]
                    pass_scale, pass_bias = _scores_for_pass(s, scale, softcap, terms.full(h, full_buf[:n]), t)
                    _exp_pass(s.reshape(n * TILE, TILE), pass_scale,
                              None if pass_bias is None else pass_bias.reshape(n * TILE, TILE),
                              np.ascontiguousarray(lse).reshape(-1), sums)
                    over = ~(sums <= 2)
                    if over.any():  # lse does not bound these rows' scores: poison them, add nothing
                        over = over.reshape(n, TILE)
                        s[over] = 0
                        rows_p, keys_p = _poison_pairs(terms.visibility(), over, np.zeros(TILE, bool))
                        _poison_rows(q_poison[b, h], index, rows_p)
                        tile_pk[b, hkv] |= keys_p.any(axis=0)
                    drop = _drop(spec, b, h, qp, k_pos, n, False, ct)
                    pd = s if drop is None else s * drop
                    np.matmul(pd.swapaxes(1, 2), dos, out=out_v[:n])
                    bad_k = tile_pk[b, hkv][None]
                    fixed_point.add(tile_dv[b, hkv][None], out_v[:n], cols=grids.dv_cols[b, hkv], bad=bad_k,
                                    limbs=limbs)
                    np.matmul(dos, vt[b, hkv].T, out=dp)
                    if drop is not None:
                        dp *= drop
                    dp -= dvec[..., None]
                    dp *= s
                    if t is not None:  # the cap's slope 1 - tanh^2
                        np.square(t, out=t)
                        np.subtract(1, t, out=t)
                        dp *= t
                    np.matmul(dp, kt[b, hkv], out=out_d[:n])
                    fixed_point.add(dq_acc[b, h], out_d[:n], rows=grids.dq_rows[b, h], cols=grids.dq_cols[b, hkv],
                                    index=index, bad=q_poison[b, h], limbs=limbs)
                    np.matmul(dp.swapaxes(1, 2), qs, out=out_d[:n])
                    fixed_point.add(tile_dk[b, hkv][None], out_d[:n], cols=grids.dk_cols[b, hkv], bad=bad_k,
                                    limbs=limbs)
                    if res.any_bad[b, h] or bad_j[b, hkv].any():
                        rows_p, keys_p = _poison_pairs(terms.visibility(), res.bad[b, h, index], bad_j[b, hkv])
                        _poison_rows(q_poison[b, h], index, rows_p)
                        tile_pk[b, hkv] |= keys_p.any(axis=0)
                    if tick is not None:
                        tick()
        if kv_need is not None and kt_tiling.sorted:
            kv_need(first + count)
        dk[:, :, rows] += tile_dk[:, :, held]
        dv[:, :, rows, :limbs * dim_v] += tile_dv[:, :, held]
        dv[:, :, rows, limbs * dim_v] += tile_pk[:, :, held]
        first += count
        if kv_done is not None and kt_tiling.sorted:
            kv_done(first)
    if kv_done is not None:
        kv_done(skv)
    return blk.counts(batch)


def _poison_rows(poison: np.ndarray, index: np.ndarray, rows: np.ndarray) -> None:
    """``poison[index] |= rows`` (``poison (nq, TILE)`` uint8, ``rows (n, TILE)`` bool)."""
    poison[index] |= rows.astype(np.uint8)
