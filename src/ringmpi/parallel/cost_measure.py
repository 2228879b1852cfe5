"""The cost model's parts measured on this machine, and ``schedule="auto"``'s choice from them.

* :func:`block_rate` -- the block op's FLOP/s for a dtype and head dims: one dense
  block timed (rows of them, each row as one, the median row's) on every rank at once (ranks
  that share cores share them, as in a call), less the same block with every tile masked (the
  block op's scans, which :func:`block_parts` keeps as ``Machine.block_overhead``: seconds per
  visiting K/V row and head), the slowest rank's; measured once per machine and cached in
  ``$RINGMPI_CACHE`` (default ``~/.cache/ringmpi``)/``block_rates.json`` under the
  host name, backend, vector path, dtype, dims and ranks per node; rank 0 reads the
  cache and broadcasts, so every rank predicts alike.
* :func:`links` -- latency and bandwidth of each link level (inside a node, between
  nodes) from a short exchange with the ring neighbours (8-byte, 1 MiB and 4 MiB messages,
  each rank timing its receive from its predecessor: the hop that receive crosses names the
  level; the bandwidth is the sustained one, of the 3 MiB the large message adds, so that a
  link's burst allowance, as a token bucket's, does not pass for its rate), the slowest figure
  of each level over all ranks; and, where nodes hold several ranks, the inter-node link as
  head x ring's rings load it (:func:`_pairs_link`: every rank exchanging with its counterpart
  on the next node at once, the median of three, the slowest flow's); once per communicator
  (kept on it); :func:`assume_links` sets them instead.
* :func:`call_costs` -- what a call of each (schedule, U) costs besides its blocks and
  transfers (``Machine.call_seconds``): a minimal call (a few tokens per rank) of each, timed
  on the communicator (the median over three of the slowest rank's); once per communicator
  and pair (kept on it); 0 where :func:`assume_links` describes the links.
* :func:`recall` / :func:`remember` -- a decision of ``"auto"`` kept on the communicator for
  the next call of the same shape, positions and mask (each rank's own key, :func:`call_key`):
  one Allreduce of two integers confirms every rank holds the same decision, instead of the
  plan's and the tile counts' collectives and the predictions (about 10 ms a call on 4 ranks
  here; a model's every layer makes such a call).
* :func:`choose_schedule` -- collective: the predictions of
  :mod:`ringmpi.core.cost_model` for the call's shape on these parts, and the
  fastest that fits every rank's memory budget (:mod:`ringmpi.runtime.memory`);
  a ConfigError on every rank, naming each schedule's need, where none fits.
  :func:`choose_plan` the same over head x ring's ``U`` too (``head_parallel="auto"``);
  :func:`predictions_on` every prediction it chooses from (``ringmpi.bench.schedule_grid``
  sets them beside measured times).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..core.cost_model import Link, Machine, Shape, choose, predict_all
from ..runtime.errors import ConfigError
from ..runtime.watchdog import phase
from .topology import cached_node_ids, counterparts

_LINKS_KEY = "cost_model_links"
_CALLS_KEY = "cost_model_calls"
_DECISIONS_KEY = "cost_model_decisions"
KEPT_DECISIONS = 64  # per communicator: the most recent
LARGE_MESSAGES = (1 << 20, 1 << 22)  # the link measurement's large messages: the bandwidth is their difference's
CALL_ROWS = 4  # tokens per rank of the minimal call that call_costs times
BLOCKS_IN_A_ROW = 8  # block_rate's blocks timed as one, every rank at once
ROWS_OF_BLOCKS = 3  # block_rate's rows of blocks: the median row's
_RATES: dict = {}  # this process's measured rates (the file is the machine's)


def cache_path() -> Path:
    return Path(os.environ.get("RINGMPI_CACHE") or Path.home() / ".cache" / "ringmpi") / "block_rates.json"


def _rate_key(backend, dtype, dim: int, dim_v: int) -> str:
    path = ""
    if backend.name == "numpy":
        from ..backends.tile_pass import vector_path

        path = vector_path() or ""
    return f"{socket.gethostname()}|{backend.name}|{path}|{np.dtype(dtype).name}|{dim}|{dim_v}"


def _measure_rate(backend, dtype, dim: int, dim_v: int):
    """``(FLOP/s of the block op's tiles, seconds per visiting K/V row and head besides them, FLOP/s
    of its tiles with segment ids)``: one dense block, the same block with every tile masked (a
    causal mask, keys after the queries) and with segment ids (one document: every tile whole),
    each the median of :data:`ROWS_OF_BLOCKS` rows of :data:`BLOCKS_IN_A_ROW` blocks timed as one,
    after an untimed block: where ranks share a core, one block (a few ms) falls in or out of the
    scheduler's time slices and its time ranges over 2x, while a row of them is the rate the ranks
    share, as in a call, and the median row leaves out a row that a slow spell fell on; the
    rates are of the difference (the tiles alone), the overhead the masked block's time per row
    and head (the block's scans)."""
    from ..core.masks import BlockMask, ScoreSpec
    from ..core.online_softmax import SoftmaxState

    s = 1024 if backend.name == "numpy" else 4096
    heads = 1 if backend.name == "numpy" else 8
    ct = backend.compute_dtype(np.dtype(dtype))
    rng = np.random.default_rng(0)
    q = backend.asarray(rng.standard_normal((1, heads, s, dim)).astype(ct))
    k = backend.asarray(rng.standard_normal((1, heads, s, dim)).astype(dtype))
    v = backend.asarray(rng.standard_normal((1, heads, s, dim_v)).astype(dtype))
    pos = np.arange(s, dtype=np.int64)

    def each(mask) -> float:
        def block(state):
            backend.forward_block(q, k, v, *state.arrays(), 1.0 / dim ** 0.5, mask, resident={})

        block(SoftmaxState(backend, (1, heads, s), dim_v, ct))  # untimed
        backend.synchronize()
        rows = []
        for _ in range(ROWS_OF_BLOCKS):
            states = [SoftmaxState(backend, (1, heads, s), dim_v, ct) for _ in range(BLOCKS_IN_A_ROW)]
            start = time.perf_counter()
            for state in states:
                block(state)
            backend.synchronize()
            rows.append((time.perf_counter() - start) / BLOCKS_IN_A_ROW)
        return float(np.median(rows))

    dense = each(BlockMask(ScoreSpec(), pos, pos, None, None))
    masked = each(BlockMask(ScoreSpec(causal=True), pos, pos + s, None, None))  # every tile skipped
    masked = min(masked, dense / 2)  # a noisy masked time never leaves the tiles less than half the block
    one = np.zeros((1, s), np.int64)  # one document: every tile whole, on the path segment ids take
    segmented = max(each(BlockMask(ScoreSpec(), pos, pos, one, one)), 2 * masked)
    flops = 2.0 * heads * s * s * (dim + dim_v)
    return flops / (dense - masked), masked / (s * heads), flops / (segmented - masked)


def block_rate(comm, backend, dtype, dim: int, dim_v: int, timeout=None) -> float:
    """FLOP/s of this machine's block op with as many ranks computing on a node as ``comm``
    puts there, on every rank: rank 0 reads the cache; where it has no figure, every rank
    times the block at once (ranks sharing cores share them, as in a call) and the slowest
    rank's rate is kept and written."""
    return block_parts(comm, backend, dtype, dim, dim_v, timeout)[0]


def block_parts(comm, backend, dtype, dim: int, dim_v: int, timeout=None):
    """``(rate, overhead, segment rate)``: :func:`block_rate`'s FLOP/s of the tiles, the block op's
    seconds per visiting K/V row and head besides them (``Machine.block_overhead``) and the FLOP/s
    of its tiles with segment ids (``Machine.segment_rate``), measured together (every rank at
    once; the slowest rank's of each) and cached together."""
    nodes = cached_node_ids(comm)
    key = f"{_rate_key(backend, dtype, dim, dim_v)}|{max(nodes.count(n) for n in set(nodes))} ranks"
    parts = _RATES.get(key)
    if parts is not None:
        return parts
    table, path = {}, cache_path()
    if comm.Get_rank() == 0:
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
    cached = table.get(key), table.get(f"{key}|overhead"), table.get(f"{key}|segments")
    with phase("the cost model's block rate (bcast from rank 0)", timeout):
        cached = comm.bcast(cached if None not in cached else None, root=0)
    if cached is None:
        with phase("the cost model's block rate (every rank times one block; MIN)", timeout):
            comm.Barrier()
            rate, overhead, segmented = _measure_rate(backend, dtype, dim, dim_v)
            cached = (comm.allreduce(rate, op=_min()), comm.allreduce(overhead, op=_max()),
                      comm.allreduce(segmented, op=_min()))
        if comm.Get_rank() == 0:
            table[key], table[f"{key}|overhead"], table[f"{key}|segments"] = cached
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
                tmp.replace(path)
            except OSError:
                pass  # a read-only home: measured again by the next process
    _RATES[key] = tuple(float(x) for x in cached)
    return _RATES[key]


def _min():
    from mpi4py import MPI

    return MPI.MIN


def _max():
    from mpi4py import MPI

    return MPI.MAX


def _receive_times(comm, nbytes: int, reps: int, dest, source, together: bool = False) -> list:
    """``reps`` times of receiving ``nbytes`` from ``source`` while sending as much to ``dest``
    (either None: that side idle; no times where nothing is received): the receive's own time
    (until it completes), so the figure is the hop from ``source`` alone (a send may complete
    early, into the sockets' buffers, while the data is still crossing a slow link);
    ``together``: a barrier before each, so that every rank's pair moves at once."""
    send = np.zeros(max(nbytes, 1), np.uint8)
    recv = np.empty_like(send)
    times = []
    for _ in range(reps):
        if together:
            comm.Barrier()
        start = time.perf_counter()
        incoming = comm.Irecv(recv, source=source, tag=7190) if source is not None else None
        outgoing = comm.Isend(send, dest=dest, tag=7190) if dest is not None else None
        if incoming is not None:
            incoming.Wait()
            times.append(time.perf_counter() - start)
        if outgoing is not None:
            outgoing.Wait()
    return times


def _exchange_seconds(comm, nbytes: int, reps: int, dest: int, source: int) -> float:
    """The best of :func:`_receive_times` with the ring neighbours."""
    return min(_receive_times(comm, nbytes, reps, dest, source))


def _pairs_link(comm, nodes: Sequence, per_node: int, latency: float) -> Optional[Link]:
    """The inter-node link as head x ring's rings cross it (``Machine.inter_pairs``): every rank
    exchanging the larger of :data:`LARGE_MESSAGES` with its counterpart on the next node at once;
    the slowest flow's rate over its whole message (a call waits until a node's last flow ends;
    a difference of two medians of unevenly shared flows swings too far to take a sustained rate
    from) times the ``per_node`` flows of a node, which the model divides among the rings that
    cross at once; the median of three times (a barrier before each, every pair moving at once),
    not the best: several flows through one link share it unevenly, and a call waits for its
    slowest; None where no node holds two ranks or there is one node (collective)."""
    if per_node < 2 or len(set(nodes)) < 2:
        return None
    dest, source = counterparts(nodes, comm.Get_rank())
    big = LARGE_MESSAGES[-1]
    times = _receive_times(comm, big, 3, dest, source, together=True)
    mine = big / max(float(np.median(times)) - latency, 1e-9) if times else None
    rates = [r for r in comm.allgather(mine) if r is not None]
    return Link(latency, min(rates) * per_node) if rates else None


def links(comm, timeout=None):
    """``(intra, inter, ranks per node, inter_pairs)``: each level's :class:`Link` (the slowest over
    the ranks; a level no hop uses takes the other's figures) and the inter-node link as head x
    ring's rings load it (:func:`_pairs_link`; None where it does not apply), measured once per
    communicator."""
    from .ring import Ring
    from .topology import ring_order

    attr = _attr(comm)
    if _LINKS_KEY in attr:
        return attr[_LINKS_KEY]
    nodes = cached_node_ids(comm)
    size, rank = comm.Get_size(), comm.Get_rank()
    ring = Ring(comm, order=ring_order(comm))
    mine = None
    with phase("the cost model's link measurement (Isend/Irecv with the ring neighbours)", timeout):
        if size > 1:
            small = _exchange_seconds(comm, 8, 20, ring.next, ring.prev)
            one, big = LARGE_MESSAGES
            t_one = _exchange_seconds(comm, one, 3, ring.next, ring.prev)
            t_big = _exchange_seconds(comm, big, 3, ring.next, ring.prev)
            # the level of the hop that each rank's timed receive crosses: from its ring predecessor
            mine = ("inter" if nodes[ring.prev] != nodes[rank] else "intra", small,
                    sustained_bandwidth(one, t_one, big, t_big, small))
        every = comm.allgather(mine)
    levels = {}
    for level in ("intra", "inter"):
        seen = [m for m in every if m is not None and m[0] == level]
        if seen:
            levels[level] = Link(max(m[1] for m in seen), min(m[2] for m in seen))
    default = Link(1e-6, 1e10)
    intra = levels.get("intra", levels.get("inter", default))
    inter = levels.get("inter", intra)
    per_node = max(nodes.count(n) for n in set(nodes))
    with phase("the cost model's link measurement (every rank with its counterpart on the next node)", timeout):
        pairs = _pairs_link(comm, nodes, per_node, inter.latency) if size > 1 else None
    attr[_LINKS_KEY] = (intra, inter, per_node, pairs)
    return attr[_LINKS_KEY]


def sustained_bandwidth(one: int, t_one: float, big: int, t_big: float, latency: float) -> float:
    """Bytes/s of a link from the best times ``t_one``, ``t_big`` of receiving ``one`` and ``big``
    bytes: the rate of the bytes the larger adds (a token bucket's burst, or any allowance a link
    grants its first bytes, rides in both and cancels), never above the larger message's own rate
    (a slowed smaller message would leave the difference too small)."""
    own = big / max(t_big - latency, 1e-9)
    extra = t_big - t_one
    return min((big - one) / extra, own) if extra > 0 else own


def call_key(arrays: Sequence, *parts) -> bytes:
    """This rank's key of one ``"auto"`` decision: a digest of ``arrays`` (positions, segment ids:
    None allowed) and the ``repr`` of ``parts`` (shapes, dtypes, mask, ...), with the memory
    budget's setting (a changed ``RINGMPI_MEMORY_BUDGET`` decides again)."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(b"-" if a is None else np.ascontiguousarray(a).tobytes() + repr(np.shape(a)).encode())
    h.update(repr((parts, os.environ.get("RINGMPI_MEMORY_BUDGET"))).encode())
    return h.digest()


def _decisions(comm) -> dict:
    """The decisions kept on ``comm``: ``{"next": the next one's number, "kept": {key: (number, value)}}``."""
    return _attr(comm).setdefault(_DECISIONS_KEY, {"next": 0, "kept": {}})


def recall(comm, key: bytes, timeout=None):
    """Collective: the value :func:`remember` kept under ``key`` when every rank's key names the same
    decision (one Allreduce of two integers, under the watchdog's ``timeout``), else None."""
    from mpi4py import MPI

    found = _decisions(comm)["kept"].get(key)
    ident = -1 if found is None else found[0]
    both = np.array([ident, -ident], dtype=np.int64)
    with phase("the ranks' kept auto decision (Allreduce)", timeout):
        comm.Allreduce(MPI.IN_PLACE, both, op=MPI.MIN)  # the smallest id, minus the largest
    return found[1] if ident >= 0 and both[0] == ident == -both[1] else None


def remember(comm, key: bytes, value, schedule: str):
    """Keep ``value``, a decision every rank of ``comm`` has just made together, under this rank's
    ``key``, unless the K/V ``schedule`` it chose is the all-gather: that holds every K/V row, so
    each call weighs it again against the memory budget of its time.  Returns ``value``.  Every
    rank numbers its decisions alike (they are collective)."""
    if schedule == "allgather":
        return value
    memo = _decisions(comm)
    memo["kept"][key] = (memo["next"], value)
    memo["next"] += 1
    if len(memo["kept"]) > KEPT_DECISIONS:
        memo["kept"].pop(next(iter(memo["kept"])))
    return value


def assume_links(comm, intra: Link, inter: Link) -> None:
    """Take ``intra`` and ``inter`` as this communicator's link figures instead of measuring them
    (collective: the node layout): to ask ``"auto"`` what it would choose on the links of
    another machine, as ``ringmpi plan`` does without MPI.  Every rank must give the same.  The
    calls' own costs (:func:`call_costs`) are then those of a described machine: none."""
    nodes = cached_node_ids(comm)
    attr = _attr(comm)
    attr[_LINKS_KEY] = (intra, inter, max(nodes.count(n) for n in set(nodes)), None)
    attr[_CALLS_KEY] = None  # described: no measured per-call cost
    attr.pop(_DECISIONS_KEY, None)  # decided on other links


def call_costs(comm, backend, pairs: Sequence[tuple], timeout=None) -> tuple:
    """``((schedule, U, seconds), ...)`` for each ``(schedule, U)`` of ``pairs``: what a call of it
    costs on ``comm`` besides its blocks and transfers (``Machine.call_seconds``), timed as a
    minimal call (:data:`CALL_ROWS` tokens per rank, ``U`` heads of dim 8, causal, forward, one
    warm-up) median over three of the slowest rank's time; each pair once per communicator (kept
    on it), none (an empty tuple) after :func:`assume_links`.  Collective; every rank gets the same."""
    attr = _attr(comm)
    known = attr.setdefault(_CALLS_KEY, {})
    if known is None:
        return ()
    for schedule, u in pairs:
        if (backend.name, schedule, int(u)) not in known:
            with phase(f"the cost model's per-call cost ({schedule}, U={u}: a minimal call)", timeout):
                known[(backend.name, schedule, int(u))] = _minimal_call_seconds(comm, backend, schedule, int(u))
    return tuple((schedule, int(u), known[(backend.name, schedule, int(u))]) for schedule, u in pairs)


# the public call a minimal call times, ``call(q, k, v, context)``: set by ``ringmpi.attention`` (a
# higher layer than this one) when it is imported, as every use of the package does
MINIMAL_CALL = None


def _minimal_call_seconds(comm, backend, schedule: str, u: int, repeat: int = 3) -> float:
    """The median over ``repeat`` (after one warm-up) of the slowest rank's time of a minimal
    forward call (:data:`MINIMAL_CALL`, causal) of ``schedule`` with ``head_parallel=u`` on
    ``comm`` (a barrier before each)."""
    from ..context import RingContext

    rng = np.random.default_rng(comm.Get_rank())
    q, k, v = (backend.asarray(rng.standard_normal((1, CALL_ROWS, u, 8)).astype(np.float32)) for _ in range(3))
    context = RingContext(comm=comm, layout="contiguous", backend=backend.name, schedule=schedule, head_parallel=u)
    times = []
    for _ in range(repeat + 1):
        comm.Barrier()
        start = time.perf_counter()
        MINIMAL_CALL(q, k, v, context)
        backend.synchronize()
        times.append(comm.allreduce(time.perf_counter() - start, op=_max()))
    return float(np.median(times[1:]))


_KEYVAL = None


def _attr(comm) -> dict:
    """A dict kept on ``comm`` (an MPI attribute: gone when ``comm`` is freed)."""
    from mpi4py import MPI

    global _KEYVAL
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval()
    found = comm.Get_attr(_KEYVAL)
    if found is None:
        found = {}
        comm.Set_attr(_KEYVAL, found)
    return found


def machine(comm, backend, dtype, dim: int, dim_v: int, timeout=None) -> Machine:
    """This communicator's measured :class:`~ringmpi.core.cost_model.Machine` (memory: the
    smallest budget over its ranks, None when unknown)."""
    from ..runtime.memory import budget

    rate, overhead, segmented = block_parts(comm, backend, dtype, dim, dim_v, timeout)
    intra, inter, per_node, pairs = links(comm, timeout)
    with phase("the ranks' memory budgets (allgather)", timeout):
        budgets = comm.allgather(budget(on_device=backend.name == "cupy"))
    known = [b for b in budgets if b is not None]
    return Machine(rate=rate, intra=intra, inter=inter, ranks_per_node=per_node,
                   memory=min(known) if known else None, block_overhead=overhead,
                   segment_rate=segmented, inter_pairs=pairs)


def predictions_on(comm, backend, dtype, shape: Shape, schedules: Sequence[str], head_parallel: Sequence[int],
                   backward: bool, routed_rows: Optional[float] = None, timeout=None):
    """``(machine, predictions)``: this communicator's measured :class:`~ringmpi.core.cost_model.Machine`
    and :func:`~ringmpi.core.cost_model.predict_all` on it, fastest first: what :func:`choose_plan`
    chooses from, and what a benchmark compares with its measured times (collective)."""
    found = machine(comm, backend, dtype, shape.dim, shape.dim_v, timeout)
    pairs = [(s, u) for u in head_parallel if not (comm.Get_size() % u or shape.heads % u) for s in schedules]
    found = replace(found, call_seconds=call_costs(comm, backend, pairs, timeout))
    return found, predict_all(shape, found, comm.Get_size(), schedules, head_parallel=head_parallel,
                              backward=backward, routed_rows=routed_rows)


def choose_schedule(comm, backend, dtype, shape: Shape, schedules: Sequence[str], backward: bool,
                    routed_rows: Optional[float] = None, timeout=None):
    """``(chosen, runner-up or None)`` :class:`~ringmpi.core.cost_model.Prediction` s among
    ``schedules`` on this communicator, the same on every rank; ConfigError on every rank
    where none fits the memory budget."""
    return choose_plan(comm, backend, dtype, shape, schedules, (1,), backward, routed_rows, timeout)


def choose_plan(comm, backend, dtype, shape: Shape, schedules: Sequence[str], head_parallel: Sequence[int],
                backward: bool, routed_rows: Optional[float] = None, timeout=None):
    """:func:`choose_schedule` over every ``(schedule, U)`` of ``schedules`` and ``head_parallel``
    (``head_parallel="auto"``'s joint choice): the same on every rank."""
    found, predictions = predictions_on(comm, backend, dtype, shape, schedules, head_parallel, backward,
                                        routed_rows, timeout)
    best, runner = choose(predictions)
    if best is None:
        needs = ", ".join(f"{p.name} {p.memory / 2**20:.1f} MiB" for p in predictions)
        raise ConfigError(f"no schedule fits the memory budget of {found.memory / 2**20:.1f} MiB per rank "
                          f"(RINGMPI_MEMORY_BUDGET, else the free memory); each needs per rank: {needs}")
    return best, runner
