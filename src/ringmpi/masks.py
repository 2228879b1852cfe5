"""Attention masks as functions of global token positions.

A :class:`MaskSpec` describes which keys a query may see; it never stores an
``N x N`` matrix.  Positions are global token indices (from a
:class:`~ringmpi.layout.Layout`), so the same spec works on every rank and for
every layout.

Rules, for query position ``i`` and key position ``j`` with
``offset = N_kv - N_q`` (bottom-right alignment, as FlashAttention >= 2.1):

* causal: ``j <= i + offset``;
* window ``(left, right)``: ``i + offset - left <= j <= i + offset + right``
  (``None`` on a side means unbounded on that side);
* segment ids: ``seg_q[b, i] == seg_kv[b, j]`` (packed documents).

All given rules must hold.  Tiles are classified as ``SKIP`` (nothing visible),
``FULL`` (everything visible, no elementwise mask needed) or ``PARTIAL``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

SKIP, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class MaskSpec:
    """Mask rules for one attention call.

    Parameters
    ----------
    causal : bool
        Bottom-right aligned causal mask.
    window : (left, right) or None
        Sliding window in global positions; either side may be ``None``.
    offset : int
        ``N_kv - N_q`` (global lengths); 0 when they are equal.
    """

    causal: bool = False
    window: Optional[Tuple[Optional[int], Optional[int]]] = None
    offset: int = 0

    def __post_init__(self):
        if self.window is not None:
            left, right = self.window
            for side in (left, right):
                if side is not None and int(side) < 0:
                    raise ValueError(f"window sides must be >= 0 or None, got {self.window}")

    # -- the bounds of visible keys for a query position, as (lo, hi) inclusive
    def key_bounds(self, q_pos: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Inclusive ``[lo, hi]`` key-position bounds per query position (int64)."""
        q_pos = np.asarray(q_pos, dtype=np.int64)
        big = np.iinfo(np.int64).max // 4
        lo = np.full(q_pos.shape, -big, dtype=np.int64)
        hi = np.full(q_pos.shape, big, dtype=np.int64)
        anchor = q_pos + self.offset
        if self.causal:
            hi = np.minimum(hi, anchor)
        if self.window is not None:
            left, right = self.window
            if left is not None:
                lo = np.maximum(lo, anchor - int(left))
            if right is not None:
                hi = np.minimum(hi, anchor + int(right))
        return lo, hi

    @property
    def positional(self) -> bool:
        """True when the mask depends on positions (causal or window)."""
        return self.causal or (self.window is not None and self.window != (None, None))

    def classify(self, q_pos, kv_pos, seg_q=None, seg_kv=None) -> int:
        """Classify a tile: ``SKIP``, ``FULL`` or ``PARTIAL``.

        ``q_pos``/``kv_pos`` are the tile's global positions (any order);
        ``seg_q``/``seg_kv`` the tile's segment ids for one batch entry, or None.
        """
        if len(q_pos) == 0 or len(kv_pos) == 0:
            return SKIP
        state = FULL
        if self.positional:
            lo, hi = self.key_bounds(q_pos)
            kmin, kmax = int(kv_pos.min()), int(kv_pos.max())
            # every query sees nothing of [kmin, kmax]
            if np.all((hi < kmin) | (lo > kmax)):
                return SKIP
            if not np.all((lo <= kmin) & (hi >= kmax)):
                state = PARTIAL
        if seg_q is not None:
            qmin, qmax = seg_q.min(), seg_q.max()
            kmin, kmax = seg_kv.min(), seg_kv.max()
            if qmax < kmin or qmin > kmax:
                return SKIP
            if not (qmin == qmax == kmin == kmax):
                state = PARTIAL
        return state

    def visible(self, q_pos, kv_pos, seg_q=None, seg_kv=None) -> np.ndarray:
        """Boolean ``(len(q_pos), len(kv_pos))`` visibility for one tile."""
        kv_pos = np.asarray(kv_pos, dtype=np.int64)
        vis = np.ones((len(q_pos), len(kv_pos)), dtype=bool)
        if self.positional:
            lo, hi = self.key_bounds(q_pos)
            vis &= (kv_pos[None, :] >= lo[:, None]) & (kv_pos[None, :] <= hi[:, None])
        if seg_q is not None:
            vis &= np.asarray(seg_q)[:, None] == np.asarray(seg_kv)[None, :]
        return vis


@dataclass(frozen=True)
class BlockMask:
    """The mask for one (resident Q shard, visiting K/V block) pair.

    q_pos : (S_q_local,) int64, global positions of the resident queries.
    kv_pos : (S_kv_block,) int64, global positions of the visiting keys.
    seg_q : (B, S_q_local) int64 or None.
    seg_kv : (B, S_kv_block) int64 or None.
    All host (NumPy) arrays; a GPU backend uploads them.
    """

    spec: MaskSpec
    q_pos: np.ndarray
    kv_pos: np.ndarray
    seg_q: Optional[np.ndarray] = None
    seg_kv: Optional[np.ndarray] = None
