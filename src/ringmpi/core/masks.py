"""Which scores survive, and how they are changed, as functions of global token positions.

A :class:`ScoreSpec` describes one call's scores: which keys a query may see
(the mask rules below) and what changes a visible score (the logit softcap,
the score modifiers of :mod:`ringmpi.core.modifiers`, dropout on the
weights); it never stores an ``N x N`` matrix.  Positions are global token indices (from a
:class:`~ringmpi.core.layout.Layout`), so the same spec works on every rank and for
every layout.

Rules, for query position ``i`` and key position ``j`` with
``offset = N_kv - N_q`` (bottom-right alignment, as FlashAttention >= 2.1):

* causal: ``j <= i + offset``;
* window ``(left, right)``: ``i + offset - left <= j <= i + offset + right``
  (``None`` on a side means unbounded on that side);
* segment ids: ``seg_q[b, i] == seg_kv[b, j]`` (packed documents).

All given rules must hold.  Tiles are classified as ``SKIP`` (nothing visible),
``FULL`` (everything visible, no elementwise mask needed) or ``PARTIAL``.

This module is the one Python source of the rule (the reference): the NumPy tiles call
:meth:`ScoreSpec.classify` and ``tile_pass.visible`` (``elem_visible`` of ``kernels/rules.h``
where the C extension is loaded, :meth:`ScoreSpec.visible` otherwise), and the CuPy backend
builds its launch arguments with :meth:`ScoreSpec.key_deltas`,
:func:`kernel_scalars`, :func:`tile_bounds` and counts its tiles with
:func:`classify_tiles` -- the host twin of ``classify_tile`` in
``kernels/rules.h``, the one place the C and CUDA code state the rule.

A :class:`BlockMask` is the one object through which a block's mask and its
spec (with the modifiers and dropout) reach the block kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple

import numpy as np

if TYPE_CHECKING:
    from .dropout import Dropout
    from .modifiers import HeadModifier

SKIP, PARTIAL, FULL = 0, 1, 2  # tile classes; the kernels' TILE_* (-D defines: kernels.KERNEL_DEFINES)

WINDOW_OFF = (-1, -1)  # flash-attn's window_size: -1 is an unbounded side, (-1, -1) no window
Window = Optional[Tuple[Optional[int], Optional[int]]]  # the sides as a ScoreSpec holds them


def _integral(x) -> bool:
    """``x`` is a whole number (an int, a NumPy integer or a float such as 4.0), not a bool."""
    try:
        return not isinstance(x, (bool, np.bool_)) and int(x) == x
    except (TypeError, ValueError, OverflowError):
        return False


def window_problem(window) -> Optional[str]:
    """The problem with a sliding window (None when fine), in each spelling the library takes:
    flash-attn's ``(left, right)`` with each side a whole number >= 0 or -1 (unbounded), a side of
    None (unbounded, as :class:`ScoreSpec` holds it), or None (no window)."""
    if window is None:
        return None
    try:
        sides = tuple(window)
        ok = len(sides) == 2 and all(w is None or (_integral(w) and int(w) >= -1) for w in sides)
    except TypeError:
        ok = False
    return None if ok else f"window must be (left, right), each an int >= 0 or -1 (unbounded), got {window!r}"


def window_sides(window) -> Window:
    """``window`` (any spelling :func:`window_problem` takes) as a :class:`ScoreSpec` holds it:
    ``(left, right)`` ints with None for an unbounded side, None for no window at all.
    ValueError (:func:`window_problem`'s text) for anything else."""
    problem = window_problem(window)
    if problem is not None:
        raise ValueError(problem)
    if window is None:
        return None
    sides = tuple(None if w is None or int(w) == -1 else int(w) for w in window)
    return None if sides == (None, None) else sides


def window_of(sides: Window) -> Tuple[int, int]:
    """The sides a :class:`ScoreSpec` holds (None unbounded) as flash-attn's ``(left, right)``,
    -1 unbounded: how the calls, the command line and the HDF5 attributes spell them."""
    if sides is None:
        return WINDOW_OFF
    return tuple(-1 if w is None else int(w) for w in sides)


@dataclass(frozen=True)
class ScoreSpec:
    """The score rules of one attention call: its mask, modifiers and dropout.

    Parameters
    ----------
    causal : bool
        Bottom-right aligned causal mask.
    window : (left, right) or None
        Sliding window in global positions; either side may be ``None``.
    offset : int
        ``N_kv - N_q`` (global lengths); 0 when they are equal.
    softcap : float or None
        Score modifier (Gemma 2): a visible score ``s = scale * q.k`` becomes
        ``softcap * tanh(s / softcap)`` before the softmax (``None``: no cap).
        It changes scores, never visibility.
    exact_max : bool
        Keep the running maximum ``m`` of the online softmax exact (the NumPy
        tiles then skip their lagging-shift fast path), so that after the last
        block ``m`` is each row's largest visible score: the max logit.
    dropout : ringmpi.core.dropout.Dropout or None
        Dropout on the visible weights (a function of global positions too);
        it never changes visibility, tile classes or the softmax denominator.
    modifiers : tuple of ringmpi.core.modifiers.HeadModifier
        Score modifiers with per-head data (ALiBi: a visible score gains
        ``-slope_h * |i + offset - j|``), applied after the softcap, in
        :data:`ringmpi.core.modifiers.MODIFIERS`' order.
    """

    causal: bool = False
    window: Window = None
    offset: int = 0
    softcap: Optional[float] = None
    exact_max: bool = False
    dropout: Optional["Dropout"] = None
    modifiers: Tuple["HeadModifier", ...] = ()

    def for_heads(self, first: int, count: int) -> "ScoreSpec":
        """This spec for a call over the query heads ``[first, first + count)`` of this one:
        dropout draws those heads' masks, the modifiers take their values."""
        from dataclasses import replace

        spec = self
        if spec.dropout is not None:
            spec = replace(spec, dropout=replace(spec.dropout, head_offset=spec.dropout.head_offset + first))
        if spec.modifiers:
            part = slice(first, first + count)
            spec = replace(spec, modifiers=tuple(m.for_heads(part) for m in spec.modifiers))
        return spec

    def modifier_terms(self, q_pos, kv_pos, dtype):
        """Per-head additive score terms of the score modifiers over global positions
        ``q_pos`` x ``kv_pos``: a function ``h -> (len(q_pos), len(kv_pos))`` array in
        ``dtype``, or None without any (each modifier's
        :meth:`~ringmpi.core.modifiers.HeadModifier.terms`, added in their order)."""
        parts = [m.terms(q_pos, kv_pos, self.offset, dtype) for m in self.modifiers]
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return lambda h: sum((term(h) for term in parts[1:]), parts[0](h))

    def __post_init__(self):
        if self.window is not None:
            left, right = self.window
            for side in (left, right):
                if side is not None and int(side) < 0:
                    raise ValueError(f"window sides must be >= 0 or None, got {self.window}")

    def key_deltas(self) -> Tuple[Optional[int], Optional[int]]:
        """``(lo_delta, hi_delta)``: key ``j`` is visible from query ``i`` by position
        when ``j >= i + lo_delta`` and ``j <= i + hi_delta`` (``None``: unbounded side).
        Causal, window and the bottom-right offset folded into two numbers."""
        off = int(self.offset)
        los, his = [], []
        if self.causal:
            his.append(off)
        if self.window is not None:
            left, right = self.window
            if left is not None:
                los.append(off - int(left))
            if right is not None:
                his.append(off + int(right))
        return (max(los) if los else None), (min(his) if his else None)

    def key_bounds(self, q_pos: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Inclusive ``[lo, hi]`` key-position bounds per query position (int64)."""
        q_pos = np.asarray(q_pos, dtype=np.int64)
        big = np.iinfo(np.int64).max // 4
        lo_delta, hi_delta = self.key_deltas()
        lo = np.full(q_pos.shape, -big, dtype=np.int64) if lo_delta is None else q_pos + lo_delta
        hi = np.full(q_pos.shape, big, dtype=np.int64) if hi_delta is None else q_pos + hi_delta
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
    """The mask for one (resident Q shard, visiting K/V block) pair: the one
    object a block kernel receives about which scores survive (see the module
    docstring for where a new score modifier goes).

    q_pos : (S_q_local,) int64, global positions of the resident queries.
    kv_pos : (S_kv_block,) int64, global positions of the visiting keys.
    seg_q : (B, S_q_local) int64 or None.
    seg_kv : (B, S_kv_block) int64 or None.
    All host (NumPy) arrays; a GPU backend uploads them.
    """

    spec: ScoreSpec
    q_pos: np.ndarray
    kv_pos: np.ndarray
    seg_q: Optional[np.ndarray] = None
    seg_kv: Optional[np.ndarray] = None


# ------------------------------------------------------------ the kernels' view of the rule
def kernel_scalars(spec: ScoreSpec):
    """``(has_lo int32, lo_delta int64, has_hi int32, hi_delta int64)``: the typed
    launch scalars of :meth:`ScoreSpec.key_deltas` (``MASK_PARAMS`` in common.cuh)."""
    lo, hi = spec.key_deltas()
    return (np.int32(lo is not None), np.int64(0 if lo is None else lo),
            np.int32(hi is not None), np.int64(0 if hi is None else hi))


def modifier_scalars(spec: ScoreSpec):
    """``(softcap float64,)``: the typed launch scalars of the score modifiers
    (``MOD_PARAMS`` in common.cuh); ``softcap = 0`` means no cap."""
    return (np.float64(0.0 if spec.softcap is None else spec.softcap),)


def tile_bounds(pos: np.ndarray, seg, tile: int) -> np.ndarray:
    """Per-tile (min, max) of positions, then per (batch, tile) of segment ids.

    ``pos (S,)`` int, ``seg (B, S)`` int or None, ``tile`` rows per tile.
    Layout (int64, flat): ``[ntiles, 2]`` for positions followed, when ``seg``
    is given, by ``[B, ntiles, 2]`` -- as ``classify_tile`` in rules.h reads it.
    """
    pos = np.asarray(pos, dtype=np.int64)
    starts = np.arange(0, len(pos), tile)
    parts = [np.stack([np.minimum.reduceat(pos, starts), np.maximum.reduceat(pos, starts)], axis=-1).ravel()]
    if seg is not None:
        seg = np.asarray(seg, dtype=np.int64)
        parts.append(np.stack([np.minimum.reduceat(seg, starts, axis=1),
                               np.maximum.reduceat(seg, starts, axis=1)], axis=-1).ravel())
    return np.ascontiguousarray(np.concatenate(parts))


def classify_tiles(spec: ScoreSpec, q_bounds: np.ndarray, kv_bounds: np.ndarray,
                   nqt: int, nkt: int, batch: int, has_seg: bool) -> np.ndarray:
    """Every tile's class as the kernels compute it (``classify_tile`` in kernels/rules.h).

    ``q_bounds``/``kv_bounds`` from :func:`tile_bounds` with ``nqt``/``nkt`` tiles.
    Returns ``(B or 1, nqt, nkt)`` int8 of ``SKIP``/``PARTIAL``/``FULL`` (one
    batch entry stands for all when there are no segment ids).  Conservative
    like the kernel: a ``PARTIAL`` tile may turn out fully hidden.
    """
    q_bounds, kv_bounds = np.asarray(q_bounds, np.int64), np.asarray(kv_bounds, np.int64)
    qlo, qhi = q_bounds[0:2 * nqt:2, None], q_bounds[1:2 * nqt:2, None]
    klo, khi = kv_bounds[0:2 * nkt:2][None, :], kv_bounds[1:2 * nkt:2][None, :]
    lo, hi = spec.key_deltas()
    skip = np.zeros((nqt, nkt), dtype=bool)
    partial = np.zeros((nqt, nkt), dtype=bool)
    if hi is not None:
        skip |= qhi + hi < klo
        partial |= qlo + hi < khi
    if lo is not None:
        skip |= qlo + lo > khi
        partial |= qhi + lo > klo
    skip, partial = skip[None], partial[None]
    if has_seg:
        sq = q_bounds[2 * nqt:].reshape(batch, nqt, 1, 2)
        sk = kv_bounds[2 * nkt:].reshape(batch, 1, nkt, 2)
        skip = skip | (sq[..., 1] < sk[..., 0]) | (sq[..., 0] > sk[..., 1])
        partial = partial | ~((sq[..., 0] == sq[..., 1]) & (sk[..., 0] == sk[..., 1]) & (sq[..., 0] == sk[..., 0]))
    out = np.where(partial, PARTIAL, FULL).astype(np.int8)
    out[np.broadcast_to(skip, out.shape)] = SKIP
    return out


def tile_counts(classes: np.ndarray, has_seg: bool, batch: int):
    """``(tiles computed, tiles skipped)`` of :func:`classify_tiles`' ``classes`` over ``batch``
    entries (without segment ids its one row stands for every entry)."""
    per_class = 1 if has_seg else batch
    skipped = int(np.count_nonzero(classes == SKIP)) * per_class
    return classes.size * per_class - skipped, skipped