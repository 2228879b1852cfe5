"""CPU backend: tiled BLAS GEMMs and an in-place online softmax.

No ``S_q x S_kv`` matrix is ever built: a block is processed in tiles of at
most ``TILE_Q x TILE_KV`` scores, held in one scratch buffer per call.  Tiles
the mask hides completely are skipped; tiles it shows completely run without
an elementwise mask.  Parallelism comes from MPI ranks: use one BLAS thread
per rank (``OPENBLAS_NUM_THREADS=1``).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from ..dtypes import compute_dtype, is_16bit
from ..masks import FULL, SKIP, BlockMask
from . import HostMessage

TILE_Q = int(os.environ.get("RINGMPI_TILE_Q", "512"))
TILE_KV = int(os.environ.get("RINGMPI_TILE_KV", "512"))
_RENORM = 2.0 ** 40  # row sums above this move the shift up (exp reaches inf only past ~2^127)


def _tiles(n: int, size: int):
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


class _TilePlan:
    """Tile classification and additive masks for one block, computed once.

    Iterating yields ``(rows, cols, b, bias)`` for every tile that is not
    skipped, where ``bias`` is None for fully visible tiles and otherwise a
    ``(rows, cols)`` array of 0 / -inf; ``b`` is None when the mask does not
    depend on the batch entry (no segment ids).  ``computed`` and ``skipped``
    count the tiles iterated so far, one per (query tile, key tile, batch entry).
    """

    def __init__(self, mask: BlockMask, sq: int, skv: int, batch: int, dtype):
        self.mask, self.dtype, self.batch = mask, dtype, batch
        self.q_tiles, self.kv_tiles = _tiles(sq, TILE_Q), _tiles(skv, TILE_KV)
        self.computed = self.skipped = 0

    def counts(self):
        return self.computed, self.skipped

    def __iter__(self):
        mask, spec = self.mask, self.mask.spec
        per_batch = mask.seg_q is not None
        batches = range(self.batch) if per_batch else [None]
        entries = 1 if per_batch else self.batch
        for rows in self.q_tiles:
            qp = mask.q_pos[rows]
            for cols in self.kv_tiles:
                kp = mask.kv_pos[cols]
                for b in batches:
                    sq = mask.seg_q[b, rows] if per_batch else None
                    sk = mask.seg_kv[b, cols] if per_batch else None
                    kind = spec.classify(qp, kp, sq, sk)
                    if kind == SKIP:
                        self.skipped += entries
                        continue
                    self.computed += entries
                    bias = None
                    if kind != FULL:
                        vis = spec.visible(qp, kp, sq, sk)
                        bias = np.where(vis, 0.0, -np.inf).astype(self.dtype)
                    yield rows, cols, b, bias


def _kv_precision(x, kv_dtype):
    """``x`` rounded to a 16-bit K/V dtype and back (what the tensor-core
    kernels multiply), or ``x`` itself for 32/64-bit K/V."""
    return x.astype(kv_dtype).astype(x.dtype) if is_16bit(kv_dtype) else x


def _extend(x, fill, dtype=None):
    """``x (..., D)`` with one more last column set to ``fill``, as a new array."""
    out = np.empty(x.shape[:-1] + (x.shape[-1] + 1,), dtype=dtype or x.dtype)
    out[..., :-1] = x
    out[..., -1] = fill
    return out


def _scores(qe, ke, s, bias, scale, shift_column, dim):
    """``s = scale * ([q, shift_column] . [k, 1]) + bias``, in place: the tile's scores."""
    qe[:, dim] = shift_column
    np.matmul(qe, ke.T, out=s)
    s *= scale
    if bias is not None:
        s += bias


def _shifted_tile(qe, ke, ve, s, pv, bias, scale, m_rows, l_rows, o_rows, dim) -> bool:
    """One tile with the running maximum as the shift, folded into the GEMM.

    Returns False, having changed nothing, when the tile overflows; the caller
    then takes the exact path.
    """
    _scores(qe, ke, s, bias, scale, -m_rows / scale, dim)
    np.exp(s, out=s)
    np.matmul(s, ve, out=pv)
    if not np.isfinite(pv).all():
        return False
    o_rows += pv[:, :dim]
    l_rows += pv[:, dim]
    big = l_rows > _RENORM
    if big.any():  # keep the state far from overflow: move the shift up to the sum
        o_rows[big] /= l_rows[big, None]
        m_rows[big] += np.log(l_rows[big])
        l_rows[big] = 1
    return True


def _exact_tile(qe, ke, ve, s, pv, bias, scale, m_rows, l_rows, o_rows, dim):
    """One tile of the classic online softmax, updating the row state in place."""
    _scores(qe, ke, s, bias, scale, 0, dim)
    m_new = np.maximum(m_rows, s.max(axis=1))
    # rows that have seen nothing yet keep m = -inf; shift them by 0
    shift = np.where(np.isneginf(m_new), 0, m_new).astype(s.dtype, copy=False)
    s -= shift[:, None]
    np.exp(s, out=s)
    np.matmul(s, ve, out=pv)
    alpha = np.exp(m_rows - shift)
    l_rows *= alpha
    l_rows += pv[:, dim]
    o_rows *= alpha[:, None]
    o_rows += pv[:, :dim]
    m_rows[...] = m_new


