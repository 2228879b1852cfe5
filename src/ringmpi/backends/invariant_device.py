"""The CuPy backend's block ops for ``invariant=True``: invariant.cu's kernels, driven as
:mod:`ringmpi.backends.invariant_tiles` drives NumPy.

Same passes, grids and rules as the NumPy ops (:mod:`ringmpi.parallel.invariant_passes` runs
either): fixed (query tile, key tile) pairs of 64 global positions, each pair's float partial
sums added in int64 fixed point, so the bits do not depend on P or the placement -- on this
GPU, with this backend (not the CPU's bits: the arithmetic inside a pair differs).  The host
prepares what the kernels read: the resident rows in the compute dtype (q and do rounded to a
16-bit K/V dtype as the NumPy ops round them), flagged rows (NaN/Inf) zeroed with their flags,
``lse`` and ``dvec`` as the NumPy :class:`~ringmpi.backends.invariant_tiles.Resident` makes
them; per block, the K/V in the compute dtype with flagged keys zeroed, the slot maps of the
tiles (tile slot -> local row, -1 for a pad) and every pair's class
(:func:`~ringmpi.backends.invariant_tiles.pair_classes`, on the host).

Arrays the passes hand in (``m``, ``poison``, the integer accumulators, the travelling int64
``dk``/``dv``) are CuPy arrays on the backend's device; the grids are host float64 arrays,
uploaded once per call (:meth:`DeviceResident.grid`).
"""

from __future__ import annotations

import numpy as np

from .. import kernels as K
from ..core.dropout import kernel_values as dropout_values
from ..core.global_tiles import TILE, Tiling
from ..core.host import to_host
from ..core.masks import tile_counts
from .invariant_tiles import pair_classes, tiled_segments


def slot_map(tiling: Tiling) -> np.ndarray:
    """``(nt * TILE,)`` int32: the local row in each tile slot of ``tiling``, -1 for a pad slot."""
    out = np.full(tiling.count * TILE, -1, dtype=np.int32)
    out[tiling.slots()] = np.arange(tiling.rows, dtype=np.int32)
    return out


def _acc_kind(ct) -> int:
    return K.F64 if np.dtype(ct) == np.float64 else K.F32


def _flag_rows(cp, x):
    """``(..., S)`` uint8 flags of the rows of ``x (..., S, D)`` holding NaN/Inf."""
    return (~cp.isfinite(x).all(axis=-1)).astype(np.uint8)


class DeviceResident:
    """What one call derives from its resident rows, once (the ``resident`` of the device ops).

    ``q`` (and ``do``) ``(B, H, S, D)`` contiguous CuPy copies in the compute dtype ``ct``, rounded
    to a 16-bit K/V dtype as the NumPy ops do, flagged rows zero; ``bad`` ``(B, H, S)`` uint8
    flags; ``lse_rows``, ``dvec_rows`` ``(B, H, S)`` (``lse = -inf`` read as ``+inf``, flagged rows
    ``+inf`` and 0); ``dvec`` the host ``(B, H, nq, TILE)`` tiles of ``dvec_rows`` (as the NumPy
    :class:`~ringmpi.backends.invariant_tiles.Resident`'s, for the backward's grids).
    """

    def __init__(self, be, qh, positions, seg, kv_dtype, ct, spec, do=None, lse=None, dvec=None):
        cp = be.xp
        self.be, self.ct, self.spec, self.kv_dtype = be, np.dtype(ct), spec, kv_dtype
        self.tiling = Tiling.of(positions)
        self.seg = tiled_segments(self.tiling, seg)
        self.do = self.lse_rows = self.dvec_rows = self.dvec = None
        with be._on_stream():
            self.q = self._rows(qh)
            bad = _flag_rows(cp, self.q)
            if do is not None:
                self.do = self._rows(do)
                lse = be._convert(cp.asarray(lse), self.ct, copy=True)
                dvec = be._convert(cp.asarray(dvec), self.ct, copy=True)
                bad |= _flag_rows(cp, self.do) | cp.isnan(lse) | ~cp.isfinite(dvec)
                flagged = bad.astype(bool)
                lse[cp.isneginf(lse)] = cp.inf
                lse[flagged] = cp.inf
                dvec[flagged] = 0
                self.do[flagged] = 0
                self.lse_rows, self.dvec_rows = lse, dvec
            self.q[bad.astype(bool)] = 0
            self.bad = bad
        if self.dvec_rows is not None:
            self.dvec = self.tiling.to_tiles(to_host(self.dvec_rows), axis=2, dtype=self.ct)
        self.q_slot = be.asarray(slot_map(self.tiling))
        self._grids: dict = {}

    def grid(self, host):
        """``host``, one of this call's float64 grids (the same array every ring step), on the
        device: uploaded at its first step only."""
        hit = self._grids.get(id(host))
        if hit is None:  # the entry keeps ``host`` alive, so its id stays its own
            hit = self._grids[id(host)] = (host, self.be.asarray(np.ascontiguousarray(host, dtype=np.float64)))
        return hit[1]

    def _rows(self, x):
        """A contiguous compute-dtype copy of ``x``, rounded to a 16-bit K/V dtype first."""
        be = self.be
        if np.dtype(self.kv_dtype).itemsize == 2:
            x = be._convert(be.xp.asarray(x), self.kv_dtype)
        return be._convert(be.xp.asarray(x), self.ct, copy=True)


