"""Attention work of packed documents, and a placement that balances it over ranks.

A *pack* is one sequence of documents (lengths in sequence order); a query
sees keys of its own document only, within the causal mask and the sliding
window when given.  The *work* of a set of queries is the number of (query,
key) pairs they see: what the block ops compute, up to tiles.  All counts
here are closed forms per document or per token (no ``N x N`` array).

:func:`balanced_pieces` places a pack on ``P`` ranks so that every rank's
work is within one split unit of ``W / P`` while token counts stay near
``N / P``: documents are dealt whole, densest and sparsest alternately (a
rank's mix aims at both targets), and the one document that would overshoot
a rank's work is split there.  A causal document splits into ranges of
*pairs* of tokens ``{i, L-1-i}`` (its head and tail together, as zigzag pairs
chunks), each pair seeing ``L + 1`` keys, so every piece has its document's
work per token; any other document splits into ranges of tokens.  Every rank
computes the same placement from the lengths alone, with no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

Window = Optional[Tuple[Optional[int], Optional[int]]]


# ------------------------------------------------------------------ work in closed form
def _reach(causal: bool, window: Window) -> Tuple[Optional[int], Optional[int]]:
    """``(left, right)``: query ``t`` of a document sees its keys ``[t - left, t + right]``
    (``None``: the document's edge)."""
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(int(right), 0)
    return left, right


def prefix_pairs(length: int, x: int, causal: bool, window: Window = None) -> int:
    """Visible (query, key) pairs of the first ``x`` queries of a ``length``-token document."""
    left, right = _reach(causal, window)
    x = int(x)
    if x <= 0:
        return 0
    top = length - 1
    if right is None:
        his = x * top
    else:  # sum of min(top, t + right) over t < x
        c = min(max(length - right, 0), x)
        his = c * (c - 1) // 2 + c * right + (x - c) * top
    if left is None:
        los = 0
    else:  # sum of max(0, t - left) over t < x
        m = max(0, x - left)
        los = m * (m - 1) // 2
    return his - los + x


def _prefix_pairs_of(lengths: np.ndarray, x: np.ndarray, causal: bool, window: Window) -> np.ndarray:
    """:func:`prefix_pairs` elementwise over int64 arrays (exact below 2^63 pairs)."""
    left, right = _reach(causal, window)
    n, x = lengths.astype(np.int64), x.astype(np.int64)
    top = n - 1
    if right is None:
        his = x * top
    else:
        c = np.clip(n - right, 0, x)
        his = c * (c - 1) // 2 + c * right + (x - c) * top
    if left is None:
        los = 0
    else:
        m = np.maximum(0, x - left)
        los = m * (m - 1) // 2
    return his - los + x


def visible_pairs(positions: np.ndarray, lengths: Sequence[int], causal: bool, window: Window = None) -> int:
    """Visible pairs of the queries at global ``positions`` of a pack of ``lengths`` (one rank's
    work under any placement): per run of consecutive positions, a difference of the pack's
    prefix work, so O(runs log documents)."""
    positions = np.sort(np.asarray(positions, dtype=np.int64))
    if len(positions) == 0:
        return 0
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    done = np.concatenate([[0], np.cumsum(_prefix_pairs_of(lengths, lengths, causal, window))])
    cut = np.flatnonzero(np.diff(positions) != 1) + 1
    first = positions[np.concatenate([[0], cut])]
    last = positions[np.concatenate([cut - 1, [len(positions) - 1]])] + 1

    def prefix(x):  # visible pairs of the queries at positions < x
        doc = np.minimum(np.searchsorted(ends, x, side="right"), len(lengths) - 1)
        return done[doc] + _prefix_pairs_of(lengths[doc], np.minimum(x - starts[doc], lengths[doc]),
                                            causal, window)
    return int((prefix(last) - prefix(first)).sum())


def visible_keys(positions: np.ndarray, lengths: Sequence[int], causal: bool, window: Window = None) -> np.ndarray:
    """``(2, m)`` merged half-open intervals of the key positions that some query at ``positions``
    sees (a run of consecutive queries in one document sees one interval: its bounds move
    monotonically), O(runs log documents)."""
    positions = np.sort(np.asarray(positions, dtype=np.int64))
    if len(positions) == 0:
        return np.zeros((2, 0), dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    doc = np.searchsorted(ends, positions, side="right")
    cut = np.flatnonzero((np.diff(positions) != 1) | (np.diff(doc) != 0)) + 1
    first, last = positions[np.concatenate([[0], cut])], positions[np.concatenate([cut - 1, [len(positions) - 1]])]
    d = doc[np.concatenate([[0], cut])]
    start, stop = ends[d] - lengths[d], ends[d]
    left, right = _reach(causal, window)
    lo = start if left is None else np.maximum(start, first - left)
    hi = stop if right is None else np.minimum(stop, last + right + 1)
    out_lo, out_hi = [], []
    for a, b in zip(lo.tolist(), hi.tolist()):  # sorted by first query: merge in order
        if out_hi and a <= out_hi[-1]:
            out_hi[-1] = max(out_hi[-1], b)
        else:
            out_lo.append(a)
            out_hi.append(b)
    return np.array([out_lo, out_hi], dtype=np.int64)


def seen_elsewhere(positions: np.ndarray, lengths: Sequence[int], causal: bool, window: Window = None) -> int:
    """How many keys held by other ranks the queries at ``positions`` (one rank's, which also
    holds the keys at ``positions``) can see: what a schedule must bring that rank, at least."""
    keys = visible_keys(positions, lengths, causal, window)
    own = np.sort(np.asarray(positions, dtype=np.int64))
    inside = np.searchsorted(own, keys[1], side="left") - np.searchsorted(own, keys[0], side="left")
    return int((keys[1] - keys[0]).sum() - inside.sum())


# ------------------------------------------------------------------ one document's split units
@dataclass(frozen=True)
class _Document:
    """A document at ``start`` of ``length`` tokens, split in units: pairs ``{i, L-1-i}`` for a
    causal document the window does not cut (``paired``), else single tokens."""

    start: int
    length: int
    causal: bool
    window: Window
    paired: bool

    @property
    def units(self) -> int:
        return (self.length + 1) // 2 if self.paired else self.length

    def _prefix(self, x: int) -> int:
        return prefix_pairs(self.length, x, self.causal, self.window)

    def _tail(self, u1: int) -> int:
        """First token of the tail half of units ``[., u1)`` (the middle token counted once)."""
        return max(self.length - u1, u1)

    def work(self, u0: int, u1: int) -> int:
        """Visible pairs of the queries of units ``[u0, u1)``."""
        head = self._prefix(u1) - self._prefix(u0)
        if not self.paired:
            return head
        return head + self._prefix(self.length - u0) - self._prefix(self._tail(u1))

    def tokens(self, u0: int, u1: int) -> List[Tuple[int, int]]:
        """Global token intervals ``[(a, b), ...]`` of units ``[u0, u1)``."""
        s = self.start
        if not self.paired:
            return [(s + u0, s + u1)]
        tail = (s + self._tail(u1), s + self.length - u0)
        return [(s + u0, s + u1)] + ([tail] if tail[1] > tail[0] else [])

    def count(self, u0: int, u1: int) -> int:
        return sum(b - a for a, b in self.tokens(u0, u1))

    def units_for(self, u0: int, want: float) -> int:
        """The ``u1`` in ``[u0, units]`` whose work ``work(u0, u1)`` is nearest ``want``."""
        lo, hi = u0, self.units
        while lo < hi:  # the first u1 with work >= want
            mid = (lo + hi) // 2
            if self.work(u0, mid) >= want:
                hi = mid
            else:
                lo = mid + 1
        if lo > u0 and want - self.work(u0, lo - 1) <= self.work(u0, lo) - want:
            return lo - 1
        return lo


def _document(start: int, length: int, causal: bool, window: Window) -> _Document:
    left = None if window is None else window[0]
    return _Document(start, length, causal, window, causal and (left is None or int(left) >= length - 1))


def balanced_pieces(lengths: Sequence[int], world_size: int, causal: bool,
                    window: Window = None) -> List[List[Tuple[int, int]]]:
    """Each rank's global token intervals ``[(a, b), ...]`` (ascending, disjoint) of a pack of
    ``lengths`` placed on ``world_size`` ranks with balanced work (see the module docstring).

    Documents are ordered by work per token, densest first (ties: sequence order).  Rank
    ``r < P - 1`` aims at the work ``W_left / (P - r)`` and the tokens ``N_left / (P - r)``:
    it takes from the dense end while its share of the work lags its share of the tokens,
    else from the sparse end; a dense document is cut where the rank's rest of both targets
    can still be met by the sparse pool (its mean work per token), a sparse one where the
    work target is met.  The last rank takes what is left.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    work = _prefix_pairs_of(lengths, lengths, causal, window)
    keep = np.flatnonzero(lengths > 0)
    density = work[keep] / lengths[keep]
    order = [int(i) for i in keep[np.lexsort((keep, -density))]]
    work_of, length_of = work.tolist(), lengths.tolist()
    split: dict = {}  # document -> (its _Document, units placed so far), once it is cut
    pieces: List[list] = [[] for _ in range(world_size)]  # per rank: whole documents or (doc, u0, u1)
    front, back = 0, len(order) - 1
    work_left, tokens_left = int(work.sum()), int(lengths.sum())
    # work and tokens of order[:j], to estimate what the sparse end holds
    cum_w = np.concatenate([[0], np.cumsum(work[order])]) if order else np.zeros(1)
    cum_c = np.concatenate([[0], np.cumsum(lengths[order])]) if order else np.zeros(1)

    def rest(i: int) -> Tuple[int, int]:
        """Work and tokens of document ``i`` not placed yet."""
        if i not in split:
            return work_of[i], length_of[i]
        d, u0 = split[i]
        return d.work(u0, d.units), d.count(u0, d.units)

    for rank in range(world_size - 1):
        target_w = work_left / (world_size - rank)
        target_c = tokens_left / (world_size - rank)
        w = c = 0
        mixed = False  # a dense document was cut to this rank's mix: the rest is sparse
        while front <= back and w < target_w:
            dense_turn = front == back or (not mixed and w * target_c <= c * target_w)
            i = order[front] if dense_turn else order[back]
            rest_w, rest_c = rest(i)
            need_w = target_w - w
            want = need_w
            if dense_turn and front != back:
                want = _dense_share(work_of[i] / length_of[i], need_w, max(target_c - c, 0.0),
                                    cum_w, cum_c, front + 1, back)
            if rest_w <= want:  # the whole rest
                if i in split:
                    d, u0 = split[i]
                    pieces[rank].append((i, u0, d.units))
                else:
                    pieces[rank].append(i)
                w, c = w + rest_w, c + rest_c
                work_left -= rest_w
                tokens_left -= rest_c
                if dense_turn:
                    front += 1
                else:
                    back -= 1
                continue
            d, u0 = split.get(i) or (_document(int(starts[i]), length_of[i], causal, window), 0)
            u1 = max(d.units_for(u0, want), u0 + 1)
            piece_w, piece_c = d.work(u0, u1), d.count(u0, u1)
            pieces[rank].append((i, u0, u1))
            split[i] = (d, u1)
            w, c = w + piece_w, c + piece_c
            work_left -= piece_w
            tokens_left -= piece_c
            if u1 == d.units:
                if dense_turn:
                    front += 1
                else:
                    back -= 1
            elif not dense_turn or front == back:
                break  # a sparse (or the last) document cut at the work target: the rank is full
            else:
                mixed = True
    for j in range(front, back + 1):
        i = order[j]
        if i in split:
            d, u0 = split[i]
            if u0 < d.units:
                pieces[-1].append((i, u0, d.units))
        else:
            pieces[-1].append(i)
    result = []
    for rank_pieces in pieces:
        spans = []
        for piece in rank_pieces:
            if isinstance(piece, tuple):
                i, u0, u1 = piece
                spans.extend(split[i][0].tokens(u0, u1))
            else:
                spans.append((int(starts[piece]), int(starts[piece]) + length_of[piece]))
        result.append(_merged(sorted(spans)))
    return result


def _dense_share(rho_d: float, need_w: float, need_c: float, cum_w, cum_c, lo: int, back: int) -> float:
    """The work a rank should take from a dense document (``rho_d`` pairs per token) so that
    sparse documents from the end of the order (``order[lo .. back]``, prefix sums ``cum_w``,
    ``cum_c``) fill the rest of ``need_w`` pairs with ``need_c`` tokens: ``x`` solves
    ``x / rho_d + (need_w - x) / rho_s = need_c`` with ``rho_s`` the work per token of the
    documents that fill ``need_w - x`` (found in a few rounds); ``need_w`` when nothing
    sparse can balance it."""
    x = need_w
    for _ in range(4):
        fill = need_w - x
        top_w, top_c = cum_w[back + 1], cum_c[back + 1]
        # the fewest documents from the end with at least `fill` work (at least one)
        j = int(np.searchsorted(-(top_w - cum_w[lo:back + 1]), -max(fill, 1e-9), side="right")) - 1 + lo
        j = min(max(j, lo), back)
        sw, sc = top_w - cum_w[j], top_c - cum_c[j]
        rho_s = sw / sc if sc else rho_d
        if rho_s >= rho_d:
            return need_w
        x = min(max((need_w - rho_s * need_c) / (1.0 - rho_s / rho_d), 0.0), need_w)
    return x if x > 0 else need_w


def _merged(spans: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


# ------------------------------------------------------------------ packs for measurements
def lognormal_documents(n: int, mean: float, sigma: float, seed: int = 0) -> List[int]:
    """Document lengths drawn from a log-normal of the given ``mean`` and ``sigma`` (of the
    underlying normal), at least 1 token each, packed to exactly ``n`` tokens (the last cut)."""
    rng = np.random.default_rng(seed)
    mu = np.log(mean) - sigma * sigma / 2
    lengths, total = [], 0
    while total < n:
        length = max(1, int(round(float(rng.lognormal(mu, sigma)))))
        length = min(length, n - total)
        lengths.append(length)
        total += length
    return lengths
