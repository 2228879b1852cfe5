"""The routed schedule's plan: which K/V rows of each rank the queries of each other rank can see.

Each rank sums its tokens up as *runs* (:class:`Runs`): maximal stretches of
local rows whose global positions rise by one and whose segment ids (every
batch entry's) stay the same.  A packed sequence has O(documents) runs per
rank, not O(N) rows.  The runs of every rank's queries and keys are gathered
once per call (:func:`gather_plan`, one allgather), and every rank computes
the same :class:`RoutePlan` from them: for each (receiver, sender) pair the
sender's local row intervals that some query of the receiver sees (same
segment id in some batch entry, inside the causal and window bounds of
:meth:`ringmpi.core.masks.ScoreSpec.key_deltas`) -- per receiver one sorted
sweep over the merged visibility windows of its query runs, O(runs log runs).

Steps and rounds: at ring step ``t`` a rank receives from ring rank
``src(t) = order[pos - t]`` and sends to ``dst(t) = order[pos + t]`` (the
ring's own pairing, with the data going straight to its reader).  Steps
``1 .. P-1`` are cut into *rounds* of consecutive steps, the same on every
rank, such that no rank receives or sends more than ``cap`` rows in one round
(``cap``: the largest K/V shard, one ring slot): a round's transfers are
posted while the round before computes, two rounds' buffers at a time, so
memory stays that of a ring's slots whatever P, and a sparse plan is one
round, all posted before the rank's own block computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..core.masks import ScoreSpec


@dataclass(frozen=True)
class Runs:
    """One rank's tokens as runs: ``row`` (R,) first local row, ``pos`` (R,) its global position,
    ``length`` (R,), ``seg`` (B, R) segment ids of each batch entry (None without segment ids)."""

    row: np.ndarray
    pos: np.ndarray
    length: np.ndarray
    seg: Optional[np.ndarray] = None

    @property
    def rows(self) -> int:
        return int(self.length.sum())

    def positions(self, rows: np.ndarray) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """Global positions ``(n,)`` and segment ids ``(B, n)`` (or None) of local ``rows``."""
        run = np.searchsorted(self.row, rows, side="right") - 1
        pos = self.pos[run] + (rows - self.row[run])
        return pos, None if self.seg is None else np.ascontiguousarray(self.seg[:, run])


def runs_of(pos: np.ndarray, seg: Optional[np.ndarray]) -> Runs:
    """The :class:`Runs` of local positions ``pos (S,)`` and segment ids ``seg (B, S)`` or None."""
    pos = np.asarray(pos, dtype=np.int64)
    if len(pos) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Runs(empty, empty, empty, None if seg is None else np.zeros((seg.shape[0], 0), np.int64))
    cut = np.diff(pos) != 1
    if seg is not None:
        cut |= (np.diff(seg, axis=1) != 0).any(axis=0)
    first = np.concatenate([[0], np.flatnonzero(cut) + 1]).astype(np.int64)
    length = np.diff(np.concatenate([first, [len(pos)]])).astype(np.int64)
    return Runs(first, pos[first], length, None if seg is None else np.ascontiguousarray(seg[:, first], np.int64))


def _intervals(start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    return np.stack([start, stop]).astype(np.int64).reshape(2, -1)


def merge_intervals(owner: np.ndarray, start: np.ndarray, stop: np.ndarray):
    """Half-open intervals grouped by ``owner`` merged where they overlap or touch:
    ``(owner, start, stop)`` sorted by owner then start."""
    if len(start) == 0:
        return owner, start, stop
    order = np.lexsort((start, owner))
    owner, start, stop = owner[order], start[order], stop[order]
    span = int(max(stop.max(), 0)) + 2
    key_start = owner * span + start
    key_stop = owner * span + stop
    reach = np.maximum.accumulate(key_stop)
    new = np.concatenate([[True], key_start[1:] > reach[:-1]])
    first = np.flatnonzero(new)
    return owner[first], start[first], np.maximum.reduceat(key_stop, first) - owner[first] * span


def _visible_rows(q: Runs, senders: Sequence[Tuple[int, Runs]], deltas, n_kv: int, batch: int):
    """``(sender, start, stop)`` local row intervals of the senders' runs that some query of ``q``
    sees: per batch entry, the query runs' windows ``[pos + lo, last + hi]`` merged per segment
    id, intersected with the key runs of the same segment id."""
    lo_d, hi_d = deltas
    owners, starts, stops = [], [], []
    k_owner = np.concatenate([np.full(len(r.row), s, np.int64) for s, r in senders] or [np.zeros(0, np.int64)])
    k_row = np.concatenate([r.row for _, r in senders] or [np.zeros(0, np.int64)])
    k_pos = np.concatenate([r.pos for _, r in senders] or [np.zeros(0, np.int64)])
    k_len = np.concatenate([r.length for _, r in senders] or [np.zeros(0, np.int64)])
    if len(q.row) == 0 or len(k_row) == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    span = n_kv + 3  # positions clipped to [-1, n_kv], shifted by one: [0, n_kv + 1]
    win_lo = np.clip(q.pos + lo_d if lo_d is not None else np.full_like(q.pos, -1), -1, n_kv) + 1
    win_hi = np.clip(q.pos + q.length - 1 + hi_d if hi_d is not None else np.full_like(q.pos, n_kv), -1, n_kv) + 1
    k_lo, k_hi = k_pos + 1, k_pos + k_len  # shifted by one, inclusive
    for b in range(batch if q.seg is not None else 1):
        if q.seg is not None:
            k_seg = np.concatenate([r.seg[b] for _, r in senders])
            ids, inverse = np.unique(np.concatenate([q.seg[b], k_seg]), return_inverse=True)
            gq, gk = inverse[:len(q.row)].astype(np.int64), inverse[len(q.row):].astype(np.int64)
        else:
            gq, gk = np.zeros(len(q.row), np.int64), np.zeros(len(k_row), np.int64)
        # the query runs' windows, merged per segment id (composite keys sort by id, then position)
        ws = np.lexsort((win_lo, gq))
        c_lo, c_hi = gq[ws] * span + win_lo[ws], gq[ws] * span + win_hi[ws]
        reach = np.maximum.accumulate(c_hi)
        first = np.flatnonzero(np.concatenate([[True], c_lo[1:] > reach[:-1] + 1]))
        u_lo, u_hi = c_lo[first], np.maximum.reduceat(c_hi, first)
        # each key run against the merged windows it overlaps (both families are disjoint)
        key_lo, key_hi = gk * span + k_lo, gk * span + k_hi
        i0 = np.searchsorted(u_hi, key_lo, side="left")
        i1 = np.searchsorted(u_lo, key_hi, side="right") - 1
        count = np.maximum(i1 - i0 + 1, 0)
        total = int(count.sum())
        if total == 0:
            continue
        run = np.repeat(np.arange(len(k_row)), count)
        offset = np.concatenate([[0], np.cumsum(count)[:-1]])
        u = i0[run] + (np.arange(total) - offset[run])
        a = np.maximum(key_lo[run], u_lo[u]) - gk[run] * span  # shifted positions, inclusive
        z = np.minimum(key_hi[run], u_hi[u]) - gk[run] * span
        keep = z >= a
        run, a, z = run[keep], a[keep], z[keep]
        owners.append(k_owner[run])
        starts.append(k_row[run] + (a - k_lo[run]))
        stops.append(k_row[run] + (z - k_lo[run]) + 1)
    if not owners:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    return merge_intervals(np.concatenate(owners), np.concatenate(starts), np.concatenate(stops))


@dataclass(frozen=True)
class RoutePlan:
    """What one rank sends and receives under the routed schedule (the same plan on every rank).

    rows : (P, P) int64, ``rows[r, s]``: how many of sender ``s``'s K/V rows receiver ``r``'s
        queries see (0 on the diagonal: a rank's own block never travels).
    incoming : per sender ``s`` the ``(2, m)`` local row intervals of ``s`` this rank receives.
    outgoing : per receiver ``r`` the ``(2, m)`` local row intervals of this rank it sends.
    kv_runs : every rank's key runs (positions and segment ids of received rows come from them).
    order : the ranks in ring order; rounds : the steps of each round (round 0 is ``[0]``).
    """

    rank: int
    rows: np.ndarray
    incoming: List[np.ndarray]
    outgoing: List[np.ndarray]
    kv_runs: List[Runs]
    order: List[int]
    rounds: List[List[int]]

    @property
    def size(self) -> int:
        return len(self.order)

    def source(self, step: int) -> int:
        """The rank whose rows reach this rank at ``step``."""
        pos = self.order.index(self.rank)
        return self.order[(pos - step) % self.size]

    def dest(self, step: int) -> int:
        """The rank this rank's rows go to at ``step``."""
        pos = self.order.index(self.rank)
        return self.order[(pos + step) % self.size]

    def ring_rows(self) -> int:
        """K/V rows the ring would move in one pass (every rank receives every other block)."""
        counts = np.array([r.rows for r in self.kv_runs], dtype=np.int64)
        return int((self.size - 1) * counts.sum())

    def routed_rows(self) -> int:
        """K/V rows this plan moves (every rank, one pass)."""
        return int(self.rows.sum())


def make_plan(rank: int, q_runs: Sequence[Runs], kv_runs: Sequence[Runs], spec: ScoreSpec, order: Sequence[int],
              batch: int) -> RoutePlan:
    """The :class:`RoutePlan` of ``rank`` from every rank's runs (rank order) and the mask spec."""
    size = len(q_runs)
    n_kv = int(sum(r.rows for r in kv_runs))
    deltas = spec.key_deltas()
    rows = np.zeros((size, size), dtype=np.int64)
    incoming = [np.zeros((2, 0), np.int64) for _ in range(size)]
    outgoing = [np.zeros((2, 0), np.int64) for _ in range(size)]
    for r in range(size):
        senders = [(s, kv_runs[s]) for s in range(size) if s != r]
        owner, start, stop = _visible_rows(q_runs[r], senders, deltas, n_kv, batch)
        if len(owner):
            rows[r] = np.bincount(owner, weights=stop - start, minlength=size).astype(np.int64)
        for s in np.unique(owner):
            pick = owner == s
            if r == rank:
                incoming[int(s)] = _intervals(start[pick], stop[pick])
            if int(s) == rank:
                outgoing[r] = _intervals(start[pick], stop[pick])
    order = list(order)
    cap = max(max((r.rows for r in kv_runs), default=0), 1)
    return RoutePlan(rank, rows, incoming, outgoing, list(kv_runs), order, _rounds(rows, order, cap))


def _rounds(rows: np.ndarray, order: List[int], cap: int) -> List[List[int]]:
    """Steps ``1 .. P-1`` cut into rounds of consecutive steps in which no rank receives, nor
    sends, more than ``cap`` rows (a lone step always fits: a block has at most ``cap`` rows)."""
    size = len(order)
    where = np.argsort(order)  # rank -> position in the ring
    ranks = np.arange(size)
    rounds: List[List[int]] = [[0]]
    current: List[int] = []
    taken_in = np.zeros(size, np.int64)
    taken_out = np.zeros(size, np.int64)
    for step in range(1, size):
        src = np.asarray(order)[(where - step) % size]  # each rank's source at this step
        got = rows[ranks, src]                           # rows each rank receives
        sent = np.zeros(size, np.int64)
        np.add.at(sent, src, got)                        # rows each rank sends
        if current and ((taken_in + got).max() > cap or (taken_out + sent).max() > cap):
            rounds.append(current)
            current, taken_in[:], taken_out[:] = [], 0, 0
        current.append(step)
        taken_in += got
        taken_out += sent
    if current:
        rounds.append(current)
    return rounds


def gather_plan(comm, q_pos, seg_q, kv_pos, seg_kv, spec: ScoreSpec, order, timeout=None) -> RoutePlan:
    """Collective over ``comm``: every rank's runs in one allgather, then this rank's plan."""
    from ..runtime.watchdog import phase

    mine = (runs_of(q_pos, seg_q), runs_of(kv_pos, seg_kv))
    with phase("the routed schedule's plan (allgather of position and segment runs)", timeout):
        every = comm.allgather(mine)
    batch = 1 if seg_q is None else seg_q.shape[0]
    order = list(range(comm.Get_size())) if order is None else order
    return make_plan(comm.Get_rank(), [e[0] for e in every], [e[1] for e in every], spec, order, batch)
