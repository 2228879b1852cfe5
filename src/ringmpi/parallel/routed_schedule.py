"""The routed schedule: each rank receives only the K/V rows its queries can see, from their owner.

:class:`RoutedSchedule` is a drop-in for :class:`~ringmpi.parallel.ring_schedule.RingSchedule`
(the same :class:`~ringmpi.parallel.ring_schedule.Block` per step to the same
``forward_pass``/``backward_pass`` loop, the same records, deadlines and fault
points), driven by a :class:`~ringmpi.parallel.route_plan.RoutePlan`: at step
``t`` a rank computes on the rows of ``src(t)`` its queries see, which came
straight from ``src(t)`` (point to point, ``Isend``/``Irecv`` on the ring's
communicator), and sends the rows ``dst(t)`` sees of its own block.  Steps
with nothing to receive compute nothing.

Order: the transfers of round ``k + 1`` (:mod:`ringmpi.parallel.route_plan`) are
posted when round ``k`` starts, before it computes (round 1 before the rank's
own block: for a sparse plan, everything at once); each step waits for its
own message with the deadline.  Each step has its own messages (outgoing
rows packed with ``take``), made when its round is posted and dropped once
their transfers are done -- round ``k - 1``'s when round ``k + 1`` is posted --
so a buffer is never written while MPI owns it and at most three rounds'
messages exist at a time (a round: at most one ring slot of rows per rank).

Backward: the rows a rank received get their ``dK, dV`` terms in a zeroed
message (compute dtype), sent back to the owner right after the step; the
owner adds its own block's terms first, then the partial sums of its readers
round by round, step by step -- a fixed order, so the result is bitwise
repeatable at a fixed placement and P (not bitwise the ring's: the order of
the sums differs).  The partial sums of round ``k`` are received into
messages posted with round ``k``'s K/V and added when round ``k + 3`` is
posted (one round of slack for the readers) or at the end.
"""

from __future__ import annotations

from typing import Iterator, Optional

import numpy as np

from ..core.masks import BlockMask, ScoreSpec
from ..runtime.faults import fault_point
from .ring import Ring
from .ring_schedule import Block, observed_compute, steps_done
from .route_plan import RoutePlan


def _rows_of(intervals: np.ndarray) -> np.ndarray:
    """Local row indices of ``(2, m)`` half-open intervals, in order."""
    if intervals.shape[1] == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in intervals.T])


class _Messages:
    """One message per step (``(B, H_kv, rows, D)`` then ``(B, H_kv, rows, D_v)`` of one dtype),
    made when its round is posted and dropped once its transfers are done, so that a buffer is
    never written while MPI owns it and at most two rounds' messages exist at a time."""

    def __init__(self, backend, batch: int, kv_heads: int, dim: int, dim_v: int, dtype):
        self.backend = backend
        self.batch, self.kv_heads, self.dim, self.dim_v = batch, kv_heads, dim, dim_v
        self.dtype = np.dtype(dtype)
        self.msgs = {}

    def nbytes(self, rows: int) -> int:
        return self.batch * self.kv_heads * rows * (self.dim + self.dim_v) * self.dtype.itemsize

    def new(self, step: int, rows: int):
        msg = self.msgs[step] = self.backend.message(self.nbytes(rows))
        return msg

    def views(self, step: int, rows: int):
        """``(k, v)`` (or ``(dk, dv)``) of ``step``'s message."""
        shape = (self.batch, self.kv_heads, rows, self.dim)
        msg = self.msgs[step]
        k = msg.view(0, shape, self.dtype)
        return k, msg.view(k.nbytes, shape[:3] + (self.dim_v,), self.dtype)

    def mpi(self, step: int, rows: int):
        return self.msgs[step].mpi_buffer()[:self.nbytes(rows)]

    def drop(self, steps) -> None:
        for t in steps:
            self.msgs.pop(t, None)