class _DeviceBlock:
    """One visiting block: its K (and V) in the compute dtype with flagged keys zero, their flags,
    the key slot map and every pair's class; ``counts`` as the NumPy ops count tiles."""

    def __init__(self, res: DeviceResident, mask, kh, vh=None):
        be, cp = res.be, res.be.xp
        self.tiling = Tiling.of(mask.kv_pos)
        batch = res.q.shape[0]
        self.k = be._convert(cp.asarray(kh), res.ct, copy=True)
        bad = _flag_rows(cp, self.k)
        self.v = None
        if vh is not None:
            self.v = be._convert(cp.asarray(vh), res.ct, copy=True)
            bad |= _flag_rows(cp, self.v)
        flagged = bad.astype(bool)
        if vh is not None:
            self.v[flagged] = 0
        self.k[flagged] = 0
        self.bad = bad
        classes = pair_classes(res.spec, res.tiling, res.seg, self.tiling, tiled_segments(self.tiling, mask.seg_kv),
                               batch)
        self.class_batch = np.int32(res.seg is not None)
        self.classes = be.asarray(np.ascontiguousarray(classes))
        self.k_slot = be.asarray(slot_map(self.tiling))
        self.counts = tile_counts(classes, res.seg is not None, batch)


def _shape(res: DeviceResident, blk: _DeviceBlock, heads: int, kv_heads: int, d: int, d_v: int):
    batch, sq, skv = res.q.shape[0], res.q.shape[2], blk.k.shape[2]
    return tuple(np.int32(x) for x in (batch, heads, kv_heads, sq, skv, d, d_v, res.tiling.count, blk.tiling.count))


def _launch(res, name: str, blk: _DeviceBlock, before: tuple, after: tuple, mask, heads: int, kv_heads: int,
            d: int, d_v: int):
    """Launch invariant.cu's ``name`` kernel: its arguments ``before`` the tile maps, the maps
    (``INV_TILES``), ``after``, then ``MASK_PARAMS``, ``MOD_PARAMS``, ``DROPOUT_PARAMS`` (not for
    ``max``) and the shape (``INV_SHAPE``)."""
    be = res.be
    plan = K.InvariantLaunch(name, _acc_kind(res.ct))
    filename, expr = plan.instantiation
    margs = be._mask_values(mask, res.q.shape[0])
    if name != "max":
        margs += dropout_values(mask.spec.dropout, res.ct)
    tiles = (res.q_slot, blk.k_slot, blk.classes, blk.class_batch, res.bad, blk.bad)
    grid = plan.grid(res.q.shape[0], heads, kv_heads, res.tiling.count, blk.tiling.count)
    smem = plan.shared_mem_bytes()
    be._kernel(filename, expr, smem)(grid, plan.block(),
                                     before + tiles + after + margs + _shape(res, blk, heads, kv_heads, d, d_v),
                                     shared_mem=smem)


def _empty(res, kh, tick, kv_done=None) -> bool:
    if kh.shape[2] == 0 or res.tiling.rows == 0 or res.q.shape[0] == 0:
        if kv_done is not None:
            kv_done(kh.shape[2])
        if tick is not None:
            tick()
        return True
    return False


