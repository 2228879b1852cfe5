"""What a call will cost under each schedule: a model from a few measured (or described) parts.

Pure arithmetic, no MPI: :mod:`ringmpi.parallel.cost_measure` fills a :class:`Machine` by
measuring (the block op's rate, cached per machine; each link level's latency and
bandwidth, measured once per communicator) and ``schedule="auto"`` takes the
fastest prediction that fits the memory budget; ``ringmpi plan`` fills it from a
description of a cluster.  The parts:

* **compute** ``C``: the (query, key) pairs of the busiest rank times
  ``2 (D + D_v)`` FLOPs (FlashAttention's count; the backward 2.5x), over the block
  op's rate (the backward's own rate where the machine gives one: FlashAttention's
  backward runs below its forward's rate; with segment ids ``Machine.segment_rate``
  where measured; else the forward's).  The pairs are those of the tiles its block
  ops compute where the call gave them (``Shape.tile_pairs``: a partially masked tile
  is computed whole), else the visible ones (``density``).  Every schedule computes the
  same pairs; they differ in what they move and how much of it hides behind ``C``.
* **scans** ``B``: a block op's cost beyond its tiles, ``Machine.block_overhead`` per
  visiting K/V row and K/V head (measured: a block whose tiles are all masked; 0 on a
  described machine): the ring pays a whole block's every step, masked or not; routed
  and the all-gather the rows they receive.
* **ring** (P ranks, node-major order: one hop per node crosses the inter-node link
  per step): the own block, then ``P - 1`` steps of
  ``max(C / P + B, latency + shard bytes / bandwidth)``; the backward's dK/dV partial
  sums travel with the K/V and take one more hop home.
* **routed**: the rank's own block, then ``max(rest of C, transfer of the visible rows)``
  (one message per sender that has rows to send); where the route plan is known
  (``Shape.routed_split``) the rows from the rank's own node cross the intra link and
  those all of a node's ranks receive from other nodes share its inter link.
* **all-gather**: the own block, then ``max(rest of C, the gather + the last piece's
  compute)``; the backward hands its partial sums back, the last piece's exposed.
  The gather crosses the node boundary for ``(P - ranks per node) / (P - 1)`` of its
  bytes, on a link every rank of the node shares.
* **head x ring** with ``U`` ranks per group: an all-to-all over heads inside the
  node before and after (exposed), then the schedule above over the ring of ``P / U``
  groups, ``U`` rings sharing each node's link.
* **per call** ``F``: what a call costs besides its blocks and transfers (the ranks' agreement on
  the call, the plan's and the schedule's collectives, Python), ``Machine.call_seconds`` per
  (schedule, U) (measured: a minimal call of that schedule timed on the communicator; 0 on a
  described machine), added to every schedule's time (``Prediction.fixed``).
* **torus** (a node's ranks wired as a torus, e.g. a TPU slice's ICI; ``Machine.torus``):
  ``intra`` is then one link; the ring's neighbour exchange uses one, a gather inside
  the node as many as a rank has (``2`` a dimension, ``1`` for a dimension of 2) unless
  the torus' bisection is the narrower, and the all-to-all over heads is held to the
  bisection (:func:`torus_factor`).  Without a torus ``intra`` is a rank's whole
  bandwidth into the node's switch (NVSwitch), every pattern alike.

Memory per rank: the ring's and routed's a fixed number of shards; the all-gather
holds every K/V row (:func:`allgather_memory`).  :func:`hiding_length` is the shard
length below which the ring cannot hide its transfers behind its compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

from .masks import window_sides

SCHEDULES = ("ring", "routed", "allgather")
MAX_PIECES = 4       # the all-gather's collectives per pass: its first piece's blocks start after 1/4
MIN_PIECE_ROWS = 64  # no piece of a rank thinner than this (beyond the first)
TILE_ROWS = 512      # the block ops' tile edge: the NumPy backend's TILE_Q and TILE_KV unless set
WORKSPACE_TILES = 2  # tiles of scores the block ops hold at once (scores; probabilities, dS)


def piece_count(counts: Sequence[int]) -> int:
    """How many pieces the all-gather cuts its transfer into, the same on every rank (from the
    ranks' K/V row counts)."""
    largest = max((int(c) for c in counts), default=0)
    return max(1, min(MAX_PIECES, -(-largest // MIN_PIECE_ROWS)))


@dataclass(frozen=True)
class Link:
    """One level of the network: ``latency`` seconds per message, ``bandwidth`` bytes/s."""

    latency: float
    bandwidth: float

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.latency + max(nbytes, 0.0) / self.bandwidth


@dataclass(frozen=True)
class Machine:
    """What a rank computes and how ranks talk: ``rate`` FLOP/s of one rank's block op (the
    call's dtype and head dim), ``intra``/``inter`` the links inside a node and between
    nodes, ``ranks_per_node``, ``memory`` bytes a rank may hold (None: unlimited);
    ``block_overhead``: seconds per visiting K/V row and K/V head a block op spends besides
    its tiles (the NumPy backend's NaN/Inf scans of the block, its widening: measured on a block
    whose tiles are all masked, :func:`ringmpi.parallel.cost_measure.block_rate`; 0, the
    default, for the described GPU machines, where a block op is a few kernel launches);
    ``segment_rate``: FLOP/s of forward block ops with segment ids (measured separately: a
    backend may take another path for them, and their strips' masks cost; None, the default,
    where they run at ``rate``); ``call_seconds``: ``(schedule, U, seconds)`` a call costs besides
    its blocks and transfers (:meth:`call_cost`; empty, the default, on a described machine);
    ``inter_pairs``: the inter-node link as several rings cross it at once (head x ring's rings: every
    rank of a node exchanging with its counterpart on the next node), its bandwidth all of a node's
    flows together, measured so (:func:`ringmpi.parallel.cost_measure.links`: several TCP flows
    through one shaped link may together move less than one); None, the default: ``inter``'s
    bandwidth, shared."""

    rate: float
    intra: Link
    inter: Link
    ranks_per_node: int = 1
    memory: Optional[float] = None
    ranks_per_nic: Optional[int] = None  # ranks of a node sharing one inter-node link (None: all of them)
    backward_rate: Optional[float] = None  # FLOP/s of the backward's block ops (None: ``rate``)
    torus: Optional[Tuple[int, ...]] = None  # a node's ranks as a torus with wraparound, rank-major (None: a switch)
    block_overhead: float = 0.0  # seconds a block op spends per visiting K/V row and K/V head besides its tiles
    segment_rate: Optional[float] = None  # FLOP/s of the forward's block ops with segment ids (None: ``rate``)
    call_seconds: Tuple[Tuple[str, int, float], ...] = ()  # (schedule, U, seconds of a minimal call)
    inter_pairs: Optional[Link] = None  # the inter-node link with every rank of a node crossing it at once

    def shared_hop(self, sharing: int) -> Link:
        """The inter-node link that ``sharing`` rings cross at once, whole (:func:`_inner` divides its
        bandwidth among them): ``inter_pairs`` where measured and shared, else ``inter``."""
        return self.inter_pairs if sharing > 1 and self.inter_pairs is not None else self.inter

    def call_cost(self, schedule: str, head_parallel: int = 1) -> float:
        """Seconds a call of ``schedule`` with ``head_parallel`` U costs besides its blocks and
        transfers: ``call_seconds``' figure (a minimal call's time, measured on the communicator by
        :func:`ringmpi.parallel.cost_measure.call_costs`); 0 where it has none (a described machine)."""
        return next((s for name, u, s in self.call_seconds if name == schedule and u == head_parallel), 0.0)

    def block_op(self, kv_rows: float, kv_heads: int, batch: int = 1) -> float:
        """Seconds block ops spend on ``kv_rows`` visiting K/V rows beyond their tiles (the scans of
        the block, computed tiles or not: ``block_overhead`` per row and K/V head; 0 on a
        described machine)."""
        return self.block_overhead * batch * kv_rows * kv_heads

    @property
    def nic_sharing(self) -> int:
        return self.ranks_per_node if self.ranks_per_nic is None else self.ranks_per_nic

    def rate_of(self, backward: bool = False, segments: bool = False) -> float:
        """FLOP/s of the forward's (or the backward's) block ops; ``segments``: with segment ids
        (``segment_rate`` where measured: a backend may take another path for them)."""
        if backward and self.backward_rate:
            return self.backward_rate
        return self.segment_rate if segments and not backward and self.segment_rate else self.rate


@dataclass(frozen=True)
class Shape:
    """One call's sizes: global ``n_q``, ``n_kv``, ``batch``, ``heads``, ``kv_heads``,
    ``dim``, ``dim_v``; ``itemsize`` of the inputs (what travels), ``grad_itemsize`` of the
    compute dtype (the backward's partial sums); ``density``: the share of (query, key)
    pairs visible (1 dense, about 1/2 causal, less with windows or documents);
    ``seen``: the share of the other ranks' K/V rows a rank's queries see (what the
    routed schedule moves; 1 for dense and causal masks); ``tile_pairs``: the (query, key)
    pairs of the tiles the busiest rank's block ops compute, per batch entry and head (the
    kernels compute a partially masked tile whole: with windows and documents this is well
    above the visible pairs; None: ``density`` of the rank's share); ``routed_split``: from a
    route plan, ``(rows the busiest rank receives from its own node, rows the busiest node's
    ranks receive from other nodes together)`` (None: ``seen``'s rows, a share of them remote
    in proportion to the ranks off the node, every rank of the node moving at once);
    ``segments``: the call has segment ids (packed documents): its block ops run at
    ``Machine.segment_rate``."""

    n_q: int
    n_kv: int
    batch: int = 1
    heads: int = 1
    kv_heads: int = 1
    dim: int = 64
    dim_v: int = 64
    itemsize: int = 2
    grad_itemsize: int = 4
    density: float = 1.0
    seen: float = 1.0
    tile_pairs: Optional[float] = None
    routed_split: Optional[Tuple[float, float]] = None
    segments: bool = False

    def busiest_flops(self, ranks: int, backward: bool = False) -> float:
        """FLOPs of the busiest of ``ranks`` ranks: its block ops' whole tiles (``tile_pairs``, the
        (query, key) pairs of every tile they compute, partial tiles whole, per batch entry and
        head) where the call's shards gave them, else its share of :meth:`flops`."""
        if self.tile_pairs is None:
            return self.flops(backward) / ranks
        fwd = 2.0 * self.batch * self.heads * self.tile_pairs * (self.dim + self.dim_v)
        return fwd * (2.5 if backward else 1.0)

    def kv_row(self, itemsize: Optional[int] = None) -> float:
        """Bytes of one K/V row (all batch entries and K/V heads, K and V)."""
        return self.batch * self.kv_heads * (self.dim + self.dim_v) * (itemsize or self.itemsize)

    def flops(self, backward: bool = False) -> float:
        """The whole call's FLOPs over its visible pairs (FlashAttention's count)."""
        fwd = 2.0 * self.batch * self.heads * self.n_q * self.n_kv * (self.dim + self.dim_v) * self.density
        return fwd * (2.5 if backward else 1.0)


@dataclass(frozen=True)
class Prediction:
    """One schedule's predicted cost on every rank (the busiest rank's): ``seconds`` in all,
    ``compute`` of it, ``exposed`` communication (``seconds - compute - fixed``), ``bytes`` received
    per rank, ``memory`` bytes a rank holds for the call (shards, buffers, accumulators), ``fixed``
    the call's cost besides its blocks and transfers (:meth:`Machine.call_cost`)."""

    schedule: str
    head_parallel: int
    seconds: float
    compute: float
    bytes: float
    memory: float
    fits: bool = True
    fixed: float = 0.0

    @property
    def exposed(self) -> float:
        return max(self.seconds - self.compute - self.fixed, 0.0)

    @property
    def name(self) -> str:
        return self.schedule if self.head_parallel == 1 else f"head x {self.schedule}, U={self.head_parallel}"


def member_kv_heads(heads: int, kv_heads: int, u: int) -> int:
    """K/V heads one member of a head x ring group holds (:func:`ringmpi.parallel.head_parallel.kv_heads_of`):
    whole GQA groups, one shared head, or a copy per query head."""
    hu, group = max(heads // u, 1), max(heads // max(kv_heads, 1), 1)
    if hu % group == 0:
        return hu // group
    return 1 if group % hu == 0 else hu


def split_torus(dims: Optional[Sequence[int]], inner: int) -> Optional[Tuple[Tuple[Tuple[int, bool], ...],
                                                                              Tuple[Tuple[int, bool], ...]]]:
    """A torus (``dims``, rank-major, wraparound in every dimension) cut into the sub-torus of
    ``inner`` consecutive ranks (a head group: the fastest dimensions) and the one its members'
    strided partners form (a ring's members: the rest); each as ``((size, wraps), ...)``, a
    dimension cut short does not wrap.  None: no torus, or ``inner`` does not factor into it."""
    if not dims:
        return None
    outer, inn, k = [(int(d), True) for d in dims], [], int(inner)
    for i in reversed(range(len(outer))):
        if k == 1:
            break
        d = outer[i][0]
        g = math.gcd(d, k)
        if g > 1:
            inn.insert(0, (g, g == d))
            outer[i] = (d // g, False)  # the members left in it are strided: no ring of neighbours
            k //= g
    if k != 1:
        return None
    return tuple(x for x in outer if x[0] > 1), tuple(x for x in inn if x[0] > 1)


def torus_factor(dims: Sequence[Tuple[int, bool]], pattern: str) -> float:
    """Seconds a byte costs on a torus, in units of one link's (``1 / bandwidth``), for the bytes a
    rank receives in an all-gather (``"gather"``) or sends in an all-to-all (``"alltoall"``) among
    the torus' ranks: the larger of a rank's links (every link into it busy at once; a dimension
    of more than 2 gives 2 neighbours, of 2 one) and the bisection (the ranks of one half send
    across the cut of the longest dimension: ``n / d`` lines of 2 links each, 1 where the
    dimension does not wrap).  1 (one link) where ``dims`` is empty."""
    dims = [d for d in dims if d[0] > 1]
    if not dims:
        return 1.0
    n = math.prod(d for d, _ in dims)
    links = sum(2 if d > 2 else 1 for d, _ in dims)
    cut = min((n // d) * (2 if wraps and d > 2 else 1) for d, wraps in dims)
    crossing = n / (2 * (n - 1)) if pattern == "gather" else n * n / (4 * (n - 1))
    return max(1.0 / links, crossing / cut)


def _spans(ranks: int, machine: Machine) -> bool:
    return ranks > machine.ranks_per_node


def _gather_seconds(nbytes: float, ranks: int, per_node: int, machine: Machine, messages: int,
                    sharing: int, torus=()) -> float:
    """A transfer that reaches every other of ``ranks`` ring members (``per_node`` of them on a
    node): the share from other nodes comes over the node's link, which ``sharing`` ranks of the
    node use at once; inside the node, over the members' ``torus`` (:func:`torus_factor`) where
    the node is one."""
    if ranks <= 1:
        return 0.0
    rpn = min(per_node, ranks)
    remote = (ranks - rpn) / (ranks - 1)
    near = machine.intra.seconds(nbytes * (1 - remote) * torus_factor(torus, "gather"),
                                 messages if remote < 1 else 0)
    far = machine.inter.seconds(nbytes * remote * sharing, messages) if remote else 0.0
    return max(near, far)


def ring_memory(shape: Shape, ranks: int, backward: bool) -> float:
    """Bytes a rank holds under the ring (or routed): two K/V slots each way, the resident
    queries' accumulators; the backward two dK/dV buffers, ``dq`` and ``do``."""
    s_kv, s_q = math.ceil(shape.n_kv / ranks), math.ceil(shape.n_q / ranks)
    q_row = shape.batch * shape.heads * (shape.dim + shape.dim_v)
    held = 4 * s_kv * shape.kv_row() + s_q * q_row * shape.grad_itemsize
    if backward:
        held += 2 * s_kv * shape.kv_row(shape.grad_itemsize) + 2 * s_q * q_row * shape.grad_itemsize
    return float(held)


def allgather_memory(shape: Shape, ranks: int, backward: bool) -> float:
    """Bytes a rank holds under the all-gather: every K/V row (its own gathered in place), the
    accumulators; the backward its finished ``dK, dV`` and, of at most two pieces at a time,
    every row's partial sums and those of its own rows from every rank
    (:func:`ringmpi.parallel.allgather_schedule.declared_bytes` plus the accumulators)."""
    s_kv, s_q = math.ceil(shape.n_kv / ranks), math.ceil(shape.n_q / ranks)
    q_row = shape.batch * shape.heads * (shape.dim + shape.dim_v)
    held = shape.n_kv * shape.kv_row() + s_q * q_row * shape.grad_itemsize
    if backward:
        pieces = piece_count([s_kv])
        piece = ranks * math.ceil(s_kv / pieces)  # one piece's rows' sums, and those returned (no own slot)
        live = min(pieces, 2) * (2 * piece - math.ceil(s_kv / pieces))
        held += (s_kv + live) * shape.kv_row(shape.grad_itemsize) + 2 * s_q * q_row * shape.grad_itemsize
    return float(held)


def workspace_memory(shape: Shape) -> float:
    """Bytes of the block ops' scratch: :data:`WORKSPACE_TILES` tiles of scores in the compute dtype."""
    return float(WORKSPACE_TILES * TILE_ROWS * TILE_ROWS * shape.grad_itemsize)


def resident_memory(shape: Shape, ranks: int, schedule: str, backward: bool) -> float:
    """Bytes a rank allocates for one call under ``schedule`` on a ring of ``ranks``: the
    schedule's buffers and accumulators (:func:`ring_memory`, :func:`allgather_memory`) and
    the block ops' tile workspace (:func:`workspace_memory`); what ``"auto"`` checks against
    the memory budget."""
    held = allgather_memory(shape, ranks, backward) if schedule == "allgather" else ring_memory(shape, ranks, backward)
    return held + workspace_memory(shape)


def _inner(shape: Shape, machine: Machine, ranks: int, per_node: int, schedule: str, backward: bool,
           compute: float, link: Link, sharing: int, routed_rows: Optional[float], torus=()) -> Tuple[float, float]:
    """``(seconds, bytes received)`` of one K/V schedule over a ring of ``ranks`` members
    (``per_node`` on a node) that each compute ``compute`` seconds; ``link``: the ring's slowest
    hop; ``sharing``: how many rings share that link; ``torus``: the members' of a node, where
    the node is one (the ring's hop stays one link)."""
    if ranks <= 1:
        return compute, 0.0
    s_kv = math.ceil(shape.n_kv / ranks)
    kv, grad = shape.kv_row(), shape.kv_row(shape.grad_itemsize)
    own = compute / ranks
    nic = min(machine.nic_sharing, ranks * sharing)  # every rank of a node moves at once
    scan = machine.block_op(s_kv, shape.kv_heads, shape.batch)  # one whole block's scans, tiles or none
    if schedule == "ring":
        step_bytes = s_kv * (kv + (grad if backward else 0))
        hop = replace(link, bandwidth=link.bandwidth / sharing)
        step = max(own + scan, hop.seconds(step_bytes))  # every block visits, its tiles masked or not
        seconds = own + scan + (ranks - 1) * step + (hop.seconds(s_kv * grad) if backward else 0.0)
        return seconds, (ranks - 1) * step_bytes + (s_kv * grad if backward else 0)
    if schedule == "routed":
        rows = (shape.n_kv - s_kv) * shape.seen if routed_rows is None else routed_rows
        nbytes = rows * (kv + grad if backward else kv)  # backward: and the partial sums of its own rows
        senders = ranks - 1 if rows else 0
        move = _gather_seconds(nbytes, ranks, per_node, machine, senders, nic, torus)
        if shape.routed_split is not None and rows:
            # where each row comes from (the plan's): the same node's over the node's link, the
            # other nodes' over the node's link into the network, all its ranks' at once
            near_rows, far_rows = shape.routed_split
            per_row = nbytes / rows
            near = machine.intra.seconds(near_rows * per_row, senders if near_rows else 0)
            far = machine.inter.seconds(far_rows * per_row, senders if far_rows else 0) if ranks > per_node else 0.0
            move = max(near, far)
        rest = compute - own + machine.block_op(rows, shape.kv_heads, shape.batch)  # only the rows seen visit
        return own + scan + max(rest, move), nbytes
    if schedule == "allgather":
        rows, pieces = shape.n_kv - s_kv, piece_count([s_kv])
        gather = _gather_seconds(rows * kv, ranks, per_node, machine, pieces * math.ceil(math.log2(ranks)), nic,
                                 torus)
        rest = compute - own + machine.block_op(rows, shape.kv_heads, shape.batch)
        last = rest / pieces
        own += scan
        seconds = own + max(rest, gather + last)
        nbytes = rows * kv
        if backward:
            back = _gather_seconds(rows * grad / pieces, ranks, per_node, machine, math.ceil(math.log2(ranks)),
                                   nic, torus)
            seconds = own + max(rest, 2 * gather + last) + back
            nbytes = 2 * rows * kv + rows * grad
        return seconds, nbytes
    raise ValueError(f"unknown schedule {schedule!r}")


def predict(shape: Shape, machine: Machine, ranks: int, schedule: str, head_parallel: int = 1,
            backward: bool = False, routed_rows: Optional[float] = None) -> Prediction:
    """The :class:`Prediction` of one schedule on ``ranks`` ranks (``head_parallel`` U ranks per
    group; ``routed_rows``: K/V rows the busiest rank receives under the routed schedule, from
    its plan, else ``shape.seen`` of the others'); ``backward``: the gradient pass."""
    u = int(head_parallel)
    compute = shape.busiest_flops(ranks, backward) / machine.rate_of(backward, shape.segments)
    wired = machine.torus if machine.torus and math.prod(machine.torus) == machine.ranks_per_node else None
    cut = split_torus(wired, u)
    members, heads = cut if cut else ((), ())
    groups = ranks // u
    spans = _spans(ranks, machine)
    sharing = min(u, machine.nic_sharing) if spans else 1
    link = machine.shared_hop(sharing) if spans else machine.intra
    inner_shape = replace(shape, heads=max(shape.heads // u, 1), kv_heads=member_kv_heads(shape.heads, shape.kv_heads, u))
    seconds, nbytes = _inner(inner_shape, machine, groups, max(machine.ranks_per_node // u, 1), schedule, backward,
                             compute, link, sharing, routed_rows, members)
    memory = resident_memory(inner_shape, groups, schedule, backward)
    if u > 1:
        s_q, s_kv = math.ceil(shape.n_q / ranks), math.ceil(shape.n_kv / ranks)
        q_row = shape.batch * shape.heads * shape.dim * shape.itemsize
        o_row = shape.batch * shape.heads * shape.dim_v * shape.itemsize
        into = s_q * (q_row + (o_row * 2 if backward else 0)) + s_kv * shape.kv_row()
        out = s_q * (q_row if backward else o_row) + (s_kv * shape.kv_row() if backward else 0)
        share = (u - 1) / u
        per_byte = torus_factor(heads, "alltoall")
        a2a = machine.intra.seconds(into * share * per_byte, u - 1) + machine.intra.seconds(out * share * per_byte, u - 1)
        seconds += a2a
        nbytes += (into + out) * share
        memory += 2 * (into + out)
    fits = machine.memory is None or memory <= machine.memory
    fixed = machine.call_cost(schedule, u)
    return Prediction(schedule, u, seconds + fixed, compute, nbytes, memory, fits, fixed)


def predict_all(shape: Shape, machine: Machine, ranks: int, schedules: Sequence[str] = SCHEDULES,
                head_parallel: Sequence[int] = (1,), backward: bool = False,
                routed_rows: Optional[float] = None) -> List[Prediction]:
    """Every (schedule, U) that can run (``U`` divides the ranks and the query heads), fastest
    first (ties: the ring, routed, the all-gather; smaller U)."""
    out = []
    for u in head_parallel:
        if ranks % u or shape.heads % u:
            continue
        for schedule in schedules:
            out.append(predict(shape, machine, ranks, schedule, u, backward, routed_rows))
    return sorted(out, key=lambda p: (p.seconds, SCHEDULES.index(p.schedule), p.head_parallel))


def choose(predictions: Sequence[Prediction]) -> Tuple[Optional[Prediction], Optional[Prediction]]:
    """``(fastest that fits, runner-up that fits)``; None where there is none."""
    fitting = [p for p in sorted(predictions, key=lambda p: p.seconds) if p.fits]
    return (fitting[0] if fitting else None), (fitting[1] if len(fitting) > 1 else None)


def mask_fractions(n: int, ranks: int, causal: bool = False, window=None,
                   documents: Optional[Sequence[int]] = None) -> Tuple[float, float]:
    """``(density, seen)`` of :class:`Shape` for a self-attention mask over ``n`` tokens on
    ``ranks`` ranks: the visible share of the (query, key) pairs, and the share of the other
    ranks' K/V rows a rank's queries see (what the routed schedule moves).  ``documents``:
    packed document lengths (a rank sees other ranks' rows only of the documents cut at its
    shard's edges: about ``E[L^2] / E[L]`` rows, the length-biased mean, each side); ``window``
    in any spelling :func:`~ringmpi.core.masks.window_sides` takes (-1 or None unbounded)."""
    shard = max(n / ranks, 1.0)
    others = max(n - shard, 1.0)
    density, seen = (0.5 if causal else 1.0), 1.0
    if documents is not None and len(documents):
        squares = float(sum(float(d) * d for d in documents))
        density *= squares / (float(n) * n)
        seen = min(1.0, squares / float(sum(documents)) / others)
    window = window_sides(window)
    if window is not None:
        left, right = (n if w is None else w for w in window)
        right = 0 if causal else right
        density = min(density, (left + right + 1) / n)
        seen = min(seen, (left + right) / others)
    return density, seen


def hiding_length(shape: Shape, machine: Machine, ranks: int, backward: bool = False) -> float:
    """The shard length (tokens per rank) below which the flat ring cannot hide a step's
    transfer behind the step's compute: ``a S^2 = latency + b S`` with ``a`` the compute of a
    (S x S) block per token pair and ``b`` the bytes of one K/V row over the ring's link."""
    link = machine.inter if _spans(ranks, machine) else machine.intra
    per_pair = shape.flops(backward) / (shape.n_q * shape.n_kv) / machine.rate_of(backward)
    row = shape.kv_row() + (shape.kv_row(shape.grad_itemsize) if backward else 0)
    b = row / link.bandwidth
    return (b + math.sqrt(b * b + 4 * per_pair * link.latency)) / (2 * per_pair)
