"""The ring: neighbours, nonblocking transfers, waits with a deadline, timings.

One :class:`Ring` per attention call.  Transfers are organised in named
channels (``"kv"``, ``"grad_in"``, ...); each channel has at most one pending
send and one pending receive, and the ring refuses to post on a channel that
is still pending (a buffer is never reused while MPI owns it).  ``tick()``
tests every pending request so that an MPI without a progress thread moves
data while the rank computes; ``wait()`` polls with a growing sleep, so a
waiting rank does not burn a core, and raises :class:`RingTimeout` past its
deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

from ..runtime.errors import RingTimeout

# the routed schedule's streams have fixed tags too: a rank may use either first
_TAGS = {"kv": 7101, "grad": 7102, "routed_kv": 7103, "routed_grad": 7104}  # further streams: the next free tags


@dataclass
class StepRecord:
    """What one rank did in one ring step (seconds, bytes, and tiles of the block kernel);
    ``compute_s`` and ``wait_s`` do not overlap (a wait inside the block op, as the backward's for
    the arriving dK/dV sums, is waiting); ``schedule``: the schedule that ran (``"ring"``, or
    ``"routed"``: :class:`ringmpi.parallel.routed_schedule.RoutedSchedule`, or ``"allgather"``:
    :class:`ringmpi.parallel.allgather_schedule.AllGatherSchedule`); where ``schedule="auto"``
    (or ``head_parallel="auto"``) chose it, step 0's record holds the choice (``chosen``: the
    :class:`~ringmpi.core.cost_model.Prediction`'s name, e.g. ``"head x ring, U=2"``), its
    prediction (``predicted_s``; of it ``predicted_fixed_s`` the call's own cost besides its blocks
    and transfers, :meth:`ringmpi.core.cost_model.Machine.call_cost`) and the runner-up's
    (``runner_up``, ``runner_up_s``)."""

    step: int
    compute_s: float = 0.0
    wait_s: float = 0.0
    bytes_sent: int = 0
    bytes_recv: int = 0
    tiles_computed: int = 0
    tiles_skipped: int = 0
    schedule: str = "ring"
    # step 0 of a schedule that schedule="auto" or head_parallel="auto" chose (issue 53): the choice,
    # its predicted seconds, and the runner-up's name and predicted seconds (ringmpi.core.cost_model)
    chosen: Optional[str] = None
    predicted_s: Optional[float] = None
    runner_up: Optional[str] = None
    runner_up_s: Optional[float] = None
    predicted_fixed_s: Optional[float] = None


@dataclass
class _Transfer:
    """One posted Isend or Irecv, with what a timeout message needs to name."""

    direction: str  # "recv from" or "send to" (a collective: its name, "Iallgatherv over")
    request: object
    peer: Optional[int]  # None: a collective over the whole communicator
    nbytes: int


def poll_until(done: Callable[[], bool], start: float, timeout: Optional[float],
               timed_out: Callable[[], str]) -> None:
    """Poll ``done()`` with short naps that grow (a waiting rank does not burn a core, and each
    poll also moves data) until it is true; :class:`RingTimeout` with the message
    ``timed_out()`` once ``timeout`` seconds have passed since ``start`` (perf_counter).
    The one deadline loop of the ring and of the head x ring all-to-alls."""
    deadline = None if timeout is None else start + timeout
    nap = 0.0
    while not done():
        if deadline is not None and time.perf_counter() > deadline:
            raise RingTimeout(timed_out())
        time.sleep(nap)
        nap = min(2 * nap + 1e-5, 2e-4)


@dataclass(frozen=True)
class TypedPart:
    """One message part that an MPI datatype picks out of ``buffer`` (one item of
    ``datatype``, e.g. a ``Create_hindexed`` type over a host buffer's scattered rows):
    many pieces of memory in one request."""

    buffer: object
    datatype: object

    @property
    def nbytes(self) -> int:
        return int(self.datatype.Get_size())

    def message(self) -> list:
        return [self.buffer, 1, self.datatype]


def _message(part):
    """The mpi4py message of one part: a :class:`TypedPart`'s, else the buffer as bytes."""
    from mpi4py import MPI

    return part.message() if isinstance(part, TypedPart) else [part, MPI.BYTE]


def _parts(buffers) -> list:
    if buffers is None:
        return []
    return list(buffers) if isinstance(buffers, (list, tuple)) else [buffers]


@dataclass
class Ring:
    """Nonblocking neighbour exchange on a communicator.

    Data flows from ``prev`` to ``rank`` to ``next``.  ``timeout`` is the
    deadline of each wait in seconds (None: wait forever).  ``order``: the
    ranks of ``comm`` in ring order, the same list on every rank (None: rank
    order; see :func:`ringmpi.parallel.topology.ring_order`).
    """

    comm: object
    timeout: Optional[float] = None
    records: List[StepRecord] = field(default_factory=list)
    order: Optional[Sequence[int]] = None
    schedule: str = "ring"  # what the records name

    def __post_init__(self):
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.order = list(range(self.size)) if self.order is None else list(self.order)
        if sorted(self.order) != list(range(self.size)):
            raise ValueError(f"ring order {self.order} is not a permutation of the {self.size} ranks")
        self.position = self.order.index(self.rank)
        self.next = self.source(-1)
        self.prev = self.source(1)
        self._pending: Dict[str, List[_Transfer]] = {}
        # tick's list of requests, rebuilt after a post; a released channel's requests stay
        # in it until then, complete (null), which Testall takes as done
        self._all_requests: Optional[list] = None
        self._tags: Dict[str, int] = dict(_TAGS)
        self._step = 0

    @property
    def step(self) -> int:
        """The current ring step (records and timeout messages name it)."""
        return self._step

    def source(self, step: int) -> int:
        """The rank whose block reaches this rank at ring step ``step`` (``step`` hops upstream)."""
        return self.order[(self.position - step) % self.size]

    def next_step(self) -> int:
        """Move to the next step and return it (only the schedule calls this)."""
        self._step += 1
        return self._step

    def _tag(self, stream: str) -> int:
        if stream not in self._tags:
            self._tags[stream] = max(self._tags.values()) + 1
        return self._tags[stream]

    def record(self, step: int) -> StepRecord:
        """The record of ``step``, created on first use."""
        while len(self.records) <= step:
            self.records.append(StepRecord(step=len(self.records), schedule=self.schedule))
        return self.records[step]

    def post(self, channel: str, send: Union[None, object, Sequence] = None,
             recv: Union[None, object, Sequence] = None, stream: Optional[str] = None,
             dest: Optional[int] = None, source: Optional[int] = None) -> None:
        """Start ``Irecv(recv from prev)`` and ``Isend(send to next)`` on ``channel``
        (``source``/``dest``: another peer than ``prev``/``next``).

        ``send``/``recv`` are buffers exposing the (CUDA) buffer protocol, sliced to
        the exact message length, or :class:`TypedPart` s, or a list of such parts (the
        parts of one message, sent and received in list order), or None.  Messages of one
        ``stream`` (default: the channel's name) share an MPI tag, so a send on
        one channel can match a receive on another channel of the same stream.
        """
        if channel in self._pending:
            raise RuntimeError(f"ring channel {channel!r} posted while a transfer on it is pending")
        tag = self._tag(stream or channel)
        transfers = []
        rec = self.record(self.step)
        source = self.prev if source is None else source
        dest = self.next if dest is None else dest
        for buf in _parts(recv):
            request = self.comm.Irecv(_message(buf), source=source, tag=tag)
            transfers.append(_Transfer("recv from", request, source, int(buf.nbytes)))
            rec.bytes_recv += int(buf.nbytes)
        for buf in _parts(send):
            request = self.comm.Isend(_message(buf), dest=dest, tag=tag)
            transfers.append(_Transfer("send to", request, dest, int(buf.nbytes)))
            rec.bytes_sent += int(buf.nbytes)
        if transfers:
            self._pending[channel] = transfers
            self._all_requests = None

    def post_collective(self, channel: str, request, name: str, sent: int, received: int) -> None:
        """Hold the request of a nonblocking collective (``Iallgatherv``, ``Ialltoallv``) started on
        this ring's communicator as ``channel``: ``tick`` progresses it, ``wait`` completes it with
        the deadline; ``sent``/``received``: its bytes to and from other ranks (the records')."""
        if channel in self._pending:
            raise RuntimeError(f"ring channel {channel!r} posted while a transfer on it is pending")
        rec = self.record(self.step)
        rec.bytes_sent += int(sent)
        rec.bytes_recv += int(received)
        self._pending[channel] = [_Transfer(name, request, None, int(received))]
        self._all_requests = None

    def tick(self, done: Optional[float] = None) -> None:
        """Let MPI progress every pending transfer (cheap; call between tiles).

        One ``Testall`` over every channel: each MPI test runs the whole progress
        engine (TCP polling included), so one call per channel would repeat it.
        ``done``: the share of the block op's tiles reached, when the op knows it (for a
        progress report, :func:`ringmpi.parallel.ring_schedule.observe_steps`; unused here)."""
        from mpi4py import MPI

        if not self._pending:
            return
        if self._all_requests is None:
            self._all_requests = [t.request for transfers in self._pending.values() for t in transfers]
        MPI.Request.Testall(self._all_requests)

    def test(self, channel: str) -> bool:
        """True when the transfers of ``channel`` are complete (then released) or none is
        pending; never blocks, records no wait."""
        from mpi4py import MPI

        transfers = self._pending.get(channel)
        if transfers is None:
            return True
        if MPI.Request.Testall([t.request for t in transfers]):
            del self._pending[channel]
            return True
        return False

    def name(self, rank: int) -> str:
        """``rank r`` of this ring as messages give it: its ``COMM_WORLD`` rank, with the ring's own
        rank beside it when they differ (a ring of the head x ring schedule's groups)."""
        from mpi4py import MPI

        try:
            world = MPI.Group.Translate_ranks(self.comm.Get_group(), [rank], MPI.COMM_WORLD.Get_group())[0]
        except Exception:  # not an MPI communicator of this process's world
            return f"rank {rank}"
        return f"rank {rank}" if world in (rank, MPI.UNDEFINED) else f"world rank {world} (ring rank {rank})"

    def wait(self, channel: str) -> None:
        """Complete the transfers of ``channel`` (no-op when none is pending)."""
        from mpi4py import MPI

        transfers = self._pending.pop(channel, None)
        if transfers is None:
            return
        requests = [t.request for t in transfers]
        start = time.perf_counter()

        def timed_out() -> str:
            self._pending[channel] = transfers  # still MPI's: a later wait may complete them
            stuck = [t for t in transfers if not t.request.Test()]  # name only what is incomplete
            peers = ", ".join(f"{t.direction} {self.name(t.peer)}" if t.peer is not None else
                              f"{t.direction} all {self.size} ranks" for t in stuck)
            sizes = ", ".join(f"{t.direction.split()[0]} {t.nbytes} bytes" for t in stuck)
            return (f"{self.name(self.rank)}: ring step {self.step} channel {channel!r} did not complete "
                    f"within {self.timeout:g} s ({peers}; expected {sizes}); "
                    f"a peer rank may have died or stopped sending")

        poll_until(lambda: MPI.Request.Testall(requests), start, self.timeout, timed_out)
        self.record(self.step).wait_s += time.perf_counter() - start

    def wait_all(self) -> None:
        """Complete every pending transfer."""
        for channel in list(self._pending):
            self.wait(channel)

