"""Tiles in global positions: the fixed units of ``invariant=True``.

Tile ``t`` of a sequence holds its global positions ``[64 t, 64 t + 64)`` (the last tile of
a sequence whose length is not a multiple of 64 is short).  The invariant mode computes
every (query tile, key tile) pair with the same shapes, strides and alignment whichever
rank holds them, so a pair's float partial sums are the same bits for every number of
ranks and every placement; :mod:`ringmpi.core.fixed_point` then adds them in any order.

A shard qualifies when it is made of whole tiles (:func:`shard_problem`): for each tile
it holds any row of, it holds all of them, in any local order.  Contiguous shards of
``N / P`` rows and zigzag shards of ``N / (2P)``-row chunks are whole tiles when those
lengths are multiples of 64; explicit positions may place whole tiles anywhere; a
striped layout qualifies only at P = 1.

:class:`Tiling` is one shard's rows in tile order: its local rows sorted by position,
padded with zero rows to whole 64-row tiles in 64-byte aligned arrays (:func:`aligned`),
so the same global tile has the same layout on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

TILE = 64
ALIGN = 64  # bytes


def aligned(shape, dtype, fill=None) -> np.ndarray:
    """A C-contiguous array whose data starts on a 64-byte boundary (zeros with ``fill=0``)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.empty(count * dtype.itemsize + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    out = raw[start:start + count * dtype.itemsize].view(dtype).reshape(shape)
    if fill is not None:
        out[...] = fill
    return out


def shard_problem(name: str, pos: np.ndarray, n: int) -> Optional[str]:
    """Why positions ``pos`` (this rank's, any order) of a sequence of ``n`` tokens are not
    whole 64-token tiles, or None."""
    if len(pos) == 0:
        return None
    tiles, counts = np.unique(np.asarray(pos, dtype=np.int64) // TILE, return_counts=True)
    want = np.minimum(TILE, n - tiles * TILE)
    bad = np.flatnonzero(counts != want)
    if bad.size == 0:
        return None
    t = int(tiles[bad[0]])
    return (f"invariant=True needs every shard made of whole {TILE}-token tiles of global positions "
            f"([{TILE}t, {TILE}t + {TILE}), the last one short): the {name} shard holds {int(counts[bad[0]])} "
            f"of the {int(want[bad[0]])} positions of tile {t} ({TILE * t} .. {min(n, TILE * t + TILE) - 1})")


@dataclass(frozen=True)
class Tiling:
    """One shard's rows as whole global tiles (checked by :func:`shard_problem` first).

    order : (S,) int64 the local rows sorted by global position (the valid slots in order hold
        local rows ``order[0], order[1], ...``).
    tiles : (nt,) int64 global tile index of each local tile, ascending.
    pos : (nt, TILE) int64 global positions; pad slots (positions this shard does not hold)
        repeat the tile's first held one.
    valid : (nt, TILE) bool, False on pad slots.
    sorted : the local rows are already in tile order (``order`` is ``0 .. S-1``).
    """

    order: np.ndarray
    tiles: np.ndarray
    pos: np.ndarray
    valid: np.ndarray
    sorted: bool

    @classmethod
    def of(cls, positions) -> "Tiling":
        """The tiling of ``positions``: whole tiles (a shard), or any rows of some tiles (a decode
        step's new tokens), each at its slot ``position mod 64`` of its tile."""
        positions = np.asarray(positions, dtype=np.int64)
        order = np.argsort(positions, kind="stable")
        by_pos = positions[order]
        tiles = np.unique(by_pos // TILE)
        nt = len(tiles)
        valid = np.zeros((nt, TILE), dtype=bool)
        valid[np.searchsorted(tiles, by_pos // TILE), by_pos % TILE] = True
        pos = tiles[:, None] * TILE + np.arange(TILE)
        first = pos[np.arange(nt), np.argmax(valid, axis=1)] if nt else pos[:, 0]
        pos = np.where(valid, pos, first[:, None])
        return cls(order=order, tiles=tiles, pos=pos, valid=valid,
                   sorted=bool(np.array_equal(order, np.arange(len(positions)))))

    @property
    def count(self) -> int:
        """Tiles of this shard."""
        return len(self.tiles)

    @property
    def rows(self) -> int:
        """Local rows (the valid slots)."""
        return len(self.order)

    @property
    def full(self) -> bool:
        """Every tile holds 64 rows (no pad slots)."""
        return self.rows == self.count * TILE

    def slots(self) -> np.ndarray:
        """(S,) int64 the tile slot (``TILE * i + r``) of each local row, in local order."""
        slot = np.empty(self.rows, dtype=np.int64)
        slot[self.order] = np.flatnonzero(self.valid.ravel())
        return slot

    def to_tiles(self, x, axis: int, dtype=None, out=None) -> np.ndarray:
        """``x``'s rows along ``axis`` in tile order, as a new 64-byte aligned C-contiguous
        array with that axis split into ``(nt, TILE)``, pad rows zero, in ``dtype`` (default
        ``x``'s); ``out``: such an array to fill instead (a reused scratch)."""
        x = np.asarray(x)
        axis = axis % x.ndim
        shape = x.shape[:axis] + (self.count, TILE) + x.shape[axis + 1:]
        if out is None:
            out = aligned(shape, x.dtype if dtype is None else dtype)
        flat = out.reshape(x.shape[:axis] + (self.count * TILE,) + x.shape[axis + 1:])
        lead = (slice(None),) * axis
        if self.full and self.sorted:
            flat[...] = x
            return out
        if not self.full:
            flat[...] = 0
        rows = np.flatnonzero(self.valid.ravel())
        if self.sorted:
            flat[lead + (rows,)] = x
        else:
            flat[lead + (rows,)] = np.take(x, self.order, axis=axis)
        return out

    def held(self, t0: int, t1: int):
        """``(rows, slots)`` of the tiles ``[t0, t1)``: their local rows (tile order) and those
        rows' slots ``TILE * (t - t0) + r`` (``slots`` None when they are every slot, in order)."""
        counts = self.valid.sum(axis=1)
        lo, hi = int(counts[:t0].sum()), int(counts[:t1].sum())
        rows = self.order[lo:hi]
        valid = self.valid[t0:t1].ravel()
        return rows, (None if valid.all() else np.flatnonzero(valid))

    def gather_tiles(self, x, t0: int, t1: int, out: np.ndarray) -> np.ndarray:
        """The tiles ``[t0, t1)`` of ``x (S, ...)`` (rows on axis 0) into ``out (t1 - t0, TILE,
        ...)``, pad rows zero (``out``'s dtype)."""
        rows, slots = self.held(t0, t1)
        flat = out.reshape((-1,) + out.shape[2:])
        if slots is None:
            if self.sorted:
                flat[...] = x[rows[0]:rows[0] + len(rows)] if len(rows) else 0
            else:
                flat[...] = x[rows]
        else:
            flat[...] = 0
            flat[slots] = x[rows]
        return out

    def from_tiles(self, xt, axis: int) -> np.ndarray:
        """The inverse of :meth:`to_tiles`: ``xt`` with axes ``(axis, axis + 1) = (nt, TILE)`` back
        to local row order along ``axis`` (a new array, pad rows dropped)."""
        axis = axis % (xt.ndim - 1)
        flat = xt.reshape(xt.shape[:axis] + (self.count * TILE,) + xt.shape[axis + 2:])
        return np.take(flat, self.slots(), axis=axis)