def _check(name, x, shape, dtype):
    if tuple(x.shape) != tuple(shape) or x.dtype != np.dtype(dtype) or not x.flags.c_contiguous:
        raise ValueError(f"{name} must be a C-contiguous {np.dtype(dtype)} array of shape {tuple(shape)}, "
                         f"got {x.dtype} {tuple(x.shape)}")


def max_block(res: DeviceResident, kh, m, poison, scale, mask, tick=None):
    """:func:`ringmpi.backends.invariant_tiles.max_block` on the GPU (``m``, ``poison`` CuPy)."""
    if _empty(res, kh, tick):
        return 0, 0
    batch, heads = res.q.shape[:2]
    shape = (batch, heads, res.tiling.count, TILE)
    _check("m", m, shape, res.ct)
    _check("poison", poison, shape, np.uint8)
    be = res.be
    with be._on_stream():
        blk = _DeviceBlock(res, mask, kh)
        _launch(res, "max", blk, (res.q, blk.k), (m, poison, res.ct.type(scale)), mask, heads, kh.shape[1],
                kh.shape[3], kh.shape[3])
        be._mark_use(kh)
    if tick is not None:
        tick()
    return blk.counts


def forward_block(res: DeviceResident, kh, vh, shift, acc_l, acc_o, poison, grid_l, grid_o, limbs: int, scale, mask,
                  tick=None):
    """:func:`ringmpi.backends.invariant_tiles.forward_block` on the GPU (``shift``, the
    accumulators and ``poison`` CuPy; ``grid_l``, ``grid_o`` host float64)."""
    if _empty(res, kh, tick):
        return 0, 0
    be = res.be
    batch, heads = res.q.shape[:2]
    d_v = vh.shape[3]
    shape = (batch, heads, res.tiling.count, TILE)
    _check("shift", shift, shape, res.ct)
    _check("acc_l", acc_l, shape + (limbs,), np.int64)
    _check("acc_o", acc_o, shape + (limbs * d_v,), np.int64)
    _check("poison", poison, shape, np.uint8)
    with be._on_stream():
        blk = _DeviceBlock(res, mask, kh, vh)
        _launch(res, "forward", blk, (res.q, blk.k, blk.v),
                (shift, acc_l, acc_o, poison, res.grid(grid_l), res.grid(grid_o), np.int32(limbs),
                 res.ct.type(scale)),
                mask, heads, kh.shape[1], kh.shape[3], d_v)
        be._mark_use(kh, vh)
    if tick is not None:
        tick()
    return blk.counts


def backward_block(res: DeviceResident, kh, vh, dq_acc, q_poison, dk, dv, grids, limbs: int, scale, mask, tick=None,
                   kv_need=None, kv_done=None):
    """:func:`ringmpi.backends.invariant_tiles.backward_block` on the GPU: the whole block at once
    (``kv_need`` asked for every row first; ``kv_done`` told once the kernel has ended -- the
    device channel passes neither); ``dq_acc``, ``q_poison`` and the travelling int64 ``dk``,
    ``dv`` CuPy, ``grids`` host float64."""
    if _empty(res, kh, tick, kv_done):
        return 0, 0
    if kv_need is not None:
        kv_need(kh.shape[2])
    be = res.be
    batch, heads, _, dim = res.q.shape
    kv_heads, skv, d_v = kh.shape[1], kh.shape[2], vh.shape[3]
    shape = (batch, heads, res.tiling.count, TILE)
    _check("dq_acc", dq_acc, shape + (limbs * dim,), np.int64)
    _check("q_poison", q_poison, shape, np.uint8)
    _check("dk", dk, (batch, kv_heads, skv, limbs * dim), np.int64)
    _check("dv", dv, (batch, kv_heads, skv, limbs * d_v + 1), np.int64)
    with be._on_stream():
        blk = _DeviceBlock(res, mask, kh, vh)
        up = [res.grid(g) for g in (grids.dq_rows, grids.dq_cols, grids.dk_cols, grids.dv_cols)]
        _launch(res, "backward", blk, (res.q, res.do, res.lse_rows, res.dvec_rows, blk.k, blk.v),
                (dq_acc, q_poison, dk, dv, *up, np.int32(limbs), res.ct.type(scale)),
                mask, heads, kv_heads, dim, d_v)
        be._mark_use(kh, vh, dk, dv)
    if kv_done is not None:
        be.synchronize()  # the rows may leave once the kernel has written them
        kv_done(skv)
    if tick is not None:
        tick()
    return blk.counts
