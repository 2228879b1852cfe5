"""The NumPy backend's block ops for ``invariant=True``: fixed tile pairs, order-free sums.

Every (query tile, key tile) pair -- tiles of 64 global positions
(:mod:`ringmpi.core.global_tiles`) -- is computed by the same arithmetic whichever rank holds
it and whatever else that rank holds.  Several pairs go into one call of the products and one
elementwise pass, which treat each pair alike: for float32, where the compiled block op is
built, the block op's own register-blocked products (``_fused.scores_packed``,
``_fused.pair_products``: each element one chain of fused multiply-adds over the pair's terms
in order, the same bits on every vector path; the keys packed once per chunk and reused by
every query tile), else one stacked ``np.matmul`` (one 64 x 64 BLAS GEMM per pair, operands of
the same shape, strides and 64-byte alignment).  Each pair's float partial sums are added into
integer fixed point (:mod:`ringmpi.core.fixed_point`), so no sum depends on the order of the
pairs.

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

import math

import numpy as np

from ..core.global_tiles import TILE, Tiling, aligned
from ..core.masks import FULL, PARTIAL, classify_tiles, tile_counts
from . import tile_pass
from .tile_pass import PANEL
from .fixed_sums import add as fixed_add


def _bad_rows(x) -> np.ndarray:
    """``(..., S)`` bool: the rows of ``x (..., S, D)`` holding a NaN or Inf."""
    return ~np.isfinite(x).all(axis=-1)


def _scratch(store: dict, key, shape, dtype) -> np.ndarray:
    """An aligned scratch array of ``shape`` (a view of one grown as needed), reused per call."""
    count = math.prod(shape)
    buf = store.get(key)
    if buf is None or buf.size < count or buf.dtype != dtype:
        buf = store[key] = aligned((max(count, 1),), dtype)
    return buf[:count].reshape(shape)


def _tile_bounds(pos: np.ndarray, seg) -> np.ndarray:
    """``classify_tiles``' bounds of tiles ``pos (nt, TILE)`` (pads repeat a valid position) and
    segment ids ``seg (B, nt, TILE)`` or None."""
    parts = [np.stack([pos.min(axis=1), pos.max(axis=1)], axis=-1).ravel()]
    if seg is not None:
        parts.append(np.stack([seg.min(axis=2), seg.max(axis=2)], axis=-1).ravel())
    return np.concatenate(parts).astype(np.int64)


def tiled_segments(tiling: Tiling, seg):
    """Segment ids ``(B, S)`` as ``(B, nt, TILE)``, pad slots repeating the tile's first id."""
    if seg is None:
        return None
    out = tiling.to_tiles(np.asarray(seg, dtype=np.int64), axis=1)
    return np.where(tiling.valid[None], out, out[..., :1])


def pair_classes(spec, q_tiling: Tiling, q_seg, k_tiling: Tiling, k_seg, batch: int) -> np.ndarray:
    """``(B or 1, nq, nk)`` int8 class of every (query tile, key tile) pair (``SKIP``/``PARTIAL``/
    ``FULL``, a pair with pad slots at most ``PARTIAL``), from the tiles' global positions and
    segment ids (``q_seg``, ``k_seg``: :func:`tiled_segments`, or None): the same for a pair on
    every rank.  One row per batch entry with segments, else one."""
    classes = classify_tiles(spec, _tile_bounds(q_tiling.pos, q_seg), _tile_bounds(k_tiling.pos, k_seg),
                             q_tiling.count, k_tiling.count, batch, q_seg is not None)
    padded = ~q_tiling.valid.all(axis=1)[:, None] | ~k_tiling.valid.all(axis=1)[None, :]
    return np.where((classes == FULL) & padded[None], PARTIAL, classes).astype(np.int8)


def _run(index: np.ndarray):
    """``slice`` when ``index`` is consecutive integers (a view, no copy), else ``index``."""
    if len(index) and index[-1] - index[0] == len(index) - 1:
        return slice(int(index[0]), int(index[-1]) + 1)
    return index


def _stack(src: np.ndarray, index, store: dict, key) -> np.ndarray:
    """``src[index]`` along axis 0: a view for a run, else a copy into the aligned scratch ``key``."""
    if isinstance(index, slice):
        return src[index]
    return np.take(src, index, axis=0, out=_scratch(store, key, (len(index),) + src.shape[1:], src.dtype))