class NumpyBackend:
    """The CPU block kernels (see :mod:`ringmpi.backends` for the interface)."""

    name = "numpy"
    xp = np

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
    def from_heads(xh, dtype):
        return np.array(xh.transpose(0, 2, 1, 3), dtype=dtype, order="C", copy=True)

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
    def forward_block(self, qh, kh, vh, o_acc, m, l, scale, mask: BlockMask, tick=None):
        """Fold one block into the online softmax; return ``(tiles computed, tiles skipped)``.

        Each tile's scores come from one GEMM of ``[q, c]`` with ``[k, 1]`` where
        ``c = -m / scale`` holds the row's running maximum, so ``exp`` runs straight
        on ``scale * s`` (no max or subtract pass), and ``exp(S) @ [v, 1]`` gives the
        output and the row sums in one GEMM.  The shift may lag the true maximum:
        weights above 1 are fine in floating point, rows whose sum grows large are
        renormalised, and a tile that overflows (or a row with no shift yet) takes
        the exact path: row max, subtract, exp, rescale.
        """
        batch, heads, sq, dim = qh.shape
        kv_heads, skv = kh.shape[1], kh.shape[2]
        if sq == 0 or skv == 0:
            return 0, 0
        ct = qh.dtype
        q_ext, k_ext, v_ext = _extend(_kv_precision(qh, kh.dtype), 0), _extend(kh, 1, ct), _extend(vh, 1, ct)
        group = heads // kv_heads
        scale = ct.type(scale)
        scratch = np.empty(min(sq, TILE_Q) * min(skv, TILE_KV), dtype=ct)
        pv_scratch = np.empty(min(sq, TILE_Q) * (dim + 1), dtype=ct)
        tiles = _TilePlan(mask, sq, skv, batch, ct)
        for rows, cols, bsel, bias in tiles:
            nq, nk = rows.stop - rows.start, cols.stop - cols.start
            s = scratch[: nq * nk].reshape(nq, nk)
            pv = pv_scratch[: nq * (dim + 1)].reshape(nq, dim + 1)
            for b in (range(batch) if bsel is None else (bsel,)):
                for h in range(heads):
                    kvh = h // group
                    qe, ke, ve = q_ext[b, h, rows], k_ext[b, kvh, cols], v_ext[b, kvh, cols]
                    m_rows, l_rows, o_rows = m[b, h, rows], l[b, h, rows], o_acc[b, h, rows]
                    if not (np.isfinite(m_rows).all() and _shifted_tile(
                            qe, ke, ve, s, pv, bias, scale, m_rows, l_rows, o_rows, dim)):
                        _exact_tile(qe, ke, ve, s, pv, bias, scale, m_rows, l_rows, o_rows, dim)
                    if tick is not None:  # every ~ms: an MPI without a progress thread moves data only here
                        tick()
        return tiles.counts()

    @staticmethod
    def finalize(o_acc, m, l, out_dtype):
        seen = l > 0
        safe_l = np.where(seen, l, 1.0)
        o = o_acc / safe_l[..., None]
        o[~seen] = 0.0
        with np.errstate(divide="ignore"):
            lse = np.where(seen, m + np.log(safe_l), -np.inf).astype(l.dtype, copy=False)
        return np.ascontiguousarray(o.transpose(0, 2, 1, 3), dtype=out_dtype), lse

    # ----------------------------------------------------------------- backward
    def backward_block(self, qh, doh, lse, dvec, kh, vh, dq, dk, dv, scale, mask: BlockMask, tick=None):
        """Accumulate one block's gradients; return ``(tiles computed, tiles skipped)``."""
        batch, heads, sq, _ = qh.shape
        kv_heads, skv = kh.shape[1], kh.shape[2]
        if sq == 0 or skv == 0:
            return 0, 0
        ct = qh.dtype
        qh, doh = _kv_precision(qh, kh.dtype), _kv_precision(doh, kh.dtype)
        kh = kh if kh.dtype == ct else kh.astype(ct)
        vh = vh if vh.dtype == ct else vh.astype(ct)
        group = heads // kv_heads
        scale = ct.type(scale)
        # P = exp(S - lse) with lse = +inf on rows that saw nothing gives P = 0
        lse_use = np.where(np.isneginf(lse), np.inf, lse).astype(ct, copy=False)
        size = min(sq, TILE_Q) * min(skv, TILE_KV)
        scratch_p, scratch_dp = np.empty(size, dtype=ct), np.empty(size, dtype=ct)
        tiles = _TilePlan(mask, sq, skv, batch, ct)
        for rows, cols, bsel, bias in tiles:
            nq, nk = rows.stop - rows.start, cols.stop - cols.start
            p = scratch_p[: nq * nk].reshape(nq, nk)
            dp = scratch_dp[: nq * nk].reshape(nq, nk)
            for b in (range(batch) if bsel is None else (bsel,)):
                for h in range(heads):
                    kvh = h // group
                    q_t, do_t = qh[b, h, rows], doh[b, h, rows]
                    k_t, v_t = kh[b, kvh, cols], vh[b, kvh, cols]
                    np.matmul(q_t, k_t.T, out=p)
                    p *= scale
                    if bias is not None:
                        p += bias
                    p -= lse_use[b, h, rows, None]
                    np.exp(p, out=p)
                    dv[b, kvh, cols] += p.T @ do_t
                    np.matmul(do_t, v_t.T, out=dp)
                    dp -= dvec[b, h, rows, None]
                    dp *= p
                    dq[b, h, rows] += dp @ k_t
                    dk[b, kvh, cols] += dp.T @ q_t
                    if tick is not None:
                        tick()
        return tiles.counts()
