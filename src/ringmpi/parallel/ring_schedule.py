"""The ring schedule: which K/V block each rank holds at each step, and the buffers that move it.

:class:`RingSchedule` owns what a ring loop needs besides the math: the
double-buffered K/V channel (each message carries the block's keys and values
*and* its global positions and segment ids, so no rank ever holds an O(N)
array), optionally the gradient channel that carries the ``dK, dV`` partial
sums one step behind the K/V, the step counter, the fault points, and the
timing and per-step records (:class:`ringmpi.parallel.ring.StepRecord`).  Iterating
over it yields one :class:`Block` per step; the caller only does the math::

    schedule = RingSchedule(comm, backend, kh_local, vh_local, ...)
    for block in schedule:
        schedule.compute(backend.forward_block, qh, block.k, block.v, o_acc, m, l, scale, block.mask)

Order within a step: post the next block's transfer, yield (the caller
computes on the current block, calling ``Ring.tick`` between tiles), then, in
the backward, send the block's ``dK, dV`` sums on (with the partial sums that
arrived from ``prev`` added: after the compute in device memory,
:class:`~ringmpi.parallel.channels.GradChannel`; in host memory the compute adds onto them in place as they
arrive and sends each piece of rows once final, :class:`~ringmpi.parallel.channels.HostGradChannel`), and
finally wait for the next block.  At step ``s`` rank ``r``
holds the block of ring rank ``(r - s) mod P``.  After the last step of a
schedule with gradients, the finished ``dK, dV`` take one more hop home
(:meth:`RingSchedule.finished_grads`).

The schedule knows only its communicator (any communicator: a head x ring
schedule passes a sub-communicator), the row count of every ring rank's
block, and this rank's own block; positions, segment ids and the mask rule
arrive with each block.  Further schedules (two-level, decode) reuse
:class:`RingSchedule` on a sub-communicator, or its parts: :class:`~ringmpi.parallel.channels.KVChannel`,
the gradient channels and :func:`timed_compute`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np

from ..backends import HostMessage
from ..runtime.faults import fault_point
from ..core.masks import BlockMask, ScoreSpec
from .channels import GradChannel, HostGradChannel, KVChannel
from .ring import Ring

# host memory: dK/dV partial sums received into, added to and sent from two buffers
# (HostGradChannel); False: as device memory, three buffers of whole messages (GradChannel)
HOST_GRADS_IN_PLACE = True

_OBSERVERS: list = []  # observe_steps: this process's observers of its ring steps


@contextmanager
def observe_steps(observer):
    """Within the block every ring schedule of this process reports its steps to ``observer``:
    ``observer.tick(phase, step, steps, done)`` between the tiles of a step's compute (``done``:
    the share of the step's tiles reached, when the block op says it, else None) and
    ``observer.step_done(phase, step, steps)`` once the step's next block has arrived
    (``phase`` ``"fwd"`` or ``"bwd"``).  In-process calls only (no message, no collective):
    the progress report of rank 0 (:mod:`ringmpi.cli.progress`) observes its own steps."""
    _OBSERVERS.append(observer)
    try:
        yield observer
    finally:
        _OBSERVERS.remove(observer)


@dataclass
class Block:
    """What the math needs at one ring step.

    step : the ring step (0 is this rank's own block).
    src : the ring rank whose K/V block this is.
    k, v : (B, H_kv, S_src, D) and (B, H_kv, S_src, D_v), the transfer dtype (views
        into the ring buffer: read-only, valid until the step ends).
    mask : the :class:`BlockMask` of (this rank's queries, this block).
    dk, dv : (B, H_kv, S_src, D), (B, H_kv, S_src, D_v) compute dtype, for this block's gradient
        contributions to be added into (schedules with gradients only, else None): zeroed, or
        (``rows`` not empty) the partial sums of the ranks before, arriving.
    rows : the row callbacks to pass to ``backward_block`` (a backward in host memory at
        P > 1: ``{"kv_need": ..., "kv_done": ...}``, see :class:`HostGradChannel`), else ``{}``.
    """

    step: int
    src: int
    k: object
    v: object
    mask: BlockMask
    dk: object = None
    dv: object = None
    rows: dict = field(default_factory=dict)


def observed_compute(backend, ring: Ring, phase: str, fn, *args, **kwargs):
    """:func:`timed_compute` of a schedule's step whose ticks also reach the observers of
    :func:`observe_steps` (``phase`` ``"fwd"``/``"bwd"``; the ring's step and size, and the share
    of the tiles the block op says it has reached)."""
    if not _OBSERVERS:
        return timed_compute(backend, ring, fn, *args, **kwargs)
    observers = tuple(_OBSERVERS)

    def tick(done=None):
        ring.tick()
        for observer in observers:
            observer.tick(phase, ring.step, ring.size, done)

    return timed_compute(backend, ring, fn, *args, tick=tick, **kwargs)


def steps_done(phase: str, step: int, steps: int) -> None:
    """Tell the observers of :func:`observe_steps` that ``step`` (of ``steps``) has ended."""
    for observer in _OBSERVERS:
        observer.step_done(phase, step, steps)


def timed_compute(backend, ring: Ring, fn, *args, tick=None, **kwargs):
    """Run the block op ``fn(*args, tick=tick, **kwargs)`` as the compute of the ring's
    current step: NVTX range, synchronised wall time and tile counts go into
    ``ring.record(ring.step)``.  ``fn`` returns ``(tiles computed, tiles skipped)``;
    ``tick`` (called between tiles) is ``ring.tick`` unless given."""
    step = ring.step
    tick = ring.tick if tick is None else tick
    record = ring.record(step)
    waited = record.wait_s  # the block op's own ring waits (the backward's kv_need) count as waiting
    start = time.perf_counter()
    with backend.annotate(f"ring step {step} compute"):
        tiles = fn(*args, tick=tick, **kwargs)
        backend.synchronize(tick=tick)
    record.compute_s += time.perf_counter() - start - (record.wait_s - waited)
    record.tiles_computed += tiles[0]
    record.tiles_skipped += tiles[1]
    return tiles


class RingSchedule:
    """One pass of every K/V block around the ring of ``comm``.

    Parameters
    ----------
    comm : mpi4py communicator (the ring: ``prev -> rank -> next`` in ``order``).
    backend : a block-op backend (:mod:`ringmpi.backends`).
    kh, vh : (B, H_kv, S_local, D), (B, H_kv, S_local, D_v) this rank's keys/values, head-major, in the
        transfer dtype (as ``backend.to_heads`` gives them).
    kv_counts : (P,) int, rows of every ring rank's block.
    q_pos : (S_q_local,) int64 global positions of this rank's queries.
    kv_pos : (S_local,) int64 global positions of this rank's keys.
    spec : the call's :class:`ScoreSpec`.
    seg_q, seg_kv : (B, S_q_local), (B, S_local) int64 segment ids, or None.
    grad_dtype : None for a forward schedule; the compute dtype when the
        schedule carries ``dK, dV`` partial sums (backward).
    grad_dims : ``(dK width, dV width)`` of the partial sums, default ``(D, D_v)`` (the
        invariant backward's int64 words and poison column are wider).
    timeout : deadline of each ring wait in seconds (None: none).
    phase : ``"fwd"`` or ``"bwd"``, the fault-injection phase.
    order : (P,) the ranks of ``comm`` in ring order, the same on every rank (None: rank
        order); the public calls pass :func:`ringmpi.parallel.topology.ring_order`, node by node.
    """

    def __init__(self, comm, backend, kh, vh, *, kv_counts: Sequence[int], q_pos: np.ndarray,
                 kv_pos: np.ndarray, spec: ScoreSpec, seg_q: Optional[np.ndarray] = None,
                 seg_kv: Optional[np.ndarray] = None, grad_dtype=None, timeout: Optional[float] = None,
                 phase: str = "fwd", order: Optional[Sequence[int]] = None,
                 grad_dims: Optional[Tuple[int, int]] = None):
        self.backend, self.spec, self.phase = backend, spec, phase
        self.q_pos, self.seg_q = q_pos, seg_q
        self.ring = Ring(comm, timeout=timeout, order=order)
        counts = np.asarray(kv_counts, dtype=np.int64)
        if len(counts) != self.ring.size:
            raise ValueError(f"kv_counts has {len(counts)} entries for a ring of {self.ring.size} ranks")
        self.kv = KVChannel(self.ring, backend, counts, kh, vh, kv_pos, seg_kv)
        self._grad_dtype = grad_dtype
        self._grad_dims = (self.kv.dim, self.kv.dim_v) if grad_dims is None else tuple(grad_dims)
        self.grads = None  # made when iteration starts, after the caller's copies of kh, vh are gone
        self._home_grads = None

    @property
    def records(self):
        """One :class:`ringmpi.parallel.ring.StepRecord` per ring step (plus the final gradient hop)."""
        return self.ring.records

    def __iter__(self) -> Iterator[Block]:
        ring, be = self.ring, self.backend
        if self._grad_dtype is not None and self.grads is None:
            host = isinstance(self.kv.msgs[0], HostMessage) and HOST_GRADS_IN_PLACE
            channel = HostGradChannel if host else GradChannel
            dim, dim_v = self._grad_dims
            self.grads = channel(ring, be, self.kv.counts, self.kv.batch, self.kv.kv_heads, dim,
                                 self._grad_dtype, dim_v=dim_v)
        for step in range(ring.size):
            if step > 0:
                ring.next_step()
            fault_point(self.phase, ring.rank, step)
            slot, src = self.kv.begin_step(step)
            k, v = self.kv.views(slot, src)
            kv_pos, seg_kv = self.kv.meta_views(slot, src)
            block = Block(step, src, k, v, BlockMask(self.spec, self.q_pos, kv_pos, self.seg_q, seg_kv))
            if self.grads is not None:
                block.dk, block.dv, block.rows = self.grads.begin_step(step, src)
            yield block
            if self.grads is not None:
                self.grads.end_step(step, src, block.dk, block.dv)
            with be.annotate(f"ring step {step} wait"):
                ring.wait("kv")
            steps_done(self.phase, step, ring.size)
        if self.grads is not None:
            ring.next_step()  # the finished dK/dV of our own block arrive from prev
            self._home_grads = self.grads.receive_home()

    def compute(self, fn, *args, **kwargs):
        """Run the block op ``fn(*args, tick=..., **kwargs)`` as this step's timed compute
        (its ticks also reach the observers of :func:`observe_steps`)."""
        return observed_compute(self.backend, self.ring, self.phase, fn, *args, **kwargs)

    def finished_grads(self):
        """``(dk (B, H_kv, S_local, D), dv (B, H_kv, S_local, D_v))`` compute dtype: this rank's finished, unscaled
        K/V gradients, once iteration has ended."""
        if self._home_grads is None:
            raise RuntimeError("finished_grads() needs a schedule with grad_dtype, iterated to its end")
        return self._home_grads
