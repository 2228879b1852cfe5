"""A rank's shard of a KV cache that grows by appends, for :func:`ringmpi.decode_attention`.

Cache slots are global positions ``0 .. n-1``.  The first ``n_prefill`` slots
(a shard handed over by :meth:`KVCache.load_shard`, e.g. from a ring-attention
prefill) follow ``Layout(kind, n_prefill, P)``; every later slot ``p`` goes to

* ``contiguous``: the last rank (the sequence keeps growing at its end; that
  rank's shard and work grow, the others' stay put);
* ``striped``: rank ``p mod P`` (so the cache stays exactly a striped layout);
* ``zigzag``: rank ``p mod P`` as well: zigzag only balances the ring's causal
  work, and for decode every cached key costs the same, so round-robin keeps
  memory and work balanced.

Every rank calls :meth:`KVCache.append` with the full new rows (they are
computed from the replicated new tokens) and keeps only the rows it owns: no
communication.  Storage is head-major ``(B, H_kv, capacity, D)`` and grows by
``chunk`` rows (never per token); :attr:`KVCache.k`/:attr:`KVCache.v` are views
``(B, S_local, H_kv, D)`` that ``decode_attention`` reads without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .context import RingContext
from .runtime.errors import ConfigError
from .core.layout import KINDS, Layout
from .parallel.comm import resolve_comm


@dataclass(frozen=True)
class CachePlacement:
    """Which global slots each rank holds: ``n`` slots, the first ``n_prefill`` by ``Layout``."""

    kind: str
    n_prefill: int
    n: int
    world_size: int
    _cached: dict = field(default_factory=dict, compare=False, repr=False)

    def owner(self, p: np.ndarray) -> np.ndarray:
        """Owning rank of each appended slot ``p >= n_prefill``."""
        p = np.asarray(p, dtype=np.int64)
        if self.kind == "contiguous":
            return np.full(p.shape, self.world_size - 1, dtype=np.int64)
        return p % self.world_size

    def indices(self, rank: int) -> np.ndarray:
        """Global slots ``rank`` holds, ascending (int64)."""
        if rank not in self._cached:
            first = (Layout(self.kind, self.n_prefill, self.world_size).indices(rank) if self.n_prefill
                     else np.zeros(0, dtype=np.int64))
            later = np.arange(self.n_prefill, self.n, dtype=np.int64)
            self._cached[rank] = np.concatenate([first, later[self.owner(later) == rank]])
        return self._cached[rank]


def _dtype(name) -> np.dtype:
    if str(name) == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class KVCache:
    """This rank's shard of a sharded KV cache.

    Parameters
    ----------
    batch, kv_heads, dim : int
        Cache shape ``(B, N, H_kv, D)`` globally.
    dim_v : int, optional
        The value head dim ``D_v`` (default ``dim``): values are ``(B, N, H_kv, D_v)``.
    dtype : float16 | bfloat16 | float32 | float64
    context : :class:`ringmpi.RingContext`, optional
        Its communicator (only its rank and size are used here) and its layout, a kind
        ("contiguous" | "zigzag" | "striped"); the decode calls over this cache run in it
        (:meth:`ring_context`).
    capacity : int
        Local rows allocated up front.
    chunk : int
        Rows added each time the storage is full (>= 1).
    xp : array module (numpy, or cupy for a GPU cache).
    """

    def __init__(self, batch: int, kv_heads: int, dim: int, dtype="float32", *,
                 context: Optional[RingContext] = None, capacity: int = 0, chunk: int = 1024, xp=np,
                 dim_v: Optional[int] = None):
        context = RingContext.of(context)
        layout = context.layout
        if layout not in KINDS:
            raise ConfigError(f"unknown layout {layout!r}: expected one of {', '.join(KINDS)}")
        if chunk < 1 or capacity < 0:
            raise ConfigError(f"need chunk >= 1 and capacity >= 0, got {chunk}, {capacity}")
        self.comm = resolve_comm(context.comm)
        self.context = context.replace(comm=self.comm)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.batch, self.kv_heads, self.dim, self.chunk, self.xp = batch, kv_heads, dim, chunk, xp
        self.dim_v = dim if dim_v is None else int(dim_v)
        self.dtype = _dtype(dtype)
        self.kind = layout
        self.placement = CachePlacement(layout, 0, 0, self.size)
        self.lengths = np.zeros(batch, dtype=np.int64)
        self._k = xp.zeros((batch, kv_heads, capacity, dim), dtype=self.dtype)
        self._v = xp.zeros((batch, kv_heads, capacity, self.dim_v), dtype=self.dtype)
        self._pos = np.zeros(capacity, dtype=np.int64)  # global slot of each local row
        self._rows = 0

    # ---------------------------------------------------------------- views
    @property
    def n(self) -> int:
        """Global slots (the longest entry's length)."""
        return self.placement.n

    @property
    def local_rows(self) -> int:
        return self._rows

    @property
    def capacity(self) -> int:
        return self._k.shape[2]

    @property
    def k(self):
        """``(B, S_local, H_kv, D)`` view of this rank's keys."""
        return self._k[:, :, :self.local_rows].transpose(0, 2, 1, 3)

    @property
    def v(self):
        return self._v[:, :, :self.local_rows].transpose(0, 2, 1, 3)

    def views(self) -> dict:
        """The arrays :func:`decode_attention` needs: ``k_cache, v_cache, cache_lengths``; its
        context is :meth:`ring_context`."""
        ragged = bool((self.lengths != self.n).any())
        return dict(k_cache=self.k, v_cache=self.v, cache_lengths=self.lengths.copy() if ragged else None)

    def ring_context(self, **changes) -> RingContext:
        """The cache's context with its placement as the layout (and ``changes``: ``backend``,
        ``invariant``, ``stats``, ...): ``decode_attention(q, **cache.views(),
        context=cache.ring_context())``."""
        return self.context.replace(layout=self.placement, **changes)

    # ---------------------------------------------------------------- growth
    def _reserve(self, rows: int) -> None:
        if rows <= self.capacity:
            return
        grown = self.capacity + self.chunk * -(-(rows - self.capacity) // self.chunk)
        for name in ("_k", "_v"):
            old = getattr(self, name)
            new = self.xp.zeros(old.shape[:2] + (grown,) + old.shape[3:], dtype=old.dtype)
            new[:, :, :old.shape[2]] = old
            setattr(self, name, new)
        self._pos = np.concatenate([self._pos, np.zeros(grown - len(self._pos), dtype=np.int64)])

    def _own(self, rows: int, n_prefill: int, n: int) -> None:
        """Hold ``rows`` local rows (slots in ``_pos``) of ``n`` global slots; a new placement."""
        self._rows = rows
        self.placement = CachePlacement(self.kind, n_prefill, n, self.size, {self.rank: self._pos[:rows]})

    def _check_rows(self, name, x, rows=None, dim=None):
        want = (self.batch, x.shape[1] if rows is None else rows, self.kv_heads, dim or self.dim)
        if getattr(x, "ndim", None) != 4 or tuple(x.shape) != want:
            raise ConfigError(f"{name} must have shape {want}, got {getattr(x, 'shape', type(x).__name__)}")

    def load_shard(self, k_local, v_local, n: int, lengths=None) -> None:
        """Start from a prefilled shard ``(B, S_local, H_kv, D)`` under ``Layout(kind, n, P)``.

        ``lengths (B,)``: ragged entries (right-padded to ``n``); default ``n`` each.
        """
        if self.n:
            raise ConfigError("load_shard needs an empty cache")
        rows = int(Layout(self.kind, n, self.size).counts()[self.rank])
        self._check_rows("k_local", k_local, rows)
        self._check_rows("v_local", v_local, rows, self.dim_v)
        lengths = np.full(self.batch, n, dtype=np.int64) if lengths is None else np.asarray(lengths, dtype=np.int64)
        if lengths.shape != (self.batch,) or lengths.min() < 0 or lengths.max() > n:
            raise ConfigError(f"lengths must be {self.batch} ints in [0, {n}], got {lengths.tolist()}")
        self._reserve(rows)
        self._pos[:rows] = Layout(self.kind, n, self.size).indices(self.rank)
        self._own(rows, int(n), int(n))
        self._k[:, :, :rows] = self.xp.asarray(k_local).transpose(0, 2, 1, 3)
        self._v[:, :, :rows] = self.xp.asarray(v_local).transpose(0, 2, 1, 3)
        self.lengths[:] = lengths

    def append(self, k_new, v_new) -> None:
        """Append ``S_new`` rows ``(B, S_new, H_kv, D)`` (the same on every rank) to every entry.

        Entry ``b``'s rows go to slots ``lengths[b] .. lengths[b] + S_new - 1``;
        this rank stores the ones it owns.  No communication.
        """
        self._check_rows("k_new", k_new)
        self._check_rows("v_new", v_new, dim=self.dim_v)
        s_new = k_new.shape[1]
        n_new = max(self.n, int(self.lengths.max()) + s_new)
        if n_new > self.n:  # new slots: only this rank's are recorded, nothing is rebuilt
            fresh = np.arange(self.n, n_new, dtype=np.int64)
            fresh = fresh[self.placement.owner(fresh) == self.rank]
            rows = self._rows + len(fresh)
            self._reserve(rows)
            self._pos[self._rows:rows] = fresh
            self._own(rows, self.placement.n_prefill, n_new)
        mine = self.placement.indices(self.rank)
        k_new, v_new = self.xp.asarray(k_new), self.xp.asarray(v_new)
        for b in range(self.batch):
            slots = self.lengths[b] + np.arange(s_new, dtype=np.int64)
            local = np.minimum(np.searchsorted(mine, slots), max(len(mine) - 1, 0))
            owned = mine[local] == slots if len(mine) else np.zeros(s_new, dtype=bool)
            if owned.any():
                t = np.flatnonzero(owned)
                self._k[b, :, local[owned]] = k_new[b, t]
                self._v[b, :, local[owned]] = v_new[b, t]
        self.lengths += s_new