class RoutedSchedule:
    """One pass of the routed schedule over ``comm`` (the interface of ``RingSchedule``).

    Parameters
    ----------
    comm, backend : as for :class:`~ringmpi.parallel.ring_schedule.RingSchedule`.
    kh, vh : (B, H_kv, S_local, D), (B, H_kv, S_local, D_v) this rank's keys/values, head-major
        (views are fine: the block ops and the packing read them in place).
    plan : the call's :class:`~ringmpi.parallel.route_plan.RoutePlan` (this rank's).
    q_pos, kv_pos, seg_q, seg_kv, spec, grad_dtype, timeout, phase : as for ``RingSchedule``.
    """

    def __init__(self, comm, backend, kh, vh, *, plan: RoutePlan, q_pos: np.ndarray, kv_pos: np.ndarray,
                 spec: ScoreSpec, seg_q: Optional[np.ndarray] = None, seg_kv: Optional[np.ndarray] = None,
                 grad_dtype=None, timeout: Optional[float] = None, phase: str = "fwd"):
        self.backend, self.spec, self.phase, self.plan = backend, spec, phase, plan
        self.q_pos, self.seg_q, self.kv_pos, self.seg_kv = q_pos, seg_q, kv_pos, seg_kv
        self.kh, self.vh = kh, vh
        self.ring = Ring(comm, timeout=timeout, order=plan.order, schedule="routed")
        batch, kv_heads, _, dim = kh.shape
        shape = (batch, kv_heads, dim, vh.shape[3])
        self._in_rows = {t: int(plan.rows[plan.rank, plan.source(t)]) for t in range(1, plan.size)}
        self._out_rows = {t: int(plan.rows[plan.dest(t), plan.rank]) for t in range(1, plan.size)}
        self.kv_in = _Messages(backend, *shape, kh.dtype)
        self.kv_out = _Messages(backend, *shape, kh.dtype)
        self._grad_dtype = grad_dtype
        self.grad_in = self.grad_out = None
        if grad_dtype is not None:
            self.grad_in = _Messages(backend, *shape, grad_dtype)   # readers' partial sums of my rows
            self.grad_out = _Messages(backend, *shape, grad_dtype)  # my partial sums of rows I read
        self._home = None
        self._finished = None
        self._out_idx = {}  # step -> this rank's rows sent at that step (backend array, made once)
        self._sends_done = 0  # rounds whose sends are complete and messages dropped
        self._added = 0       # rounds whose partial sums are added to the home sums

    @property
    def records(self):
        """One :class:`ringmpi.parallel.ring.StepRecord` per step (plus the gradients' return)."""
        return self.ring.records

    def compute(self, fn, *args, **kwargs):
        """Run the block op ``fn(*args, tick=..., **kwargs)`` as this step's timed compute
        (its ticks also reach the observers of ``ring_schedule.observe_steps``)."""
        return observed_compute(self.backend, self.ring, self.phase, fn, *args, **kwargs)

    # ------------------------------------------------------------------ transfers
    def _outgoing(self, step: int):
        idx = self._out_idx.get(step)
        if idx is None:
            idx = self._out_idx[step] = self.backend.xp.asarray(
                _rows_of(self.plan.outgoing[self.plan.dest(step)]))
        return idx

    def _post_round(self, k: int) -> None:
        """Post round ``k``'s K/V receives and sends (this rank's rows packed), and in the backward
        the receives of the partial sums its readers will send back.  Called when round ``k - 1``
        starts: round ``k - 2``'s sends are waited for first and its messages dropped, and
        round ``k - 3``'s partial sums are added (one round of slack for the readers)."""
        rounds = self.plan.rounds
        self._retire_sends(k - 2)
        self._add_grads(k - 3)
        if k >= len(rounds):
            return
        ring, plan, xp = self.ring, self.plan, self.backend.xp
        for t in rounds[k]:
            rows_in, rows_out = self._in_rows[t], self._out_rows[t]
            if rows_in:
                self.kv_in.new(t, rows_in)
                ring.post(f"kv_in{t}", recv=self.kv_in.mpi(t, rows_in), stream="routed_kv", source=plan.source(t))
            if rows_out:
                msg = self.kv_out.new(t, rows_out)
                k_out, v_out = self.kv_out.views(t, rows_out)
                xp.take(self.kh, self._outgoing(t), axis=2, out=k_out)
                xp.take(self.vh, self._outgoing(t), axis=2, out=v_out)
                msg.ready_to_send(dirty=True)
                ring.post(f"kv_out{t}", send=self.kv_out.mpi(t, rows_out), stream="routed_kv", dest=plan.dest(t))
                if self.grad_in is not None:
                    self.grad_in.new(t, rows_out)
                    ring.post(f"grad_in{t}", recv=self.grad_in.mpi(t, rows_out), stream="routed_grad",
                              source=plan.dest(t))

    def _retire_sends(self, upto: int) -> None:
        """Rounds ``<= upto`` computed: wait for their sends, drop their K/V and outgoing sums."""
        while self._sends_done < min(upto, len(self.plan.rounds) - 1):
            self._sends_done += 1
            steps = self.plan.rounds[self._sends_done]
            for t in steps:
                self.ring.wait(f"kv_out{t}")
                self.ring.wait(f"grad_out{t}")
            for messages in (self.kv_in, self.kv_out, self.grad_out):
                if messages is not None:
                    messages.drop(steps)

    def _add_grads(self, upto: int) -> None:
        """Add the partial sums of rounds ``<= upto`` (from this rank's readers) to the home sums,
        round by round, step by step: a fixed order."""
        if self._grad_dtype is None:
            return
        dk_home, dv_home = self._home
        while self._added < min(upto, len(self.plan.rounds) - 1):
            self._added += 1
            steps = self.plan.rounds[self._added]
            for t in steps:
                rows = self._out_rows[t]
                if not rows:
                    continue
                self.ring.wait(f"grad_in{t}")
                self.grad_in.msgs[t].arrived()
                dk, dv = self.grad_in.views(t, rows)
                idx = self._outgoing(t)
                dk_home[:, :, idx] += dk
                dv_home[:, :, idx] += dv
            self.grad_in.drop(steps)

    # ------------------------------------------------------------------ the pass
    def __iter__(self) -> Iterator[Block]:
        ring, be, plan = self.ring, self.backend, self.plan
        backward = self._grad_dtype is not None
        if backward:
            self._home = (be.xp.zeros(self.kh.shape, dtype=self._grad_dtype),
                          be.xp.zeros(self.vh.shape, dtype=self._grad_dtype))
        ring.record(0)
        self._post_round(1)
        fault_point(self.phase, ring.rank, 0)
        block = Block(0, ring.rank, self.kh, self.vh,
                      BlockMask(self.spec, self.q_pos, self.kv_pos, self.seg_q, self.seg_kv))
        if backward:
            block.dk, block.dv = self._home
        yield block
        steps_done(self.phase, 0, plan.size)
        for k in range(1, len(plan.rounds)):
            for i, t in enumerate(plan.rounds[k]):
                while ring.step < t:
                    ring.next_step()
                if i == 0:
                    self._post_round(k + 1)
                fault_point(self.phase, ring.rank, t)
                rows = self._in_rows[t]
                if not rows:
                    continue
                src = plan.source(t)
                with be.annotate(f"routed step {t} wait"):
                    ring.wait(f"kv_in{t}")
                self.kv_in.msgs[t].arrived()
                k_in, v_in = self.kv_in.views(t, rows)
                kv_pos, seg_kv = plan.kv_runs[src].positions(_rows_of(plan.incoming[src]))
                block = Block(t, src, k_in, v_in, BlockMask(self.spec, self.q_pos, kv_pos, self.seg_q, seg_kv))
                if backward:
                    self.grad_out.new(t, rows)
                    block.dk, block.dv = self.grad_out.views(t, rows)
                    block.dk[...] = 0
                    block.dv[...] = 0
                yield block
                if backward:
                    self.grad_out.msgs[t].ready_to_send(dirty=True)
                    ring.post(f"grad_out{t}", send=self.grad_out.mpi(t, rows), stream="routed_grad", dest=src)
                steps_done(self.phase, t, plan.size)
        while ring.step < plan.size - 1:
            ring.next_step()
        if backward:
            ring.next_step()  # the partial sums come home
        last = len(plan.rounds) - 1
        self._retire_sends(last)
        self._add_grads(last)
        if backward:
            self._finished = self._home
        ring.wait_all()

    def finished_grads(self):
        """``(dk (B, H_kv, S_local, D), dv (B, H_kv, S_local, D_v))`` compute dtype: this rank's finished,
        unscaled K/V gradients, once iteration has ended."""
        if self._finished is None:
            raise RuntimeError("finished_grads() needs a schedule with grad_dtype, iterated to its end")
        return self._finished