CHUNK = 32           # key tiles per stacked call in the forward, per chunk of the backward: bounds the scratch
BACKWARD_CHUNK = 16  # query tiles per stacked call in the backward


def _chunks(count: int, size: int = CHUNK):
    return [(lo, min(lo + size, count)) for lo in range(0, count, size)]


def _packed(x: np.ndarray, store: dict, key) -> np.ndarray:
    """Tiles ``x (n, TILE, D)`` as the compiled products read keys: each tile's ``TILE // PANEL``
    panels of ``PANEL`` keys, d-major, as ``(n, TILE * D)`` (one row per tile, so a stack of tiles
    is a take along axis 0), in the scratch ``key``."""
    n, _, dim = x.shape
    out = _scratch(store, key, (n, TILE // PANEL, dim, PANEL), x.dtype)
    np.copyto(out, x.reshape(n, TILE // PANEL, PANEL, dim).transpose(0, 1, 3, 2))
    return out.reshape(n, TILE * dim)


def _pair_scores(res: "Resident", q_tile: np.ndarray, k_stack: np.ndarray, s: np.ndarray) -> None:
    """``s (n, TILE, TILE)``: query tile ``q_tile (TILE, D)`` against each key tile of ``k_stack``
    (:func:`_packed` tiles ``(n, TILE * D)`` with the compiled products, else ``(n, TILE, D)``)."""
    if res.products is not None:
        res.products.scores_packed(q_tile, k_stack.reshape(-1, PANEL), s.reshape(-1, TILE), TILE)
    else:
        np.matmul(q_tile[None], k_stack.swapaxes(1, 2), out=s)


def _stack_scores(res: "Resident", rows: np.ndarray, k_tile: np.ndarray, s: np.ndarray) -> None:
    """``s (n, TILE, TILE)``: each row tile of ``rows (n, TILE, D)`` against key tile ``k_tile``
    (:func:`_packed`'s ``(TILE * D,)`` with the compiled products, else ``(TILE, D)``)."""
    if res.products is not None:
        res.products.scores_packed(rows.reshape(-1, rows.shape[2]), k_tile.reshape(-1, PANEL),
                                   s.reshape(-1, TILE), 0)
    else:
        np.matmul(rows, k_tile.T, out=s)


def _pair_products(res: "Resident", a: np.ndarray, b: np.ndarray, out: np.ndarray, trans: bool = False) -> None:
    """``out[j] = a[j] @ b[j]`` (``a[j].T @ b[j]`` with ``trans``) for the stack's pairs ``a (n, TILE,
    TILE)``, ``b (n, TILE, w)`` or one ``(TILE, w)`` for all, ``out (n, TILE, w)`` (C-contiguous):
    the compiled products where float32 has them (each element one chain of fused multiply-adds
    over the pair's TILE terms in order), else BLAS's stacked GEMM."""
    if res.products is not None:
        res.products.pair_products(a.reshape(-1, TILE), b.reshape(-1, b.shape[-1]), out.reshape(-1, out.shape[-1]),
                                   trans)
    else:
        np.matmul(a.swapaxes(1, 2) if trans else a, b, out=out)


class Resident:
    """What one call derives from its resident query rows, once (the ``resident`` of these ops).

    ``q`` (and in the backward ``do``) head-major ``(B, H, S, D)`` views in the compute dtype
    ``ct`` stay where they are; :meth:`tiles` copies one batch entry's heads into 64-byte
    aligned tiles ``(heads, nq, TILE, D)`` when a block op needs them (rounded to 16-bit K/V as
    the default ops do, flagged rows zeroed).  ``lse``, ``dvec (B, H, S)`` become ``(B, H, nq,
    TILE)`` tiles, ``lse = -inf`` (a row that saw nothing) read as ``+inf`` (``P = 0``), pads
    ``+inf``.  ``bad (B, H, nq, TILE)`` flags rows with NaN/Inf (``lse`` ``+inf``, ``dvec`` 0 there).
    ``exp_pass(s, scale, bias, shift, sums)``, ``ds_pass(dp, p, dvec)``: the backend's elementwise
    tile passes (:mod:`ringmpi.backends.tile_pass`).
    """

    def __init__(self, positions, seg, q, kv_dtype, ct, spec, exp_pass, ds_pass, do=None, lse=None, dvec=None):
        self.exp_pass = exp_pass  # s = exp(s * scale + bias - shift), row sums
        self.ds_pass = ds_pass    # the backward's dS: dp = (dp - dvec) * p, each step rounded
        self.tiling = Tiling.of(positions)
        self.ct, self.spec, self.kv_dtype = np.dtype(ct), spec, np.dtype(kv_dtype)
        # the compiled block op's products (each element one chain of fused multiply-adds, whatever
        # the stack) for float32 where it is built with FMA, else BLAS: either way the same for every
        # pair (RINGMPI_CPU_BLOCK, the default path's comparison switch, does not change these bits;
        # every rank runs the same build, as it runs the same BLAS)
        compiled = tile_pass.compiled
        self.products = compiled if self.ct == np.float32 and compiled is not None and compiled.has_block() else None
        self.seg = tiled_segments(self.tiling, seg)
        self.q, self.do = q, do
        self.shape = (q.shape[0], q.shape[1], self.tiling.count, TILE)
        bad = self.tiling.to_tiles(_bad_rows(self._rounded(q)), axis=2)
        self.lse = self.dvec = None
        if do is not None:
            lse = np.where(np.isneginf(lse), np.inf, lse)
            self.lse = self.tiling.to_tiles(lse, axis=2, dtype=ct)
            self.dvec = self.tiling.to_tiles(dvec, axis=2, dtype=ct)
            bad |= (self.tiling.to_tiles(_bad_rows(self._rounded(do)), axis=2) | np.isnan(self.lse)
                    | ~np.isfinite(self.dvec))
            self.lse[..., ~self.tiling.valid] = np.inf  # pad rows: P = 0
        bad &= self.tiling.valid
        if do is not None and bad.any():
            self.lse[bad] = np.inf
            self.dvec[bad] = 0
        self.bad = bad
        self.any_bad = bad.any(axis=(2, 3))  # (B, H)
        self.scratch: dict = {}

    def _rounded(self, x):
        """``x`` as :meth:`tiles` multiplies it: rounded to a 16-bit K/V dtype (a row a finite value
        overflows there is flagged, as one holding NaN/Inf is)."""
        if self.kv_dtype.itemsize == 2 and x.dtype != self.kv_dtype:
            with np.errstate(over="ignore"):
                return x.astype(self.kv_dtype)
        return x

    def tiles(self, which: str, b: int, heads: slice, key: str) -> np.ndarray:
        """``q`` or ``do`` (``which``) of batch entry ``b``, query heads ``heads``, as aligned tiles
        ``(heads, nq, TILE, D)`` in a scratch named ``key``: rounded as the K/V, flagged rows zero."""
        x = self.q if which == "q" else self.do
        part = x[b, heads]
        out = _scratch(self.scratch, key, (part.shape[0], self.tiling.count, TILE, part.shape[2]), self.ct)
        self.tiling.to_tiles(part, axis=1, out=out)
        if self.kv_dtype.itemsize == 2:  # what the tensor-core kernels multiply (as the default ops)
            out[...] = out.astype(self.kv_dtype)
        bad = self.bad[b, heads]
        if bad.any():
            out[bad] = 0
        return out


class _Block:
    """One visiting block against the resident rows: its key tiling, flagged keys and every
    pair's class (``SKIP``/``PARTIAL``/``FULL``, a pair with pad slots at most ``PARTIAL``)."""

    def __init__(self, res: Resident, mask, bad_keys):
        self.res, self.spec = res, res.spec
        self.tiling = Tiling.of(mask.kv_pos)
        self.seg = tiled_segments(self.tiling, mask.seg_kv)
        self.bad = self.tiling.to_tiles(bad_keys, axis=2) & self.tiling.valid  # (B, Hkv, nk, TILE)
        self.any_bad = self.bad.any(axis=(2, 3))
        self.classes = pair_classes(self.spec, res.tiling, res.seg, self.tiling, self.seg, res.q.shape[0])

    def key_tiles(self, x, t0: int, t1: int, b: int, hkv: int, key: str) -> np.ndarray:
        """This block's key tiles ``[t0, t1)`` of ``x (S_kv, D)`` (one batch entry and K/V head) as
        aligned tiles ``(t1 - t0, TILE, D)`` in the compute dtype, flagged keys zero."""
        out = _scratch(self.res.scratch, key, (t1 - t0, TILE, x.shape[1]), self.res.ct)
        self.tiling.gather_tiles(x, t0, t1, out)
        bad = self.bad[b, hkv, t0:t1]
        if bad.any():
            out[bad] = 0
        return out

    def entry(self, b: int) -> int:
        """Row of :attr:`classes` for batch entry ``b``."""
        return b if self.res.seg is not None else 0

    def counts(self, batch: int):
        return tile_counts(self.classes, self.res.seg is not None, batch)

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
        vis = tile_pass.visible(self.spec, res.tiling.pos[qi].ravel(), kt.pos[kj].ravel(), segq, segk)
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
        self.blk, self.b, self.q_tiles, self.k_tiles = blk, b, q_tiles, k_tiles
        self.n, self.q_major, self.ct = n, q_major, np.dtype(ct)
        self.vis = None
        self.bias = None
        if partial:
            self.vis = _pair_stack(blk.visible(b, q_tiles, k_tiles), n, q_major)
            self.bias = np.where(self.vis, self.ct.type(0), self.ct.type(-np.inf))
        spec = blk.spec
        self.terms = None
        if spec.modifiers:  # score modifiers with per-head terms (ScoreSpec.modifier_terms)
            self.terms = tile_pass.modifier_terms(spec, self.q_pos, self.k_pos, self.ct)

    @property
    def q_pos(self) -> np.ndarray:
        """The stack's query slots' global positions."""
        return self.blk.res.tiling.pos[self.q_tiles].ravel()

    @property
    def k_pos(self) -> np.ndarray:
        """The stack's key slots' global positions."""
        return self.blk.tiling.pos[self.k_tiles].ravel()

    def full(self, h: int, store: dict):
        """The stack's additive terms for head ``h`` (None without any), in the scratch ``"full"``."""
        if self.terms is None:
            return self.bias
        out = _scratch(store, "full", (self.n, TILE, TILE), self.ct)
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
    return _pair_stack(tile_pass.dropout_multiplier(spec.dropout, b, h, q_pos, k_pos, ct), n, q_major)


def _scores_for_pass(s, scale, softcap, full, t=None):
    """Turn the raw products ``s`` into what the exp pass reads: ``(pass_scale, pass_bias)``.
    With a softcap the scores are capped here (``s = c tanh(scale s / c) + full``; ``t``, when
    given, keeps ``tanh``, the backward's slope); else the pass scales and adds ``full`` itself."""
    if softcap is None:
        return scale, full
    np.multiply(s, scale, out=s)
    t = s if t is None else t  # the cap's tanh, kept for the backward's slope when t is given
    np.divide(s, softcap, out=t)
    np.tanh(t, out=t)
    np.multiply(t, softcap, out=s)
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


def _shift_rows(out, shift_row, n: int):
    """``shift_row (TILE,)`` repeated for the ``n`` pairs of a query-major stack: ``(n * TILE,)``."""
    rows = out[:n * TILE]
    rows.reshape(n, TILE)[...] = shift_row
    return rows


def _forward_tiles(res: Resident, kh, vh, mask, scale, tick, pair):
    """The forward's loop over one block: per batch entry and K/V head, its query heads' tiles, then
    per chunk of key tiles and per query tile, the FULL and the PARTIAL pairs as two stacks;
    ``pair(b, h, hkv, i, q_tile, keys, n, terms, k_stack, v_stack)`` does the arithmetic.
    Returns ``(tile counts, the block)``."""
    batch, heads = res.shape[:2]
    kv_heads = kh.shape[1]
    if kh.shape[2] == 0 or res.tiling.rows == 0:
        return (0, 0), None
    ct, group = res.ct, heads // kv_heads
    bad_keys = _bad_rows(kh) if vh is None else _bad_rows(kh) | _bad_rows(vh)
    blk = _Block(res, mask, bad_keys)
    st = res.scratch
    for b in range(batch):
        e = blk.entry(b)
        for hkv in range(kv_heads):
            hs = slice(hkv * group, (hkv + 1) * group)
            qg = res.tiles("q", b, hs, "qg")
            for t0, t1 in _chunks(blk.tiling.count):
                kt = blk.key_tiles(kh[b, hkv], t0, t1, b, hkv, "kt")
                if res.products is not None:  # packed once for every query tile
                    kt = _packed(kt, st, "kp")
                vt = None if vh is None else blk.key_tiles(vh[b, hkv], t0, t1, b, hkv, "vt")
                for i in range(res.tiling.count):
                    for index, partial in blk.groups(blk.classes[e, i, t0:t1]):
                        run, n = _run(index), len(index)
                        keys = index + t0
                        terms = _Terms(blk, b, i, _run(keys), n, partial, True, ct)
                        k_stack = _stack(kt, run, st, "ks")
                        v_stack = None if vt is None else _stack(vt, run, st, "vs")
                        for g in range(group):
                            h = hkv * group + g
                            pair(b, h, hkv, i, qg[g, i], keys, n, terms, k_stack, v_stack)
                            if tick is not None:
                                tick()
    return blk.counts(batch), blk


def max_block(res: Resident, kh, m, poison, scale, mask, tick=None):
    """Pass 1: ``m (B, H, nq, TILE)`` becomes the elementwise maximum of itself and every visible
    score of this block (NaN propagates); rows seeing flagged keys are poisoned (``poison``
    uint8, same shape).  ``kh (B, H_kv, S_kv, D)`` the block's keys.  Returns tile counts."""
    ct = res.ct
    scale = ct.type(scale)
    softcap = None if res.spec.softcap is None else ct.type(res.spec.softcap)
    st = res.scratch

    def pair(b, h, hkv, i, q_tile, keys, n, terms, k_stack, v_stack):
        full = terms.full(h, st)
        if res.products is not None and softcap is None and full is None and scale > 0:
            # the maxima straight from the products, no scores stored (a positive scale commutes
            # with the maximum, as in _row_max)
            row_max = _scratch(st, "rowmax", (TILE,), ct)
            res.products.scores_max(q_tile, k_stack.reshape(-1, PANEL), row_max)
            row_max *= scale
        else:
            s = _scratch(st, "s", (n, TILE, TILE), ct)
            _pair_scores(res, q_tile, k_stack, s)
            row_max = _row_max(s, scale, softcap, full)
        np.maximum(m[b, h, i], row_max, out=m[b, h, i])
        _poison_forward(res, terms, poison, b, h, hkv, i, keys)

    counts, _ = _forward_tiles(res, kh, None, mask, scale, tick, pair)
    return counts


def _may_fuse(res: Resident, softcap, full) -> bool:
    """Whether a stack of pairs may run as one compiled call (``pair_forward``, ``pair_backward``: the
    scores kept in cache, the same bits as the steps apart): float32's compiled products, and no
    softcap, additive terms (``full``) or dropout."""
    return res.products is not None and softcap is None and full is None and res.spec.dropout is None


def _poison_forward(res, terms, poison, b, h, hkv, i, keys):
    """Rows of query tile ``i`` that see a flagged key of ``keys``, or are flagged and see one."""
    bad_keys = terms.blk.bad[b, hkv, keys]
    if res.bad[b, h, i].any() or bad_keys.any():
        rows, _ = _poison_pairs(terms.visibility(), res.bad[b, h, i], bad_keys)
        poison[b, h, i] |= rows.any(axis=0)


def forward_block(res: Resident, kh, vh, shift, acc_l, acc_o, poison, grid_l, grid_o, limbs: int, scale, mask,
                  tick=None):
    """Pass 2: add this block's ``sum_j exp(s - shift)`` and ``sum_j exp(s - shift) v_j`` (dropout's
    factors on the latter) into the integer ``acc_l (B, H, nq, TILE, limbs)`` and ``acc_o (..., limbs
    * D_v)`` on the grids ``grid_l (1,)`` and ``grid_o (B, H_kv, D_v)``.  ``shift (B, H, nq, TILE)``:
    pass 1's maxima (0 where not finite).  ``poison`` as :func:`max_block` (flagged values)."""
    ct, spec = res.ct, res.spec
    scale = ct.type(scale)
    softcap = None if spec.softcap is None else ct.type(spec.softcap)
    st = res.scratch
    q_pos = res.tiling.pos

    def pair(b, h, hkv, i, q_tile, keys, n, terms, k_stack, v_stack):
        sums = _scratch(st, "sums", (n * TILE,), ct)
        pv = _scratch(st, "pv", (n, TILE, v_stack.shape[2]), ct)
        full = terms.full(h, st)
        if _may_fuse(res, softcap, full):
            # the three steps below in one call, the scores kept in cache: the same bits
            res.products.pair_forward(q_tile, k_stack.reshape(-1, PANEL), v_stack.reshape(-1, v_stack.shape[2]),
                                      np.ascontiguousarray(shift[b, h, i]), scale, pv.reshape(-1, pv.shape[2]), sums)
        else:
            s = _scratch(st, "s", (n, TILE, TILE), ct)
            _pair_scores(res, q_tile, k_stack, s)
            pass_scale, pass_bias = _scores_for_pass(s, scale, softcap, full)
            res.exp_pass(s.reshape(n * TILE, TILE), pass_scale,
                         None if pass_bias is None else pass_bias.reshape(n * TILE, TILE),
                         _shift_rows(_scratch(st, "shift", (n * TILE,), ct), shift[b, h, i], n), sums)
            drop = _drop(spec, b, h, q_pos[i], terms.k_pos, n, True, ct)
            if drop is not None:
                s *= drop
            _pair_products(res, s, v_stack, pv)
        bad = poison[b, h, i][None]
        fixed_add(acc_o[b, h, i][None], pv, cols=grid_o[b, hkv], bad=bad, limbs=limbs)
        fixed_add(acc_l[b, h, i][None], sums.reshape(n, TILE, 1), cols=grid_l, bad=bad, limbs=limbs)
        _poison_forward(res, terms, poison, b, h, hkv, i, keys)

    counts, _ = _forward_tiles(res, kh, vh, mask, scale, tick, pair)
    return counts


# ---------------------------------------------------------------------------- backward
def backward_block(res: Resident, kh, vh, dq_acc, q_poison, dk, dv, grids, limbs: int, scale, mask, tick=None,
                   kv_need=None, kv_done=None):
    """Add one block's gradient terms in fixed point: ``dq_acc (B, H, nq, TILE, limbs * D)``
    (resident, poison ``q_poison (B, H, nq, TILE)`` uint8) and the block's travelling
    ``dk (B, H_kv, S_kv, limbs * D)``, ``dv (B, H_kv, S_kv, limbs * D_v + 1)`` (the last column:
    a poison count per key row), on ``grids`` (float64 powers of two: ``dq_rows (B, H, nq, TILE)``,
    ``dq_cols, dk_cols (B, H_kv, D)``, ``dv_cols (B, H_kv, D_v)``).  Unscaled: the caller
    multiplies by the softmax scale.  Chunks of key tiles are the outer loop; a chunk's terms are
    summed in scratch, then added to its rows (``kv_need``/``kv_done`` as
    :meth:`ringmpi.backends.numpy_backend.NumpyBackend.backward_block`)."""
    batch, heads = res.shape[:2]
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
    k_tiling, st = blk.tiling, res.scratch
    if kv_need is not None and not k_tiling.sorted:
        kv_need(skv)  # a chunk's rows lie anywhere in the block
    for t0, t1 in _chunks(k_tiling.count):
        nc = t1 - t0
        rows, slots = k_tiling.held(t0, t1)
        direct = k_tiling.sorted and slots is None  # the chunk's rows are consecutive rows of the block
        if direct:  # add straight into the partial sums, once they have arrived
            if kv_need is not None:
                kv_need(int(rows[-1]) + 1)
            r0, r1 = int(rows[0]), int(rows[-1]) + 1
            tile_dk = dk[:, :, r0:r1].reshape(batch, kv_heads, nc, TILE, limbs * dim)
            tile_dv = dv[:, :, r0:r1, :limbs * dim_v].reshape(batch, kv_heads, nc, TILE, limbs * dim_v)
        else:
            tile_dk = _scratch(st, "tdk", (batch, kv_heads, nc, TILE, limbs * dim), np.int64)
            tile_dv = _scratch(st, "tdv", (batch, kv_heads, nc, TILE, limbs * dim_v), np.int64)
            tile_dk[...] = 0
            tile_dv[...] = 0
        tile_pk = _scratch(st, "tpk", (batch, kv_heads, nc, TILE), np.uint8)
        tile_pk[...] = 0
        for b in range(batch):
            e = blk.entry(b)
            for hkv in range(kv_heads):
                kt = blk.key_tiles(kh[b, hkv], t0, t1, b, hkv, "kt")
                vt = blk.key_tiles(vh[b, hkv], t0, t1, b, hkv, "vt")
                # what S = Q K^T and dP = dO V^T read: packed once for every query tile
                kps, vps = (kt, vt) if res.products is None else (_packed(kt, st, "kp"), _packed(vt, st, "vp"))
                for g in range(group):
                    h = hkv * group + g
                    qt = res.tiles("q", b, slice(h, h + 1), "qt")[0]
                    dot = res.tiles("do", b, slice(h, h + 1), "dot")[0]
                    for jj in range(nc):
                        j = t0 + jj
                        for q0, q1 in _chunks(res.tiling.count, BACKWARD_CHUNK):
                            for index, partial in blk.groups(blk.classes[e, q0:q1, j]):
                                index = index + q0
                                _backward_pairs(res, blk, b, h, hkv, j, index, partial, qt, dot, kt[jj], kps[jj],
                                                vps[jj], dq_acc, q_poison, tile_dk[b, hkv, jj], tile_dv[b, hkv, jj],
                                                tile_pk[b, hkv, jj], grids, limbs, scale, softcap)
                                if tick is not None:
                                    tick()
        if direct:
            dv[:, :, r0:r1, limbs * dim_v] += tile_pk.reshape(batch, kv_heads, nc * TILE)
            if kv_done is not None:
                kv_done(r1)
            continue
        flat = (lambda x: x.reshape(batch, kv_heads, nc * TILE, -1)) if slots is None else \
            (lambda x: x.reshape(batch, kv_heads, nc * TILE, -1)[:, :, slots])
        dk[:, :, rows] += flat(tile_dk)
        dv[:, :, rows, :limbs * dim_v] += flat(tile_dv)
        dv[:, :, rows, limbs * dim_v] += flat(tile_pk[..., None])[..., 0]
    if kv_done is not None:
        kv_done(skv)
    return blk.counts(batch)


def _backward_pairs(res, blk, b, h, hkv, j, index, partial, qt, dot, k_tile, k_scores, v_scores, dq_acc, q_poison,
                    tile_dk, tile_dv, tile_pk, grids, limbs, scale, softcap):
    """The pairs (query tiles ``index``, key tile ``j``) of head ``h``: FlashAttention-2's terms,
    ``dv`` and ``dk`` summed into the key tile's ``tile_dv``, ``tile_dk`` (``(TILE, limbs * D)``),
    ``dq`` into ``dq_acc[b, h, index]``.  ``k_tile (TILE, D)``; ``k_scores``, ``v_scores``: the key
    tile and its values as :func:`_stack_scores` reads them."""
    ct, spec, st = res.ct, res.spec, res.scratch
    run, n = _run(index), len(index)
    terms = _Terms(blk, b, run, j, n, partial, False, ct)
    s, dp = _scratch(st, "s", (n, TILE, TILE), ct), _scratch(st, "dp", (n, TILE, TILE), ct)
    sums = _scratch(st, "sums", (n * TILE,), ct)
    qs, dos = _stack(qt, run, st, "qs"), _stack(dot, run, st, "dos")
    lse, dvec = _stack(res.lse[b, h], run, st, "lses"), _stack(res.dvec[b, h], run, st, "dvecs")
    full = terms.full(h, st)
    if _may_fuse(res, softcap, full):
        out_v = _scratch(st, "outv", (n, TILE, dos.shape[2]), ct)
        out_q, out_k = (_scratch(st, key, (n, TILE, qs.shape[2]), ct) for key in ("outq", "outk"))
        res.products.pair_backward(qs.reshape(-1, qs.shape[2]), dos.reshape(-1, dos.shape[2]),
                                   k_scores.reshape(-1, PANEL), v_scores.reshape(-1, PANEL), k_tile,
                                   np.ascontiguousarray(lse).reshape(-1), np.ascontiguousarray(dvec).reshape(-1),
                                   scale, out_v.reshape(-1, out_v.shape[2]), out_q.reshape(-1, qs.shape[2]),
                                   out_k.reshape(-1, qs.shape[2]), sums)
        if sums.max() <= 2:  # else the steps below again, which poison what lse does not bound
            fixed_add(tile_dv[None], out_v, cols=grids.dv_cols[b, hkv], bad=tile_pk[None], limbs=limbs)
            fixed_add(dq_acc[b, h], out_q, rows=grids.dq_rows[b, h], cols=grids.dq_cols[b, hkv], index=index,
                      bad=q_poison[b, h], limbs=limbs)
            fixed_add(tile_dk[None], out_k, cols=grids.dk_cols[b, hkv], bad=tile_pk[None], limbs=limbs)
            _poison_backward(res, blk, terms, b, h, hkv, j, index, q_poison, tile_pk)
            return
    _stack_scores(res, qs, k_scores, s)
    t = None if softcap is None else _scratch(st, "t", (n, TILE, TILE), ct)
    pass_scale, pass_bias = _scores_for_pass(s, scale, softcap, full, t)
    res.exp_pass(s.reshape(n * TILE, TILE), pass_scale, None if pass_bias is None else pass_bias.reshape(n * TILE, TILE),
              np.ascontiguousarray(lse).reshape(-1), sums)
    if not sums.max() <= 2:  # lse does not bound some rows' scores: poison them and the keys they see
        over = ~(sums <= 2).reshape(n, TILE)
        s[over] = 0
        rows_p, keys_p = _poison_pairs(terms.visibility(), over, np.zeros(TILE, bool))
        _poison_rows(q_poison[b, h], index, rows_p)
        tile_pk |= keys_p.any(axis=0)
    drop = _drop(spec, b, h, terms.q_pos, terms.k_pos, n, False, ct)
    pd = s if drop is None else s * drop
    out_v = _scratch(st, "outv", (n, TILE, dos.shape[2]), ct)
    _pair_products(res, pd, dos, out_v, trans=True)
    fixed_add(tile_dv[None], out_v, cols=grids.dv_cols[b, hkv], bad=tile_pk[None], limbs=limbs)
    _stack_scores(res, dos, v_scores, dp)
    if drop is not None:
        dp *= drop
    res.ds_pass(dp.reshape(n * TILE, TILE), s.reshape(n * TILE, TILE), np.ascontiguousarray(dvec).reshape(-1))
    if t is not None:  # the cap's slope 1 - tanh^2
        np.square(t, out=t)
        np.subtract(1, t, out=t)
        dp *= t
    out_d = _scratch(st, "outd", (n, TILE, qs.shape[2]), ct)
    _pair_products(res, dp, k_tile, out_d)
    fixed_add(dq_acc[b, h], out_d, rows=grids.dq_rows[b, h], cols=grids.dq_cols[b, hkv], index=index,
                    bad=q_poison[b, h], limbs=limbs)
    _pair_products(res, dp, qs, out_d, trans=True)
    fixed_add(tile_dk[None], out_d, cols=grids.dk_cols[b, hkv], bad=tile_pk[None], limbs=limbs)
    _poison_backward(res, blk, terms, b, h, hkv, j, index, q_poison, tile_pk)


def _poison_backward(res, blk, terms, b, h, hkv, j, index, q_poison, tile_pk):
    """The rows of query tiles ``index`` and the keys of key tile ``j`` that flagged values reach."""
    bad_j = blk.bad[b, hkv, j]
    if res.any_bad[b, h] or bad_j.any():
        rows_p, keys_p = _poison_pairs(terms.visibility(), res.bad[b, h, index], bad_j)
        _poison_rows(q_poison[b, h], index, rows_p)
        tile_pk |= keys_p.any(axis=0)


def _poison_rows(poison: np.ndarray, index: np.ndarray, rows: np.ndarray) -> None:
    """``poison[index] |= rows`` (``poison (nq, TILE)`` uint8, ``rows (n, TILE)`` bool)."""
    poison[index] |= rows.astype(np.uint8)
