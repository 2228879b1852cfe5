"""Which ranks share a node, and the groups of the head x ring schedule.

The two-level schedule (:mod:`ringmpi.parallel.head_parallel`) splits the ``P`` ranks
of a communicator into ``P/U`` groups of ``U`` ranks: an all-to-all over heads
runs inside each group, a ring runs across groups.  A group should sit on one
node, where the links are fast; this module finds the nodes and forms the
groups.

* :func:`node_ids` -- the node of every rank: the ranks sharing memory
  (``MPI_COMM_TYPE_SHARED``), or, with ``RINGMPI_NODE_SIZE=n``, pretend nodes
  of ``n`` consecutive ranks (so one machine can stand in for several).
* :func:`ring_order` -- the flat ring's order: the ranks of each node
  consecutive, nodes in order of their lowest rank, ranks ascending within a
  node, so only one hop per node boundary crosses a link whatever the rank
  placement (``--map-by node``, Slurm ``--distribution=cyclic``).
* :func:`counterparts` -- a rank's partners on the next and the previous node (the same index
  on each): the pairs whose exchange the cost model times as head x ring's rings load a link.
* :func:`group_members` -- the groups as lists of ranks, in group order: ``U``
  consecutive ranks of one node when ``U`` divides every node's rank count,
  otherwise ``U`` consecutive ranks of the communicator.
* :func:`head_parallel_candidates` -- the ``U`` that ``head_parallel="auto"`` weighs: the
  divisors of the head count that divide every node's rank count; the cost model picks
  among them (:meth:`ringmpi.parallel.ring_passes.AgreedCall.choose_head_parallel`).
* :func:`head_parallel_problem` -- why a ``U`` cannot run, or None.
* :func:`head_groups` -- the group and ring sub-communicators of one ``U``
  (collective; cached on the communicator).
* :func:`resolve_groups` -- what ``ring_attention(..., head_parallel=...)``
  calls: ``None`` for the flat ring, else the agreed groups.

Pure functions take plain lists and need no MPI; only :func:`node_ids` and
:func:`head_groups` are collective.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

from ..runtime.env import positive_int

ENV_HEAD_PARALLEL = "RINGMPI_HEAD_PARALLEL"
ENV_NODE_SIZE = "RINGMPI_NODE_SIZE"


def head_parallel_setting(value=None) -> Union[int, str]:
    """The requested ``U``: ``value``, else 1 (``RINGMPI_HEAD_PARALLEL`` is read as
    :class:`ringmpi.RingContext`'s default, :mod:`ringmpi.runtime.env`).

    Returns a positive int or ``"auto"``; raises ``ValueError`` for anything
    else (the caller turns it into an agreed :class:`~ringmpi.runtime.errors.ConfigError`).
    No MPI.
    """
    if value is None:
        value = 1
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"head_parallel must be a positive integer or 'auto', got {value!r}") from None
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"head_parallel must be a positive integer or 'auto', got {value!r}")
    return int(value)


def node_size_override() -> Optional[int]:
    """``RINGMPI_NODE_SIZE`` as a positive int, None when unset; ``ValueError`` when malformed."""
    return positive_int(ENV_NODE_SIZE)


def node_ids(comm, node_size: Optional[int] = None) -> List[int]:
    """The node of every rank of ``comm``, ``(P,)`` ints, the same list on every rank.

    With ``node_size`` (or ``RINGMPI_NODE_SIZE``): ``rank // node_size``.
    Otherwise the ranks sharing memory form a node, named by its lowest rank.
    Collective over ``comm`` (no collective with an override).
    """
    size = comm.Get_size()
    if node_size is None:
        node_size = node_size_override()
    if node_size is not None:
        return [r // node_size for r in range(size)]
    from mpi4py import MPI

    from ..runtime.watchdog import phase

    with phase("finding the ranks' nodes (COMM_TYPE_SHARED split, allgather)"):
        shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            leader = shared.allreduce(comm.Get_rank(), op=MPI.MIN)
        finally:
            shared.Free()
        return list(comm.allgather(leader))


def _node_ranks(nodes: Sequence[int]) -> List[List[int]]:
    """Ranks of each node, nodes in order of their first rank."""
    order, ranks = [], {}
    for r, node in enumerate(nodes):
        if node not in ranks:
            order.append(node)
            ranks[node] = []
        ranks[node].append(r)
    return [ranks[node] for node in order]


def counterparts(nodes: Sequence[int], rank: int) -> Tuple[Optional[int], Optional[int]]:
    """``(send to, receive from)``: the ranks of the next and the previous node (nodes in the order
    of their first rank) with ``rank``'s index on its own node, None where that node has none; both
    None with one node (the pairs of head x ring's rings where a node's ranks form its groups)."""
    per_node = _node_ranks(nodes)
    if len(per_node) < 2:
        return None, None
    here = next(i for i, ranks in enumerate(per_node) if rank in ranks)
    index = per_node[here].index(rank)
    nxt, prv = per_node[(here + 1) % len(per_node)], per_node[here - 1]
    return (nxt[index] if index < len(nxt) else None), (prv[index] if index < len(prv) else None)


def ring_order_of(nodes: Sequence[int]) -> List[int]:
    """The ranks node by node (nodes in order of their lowest rank, ranks ascending in each)."""
    return [r for ranks in _node_ranks(nodes) for r in ranks]


def cached_node_ids(comm, node_size: Optional[int] = None) -> List[int]:
    """:func:`node_ids`, computed once per communicator (its ranks' placement never changes)."""
    cache = _cache(comm)
    if ("nodes", node_size) not in cache:
        cache[("nodes", node_size)] = node_ids(comm, node_size)
    return cache[("nodes", node_size)]


def ring_order(comm) -> List[int]:
    """The ranks of ``comm`` in the flat ring's order (:func:`ring_order_of` of its nodes).

    The same list on every rank; rank order itself when every node's ranks are
    consecutive (block placement, ``RINGMPI_NODE_SIZE``, one node), so that
    placement's results do not change.  Collective the first time per
    communicator (then cached); no collective on one rank.
    """
    if comm.Get_size() == 1:
        return [0]
    try:
        node_size = node_size_override()
    except ValueError:  # reported by head_parallel="auto", which needs it; the flat ring runs on
        node_size = None
    return ring_order_of(cached_node_ids(comm, node_size))


def group_members(nodes: Sequence[int], u: int) -> List[List[int]]:
    """The ``P/U`` groups as lists of ranks, in group order (``U`` must divide ``P``).

    ``U`` consecutive ranks of one node when ``U`` divides every node's rank
    count (no group spans nodes), else ``U`` consecutive ranks of the communicator.
    """
    per_node = _node_ranks(nodes)
    if all(len(ranks) % u == 0 for ranks in per_node):
        return [ranks[i:i + u] for ranks in per_node for i in range(0, len(ranks), u)]
    return [list(range(g, g + u)) for g in range(0, len(nodes), u)]


def spans_nodes(nodes: Sequence[int], u: int) -> bool:
    """Whether the groups of ``U`` would cross node boundaries."""
    return any(len({nodes[r] for r in members}) > 1 for members in group_members(nodes, u))


def head_parallel_candidates(nodes: Sequence[int], heads: int) -> List[int]:
    """The ``U`` that ``head_parallel="auto"`` weighs, ascending (1, the flat ring, first): every
    divisor of ``heads`` that divides every node's rank count, so it divides ``P`` and no group
    spans nodes.  Any ``H_kv`` works with each (a member holds whole GQA groups, one shared K/V
    head, or copies: :func:`ringmpi.parallel.head_parallel.kv_heads_of`); the cost model
    (:func:`ringmpi.core.cost_model.member_kv_heads`) counts what each moves."""
    common = 0
    for ranks in _node_ranks(nodes):
        common = math.gcd(common, len(ranks))
    common = math.gcd(common, heads)
    return [u for u in range(1, max(common, 1) + 1) if common % u == 0]


def head_parallel_problem(u: int, size: int, heads: int) -> Optional[str]:
    """Why ``U`` ranks per group cannot run ``heads`` query heads on ``size`` ranks, or None."""
    if size % u:
        return f"head_parallel={u} must divide the number of ranks ({size})"
    if heads % u:
        return f"head_parallel={u} must divide the number of query heads H ({heads})"
    return None


@dataclass
class HeadGroups:
    """One rank's place in the head x ring schedule of ``U`` ranks per group.

    u : ranks per group (the all-to-all width).
    group : this rank's group (its rank on the ring across groups).
    index : this rank's position in its group (which heads it holds).
    members : ``(P/U, U)`` comm ranks of every group, in group order.
    group_comm : the ``U`` ranks of this group, ranked by ``index``.
    ring_comm : the ``P/U`` ranks with this ``index``, ranked by ``group``.
    """

    u: int
    group: int
    index: int
    members: List[List[int]]
    group_comm: object
    ring_comm: object


def head_groups(comm, u: int, nodes: Sequence[int]) -> HeadGroups:
    """The sub-communicators of ``U`` ranks per group on ``comm`` (collective).

    Kept on ``comm`` (an MPI attribute) per ``(U, nodes)``, so repeated calls
    split nothing; the sub-communicators live as long as ``comm``.
    """
    cache = _cache(comm)
    key = (u, tuple(nodes))
    if key not in cache:
        members = group_members(nodes, u)
        rank = comm.Get_rank()
        group, index = next((g, m.index(rank)) for g, m in enumerate(members) if rank in m)
        from ..runtime.watchdog import phase

        with phase(f"splitting the head x ring groups of {u} (Comm.Split)"):
            group_comm = comm.Split(color=group, key=index)
            ring_comm = comm.Split(color=index, key=group)
        cache[key] = HeadGroups(u=u, group=group, index=index, members=members,
                                group_comm=group_comm, ring_comm=ring_comm)
    return cache[key]


def _cache(comm) -> dict:
    """A dict kept on ``comm`` as an MPI attribute (gone when ``comm`` is freed)."""
    from mpi4py import MPI

    global _KEYVAL
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval()
    cache = comm.Get_attr(_KEYVAL)
    if cache is None:
        cache = {}
        comm.Set_attr(_KEYVAL, cache)
    return cache


_KEYVAL = None


def resolve_groups(comm, heads: int, value=None, choose: Optional[Callable[[List[int]], int]] = None
                   ) -> Optional[HeadGroups]:
    """The groups of ``head_parallel=value`` for a call with ``heads`` query heads, or
    None for the flat ring (``U = 1``).

    ``value``: a positive int, ``"auto"``, or None (1).  ``"auto"`` asks ``choose`` (collective:
    the same answer on every rank) to pick among :func:`head_parallel_candidates`; one
    candidate (1) is the flat ring without asking.  ``U = 1`` returns at once without any
    collective.  Otherwise collective over ``comm``: an unusable choice (malformed, ``U`` not
    dividing ``P`` or ``H``) raises the same :class:`~ringmpi.runtime.errors.ConfigError`
    on every rank before any data moves.
    """
    from ..runtime.errors import agree

    try:
        setting = head_parallel_setting(value)
    except ValueError as exc:
        agree(comm, str(exc))
        raise
    if setting == 1 or (setting == "auto" and comm.Get_size() == 1):
        return None
    problem, nodes = None, None
    try:
        node_size = node_size_override()
    except ValueError as exc:
        problem, node_size = str(exc), None
    if setting != "auto" and problem is None:
        problem = head_parallel_problem(setting, comm.Get_size(), heads)
    agree(comm, problem)
    nodes = cached_node_ids(comm, node_size)
    if setting == "auto":
        candidates = head_parallel_candidates(nodes, heads)
        u = choose(candidates) if len(candidates) > 1 else 1
    else:
        u = setting
    if u == 1:
        return None
    return head_groups(comm, u, nodes)
