"""Which global tokens each rank owns.

``Layout(kind, n, world_size)`` maps global token indices to ranks:

* ``contiguous``: rank ``r`` owns one slab; the first ``n % P`` ranks get one
  token more than the rest.
* ``zigzag``: the sequence is cut into ``2P`` near-equal chunks and rank ``r``
  owns chunks ``r`` and ``2P-1-r`` (balances causal work).
* ``striped``: token ``t`` lives on rank ``t mod P``.

Any ``n >= 1`` and any ``world_size >= 1`` is legal: shards may be uneven or
empty.  Local order is ascending global position for every kind.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

KINDS = ("contiguous", "zigzag", "striped")


def _split_points(n: int, parts: int) -> np.ndarray:
    """Boundaries of ``parts`` near-equal chunks of ``range(n)`` (larger first)."""
    base, extra = divmod(n, parts)
    sizes = np.full(parts, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


@dataclass(frozen=True)
class Layout:
    """Assignment of ``n`` global tokens to ``world_size`` ranks.

    Parameters
    ----------
    kind : {"contiguous", "zigzag", "striped"}
    n : int
        Global sequence length (>= 1).
    world_size : int
        Number of ranks (>= 1).
    """

    kind: str
    n: int
    world_size: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown layout {self.kind!r}: expected one of {', '.join(KINDS)}")
        if int(self.n) < 1:
            raise ValueError(f"layout needs n >= 1, got {self.n}")
        if int(self.world_size) < 1:
            raise ValueError(f"layout needs world_size >= 1, got {self.world_size}")

    def indices(self, rank: int) -> np.ndarray:
        """Global token indices rank ``rank`` owns, in local order (int64)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        p = self.world_size
        if self.kind == "contiguous":
            cut = _split_points(self.n, p)
            return np.arange(cut[rank], cut[rank + 1], dtype=np.int64)
        if self.kind == "zigzag":
            cut = _split_points(self.n, 2 * p)
            mirror = 2 * p - 1 - rank
            return np.concatenate([np.arange(cut[rank], cut[rank + 1], dtype=np.int64),
                                   np.arange(cut[mirror], cut[mirror + 1], dtype=np.int64)])
        return np.arange(rank, self.n, p, dtype=np.int64)

    def counts(self) -> np.ndarray:
        """Number of tokens on each rank, ``(world_size,)`` int64 (computed once; read-only)."""
        return self._counts

    @functools.cached_property
    def _counts(self) -> np.ndarray:
        counts = np.array([len(self.indices(r)) for r in range(self.world_size)], dtype=np.int64)
        counts.flags.writeable = False
        return counts

    def shard(self, x, rank: int, axis: int = 1):
        """The part of a global array ``x`` that ``rank`` owns along ``axis``.

        ``x`` may be a NumPy or CuPy array or a torch tensor (CPU or CUDA: the
        result stays a tensor on ``x``'s device, gathered there, never through NumPy).
        """
        if x.shape[axis] != self.n:
            raise ValueError(f"axis {axis} has length {x.shape[axis]}, layout expects {self.n}")
        if _is_torch(x):
            return x.index_select(axis, _torch_index(self.indices(rank), x.device))
        return x.take(self.indices(rank), axis=axis)

    def unshard(self, shards: Sequence, axis: int = 1):
        """Reassemble a global array from every rank's shard (in rank order).

        Torch tensors give a tensor on the first shard's device (scattered there).
        """
        if len(shards) != self.world_size:
            raise ValueError(f"expected {self.world_size} shards, got {len(shards)}")
        first = shards[0]
        shape = list(first.shape)
        shape[axis] = self.n
        torch_shards = _is_torch(first)
        if torch_shards:
            import torch
            out = torch.empty(shape, dtype=first.dtype, device=first.device)
        else:
            out = np.empty(shape, dtype=first.dtype)
        for r, part in enumerate(shards):
            idx = self.indices(r)
            if part.shape[axis] != len(idx):
                raise ValueError(f"shard {r} has {part.shape[axis]} rows along axis {axis}, layout expects {len(idx)}")
            if torch_shards:
                out.index_copy_(axis, _torch_index(idx, out.device), part.to(out.device))
                continue
            sl = [slice(None)] * out.ndim
            sl[axis] = idx
            out[tuple(sl)] = part
        return out


def _is_torch(x) -> bool:
    """Whether ``x`` is a torch tensor (without importing torch)."""
    return type(x).__module__.split(".")[0] == "torch"


def _torch_index(idx: np.ndarray, device):
    import torch
    return torch.from_numpy(idx).to(device)
