"""CPU backend: the compiled forward block op, tiled BLAS GEMMs and an in-place online softmax.

The common float32 forward runs through the compiled block op (``_fused.fwd_chunk``, see
:func:`_compiled_forward`); every other forward and every backward through the BLAS tiles below.

No ``S_q x S_kv`` matrix is ever built: a block is processed in tiles of at
most ``TILE_Q x TILE_KV`` scores, held in one scratch buffer per call.  Tiles
the mask hides completely are skipped; tiles it shows completely run without
an elementwise mask; tiles it hides in part run as row bands of ``BAND_Q`` rows,
each cut to its visible columns.  Parallelism comes from MPI ranks: use one BLAS thread
per rank (``OPENBLAS_NUM_THREADS=1``).
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..core.cost_model import TILE_ROWS
from ..core.dtypes import compute_dtype, is_16bit
from ..runtime.env import positive_int
from ..core.masks import FULL, SKIP, BlockMask
from ..core.modifiers import FIELDS as MODIFIER_FIELDS
from .interface import HostMessage
from . import tile_pass
from .tile_pass import ds_pass, exp_pass

TILE_Q = positive_int("RINGMPI_TILE_Q", TILE_ROWS)
TILE_KV = positive_int("RINGMPI_TILE_KV", TILE_ROWS)
# a partly hidden tile runs as row bands of this many rows, each cut to its visible columns
BAND_Q = positive_int("RINGMPI_BAND_Q", 128)
_RENORM = 2.0 ** 40  # row sums above this move the shift up (exp reaches inf only past ~2^127)
# a shifted tile whose row sum passes this had a shift lagging that row's maximum by up to
# ln(sum) (> 11): its exp arguments, rounded to float32 at that magnitude, lose the precision
# the exact path keeps (scores near their maximum), so the exact path redoes the tile
_LAG_SUM = 2.0 ** 16


def _once(resident, key, make):
    """``make()``, computed once per call when the caller passes ``resident`` (one dict
    for every block op of one call: what depends only on the resident operands), else
    on every block."""
    if resident is None:
        return make()
    if key not in resident:
        resident[key] = make()
    return resident[key]


def _scratch(resident, key, size: int, dtype):
    """A flat scratch buffer of at least ``size`` elements, reused across the blocks of a call."""
    buf = None if resident is None else resident.get(key)
    if buf is None or buf.size < size or buf.dtype != dtype:
        buf = np.empty(size, dtype=dtype)
        if resident is not None:
            resident[key] = buf
    return buf


def _tiles(n: int, size: int):
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _bands(vis, rows: slice, cols: slice, band: int):
    """A partly hidden tile as ``(rows, cols, vis)`` row bands of ``band`` rows, each
    cut to the columns between its first and last visible key (bands that see
    nothing are left out): on a causal diagonal tile, bands of a quarter of the
    tile compute 5/8 of its scores."""
    for start in range(0, vis.shape[0], band):
        v = vis[start:start + band]
        seen = np.flatnonzero(v.any(axis=0))
        if seen.size == 0:
            continue
        lo, hi = int(seen[0]), int(seen[-1]) + 1
        yield (slice(rows.start + start, rows.start + start + v.shape[0]),
               slice(cols.start + lo, cols.start + hi), v[:, lo:hi])


def _mask_bias(vis, dtype):
    """``(rows, cols)`` of ``dtype``: 0 where ``vis`` is set, -inf elsewhere, built from the
    bits of -inf (the visibility byte minus one masks them): three integer passes, 3x
    faster than a lookup by the byte and 2.5x faster than ``np.where``."""
    uint = np.dtype(f"u{np.dtype(dtype).itemsize}")
    bits = vis.view(np.uint8).astype(uint)
    bits -= 1
    bits &= np.array(-np.inf, dtype).view(uint)
    return bits.view(dtype)


class _TilePlan:
    """Tile classification and additive masks for one block, computed once.

    Iterating yields ``(rows, cols, b, bias)`` for every tile that is not
    skipped, where ``bias`` is None for fully visible tiles and otherwise a
    ``(rows, cols)`` array of 0 / -inf; ``b`` is None when the mask does not
    depend on the batch entry (no segment ids).  A partly hidden tile comes as
    row bands cut to their visible columns (:func:`_bands`); ``kv_tile`` is the
    whole key tile of what was yielded last.  ``computed`` and ``skipped``
    count the tiles iterated so far, one per (query tile, key tile, batch entry);
    :meth:`share` is the share of (query tile, key tile) pairs reached (a progress report's).
    """

    def __init__(self, mask: BlockMask, sq: int, skv: int, batch: int, dtype, kv_major: bool = False):
        self.mask, self.dtype, self.batch = mask, dtype, batch
        self.q_tiles, self.kv_tiles = _tiles(sq, TILE_Q), _tiles(skv, TILE_KV)
        self.kv_major = kv_major  # key tiles outermost: a key tile is finished before the next starts
        self.kv_tile = None
        self.computed = self.skipped = 0
        self.reached = 0

    def counts(self):
        return self.computed, self.skipped

    def share(self) -> float:
        return self.reached / max(1, len(self.q_tiles) * len(self.kv_tiles))

    def __iter__(self):
        mask, spec = self.mask, self.mask.spec
        per_batch = mask.seg_q is not None
        batches = range(self.batch) if per_batch else [None]
        entries = 1 if per_batch else self.batch
        if self.kv_major:
            pairs = ((rows, cols) for cols in self.kv_tiles for rows in self.q_tiles)
        else:
            pairs = ((rows, cols) for rows in self.q_tiles for cols in self.kv_tiles)
        for rows, cols in pairs:
            self.reached += 1
            qp, kp = mask.q_pos[rows], mask.kv_pos[cols]
            for b in batches:
                sq = mask.seg_q[b, rows] if per_batch else None
                sk = mask.seg_kv[b, cols] if per_batch else None
                kind = spec.classify(qp, kp, sq, sk)
                if kind == SKIP:
                    self.skipped += entries
                    continue
                self.computed += entries
                self.kv_tile = cols
                if kind == FULL:
                    yield rows, cols, b, None
                    continue
                for band_rows, band_cols, vis in _bands(tile_pass.visible(spec, qp, kp, sq, sk), rows, cols, BAND_Q):
                    bias = None if vis.all() else _mask_bias(vis, self.dtype)
                    yield band_rows, band_cols, b, bias


def _kv_precision(x, kv_dtype):
    """``x`` rounded to a 16-bit K/V dtype and back (what the tensor-core
    kernels multiply), or ``x`` itself for 32/64-bit K/V."""
    return x.astype(kv_dtype).astype(x.dtype) if is_16bit(kv_dtype) else x


def _cap(s, softcap):
    """``s = softcap * tanh(s / softcap)`` in place (the logit softcap)."""
    s /= softcap
    np.tanh(s, out=s)
    s *= softcap


def _scores(q_t, k_t, s, bias, scale, softcap=None):
    """``s = scale * (q . k) + bias``, in place: the tile's scores (capped before the mask
    when ``softcap`` is given)."""
    np.matmul(q_t, k_t.T, out=s)
    s *= scale
    if softcap is not None:
        _cap(s, softcap)
    if bias is not None:
        s += bias


def _shifted_tile(q_t, k_t, v_t, s, pv, sums, bias, scale, m_rows, l_rows, o_rows, fix_pv=None,
                  drop=None) -> bool:
    """One tile with the running maximum as the shift: ``exp(scale * q.k + bias - m)`` and
    its row sums in one pass after the scores' GEMM, no max pass.

    Returns False, having changed nothing, when the tile overflows or a row's sum passes
    ``_LAG_SUM`` (the shift lagged too far behind the row's maximum); the caller then takes
    the exact path.  ``fix_pv(weights, pv)``, when given, adds the
    contributions of non-finite ``v`` rows (see :func:`_careful_forward_tile`).
    ``drop``, when given, multiplies the weights after their row sums are taken
    (dropout: ``l`` stays the sum of the un-dropped weights).  ``pv (rows, D_v)``,
    ``sums (rows,)``: scratch.
    """
    np.matmul(q_t, k_t.T, out=s)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow here is expected: the exact path redoes it
        exp_pass(s, scale, bias, m_rows, sums)
        if drop is not None:
            s *= drop
        np.matmul(s, v_t, out=pv)
    if not (sums.max() <= _LAG_SUM and np.isfinite(pv).all()):  # NaN and inf fail too
        return False
    if fix_pv is not None:
        fix_pv(s, pv)
    o_rows += pv
    l_rows += sums
    big = l_rows > _RENORM
    if big.any():  # keep the state far from overflow: move the shift up to the sum
        o_rows[big] /= l_rows[big, None]
        m_rows[big] += np.log(l_rows[big])
        l_rows[big] = 1
    return True


def _exact_tile(q_t, k_t, v_t, s, pv, sums, bias, scale, m_rows, l_rows, o_rows, fix_pv=None, softcap=None,
                drop=None):
    """One tile of the classic online softmax, updating the row state in place
    (``m_rows`` stays the exact running maximum of the visible scores; ``drop``, ``pv``,
    ``sums``: as for :func:`_shifted_tile`)."""
    if bias is None and softcap is None and scale > 0:
        # a positive scale commutes with the row max (rounding is monotonic): the scale goes
        # into the exp pass, bitwise as if applied first
        np.matmul(q_t, k_t.T, out=s)
        row_max, pass_scale = s.max(axis=1) * scale, scale
    else:
        _scores(q_t, k_t, s, bias, scale, softcap)
        row_max, pass_scale = s.max(axis=1), s.dtype.type(1)
    m_new = np.maximum(m_rows, row_max)
    # rows that have seen nothing yet keep m = -inf; shift them by 0
    shift = np.where(np.isneginf(m_new), 0, m_new).astype(s.dtype, copy=False)
    exp_pass(s, pass_scale, None, shift, sums)
    if drop is not None:
        s *= drop
    np.matmul(s, v_t, out=pv)
    if fix_pv is not None:
        fix_pv(s, pv)
    alpha = np.exp(m_rows - shift)
    l_rows *= alpha
    l_rows += sums
    o_rows *= alpha[:, None]
    o_rows += pv
    m_rows[...] = m_new


def _plus(bias, extra):
    """The tile's additive terms: the mask's 0/-inf ``bias`` and a modifier's ``extra`` (either may be None)."""
    if extra is None:
        return bias
    return extra if bias is None else bias + extra


# ------------------------------------------------------------ non-finite values
# A masked key is not part of a query's sum.  Blocks with NaN/Inf somewhere take
# a careful path per tile (the clean path is untouched): the tile is computed
# on copies with the bad rows zeroed, which for every query that sees no bad
# value is bitwise the computation of a clean run, and the queries that do see
# one are then recomputed from the raw values over their visible keys only.

def _bad_rows(x):
    """``(..., S)`` bool: rows of ``x (..., S, D)`` holding a NaN or Inf.  For 32- and 16-bit
    ``x`` a row's float64 sum (finite exactly when every element is) says it without an
    ``x``-sized temporary."""
    if x.dtype.itemsize <= 4:
        return ~np.isfinite(x.sum(axis=-1, dtype=np.float64))
    return ~np.isfinite(x).all(axis=-1)


def _visible(bias, shape):
    return np.ones(shape, dtype=bool) if bias is None else bias == 0


def _visible_matmul(a, b, vis):
    """``sum_k a[i, k] * b[k, :]`` over the pairs with ``vis[i, k]`` only.

    A hidden pair adds nothing, even when ``a[i, k]`` or ``b[k]`` is NaN/Inf
    (a plain product would add ``0 * NaN``).
    """
    a = np.where(vis, a, 0).astype(a.dtype, copy=False)
    bad = _bad_rows(b)
    if not bad.any():
        return a @ b
    out = a[:, ~bad] @ b[~bad]
    terms = a[:, bad, None] * b[None, bad, :]
    out += np.where(vis[:, bad, None], terms, 0).sum(axis=1)
    return out


def clean_copy(x, bad):
    """A copy of ``x`` with the bad rows set to 0, laid out as ``x`` is: the same strides, at
    the same offset in a 64-byte line.  A BLAS call then takes on the copy the kernel it takes
    on ``x``, so every clean row is summed in the same order: OpenBLAS's AVX-512 gemv (used
    when a tile has one row or column) orders a row's sum by the matrix's leading dimension."""
    copy = _same_layout(x)
    copy[...] = x
    copy[bad] = 0
    return copy


def _same_layout(x):
    """An uninitialised array shaped, strided and 64-byte-aligned as ``x`` (a compact one
    where ``x`` has a zero or negative stride, which BLAS is never handed)."""
    if any(s <= 0 for s in x.strides) or x.size == 0:
        return np.empty_like(x)
    span = sum((n - 1) * s for n, s in zip(x.shape, x.strides)) + x.itemsize
    raw = np.empty(span + 64, dtype=np.uint8)
    start = (x.ctypes.data - raw.ctypes.data) % 64
    return np.ndarray(x.shape, x.dtype, buffer=raw, offset=start, strides=x.strides)


def _careful_forward_tile(q_t, k_t, v_t, s, pv, sums, bias, scale, m_rows, l_rows, o_rows,
                          bad_q, bad_k, bad_v, softcap=None, exact=False, drop=None, extra=None):
    """One tile when its rows or columns hold non-finite values (forward).

    ``bad_q`` (rows: a NaN/Inf in q, or a row state already non-finite),
    ``bad_k``, ``bad_v`` (columns) are bool masks.  Queries that see no bad
    value get exactly a clean run's arithmetic; queries that see a bad ``v``
    only keep the clean shift and sums and add ``p * v`` of their visible bad
    rows; the others are recomputed exactly over their visible keys.  ``extra``: the
    modifiers' additive terms (see :func:`_plus`), or None.
    """
    vis = _visible(bias, s.shape)
    full = _plus(bias, extra)
    redo = bad_q | vis[:, bad_k].any(axis=1)
    saved = m_rows[redo].copy(), l_rows[redo].copy(), o_rows[redo].copy()
    fresh = np.isneginf(saved[0]) & (saved[1] == 0)
    m_rows[redo] = np.where(fresh, -np.inf, 0)  # a clean run's path choice for this tile
    l_rows[redo] = 0
    o_rows[redo] = 0
    q_clean, k_clean, v_clean = clean_copy(q_t, bad_q), clean_copy(k_t, bad_k), clean_copy(v_t, bad_v)
    fix_pv = None
    if bad_v.any():
        see_v = vis[:, bad_v] & ~redo[:, None]
        v_raw = v_t[bad_v]

        def fix_pv(weights, pv_tile):
            terms = weights[:, bad_v, None] * v_raw[None]
            pv_tile += np.where(see_v[:, :, None], terms, 0).sum(axis=1)

    tile = (q_clean, k_clean, v_clean, s, pv, sums, full, scale, m_rows, l_rows, o_rows, fix_pv)
    if exact or not (np.isfinite(m_rows).all() and _shifted_tile(*tile, drop)):
        _exact_tile(*tile, softcap, drop)
    if not redo.any():
        return
    m_old, l_old, o_old = saved
    with np.errstate(invalid="ignore", over="ignore"):
        sc = (q_t[redo] @ k_t.T) * scale
        if softcap is not None:
            _cap(sc, softcap)
        if extra is not None:
            sc += extra[redo]
        sc = np.where(vis[redo], sc, -np.inf).astype(s.dtype, copy=False)
        m_new = np.maximum(m_old, sc.max(axis=1))
        shift = np.where(np.isneginf(m_new), 0, m_new).astype(s.dtype, copy=False)
        p = np.where(vis[redo], np.exp(sc - shift[:, None]), 0).astype(s.dtype, copy=False)
        alpha = np.exp(m_old - shift)
        l_rows[redo] = l_old * alpha + p.sum(axis=1)
        p_o = p if drop is None else (p * drop[redo]).astype(s.dtype, copy=False)
        o_rows[redo] = o_old * alpha[:, None] + _visible_matmul(p_o, v_t, vis[redo])
        # a row whose visible scores were all -inf has weight 0 so far (l = 0) but is no longer
        # fresh: a finite shift keeps later tiles on a clean run's path.  The exact path has no
        # such choice and keeps m the running maximum (-inf there, as the CUDA kernels do)
        stale = np.isneginf(m_new) & vis[redo].any(axis=1) & (not exact)
        m_rows[redo] = np.where(stale, 0, m_new)


def _careful_backward_tile(q_t, do_t, k_t, v_t, lse_t, dvec_t, p, dp, bias, scale,
                           dq_t, dk_t, dv_t, bad_rows, bad_cols, softcap=None, t=None, drop=None, extra=None,
                           scores=None):
    """One backward tile when its rows or columns hold non-finite values.

    ``bad_rows``: a NaN/Inf in q, do, lse or ``dvec``; ``bad_cols``: in k or v.
    Every query that sees a bad value (and every bad one) is left out of the
    clean-run arithmetic and its pairs are then added over visible keys only.
    ``extra``: the modifiers' additive terms, or None.
    """
    vis = _visible(bias, p.shape)
    redo = bad_rows | vis[:, bad_cols].any(axis=1)
    lse_clean = np.where(redo, np.inf, lse_t).astype(lse_t.dtype, copy=False)  # P = 0 on those rows
    dvec_clean = np.where(redo, 0, dvec_t).astype(dvec_t.dtype, copy=False)
    clean = (clean_copy(q_t, bad_rows), clean_copy(do_t, bad_rows), clean_copy(k_t, bad_cols),
             clean_copy(v_t, bad_cols), lse_clean, dvec_clean, p, dp, _plus(bias, extra), scale, dq_t, dk_t, dv_t)
    if softcap is None:
        _backward_tile(*clean, drop=drop, scores=scores)
    else:
        _softcap_backward_tile(*clean, softcap, t, drop=drop)
    if not redo.any():
        return
    vis_r = vis[redo]
    q_r, do_r = q_t[redo], do_t[redo]
    with np.errstate(invalid="ignore", over="ignore"):
        sc = (q_r @ k_t.T) * scale
        slope = 1
        if softcap is not None:
            _cap(sc, softcap)
            slope = 1 - np.square(sc / softcap)  # d(c tanh(x / c)) / dx
        if extra is not None:
            sc += extra[redo]
        p_r = np.where(vis_r, np.exp(sc - lse_t[redo, None]), 0).astype(p.dtype, copy=False)
        dp_r = do_r @ v_t.T
        p_v = p_r
        if drop is not None:
            dp_r = dp_r * drop[redo]
            p_v = (p_r * drop[redo]).astype(p.dtype, copy=False)
        ds = np.where(vis_r, p_r * (dp_r - dvec_t[redo, None]) * slope, 0).astype(p.dtype, copy=False)
        dv_t += _visible_matmul(p_v.T, do_r, vis_r.T)
        dq_t[redo] += _visible_matmul(ds, k_t, vis_r)
        dk_t += _visible_matmul(ds.T, q_r, vis_r.T)


def _backward_tile(q_t, do_t, k_t, v_t, lse_t, dvec_t, p, dp, bias, scale, dq_t, dk_t, dv_t, drop=None,
                   scores=None):
    """One backward tile, accumulating into the ``dq_t``, ``dk_t``, ``dv_t`` views in place.

    With dropout (``drop``: the tile's keep/(1-p) factors) ``dv += (P Z)^T do`` and
    ``dS = P * ((do v^T) Z - dvec)``.  ``scores(q, k, out)``, when given, computes the scores
    in place of the BLAS product: the compiled block op's, so that ``P = exp(S - lse)`` sees
    the very scores the forward's ``lse`` came from."""
    if scores is not None:
        scores(q_t, k_t, p)
    else:
        np.matmul(q_t, k_t.T, out=p)
    exp_pass(p, scale, bias, lse_t)
    if drop is None:
        dv_t += p.T @ do_t
    else:
        dv_t += (p * drop).T @ do_t
    np.matmul(do_t, v_t.T, out=dp)
    if drop is not None:
        dp *= drop
    ds_pass(dp, p, dvec_t)
    dq_t += dp @ k_t
    dk_t += dp.T @ q_t


def _softcap_backward_tile(q_t, do_t, k_t, v_t, lse_t, dvec_t, p, dp, bias, scale, dq_t, dk_t, dv_t,
                           softcap, t, drop=None):
    """:func:`_backward_tile` with the logit softcap: ``P = exp(c tanh(x / c) - lse)``
    with ``x = scale * q.k``, and ``dS`` carried through the cap's slope
    ``1 - tanh(x / c)^2`` (after dropout's factor).  ``t`` is scratch shaped like ``p``."""
    np.matmul(q_t, k_t.T, out=t)
    t *= scale
    t /= softcap
    np.tanh(t, out=t)
    np.multiply(t, softcap, out=p)
    if bias is not None:
        p += bias
    p -= lse_t[:, None]
    np.exp(p, out=p)
    dv_t += (p if drop is None else p * drop).T @ do_t
    np.matmul(do_t, v_t.T, out=dp)
    if drop is not None:
        dp *= drop
    ds_pass(dp, p, dvec_t)
    np.square(t, out=t)
    np.subtract(1, t, out=t)
    dp *= t
    dq_t += dp @ k_t
    dk_t += dp.T @ q_t


# ------------------------------------------------------------ the compiled forward block op
# The float32 forward (segment ids, the softcap, ALiBi and dropout too) runs as one
# compiled call per (batch entry, query head, key chunk of TILE_KV keys): ``_fused.fwd_chunk``
# (src/ringmpi/_ext/block_rows.h), the key chunk's K and V packed once here and reused by every
# query head of its K/V head; the call folds the chunk into the state of every query row, strip by
# strip, with no Python between its tiles (its own register-blocked products, the exact online
# softmax: each strip's row maximum taken before its exp).  Every other forward takes the BLAS tiles
# below; the backward, the compiled backward block op under the same conditions (further below).

PANEL = tile_pass.PANEL  # keys per packed K panel


def compiled_forward_ok(ct, scale, mask: BlockMask) -> bool:
    """Whether this forward block takes the compiled block op: float32, a positive scale, and at most
    one score modifier, ALiBi, with positions it measures exactly in float64."""
    return (tile_pass.block_op() is not None and ct == np.float32 and np.isfinite(scale) and scale > 0
            and _alibi_ok(mask.spec, mask))


_EXACT = 2 ** 52  # positions and offsets below this are exact in float64, their differences too


def _alibi_ok(spec, mask: BlockMask) -> bool:
    """No score modifier, or one ALiBi whose distances the block op computes exactly in float64."""
    from ..core.modifiers import Alibi

    if not spec.modifiers:
        return True
    if len(spec.modifiers) != 1 or type(spec.modifiers[0]) is not Alibi:
        return False
    reach = abs(int(spec.offset)) + max((int(np.abs(p).max()) for p in (mask.q_pos, mask.kv_pos) if len(p)), default=0)
    return reach < _EXACT


def _dropout_args(spec, mask: BlockMask, ct):
    """``dropout(b, h, cols)``: the block op's dropout argument for batch entry ``b``, head ``h`` and
    key columns ``cols`` (rules.h's ``dropout_keep`` inputs and the rescale), or None without dropout."""
    dropout = spec.dropout
    if dropout is None:
        return None
    k0, k1 = dropout.key()
    rescale = float(dropout.rescale(ct))
    q_pos = np.ascontiguousarray(mask.q_pos, dtype=np.int64)
    kv_pos = np.ascontiguousarray(mask.kv_pos, dtype=np.int64)

    def args(b: int, h: int, cols):
        return (int(k0), int(k1), dropout.row(b, h) & 0xFFFFFFFF, int(dropout.threshold), rescale, q_pos,
                np.ascontiguousarray(kv_pos[cols]))
    return args


def _alibi_args(spec, mask: BlockMask):
    """``(slopes (H,) float32, rows' positions plus N_kv - N_q, keys' positions)``, float64, for the
    block op's ALiBi, or None without it."""
    if not spec.modifiers:
        return None
    slopes = np.asarray(spec.modifiers[0].values, dtype=np.float32)
    return (slopes, (np.asarray(mask.q_pos, dtype=np.int64) + int(spec.offset)).astype(np.float64),
            np.asarray(mask.kv_pos, dtype=np.float64))


def _modified_scores(q_r, k, scale, softcap, extra):
    """Rows ``q_r`` against keys ``k`` with the score modifiers as the compiled block op applies them:
    ``(scores, tanh)``, the scores scaled, through the logit softcap (as :func:`_cap`; ``tanh`` None
    without one), then plus ``extra`` (the modifiers' terms, ALiBi's; or None): the careful rows' redo."""
    sc, t = (q_r @ k.T) * scale, None
    if softcap:
        t = np.tanh(sc / softcap)
        sc = t * softcap
    if extra is not None:
        sc = sc + extra
    return sc, t


def _dropped(x, drop, dtype):
    """``x`` times dropout's factors ``drop`` in ``dtype`` (``x`` itself without dropout)."""
    return x if drop is None else (x * drop).astype(dtype, copy=False)


def _segments(mask: BlockMask, b: int):
    """Batch entry ``b``'s segment ids of the rows and the keys as the compiled block op reads them
    (contiguous int64), or ``(None, None)`` without segment ids."""
    if mask.seg_q is None:
        return None, None
    return (np.ascontiguousarray(mask.seg_q[b], dtype=np.int64), np.ascontiguousarray(mask.seg_kv[b], dtype=np.int64))


def _pack_keys(k, v, kp, vp):
    """K ``(n, D)`` into panels of PANEL keys ``kp (panels * D, PANEL)`` (zero past ``n``), V ``(n, D_v)``
    into ``vp (n, D_vp)`` (zero past ``D_v``): the layouts fwd_chunk reads."""
    n, dim = k.shape
    panels = -(-n // PANEL)
    kp3 = kp[: panels * dim].reshape(panels, dim, PANEL)
    full = n // PANEL
    if full:
        kp3[:full] = k[: full * PANEL].reshape(full, PANEL, dim).transpose(0, 2, 1)
    if full < panels:
        kp3[full] = 0
        kp3[full, :, : n - full * PANEL] = k[full * PANEL:].T
    vp[:n, : v.shape[1]] = v
    return kp[: panels * dim], vp[:n]


def _tile_counts(mask: BlockMask, sq: int, skv: int, batch: int):
    """``(tiles computed, tiles skipped)`` as the BLAS tiles count them (one per TILE_Q x TILE_KV
    tile and batch entry, segment ids per entry): what the compiled route reports too."""
    per_batch = mask.seg_q is not None
    entries = 1 if per_batch else batch
    computed = skipped = 0
    for rows in _tiles(sq, TILE_Q):
        for cols in _tiles(skv, TILE_KV):
            for b in (range(batch) if per_batch else [None]):
                seg = (mask.seg_q[b, rows], mask.seg_kv[b, cols]) if per_batch else (None, None)
                if mask.spec.classify(mask.q_pos[rows], mask.kv_pos[cols], *seg) == SKIP:
                    skipped += entries
                else:
                    computed += entries
    return computed, skipped


def _terms_of(spec, q_pos, kv_pos, dtype, h: int):
    """Head ``h``'s score-modifier terms (ALiBi's) of those rows and keys, or None without any."""
    terms = tile_pass.modifier_terms(spec, q_pos, kv_pos, dtype)
    return None if terms is None else terms(h)


def _drop_of(spec, b: int, h: int, q_pos, kv_pos, dtype):
    """Dropout's factors of batch entry ``b``, head ``h`` over those rows and keys, or None."""
    if spec.dropout is None:
        return None
    return tile_pass.dropout_multiplier(spec.dropout, b, h, q_pos, kv_pos, dtype)


def _redo_rows_forward(q_r, k, v, scale, vis_r, m_old, l_old, o_old, softcap=0.0, extra=None, drop=None):
    """Rows that see a non-finite value, over the whole block from their raw values and visible
    keys only (as :func:`_careful_forward_tile` redoes them per tile): ``(m, l, o)`` after it.
    ``extra``: the score modifiers' terms of those rows and keys (ALiBi's), or None; ``drop``:
    dropout's factors there (on what reaches P V, after the row sums), or None."""
    sc, _ = _modified_scores(q_r, k, scale, softcap, extra)
    sc = np.where(vis_r, sc, -np.inf).astype(q_r.dtype, copy=False)
    m_new = np.maximum(m_old, sc.max(axis=1))
    shift = np.where(np.isneginf(m_new), 0, m_new).astype(q_r.dtype, copy=False)
    p = np.where(vis_r, np.exp(sc - shift[:, None]), 0).astype(q_r.dtype, copy=False)
    alpha = np.exp(m_old - shift)
    pd = _dropped(p, drop, q_r.dtype)
    return m_new, l_old * alpha + p.sum(axis=1), o_old * alpha[:, None] + _visible_matmul(pd, v, vis_r)


def _compiled_forward(q_use, kh, vh, k_use, v_use, o_acc, m, l, scale, mask: BlockMask, tick, resident,
                      bad_q, bad_k, bad_v):
    """:meth:`NumpyBackend.forward_block` through the compiled block op (see above).

    Non-finite values: as the BLAS tiles, a query that sees none gets exactly a clean run's
    arithmetic: the call runs on copies with the bad rows of q, k, v zeroed; the queries that see
    a bad q/k value or start the block with a non-finite state are then redone from their raw
    values over the block's visible keys (:func:`_redo_rows_forward`), and those that see a bad v
    row only (their shift and sums are clean) gain ``p * v`` of those rows afterwards."""
    fwd_chunk = tile_pass.block_op()
    batch, heads, sq, dim = q_use.shape
    kv_heads, skv, dim_v = k_use.shape[1], k_use.shape[2], v_use.shape[3]
    group = heads // kv_heads
    ct = q_use.dtype
    spec = mask.spec
    lo = hi = None
    if spec.positional:
        lo, hi = (np.ascontiguousarray(x) for x in spec.key_bounds(mask.q_pos))
    cap = float(spec.softcap or 0.0)
    alibi = _alibi_args(spec, mask)
    dropout = _dropout_args(spec, mask, ct)
    chunk = min(skv, TILE_KV)
    dvp = -(-dim_v // 16) * 16
    kp_size = -(-chunk // PANEL) * PANEL * dim
    kp = _scratch(resident, "kp", kp_size, ct)[:kp_size].reshape(-1, PANEL)
    vp = _scratch(resident, "vp", chunk * dvp, ct)[: chunk * dvp].reshape(chunk, dvp)
    vp[:, dim_v:] = 0
    key_chunks = _tiles(skv, TILE_KV)
    total = max(1, batch * heads * len(key_chunks))
    done = 0
    for b in range(batch):
        seg_q, seg_kv = _segments(mask, b)
        for kvh in range(kv_heads):
            bk, bv = bad_k[b, kvh], bad_v[b, kvh]
            k_src = clean_copy(k_use[b, kvh], bk) if bk.any() else k_use[b, kvh]
            v_src = clean_copy(v_use[b, kvh], bv) if bv.any() else v_use[b, kvh]
            careful = {}
            for h in range(kvh * group, (kvh + 1) * group):
                rows_bad = bad_q[b, h] | np.isnan(l[b, h]) | np.isnan(m[b, h]) | np.isposinf(m[b, h])
                if not (rows_bad.any() or bk.any() or bv.any()):
                    continue
                cols = np.flatnonzero(bk | bv)
                vis_bad = tile_pass.visible(spec, mask.q_pos, mask.kv_pos[cols], seg_q,
                                            None if seg_kv is None else seg_kv[cols])
                redo = rows_bad | vis_bad[:, bk[cols]].any(axis=1)
                see_v = vis_bad[:, bv[cols]] & ~redo[:, None]
                idx = np.flatnonzero(redo)
                careful[h] = (idx, see_v, (m[b, h, idx].copy(), l[b, h, idx].copy(), o_acc[b, h, idx].copy()))
                m[b, h, idx], l[b, h, idx], o_acc[b, h, idx] = -np.inf, 0, 0
            q_src = {h: (clean_copy(q_use[b, h], np.isin(np.arange(sq), careful[h][0])) if h in careful and
                         careful[h][0].size else q_use[b, h]) for h in range(kvh * group, (kvh + 1) * group)}
            for cols in key_chunks:
                nk = cols.stop - cols.start
                kpc, vpc = _pack_keys(k_src[cols], v_src[cols], kp, vp)
                kv_pos = np.ascontiguousarray(mask.kv_pos[cols]) if lo is not None else None
                seg_c = None if seg_kv is None else seg_kv[cols]
                hidden = (lo is not None or seg_q is not None) and spec.classify(
                    mask.q_pos, mask.kv_pos[cols], seg_q, seg_c) == SKIP
                alibi_kv = None if alibi is None else np.ascontiguousarray(alibi[2][cols])
                for h in range(kvh * group, (kvh + 1) * group):
                    if not hidden:
                        fwd_chunk(q_src[h], kpc, vpc, nk, o_acc[b, h], m[b, h], l[b, h], scale, lo, hi, kv_pos, seg_q,
                                  seg_c, cap, None if alibi is None else (float(alibi[0][h]), alibi[1], alibi_kv),
                                  None if dropout is None else dropout(b, h, cols))
                    done += 1
                    if tick is not None:  # every few ms: an MPI without a progress thread moves data only here
                        tick(done / total)
            for h, (idx, see_v, (m_old, l_old, o_old)) in careful.items():
                with np.errstate(invalid="ignore", over="ignore"):
                    if idx.size:
                        vis_r = tile_pass.visible(spec, mask.q_pos[idx], mask.kv_pos,
                                                  None if seg_q is None else seg_q[idx], seg_kv)
                        extra = _terms_of(spec, mask.q_pos[idx], mask.kv_pos, ct, h)
                        drop = _drop_of(spec, b, h, mask.q_pos[idx], mask.kv_pos, ct)
                        m[b, h, idx], l[b, h, idx], o_acc[b, h, idx] = _redo_rows_forward(
                            q_use[b, h, idx], k_use[b, kvh], v_use[b, kvh], scale, vis_r, m_old, l_old, o_old, cap,
                            extra, drop)
                    if see_v.any():  # clean m and l; the bad v rows' weights against the final shift
                        rows = np.flatnonzero(see_v.any(axis=1))
                        bad_cols = np.flatnonzero(bv)
                        sc, _ = _modified_scores(q_use[b, h, rows], k_use[b, kvh, bad_cols], scale, cap,
                                                 _terms_of(spec, mask.q_pos[rows], mask.kv_pos[bad_cols], ct, h))
                        shift = np.where(np.isneginf(m[b, h, rows]), 0, m[b, h, rows]).astype(ct, copy=False)
                        drop = _drop_of(spec, b, h, mask.q_pos[rows], mask.kv_pos[bad_cols], ct)
                        weights = _dropped(np.exp(sc - shift[:, None]).astype(ct, copy=False), drop, ct)
                        terms = weights[:, :, None] * v_use[b, kvh, bad_cols][None]
                        o_acc[b, h, rows] += np.where(see_v[rows][:, :, None], terms, 0).sum(axis=1)
    return _tile_counts(mask, sq, skv, batch)


# ------------------------------------------------------------ the compiled backward block op
# The same common float32 case's backward (and only where no row or key of the call holds a NaN or
# Inf) runs as one compiled call
# per (key chunk of BWD_CHUNK keys, batch entry, query head): ``_fused.bwd_chunk``
# (src/ringmpi/_ext/block_rows.h), FlashAttention-2's order: the chunk's dK, dV resident while the
# query strips stream past, P = exp(S - lse) from the forward's very scores (the same Q K^T chain
# as fwd_chunk), dS, and every product register-blocked, each element one chain of fused
# multiply-adds in a fixed order: the same bits on every vector path.  Non-finite values as the BLAS
# tiles' careful path handles them, per key tile: the calls run on copies with the bad rows of q, do,
# k, v zeroed and P = 0 (lse = +inf, dvec = 0) on every query row that is bad or sees a bad key of
# the tile, so a query that sees none gets exactly a clean run's arithmetic; those rows' terms are
# then added from their raw values over the tile's visible keys only (:func:`_redo_rows_backward`).

BWD_CHUNK = positive_int("RINGMPI_BWD_CHUNK", 512)  # keys per bwd_chunk call (inside a TILE_KV key tile)


def _redo_rows_backward(idx, q, do, k, v, lse, dvec, scale, vis_r, dq, dk_t, dv_t, softcap=0.0, extra=None,
                        drop=None):
    """The terms of the query rows ``idx`` (bad, or seeing a bad key) over one key tile, from their
    raw values and visible keys only (as :func:`_careful_backward_tile` adds them; ``extra``,
    ``drop``: the score modifiers' terms and dropout's factors, as :func:`_redo_rows_forward`'s)."""
    q_r, do_r = q[idx], do[idx]
    with np.errstate(invalid="ignore", over="ignore"):
        sc, t = _modified_scores(q_r, k, scale, softcap, extra)
        p_r = np.where(vis_r, np.exp(sc - lse[idx, None]), 0).astype(q.dtype, copy=False)
        dp_r = do_r @ v.T
        dp_r = _dropped(dp_r, drop, q.dtype)
        ds = np.where(vis_r, p_r * (dp_r - dvec[idx, None]), 0).astype(q.dtype, copy=False)
        if t is not None:  # through the cap's slope
            ds = (ds * (1 - t * t)).astype(q.dtype, copy=False)
        pd = _dropped(p_r, drop, q.dtype)
        dv_t += _visible_matmul(pd.T, do_r, vis_r.T)
        dq[idx] += _visible_matmul(ds, k, vis_r)
        dk_t += _visible_matmul(ds.T, q_r, vis_r.T)


def _compiled_backward(qh, doh, lse_use, dvec, kh, vh, dq, scale, mask: BlockMask, tick, sums, bad_rows, bad_cols):
    """:meth:`NumpyBackend.backward_block` through the compiled block op (see above)."""
    bwd_chunk = tile_pass.backward_op()
    batch, heads, sq, _ = qh.shape
    kv_heads, skv = kh.shape[1], kh.shape[2]
    group = heads // kv_heads
    spec = mask.spec
    lo = hi = None
    if spec.positional:
        lo, hi = (np.ascontiguousarray(x) for x in spec.key_bounds(mask.q_pos))
    cap = float(spec.softcap or 0.0)
    alibi = _alibi_args(spec, mask)
    dropout = _dropout_args(spec, mask, qh.dtype)
    key_tiles = _tiles(skv, TILE_KV)
    total = max(1, batch * heads * len(key_tiles))
    done = 0
    segs = [_segments(mask, b) for b in range(batch)]
    lse_c = [[np.ascontiguousarray(lse_use[b, h]) for h in range(heads)] for b in range(batch)]
    dvec_c = [[np.ascontiguousarray(dvec[b, h]) for h in range(heads)] for b in range(batch)]
    q_c = [[clean_copy(qh[b, h], bad_rows[b, h]) if bad_rows[b, h].any() else qh[b, h] for h in range(heads)]
           for b in range(batch)]
    do_c = [[clean_copy(doh[b, h], bad_rows[b, h]) if bad_rows[b, h].any() else doh[b, h] for h in range(heads)]
            for b in range(batch)]
    for tile in key_tiles:
        sums.begin(tile)
        # per (b, h): the rows redone from raw values over this key tile, and the lse, dvec the calls see
        redo, row_terms, k_c, v_c = {}, {}, {}, {}
        for b in range(batch):
            for kvh in range(kv_heads):
                bc = bad_cols[b, kvh, tile]
                k_c[b, kvh] = clean_copy(kh[b, kvh, tile], bc) if bc.any() else kh[b, kvh, tile]
                v_c[b, kvh] = clean_copy(vh[b, kvh, tile], bc) if bc.any() else vh[b, kvh, tile]
            for h in range(heads):
                bc = bad_cols[b, h // group, tile]
                rows = bad_rows[b, h].copy()
                if bc.any():
                    seg_q, seg_kv = segs[b]
                    rows |= tile_pass.visible(spec, mask.q_pos, mask.kv_pos[tile][bc], seg_q,
                                              None if seg_kv is None else seg_kv[tile][bc]).any(axis=1)
                if rows.any():
                    redo[b, h] = np.flatnonzero(rows)
                    row_terms[b, h] = (np.where(rows, np.inf, lse_c[b][h]).astype(lse_use.dtype),
                                       np.where(rows, 0, dvec_c[b][h]).astype(dvec.dtype))
        for start in range(tile.start, tile.stop, BWD_CHUNK):
            cols = slice(start, min(start + BWD_CHUNK, tile.stop))
            sub = slice(start - tile.start, cols.stop - tile.start)
            kv_pos = np.ascontiguousarray(mask.kv_pos[cols]) if lo is not None else None
            if lo is not None and spec.classify(mask.q_pos, mask.kv_pos[cols]) == SKIP:
                continue
            alibi_kv = None if alibi is None else np.ascontiguousarray(alibi[2][cols])
            for b in range(batch):
                if segs[b][0] is not None and spec.classify(mask.q_pos, mask.kv_pos[cols], segs[b][0],
                                                           segs[b][1][cols]) == SKIP:
                    continue  # hidden by segment ids in this batch entry
                for h in range(heads):
                    kvh = h // group
                    dk_t, dv_t = sums.views(b, kvh, cols)
                    lse_h, dvec_h = row_terms.get((b, h), (lse_c[b][h], dvec_c[b][h]))
                    seg_q, seg_kv = segs[b]
                    bwd_chunk(q_c[b][h], do_c[b][h], k_c[b, kvh][sub], v_c[b, kvh][sub], lse_h, dvec_h,
                              dq[b, h], dk_t, dv_t, scale, lo, hi, kv_pos, seg_q,
                              None if seg_kv is None else seg_kv[cols], cap,
                              None if alibi is None else (float(alibi[0][h]), alibi[1], alibi_kv),
                              None if dropout is None else dropout(b, h, cols))
                    if tick is not None:  # every few ms: an MPI without a progress thread moves data only here
                        tick(min(1.0, (done + (b * heads + h + 1) * (cols.stop - tile.start) / (tile.stop - tile.start))
                                 / total))
        done += batch * heads
        for (b, h), idx in redo.items():
            kvh = h // group
            dk_t, dv_t = sums.views(b, kvh, tile)
            seg_q, seg_kv = segs[b]
            vis_r = tile_pass.visible(spec, mask.q_pos[idx], mask.kv_pos[tile], None if seg_q is None else seg_q[idx],
                                      None if seg_kv is None else seg_kv[tile])
            _redo_rows_backward(idx, qh[b, h], doh[b, h], kh[b, kvh, tile], vh[b, kvh, tile], lse_c[b][h],
                                dvec_c[b][h], scale, vis_r, dq[b, h], dk_t, dv_t, cap,
                                _terms_of(spec, mask.q_pos[idx], mask.kv_pos[tile], qh.dtype, h),
                                _drop_of(spec, b, h, mask.q_pos[idx], mask.kv_pos[tile], qh.dtype))
    sums.end(skv)
    return _tile_counts(mask, sq, skv, batch)


class _KeyTileSums:
    """Where a backward block op adds its ``dK, dV`` terms, one key tile at a time.

    Without ``kv_need``: straight into ``dk, dv``.  With it (host memory, where ``dk, dv``
    hold the partial sums of the ranks before, still arriving): into a zeroed scratch of one
    key tile, added onto ``dk, dv`` once the tile is done and its rows have arrived
    (``kv_need``), so a partial sum is needed only at the end of its key tile.  Either way
    a row gets this block's terms summed in the same order, then the partial sums added:
    bitwise what a zeroed ``dk, dv`` with the partial sums added after gives.  ``kv_done(n)``
    is called as rows ``[0, n)`` become final.
    """

    def __init__(self, dk, dv, dtype, resident=None, kv_need=None, kv_done=None):
        self.dk, self.dv, self.kv_need, self.kv_done = dk, dv, kv_need, kv_done
        self.key, self.final = None, 0
        if kv_need is not None:
            batch, kv_heads, skv = dk.shape[:3]
            size = batch * kv_heads * min(skv, TILE_KV)
            self.acc = [_scratch(resident, ("acc", i), size * x.shape[3], dtype) for i, x in enumerate((dk, dv))]

    def begin(self, key: slice) -> None:
        """Key tile ``key`` is the one the next terms go to (the one before it is done)."""
        if self.key is not None and self.key.start == key.start:
            return
        self._add_tile()
        if self.kv_done is not None and key.start > self.final:
            self.final = key.start
            self.kv_done(self.final)
        self.key = key
        if self.kv_need is not None:
            rows = key.stop - key.start
            self.tiles = [a[: x.shape[0] * x.shape[1] * rows * x.shape[3]].reshape(x.shape[:2] + (rows, x.shape[3]))
                          for a, x in zip(self.acc, (self.dk, self.dv))]
            for t in self.tiles:
                t[...] = 0

    def views(self, b: int, kvh: int, cols: slice):
        """The ``(dk, dv)`` views to add the terms of key columns ``cols`` (inside the tile) into."""
        if self.kv_need is None:
            return self.dk[b, kvh, cols], self.dv[b, kvh, cols]
        lo, hi = cols.start - self.key.start, cols.stop - self.key.start
        return self.tiles[0][b, kvh, lo:hi], self.tiles[1][b, kvh, lo:hi]

    def _add_tile(self) -> None:
        if self.key is None or self.kv_need is None:
            return
        self.kv_need(self.key.stop)
        self.dk[:, :, self.key] += self.tiles[0]
        self.dv[:, :, self.key] += self.tiles[1]

    def end(self, skv: int) -> None:
        """The block is done: its last key tile added, every row final."""
        self._add_tile()
        self.key = None
        if self.kv_done is not None:
            self.kv_done(skv)


class NumpyBackend:
    """The CPU block kernels (see :mod:`ringmpi.backends` for the interface)."""

    name = "numpy"
    xp = np
    MODIFIERS = MODIFIER_FIELDS  # the score modifiers with per-head data it applies: all of them

    @staticmethod
    def compute_dtype(dtype) -> np.dtype:
        return compute_dtype(dtype)

    @staticmethod
    def asarray(x):
        return np.asarray(x)

    @staticmethod
    def to_heads(x, dtype):
        # always a copy: callers scale it in place
        return np.array(np.asarray(x).transpose(0, 2, 1, 3), dtype=dtype, order="C", copy=True)

    @staticmethod
    def heads_view(x, dtype):
        """``x (B, S, H, D)`` as ``(B, H, S, D)`` in ``dtype``, read only: a view when ``x`` has
        that dtype and unit stride along ``D`` (the GEMMs read its strided rows), else a copy."""
        x = np.asarray(x)
        item = x.itemsize
        if x.dtype == dtype and x.strides[3] == item and all(st % item == 0 for st in x.strides):
            return x.transpose(0, 2, 1, 3)
        return NumpyBackend.to_heads(x, dtype)

    @staticmethod
    def from_heads(xh, dtype):
        return np.array(xh.transpose(0, 2, 1, 3), dtype=dtype, order="C", copy=True)

    @staticmethod
    def row_dot(x, y):
        """``(x * y).sum(-1)``: ``(B, H, S, D)`` twice -> ``(B, H, S)``, same dtype."""
        return (x * y).sum(axis=-1)

    @staticmethod
    def message(nbytes: int) -> HostMessage:
        return HostMessage(nbytes)

    @staticmethod
    def synchronize(tick=None) -> None:
        pass

    @staticmethod
    def annotate(name: str):
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ forward
    def forward_block(self, qh, kh, vh, o_acc, m, l, scale, mask: BlockMask, tick=None, resident=None):
        """Fold one block into the online softmax; return ``(tiles computed, tiles skipped)``.

        Each tile's weights are ``exp(scale * q.k + bias - m)`` with ``m`` the row's running
        maximum so far, made with their row sums in one pass after the scores' GEMM (no max
        or subtract pass), then ``o += weights @ v``.  The shift may lag the true maximum:
        weights above 1 are fine in floating point, rows whose sum grows large are
        renormalised, and a tile that overflows (or a row with no shift yet) takes the
        exact path: row max, subtract, exp, rescale.  The operands are read where they lie
        (strided views: no copies of ``q`` or the block); 16-bit K/V are widened once per block.

        ``resident``: a dict shared by every block of one call (see :func:`_once`): the
        rounded ``q``, its NaN/Inf scan and the scratch tiles are made on the first block only.
        """
        batch, heads, sq, _ = qh.shape
        kv_heads, skv = kh.shape[1], kh.shape[2]
        dim_v = vh.shape[3]
        if sq == 0 or skv == 0:
            return 0, 0
        ct = qh.dtype
        q_use = _once(resident, ("q", kh.dtype), lambda: _kv_precision(qh, kh.dtype))
        k_use = kh if kh.dtype == ct else kh.astype(ct)
        v_use = vh if vh.dtype == ct else vh.astype(ct)
        group = heads // kv_heads
        scale = ct.type(scale)
        # the resident q is scanned once per call, the visiting block once per block:
        # rows with NaN/Inf (or a state made non-finite by them)
        bad_q = _once(resident, "bad_q", lambda: _bad_rows(qh)) | np.isnan(l) | np.isnan(m) | np.isposinf(m)
        bad_k, bad_v = _bad_rows(kh), _bad_rows(vh)
        if compiled_forward_ok(ct, scale, mask):
            return _compiled_forward(q_use, kh, vh, k_use, v_use, o_acc, m, l, scale, mask, tick, resident,
                                     bad_q, bad_k, bad_v)
        rows_max = min(sq, TILE_Q)
        scratch = _scratch(resident, "s", rows_max * min(skv, TILE_KV), ct)
        pv_scratch = _scratch(resident, "pv", rows_max * dim_v, ct)
        sums_scratch = _scratch(resident, "sums", rows_max, ct)
        careful = bool(bad_q.any() or bad_k.any() or bad_v.any())
        softcap = None if mask.spec.softcap is None else ct.type(mask.spec.softcap)
        exact = softcap is not None or mask.spec.exact_max  # no lagging shift: scores are capped first
        dropout = mask.spec.dropout
        tiles = _TilePlan(mask, sq, skv, batch, ct)
        for rows, cols, bsel, bias in tiles:
            nq, nk = rows.stop - rows.start, cols.stop - cols.start
            s = scratch[: nq * nk].reshape(nq, nk)
            pv = pv_scratch[: nq * dim_v].reshape(nq, dim_v)
            sums = sums_scratch[:nq]
            terms = tile_pass.modifier_terms(mask.spec, mask.q_pos[rows], mask.kv_pos[cols], ct)
            for b in (range(batch) if bsel is None else (bsel,)):
                for h in range(heads):
                    kvh = h // group
                    extra = None if terms is None else terms(h)
                    full = _plus(bias, extra)
                    q_t, k_t, v_t = q_use[b, h, rows], k_use[b, kvh, cols], v_use[b, kvh, cols]
                    m_rows, l_rows, o_rows = m[b, h, rows], l[b, h, rows], o_acc[b, h, rows]
                    drop = None if dropout is None else tile_pass.dropout_multiplier(
                        dropout, b, h, mask.q_pos[rows], mask.kv_pos[cols], ct)
                    if careful:  # a state can turn non-finite within this block: look again
                        bad_rows = bad_q[b, h, rows] | np.isnan(l_rows) | np.isnan(m_rows) | np.isposinf(m_rows)
                    if careful and (bad_rows.any() or bad_k[b, kvh, cols].any() or bad_v[b, kvh, cols].any()):
                        with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf are expected here
                            _careful_forward_tile(q_t, k_t, v_t, s, pv, sums, bias, scale, m_rows, l_rows,
                                                  o_rows, bad_rows, bad_k[b, kvh, cols], bad_v[b, kvh, cols],
                                                  softcap, exact, drop, extra)
                    elif exact or not (np.isfinite(m_rows).all() and _shifted_tile(
                            q_t, k_t, v_t, s, pv, sums, full, scale, m_rows, l_rows, o_rows, drop=drop)):
                        _exact_tile(q_t, k_t, v_t, s, pv, sums, full, scale, m_rows, l_rows, o_rows,
                                    softcap=softcap, drop=drop)
                    if tick is not None:  # every ~ms: an MPI without a progress thread moves data only here
                        tick(tiles.share())
        return tiles.counts()

    @staticmethod
    def finalize(o_acc, m, l, out_dtype):
        seen = l != 0  # a NaN sum (the row saw NaN/Inf) is seen: o and lse come out NaN
        safe_l = np.where(seen, l, 1.0)
        o = o_acc / safe_l[..., None]
        o[~seen] = 0.0
        with np.errstate(divide="ignore"):
            lse = np.where(seen, m + np.log(safe_l), -np.inf).astype(l.dtype, copy=False)
        return np.ascontiguousarray(o.transpose(0, 2, 1, 3), dtype=out_dtype), lse

    # ----------------------------------------------------------------- backward
    def backward_block(self, qh, doh, lse, dvec, kh, vh, dq, dk, dv, scale, mask: BlockMask, tick=None,
                       resident=None, kv_need=None, kv_done=None):
        """Accumulate one block's gradients; return ``(tiles computed, tiles skipped)``.

        ``resident``: as for :meth:`forward_block` (the rounded ``q, do``, ``lse`` and their scan).
        Key tiles are the outer loop, so ``dk, dv`` are final one key tile at a time
        (``kv_done``; with ``kv_need`` each key tile's terms are summed in scratch first, see
        :class:`_KeyTileSums`); every accumulator still adds its terms in the order of a
        query-tile-major loop (``dq`` over key tiles, ``dk, dv`` over query tiles then heads).
        """
        batch, heads, sq, _ = qh.shape
        kv_heads, skv = kh.shape[1], kh.shape[2]
        if sq == 0 or skv == 0:
            if kv_done is not None:
                kv_done(skv)
            return 0, 0
        ct = qh.dtype
        qh = _once(resident, ("q", kh.dtype), lambda: _kv_precision(qh, kh.dtype))
        doh = _once(resident, ("do", kh.dtype), lambda: _kv_precision(doh, kh.dtype))
        kh = kh if kh.dtype == ct else kh.astype(ct)
        vh = vh if vh.dtype == ct else vh.astype(ct)
        group = heads // kv_heads
        scale = ct.type(scale)
        # P = exp(S - lse) with lse = +inf on rows that saw nothing gives P = 0
        lse_use = _once(resident, "lse", lambda: np.where(np.isneginf(lse), np.inf, lse).astype(ct, copy=False))
        # rows with NaN/Inf in q, do, lse or dvec (scanned once per call); keys with NaN/Inf
        # in k or v (once per block)
        bad_rows = _once(resident, "bad_rows", lambda: _bad_rows(qh) | _bad_rows(doh) | np.isnan(lse_use)
                         | ~np.isfinite(dvec))
        bad_cols = _bad_rows(kh) | _bad_rows(vh)
        careful = bool(bad_rows.any() or bad_cols.any())
        compiled = compiled_forward_ok(ct, scale, mask)
        if compiled and tile_pass.backward_op() is not None and all(x.dtype == ct for x in (dq, dk, dv, dvec)):
            sums = _KeyTileSums(dk, dv, ct, resident, kv_need, kv_done)
            return _compiled_backward(qh, doh, lse_use, dvec, kh, vh, dq, scale, mask, tick, sums, bad_rows,
                                      bad_cols)
        size = min(sq, TILE_Q) * min(skv, TILE_KV)
        scratch_p, scratch_dp = _scratch(resident, "p", size, ct), _scratch(resident, "dp", size, ct)
        softcap = None if mask.spec.softcap is None else ct.type(mask.spec.softcap)
        scratch_t = None if softcap is None else _scratch(resident, "t", size, ct)
        dropout = mask.spec.dropout
        # where the forward took the compiled block op, the backward's scores are its scores, bit
        # for bit (its P then matches the forward's lse, the softcap's tanh to a few ulp; the rest
        # stays on BLAS)
        scores = tile_pass.compiled.scores if compiled else None
        tiles = _TilePlan(mask, sq, skv, batch, ct, kv_major=True)
        sums = _KeyTileSums(dk, dv, ct, resident, kv_need, kv_done)
        for rows, cols, bsel, bias in tiles:
            sums.begin(tiles.kv_tile)
            nq, nk = rows.stop - rows.start, cols.stop - cols.start
            p = scratch_p[: nq * nk].reshape(nq, nk)
            dp = scratch_dp[: nq * nk].reshape(nq, nk)
            t = None if softcap is None else scratch_t[: nq * nk].reshape(nq, nk)
            terms = tile_pass.modifier_terms(mask.spec, mask.q_pos[rows], mask.kv_pos[cols], ct)
            for b in (range(batch) if bsel is None else (bsel,)):
                for h in range(heads):
                    kvh = h // group
                    extra = None if terms is None else terms(h)
                    operands = (qh[b, h, rows], doh[b, h, rows], kh[b, kvh, cols], vh[b, kvh, cols],
                                lse_use[b, h, rows], dvec[b, h, rows], p, dp)
                    outs = (scale, dq[b, h, rows]) + sums.views(b, kvh, cols)
                    args = operands + (_plus(bias, extra),) + outs
                    drop = None if dropout is None else tile_pass.dropout_multiplier(
                        dropout, b, h, mask.q_pos[rows], mask.kv_pos[cols], ct)
                    if careful and (bad_rows[b, h, rows].any() or bad_cols[b, kvh, cols].any()):
                        with np.errstate(invalid="ignore", over="ignore"):
                            _careful_backward_tile(*operands, bias, *outs, bad_rows[b, h, rows],
                                                   bad_cols[b, kvh, cols], softcap, t, drop, extra, scores)
                    elif softcap is not None:
                        _softcap_backward_tile(*args, softcap, t, drop=drop)
                    else:
                        _backward_tile(*args, drop=drop, scores=scores)
                    if tick is not None:
                        tick(tiles.share())
        sums.end(skv)
        return tiles.counts()

    # ----------------------------------------------------------- invariant=True
    # the block ops of the invariant mode (fixed global tile pairs, fixed-point sums):
    # ringmpi.backends.invariant_tiles, driven by ringmpi.parallel.invariant_passes
    INVARIANT = True

    @staticmethod
    def invariant_resident(qh, positions, seg, kv_dtype, ct, spec, do=None, lse=None, dvec=None):
        """The call's resident rows as global tiles (:class:`ringmpi.backends.invariant_tiles.Resident`)."""
        from .invariant_tiles import Resident
        return Resident(positions, seg, qh, kv_dtype, ct, spec, exp_pass, ds_pass, do=do, lse=lse, dvec=dvec)

    @staticmethod
    def invariant_max_block(*args, **kwargs):
        """:func:`ringmpi.backends.invariant_tiles.max_block`."""
        from .invariant_tiles import max_block
        return max_block(*args, **kwargs)

    @staticmethod
    def invariant_forward_block(*args, **kwargs):
        """:func:`ringmpi.backends.invariant_tiles.forward_block`."""
        from .invariant_tiles import forward_block
        return forward_block(*args, **kwargs)

    @staticmethod
    def invariant_backward_block(*args, **kwargs):
        """:func:`ringmpi.backends.invariant_tiles.backward_block`."""
        from .invariant_tiles import backward_block
        return backward_block(*args, **kwargs)
