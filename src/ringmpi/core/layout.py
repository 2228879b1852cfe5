"""Which global tokens each rank owns.

``Layout(kind, n, world_size)`` maps global token indices to ranks:

* ``contiguous``: rank ``r`` owns one slab; the first ``n % P`` ranks get one
  token more than the rest.
* ``zigzag``: the sequence is cut into ``2P`` near-equal chunks and rank ``r``
  owns chunks ``r`` and ``2P-1-r`` (balances causal work).
* ``striped``: token ``t`` lives on rank ``t mod P``.
* ``balanced`` (``documents=`` the lengths of a pack of documents, ``causal=``,
  ``window=`` the call's mask): every rank gets the same visible (query, key)
  pairs, within one split unit, and near ``n / P`` tokens
  (:func:`ringmpi.core.balance.balanced_pieces`; zigzag's placement instead where
  that has the smaller maximum, as for a few tiny documents).  Computed from the
  lengths alone, the same on every rank.

Any ``n >= 1`` and any ``world_size >= 1`` is legal: shards may be uneven or
empty.  Local order is ascending global position for every kind.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .masks import Window, window_sides

KINDS = ("contiguous", "zigzag", "striped")  # the kinds made from (n, world_size) alone
BALANCED = "balanced"                         # made from a pack's document lengths too


def _split_points(n: int, parts: int) -> np.ndarray:
    """Boundaries of ``parts`` near-equal chunks of ``range(n)`` (larger first)."""
    base, extra = divmod(n, parts)
    sizes = np.full(parts, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


@dataclass(frozen=True, repr=False)
class Layout:
    """Assignment of ``n`` global tokens to ``world_size`` ranks.

    Parameters
    ----------
    kind : {"contiguous", "zigzag", "striped", "balanced"}
    n : int
        Global sequence length (>= 1).
    world_size : int
        Number of ranks (>= 1).
    documents : sequence of int, only for ``"balanced"``
        The lengths (>= 1) of the pack's documents in sequence order, summing to ``n``.
    causal, window : only for ``"balanced"``
        The call's causal mask and sliding window ``(left, right)``: the work of a
        document depends on them.
    """

    kind: str
    n: int
    world_size: int
    documents: Optional[Tuple[int, ...]] = None
    causal: bool = False
    window: Window = None

    def __post_init__(self):
        if self.kind not in KINDS + (BALANCED,):
            raise ValueError(f"unknown layout {self.kind!r}: expected one of {', '.join(KINDS + (BALANCED,))}")
        if int(self.n) < 1:
            raise ValueError(f"layout needs n >= 1, got {self.n}")
        if int(self.world_size) < 1:
            raise ValueError(f"layout needs world_size >= 1, got {self.world_size}")
        if self.kind != BALANCED:
            if self.documents is not None or self.causal or self.window is not None:
                raise ValueError(f"documents=, causal= and window= are for the balanced layout, not {self.kind!r}")
            return
        if self.documents is None:
            raise ValueError("the balanced layout needs documents= (the lengths of the pack's documents)")
        lengths = tuple(int(x) for x in np.asarray(self.documents, dtype=np.int64).ravel())
        if any(x < 1 for x in lengths) or sum(lengths) != int(self.n):
            raise ValueError(f"documents must be lengths >= 1 summing to n = {self.n}, got {len(lengths)} "
                             f"lengths summing to {sum(lengths)} (smallest {min(lengths, default=None)})")
        object.__setattr__(self, "documents", lengths)
        object.__setattr__(self, "causal", bool(self.causal))
        object.__setattr__(self, "window", window_sides(self.window))  # flash-attn's -1 taken too

    def __repr__(self) -> str:
        text = f"Layout(kind={self.kind!r}, n={self.n}, world_size={self.world_size}"
        if self.kind == BALANCED:
            text += f", documents=<{len(self.documents)} documents>, causal={self.causal}, window={self.window}"
        return text + ")"

    def indices(self, rank: int) -> np.ndarray:
        """Global token indices rank ``rank`` owns, in local order (int64)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        p = self.world_size
        if self.kind == BALANCED:
            return _spans_indices(self._spans[rank])
        if self.kind == "contiguous":
            cut = _split_points(self.n, p)
            return np.arange(cut[rank], cut[rank + 1], dtype=np.int64)
        if self.kind == "zigzag":
            return _spans_indices(_zigzag_spans(self.n, p)[rank])
        return np.arange(rank, self.n, p, dtype=np.int64)

    def segment_ids(self, rank: int, batch: int = 1) -> np.ndarray:
        """``(batch, S_local)`` int64 the document of each of ``rank``'s tokens (balanced layout
        only): the calls' ``segment_ids_q``/``segment_ids_kv``, made without a global array."""
        if self.kind != BALANCED:
            raise ValueError(f"segment_ids needs the balanced layout's documents, not {self.kind!r}")
        ends = np.cumsum(np.asarray(self.documents, dtype=np.int64))
        ids = np.searchsorted(ends, self.indices(rank), side="right").astype(np.int64)
        return np.ascontiguousarray(np.broadcast_to(ids, (batch, len(ids))))

    @functools.cached_property
    def _spans(self) -> List[List[Tuple[int, int]]]:
        """The balanced layout's token intervals per rank (computed once)."""
        from .balance import balanced_pieces, visible_pairs

        spans = balanced_pieces(self.documents, self.world_size, self.causal, self.window)
        zigzag = _zigzag_spans(self.n, self.world_size)

        def most(per_rank):
            return max(visible_pairs(_spans_indices(s), self.documents, self.causal, self.window)
                       for s in per_rank)
        return zigzag if most(zigzag) < most(spans) else spans

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


def _zigzag_spans(n: int, p: int) -> List[List[Tuple[int, int]]]:
    """Zigzag's two intervals per rank: chunks ``r`` and ``2P-1-r`` of ``2P``."""
    cut = _split_points(n, 2 * p)
    return [[(int(cut[r]), int(cut[r + 1])), (int(cut[2 * p - 1 - r]), int(cut[2 * p - r]))] for r in range(p)]


def _spans_indices(spans) -> np.ndarray:
    if not spans:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in spans])


def _is_torch(x) -> bool:
    """Whether ``x`` is a torch tensor (without importing torch)."""
    return type(x).__module__.split(".")[0] == "torch"


def _torch_index(idx: np.ndarray, device):
    import torch
    return torch.from_numpy(idx).to(device)
