"""Which global token positions each rank holds: produced by a layout, or given.

A :class:`Placement` is one call's answer for one of its sequences (queries
or keys/values): the global length ``N``, every rank's token count and this
rank's own positions.  A :class:`~ringmpi.core.layout.Layout` produces one
(:func:`from_layout`); explicit positions (``ring_attention(positions_q=,
positions_kv=)``: any assignment of tokens to ranks, such as whole documents
placed on ranks) are checked across the ranks without gathering them: each
rank sends a :func:`summary` of its positions inside the call's planning
allgather and :func:`placement_problem` checks, on every rank alike, that they
lie in ``[0, N)``, that none repeats on a rank, and that the counts and the
power sums ``sum p^k`` (k = 1, 2, 3, modulo 2^64) over all ranks are those of
``0 .. N-1``.  A position given twice on two ranks (so another is missing)
passes only if the two multisets also agree in those three sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .host import to_host
from .layout import Layout

_MOD = 1 << 64


@dataclass(frozen=True)
class Placement:
    """One sequence's tokens over the ranks of a call.

    n : the global length; counts : (P,) int64 tokens per rank (in rank order);
    mine : (S_local,) int64 this rank's global positions, in local order;
    layout : the :class:`~ringmpi.core.layout.Layout` that produced them, or None for
    positions the caller gave (then only this rank's are known here).
    """

    n: int
    counts: np.ndarray
    mine: np.ndarray
    layout: Optional[Layout] = None


def from_layout(layout: Layout, rank: int) -> Placement:
    """The placement a layout produces, seen from ``rank``."""
    return Placement(n=layout.n, counts=layout.counts(), mine=layout.indices(rank), layout=layout)


def given(pos: np.ndarray, counts: Sequence[int]) -> Placement:
    """The placement of checked positions ``pos`` (this rank's), with every rank's ``counts``."""
    counts = np.asarray(counts, dtype=np.int64)
    return Placement(n=int(counts.sum()), counts=counts, mine=pos)


def as_positions(x) -> Optional[np.ndarray]:
    """Host NumPy view of a given positions argument (NumPy, CuPy or torch; None stays None)."""
    if x is None:
        return None
    if type(x).__module__.split(".")[0] == "torch":
        x = x.detach().cpu().numpy()
    return to_host(x)


def local_problem(name: str, pos: Optional[np.ndarray], rows: int) -> Optional[str]:
    """This rank's own problem with ``pos`` for a shard of ``rows`` tokens, or None."""
    if pos is None:
        return None
    if pos.shape != (rows,):
        return f"{name} must have shape (S_local,) = ({rows},), got {tuple(pos.shape)}"
    if pos.dtype.kind not in "iu":
        return f"{name} must be integers, got dtype {pos.dtype}"
    return None


def summary(pos: Optional[np.ndarray]) -> Optional[tuple]:
    """``(count, min, max, repeats, s1, s2, s3)`` of this rank's positions (power sums modulo
    2^64), or None when none were given.  O(S_local log S_local), a few int64 passes."""
    if pos is None:
        return None
    if len(pos) == 0:
        return (0, None, None, 0, 0, 0, 0)
    p = np.asarray(pos, dtype=np.int64)
    repeats = len(p) - len(np.unique(p))
    u = p.astype(np.uint64)  # wraps modulo 2^64, as the sums below do
    sq = u * u
    return (len(p), int(p.min()), int(p.max()), repeats,
            int(u.sum(dtype=np.uint64)), int(sq.sum(dtype=np.uint64)), int((sq * u).sum(dtype=np.uint64)))


def placement_problem(name: str, summaries: Sequence[tuple]) -> Optional[str]:
    """The problem with every rank's :func:`summary` (rank order) as positions ``0 .. N-1``
    with ``N`` the sum of the counts, or None.  The same answer on every rank."""
    n = sum(s[0] for s in summaries)
    for r, (count, lo, hi, repeats, *_) in enumerate(summaries):
        if count and (lo < 0 or hi >= n):
            return (f"{name} must lie in [0, N = {n}) (the sum of the shard lengths): rank {r} "
                    f"holds positions {lo} .. {hi}")
        if repeats:
            return f"{name}: rank {r} holds {repeats} position(s) more than once"
    want = (n * (n - 1) // 2, (n - 1) * n * (2 * n - 1) // 6, (n * (n - 1) // 2) ** 2)
    got = tuple(sum(s[4 + k] for s in summaries) % _MOD for k in range(3))
    if got != tuple(w % _MOD for w in want):
        return (f"{name} over all ranks are not a permutation of 0 .. {n - 1}: some position is "
                "held by two ranks and another by none")
    return None
