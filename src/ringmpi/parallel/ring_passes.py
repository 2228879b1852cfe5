"""The forward and backward passes of one local problem over a ring: the core of every schedule.

A :class:`LocalProblem` is what one rank computes once its data is in place:
resident queries at global positions ``q_pos``, its own K/V rows at ``kv_pos``
(the ring's members hold ``kv_counts`` rows each), the mask spec, the scale and
the ring's communicator.  The flat ring (:mod:`ringmpi.attention`) builds one
from the call's layouts; the head x ring schedule (:mod:`ringmpi.parallel.head_parallel`)
builds one from its all-to-all (the group's tokens, this member's heads) and
sends the results back.  :func:`forward_pass` and :func:`backward_pass` run the
:class:`~ringmpi.parallel.ring_schedule.RingSchedule` over it, folding each visiting block
into a :class:`~ringmpi.core.online_softmax.SoftmaxState` (forward) or the gradient
accumulators (backward).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from ..core.positions import Placement
from ..core.masks import ScoreSpec
from ..core.host import to_host
from ..core.online_softmax import SoftmaxState, local_max_logit
from .ring_schedule import RingSchedule
from .topology import ring_order
from ..runtime.watchdog import phase


def _heads_view(x):
    """``x (B, S, H, D)`` as a ``(B, H, S, D)`` view (no copy; numpy or cupy)."""
    return x.transpose(0, 2, 1, 3)


@dataclass(frozen=True)
class LocalProblem:
    """One rank's share of an attention call, ready for a ring.

    comm : the ring's communicator (``COMM_WORLD``'s dup, or a head group's ring).
    backend : the block-op backend; compute_dtype its compute dtype for the inputs.
    spec : the mask spec (dropout's heads already those of this problem).
    scale : the softmax scale.
    kv_counts : K/V rows each ring member holds; q_pos, kv_pos : (S_q,), (S_kv,) int64
        global positions of the resident queries and of this rank's K/V rows.
    seg_q, seg_kv : (B, S_q), (B, S_kv) int64 segment ids, or None.
    timeout : deadline of each ring wait, or None.
    order : the ranks of ``comm`` in ring order, the same on every rank (None: rank order).
    kv_schedule : how K/V move (``AttentionOptions.schedule``, resolved): ``"ring"``, ``"routed"``
        (each rank receives only the rows its queries see: :mod:`ringmpi.parallel.routed_schedule`)
        ``"allgather"`` (every rank gathers all K/V rows: :mod:`ringmpi.parallel.allgather_schedule`)
        or ``"auto"`` (the fastest predicted, :mod:`ringmpi.parallel.cost_measure`), the same on every rank.
    q_counts, q_heads : query rows of every ring member and the query heads (what ``"auto"``'s
        prediction counts; None: as the K/V's).
    choice : ``(chosen, runner-up or None)`` :class:`~ringmpi.core.cost_model.Prediction` s where
        ``head_parallel="auto"`` already chose this problem's schedule
        (:meth:`AgreedCall.choose_head_parallel`): stamped on the first record, as ``"auto"``'s.
    """

    comm: object
    backend: object
    compute_dtype: np.dtype
    spec: ScoreSpec
    scale: float
    kv_counts: Sequence[int]
    q_pos: np.ndarray
    kv_pos: np.ndarray
    seg_q: Optional[np.ndarray] = None
    seg_kv: Optional[np.ndarray] = None
    timeout: Optional[float] = None
    order: Optional[Sequence[int]] = None
    kv_schedule: str = "ring"
    q_counts: Optional[Sequence[int]] = None
    q_heads: Optional[int] = None
    choice: Optional[tuple] = None

    def schedule(self, k, v, grad_dtype=None, phase: str = "fwd", grad_dims=None):
        """The schedule loaded with this rank's ``k (B, S_kv, H_kv, D)``, ``v (B, S_kv, H_kv, D_v)``:
        a :class:`RingSchedule`, a :class:`~ringmpi.parallel.routed_schedule.RoutedSchedule` or an
        :class:`~ringmpi.parallel.allgather_schedule.AllGatherSchedule` as ``kv_schedule`` asks
        (``"auto"``: the cost model's fastest prediction that fits the memory budget, among the
        ring, the all-gather and, where a mask's plan moves fewer rows than the ring, routed);
        ``grad_dtype``, ``grad_dims``: the partial sums' words, see
        :class:`RingSchedule` (the invariant passes' integer sums: the ring only)."""
        be = self.backend
        kv_schedule, choice, plan = self.kv_schedule, self.choice, None
        if self.comm.Get_size() == 1:
            kv_schedule = "ring"
        masked = self.spec.positional or self.seg_q is not None
        kept = key = None
        if kv_schedule == "auto":  # the decision of an identical earlier call, if every rank has one
            from .cost_measure import call_key, recall

            key = call_key((self.q_pos, self.kv_pos, self.seg_q, self.seg_kv), "schedule", self._key_parts(k, v),
                           grad_dtype is None)
            kept = recall(self.comm, key, self.timeout)
        if kept is not None:
            plan, choice = kept
        elif kv_schedule == "routed" or (kv_schedule == "auto" and masked):
            from .route_plan import gather_plan

            order = self.order if self.order is not None else list(range(self.comm.Get_size()))
            plan = gather_plan(self.comm, self.q_pos, self.seg_q, self.kv_pos, self.seg_kv, self.spec, order,
                               timeout=self.timeout)
        if kv_schedule == "auto":
            if kept is None:
                from .cost_measure import remember

                choice = self._choose(k, v, grad_dtype, plan)
                remember(self.comm, key, (plan, choice), choice[0].schedule)
            kv_schedule = choice[0].schedule
        if kv_schedule == "allgather":
            schedule = self._allgather(k, v, grad_dtype, phase, checked=choice is not None)
        elif kv_schedule == "routed":
            from .routed_schedule import RoutedSchedule

            # this rank's own block read where it lies (a view on the host; the GPU kernels need a copy)
            kh, vh = be.heads_view(k, k.dtype), be.heads_view(v, v.dtype)
            schedule = RoutedSchedule(self.comm, be, kh, vh, plan=plan, q_pos=self.q_pos,
                                      kv_pos=self.kv_pos, spec=self.spec, seg_q=self.seg_q, seg_kv=self.seg_kv,
                                      grad_dtype=grad_dtype, timeout=self.timeout, phase=phase)
        else:
            schedule = self._ring(k, v, grad_dtype, phase, grad_dims)
        if choice is not None:
            stamp(schedule.ring.record(0), choice)
        return schedule

    def _key_parts(self, k, v):
        """What besides positions and segment ids an ``"auto"`` decision of this problem depends on."""
        spec = self.spec
        return (k.shape, v.shape, str(k.dtype), str(np.dtype(self.compute_dtype)), spec.causal, spec.window,
                spec.offset, spec.softcap is None, spec.dropout is None, tuple(type(m).__name__ for m in spec.modifiers),
                tuple(int(c) for c in self.kv_counts), None if self.q_counts is None else tuple(map(int, self.q_counts)),
                None if self.order is None else tuple(map(int, self.order)), self.q_heads, self.backend.name)

    def _choose(self, k, v, grad_dtype, plan):
        """``schedule="auto"``: the (chosen, runner-up) predictions of the cost model
        (:mod:`ringmpi.parallel.cost_measure`), the same on every rank; the routed schedule is a
        candidate where its plan moves fewer rows than the ring."""
        from .cost_measure import choose_schedule

        schedules, routed_rows = ("ring", "allgather"), None
        shape, rows = self._cost_shape(k, v, plan)
        if plan is not None and plan.routed_rows() < plan.ring_rows():
            schedules, routed_rows = schedules + ("routed",), rows
        return choose_schedule(self.comm, self.backend, k.dtype, shape, schedules, grad_dtype is not None,
                               routed_rows=routed_rows, timeout=self.timeout)

    def _cost_shape(self, k, v, plan):
        """``(the cost model's Shape of this call, the K/V rows the busiest rank receives under the
        routed schedule or None)``: the shape from ``plan``'s seen rows where there is a plan."""
        size = self.comm.Get_size()
        n_kv = int(sum(self.kv_counts))
        n_q = int(sum(self.q_counts)) if self.q_counts is not None else n_kv
        seen, rows = None, None
        if plan is not None:
            seen = max(plan.routed_rows() / max(plan.ring_rows(), 1), 1.0 / size)
            rows = float(plan.rows.sum(axis=1).max())
        shape = call_shape(n_q, n_kv, self.q_heads or k.shape[2], k, v, self.compute_dtype, self.spec, seen)
        pairs = busiest_tile_pairs(self.comm, self.q_pos, self.seg_q, self.kv_pos, self.seg_kv, self.spec,
                                   self.timeout)
        split = None
        if plan is not None:
            from .topology import cached_node_ids

            node = np.asarray(cached_node_ids(self.comm))
            same = node[:, None] == node[None, :]
            near = float((plan.rows * same).sum(axis=1).max())  # the busiest rank's rows from its own node
            far = max(float(plan.rows[node == n][:, node != n].sum()) for n in set(node.tolist()))
            split = (near, far)
        return replace(shape, tile_pairs=pairs, routed_split=split, segments=self.seg_q is not None), rows

    def predictions(self, k, v, backward: bool = False, head_parallel: Sequence[int] = (1,)):
        """Every schedule's :class:`~ringmpi.core.cost_model.Prediction` for this problem on this
        communicator's measured parts, fastest first (collective): the ring, routed (its plan's
        rows, whether or not it moves fewer than the ring), the all-gather, each for every ``U``
        of ``head_parallel``, from the figures ``schedule="auto"`` chooses with (:meth:`schedule`);
        what ``ringmpi.bench.schedule_grid`` compares with the measured times."""
        from ..core.cost_model import SCHEDULES
        from .cost_measure import predictions_on
        from .route_plan import gather_plan

        order = self.order if self.order is not None else list(range(self.comm.Get_size()))
        plan = gather_plan(self.comm, self.q_pos, self.seg_q, self.kv_pos, self.seg_kv, self.spec, order,
                           timeout=self.timeout)
        shape, rows = self._cost_shape(k, v, plan)  # a dense mask's plan: every row seen, as without one
        return predictions_on(self.comm, self.backend, k.dtype, shape, SCHEDULES, head_parallel, backward,
                              routed_rows=rows, timeout=self.timeout)[1]

    def _ring(self, k, v, grad_dtype, phase: str, grad_dims):
        be = self.backend
        # head-major views: the schedule copies them straight into its first K/V buffer
        # (no (B, H_kv, S, D) temporaries beside the buffers)
        return RingSchedule(
            self.comm, be, _heads_view(k), _heads_view(v), kv_counts=self.kv_counts,
            q_pos=self.q_pos, kv_pos=self.kv_pos, spec=self.spec, seg_q=self.seg_q, seg_kv=self.seg_kv,
            grad_dtype=grad_dtype, timeout=self.timeout, phase=phase, order=self.order, grad_dims=grad_dims)

    def _allgather(self, k, v, grad_dtype, phase: str, checked: bool = False):
        """The :class:`~ringmpi.parallel.allgather_schedule.AllGatherSchedule` of this problem, once
        every rank agrees its declared memory fits its budget (a ConfigError on every rank
        otherwise) and has every rank's key runs (one allgather)."""
        from ..runtime.errors import agree
        from ..runtime.memory import budget
        from ..runtime import watchdog
        from .allgather_schedule import AllGatherSchedule, declared_bytes
        from .route_plan import runs_of

        be, comm = self.backend, self.comm
        batch, _, kv_heads, dim = k.shape
        grad_size = 0 if grad_dtype is None else np.dtype(grad_dtype).itemsize
        need = declared_bytes(self.kv_counts, comm.Get_rank(), batch, kv_heads, dim, v.shape[3],
                              np.dtype(k.dtype).itemsize, grad_size)
        have = None if checked else budget(on_device=be.name == "cupy")  # auto checked its prediction's
        agree(comm, None if have is None or need <= have else
              f"schedule='allgather' needs {need / 2**20:.1f} MiB per rank for the gathered K/V"
              f"{' and their gradients' if grad_size else ''}, beyond this rank's memory budget of "
              f"{have / 2**20:.1f} MiB (RINGMPI_MEMORY_BUDGET); use schedule='ring'")
        with watchdog.phase("the all-gather schedule's key runs (allgather)", self.timeout):
            kv_runs = comm.allgather(runs_of(self.kv_pos, self.seg_kv))
        kh, vh = be.heads_view(k, k.dtype), be.heads_view(v, v.dtype)
        return AllGatherSchedule(comm, be, kh, vh, kv_counts=self.kv_counts, kv_runs=kv_runs, q_pos=self.q_pos,
                                 kv_pos=self.kv_pos, spec=self.spec, seg_q=self.seg_q, seg_kv=self.seg_kv,
                                 grad_dtype=grad_dtype, timeout=self.timeout, phase=phase, order=self.order)


def busiest_tile_pairs(comm, q_pos, seg_q, kv_pos, seg_kv, spec: ScoreSpec, timeout=None) -> Optional[float]:
    """The (query, key) pairs of the tiles the busiest rank's block ops compute over one pass (every
    rank's K/V block against its queries; partially masked tiles whole, as the kernels compute
    them; per batch entry and head): the cost model's ``Shape.tile_pairs``, from every rank's
    K/V tile bounds (one allgather) and the tile rule of the kernels
    (:func:`ringmpi.core.masks.classify_tiles`, tiles of :data:`ringmpi.core.cost_model.TILE_ROWS`);
    None where there is no mask (every tile computed: the visible pairs are the same).
    Collective."""
    from ..core.cost_model import TILE_ROWS
    from ..core.masks import SKIP, classify_tiles, tile_bounds
    from ..runtime.watchdog import phase

    if q_pos is None or kv_pos is None or not (spec.positional or seg_q is not None):
        return None
    mine = (len(kv_pos), tile_bounds(kv_pos, seg_kv, TILE_ROWS)) if len(kv_pos) else (0, None)
    with phase("the cost model's tile count (allgather of K/V tile bounds)", timeout):
        every = comm.allgather(mine)
    batch = 1 if seg_q is None else seg_q.shape[0]
    sq = len(q_pos)
    pairs = 0.0
    if sq:
        nqt = -(-sq // TILE_ROWS)
        q_rows = np.minimum(TILE_ROWS, sq - TILE_ROWS * np.arange(nqt))
        q_bounds = tile_bounds(q_pos, seg_q, TILE_ROWS)
        for skv, bounds in every:
            if not skv:
                continue
            nkt = -(-skv // TILE_ROWS)
            k_rows = np.minimum(TILE_ROWS, skv - TILE_ROWS * np.arange(nkt))
            classes = classify_tiles(spec, q_bounds, bounds, nqt, nkt, batch, seg_q is not None)
            sizes = q_rows[:, None] * k_rows[None, :]
            pairs += float(((classes != SKIP) * sizes[None]).sum()) / classes.shape[0]
    with phase("the cost model's tile count (allreduce MAX)", timeout):
        return float(comm.allreduce(pairs, op=_max_op()))


def _max_op():
    from mpi4py import MPI

    return MPI.MAX


def call_shape(n_q: int, n_kv: int, heads: int, k, v, compute_dtype, spec: ScoreSpec, seen=None):
    """The cost model's :class:`~ringmpi.core.cost_model.Shape` of a call: ``k (B, S, H_kv, D)``,
    ``v``'s ``D_v``, the mask's visible share (causal: half; a window: its width; ``seen``: the
    share of the other ranks' rows a route plan found visible, else 1)."""
    from ..core.cost_model import Shape

    half = 0.5 if spec.causal else 1.0
    density = half
    window = spec.window
    if window is not None and None not in window:
        density = min(density, (window[0] + window[1] + 1) / max(n_kv, 1))
    if seen is not None:
        density = min(density, seen * half)
    return Shape(n_q=n_q, n_kv=n_kv, batch=k.shape[0], heads=heads, kv_heads=k.shape[2], dim=k.shape[3],
                 dim_v=v.shape[3], itemsize=np.dtype(k.dtype).itemsize,
                 grad_itemsize=np.dtype(compute_dtype).itemsize, density=density)


def stamp(record, choice) -> None:
    """Write ``choice`` (``(chosen, runner-up or None)`` predictions) into a pass's first record."""
    best, runner = choice
    record.chosen, record.predicted_s, record.predicted_fixed_s = best.name, best.seconds, best.fixed
    if runner is not None:
        record.runner_up, record.runner_up_s = runner.name, runner.seconds


@dataclass(frozen=True)
class AgreedCall:
    """Everything one sharded call agreed on across the ranks of ``comm`` before any compute.

    place_q, place_kv : where the call's ``N_q`` queries and ``N_kv`` keys are over ``comm``
        (:class:`~ringmpi.core.positions.Placement`: from a layout or given positions).
    seg_q, seg_kv : (B, S_q_local), (B, S_kv_local) int64 segment ids of this rank, or None.
    sinks : (H,) this backend's array in the compute dtype, or None.
    kv_schedule : ``AttentionOptions.schedule`` resolved (``"ring"``, ``"routed"``, ``"allgather"`` or ``"auto"``).
    choice : what ``head_parallel="auto"`` chose (:meth:`choose_head_parallel`), or None.
    The other fields as :class:`LocalProblem`'s.
    """

    comm: object
    backend: object
    compute_dtype: np.dtype
    batch: int
    heads: int
    place_q: Placement
    place_kv: Placement
    spec: ScoreSpec
    scale: float
    seg_q: Optional[np.ndarray] = None
    seg_kv: Optional[np.ndarray] = None
    timeout: Optional[float] = None
    sinks: Optional[object] = None
    kv_schedule: str = "ring"
    choice: Optional[tuple] = None

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def masked(self) -> bool:
        """Whether a mask leaves rows of other ranks unseen (the routed schedule's case)."""
        return bool(self.spec.positional or self.seg_q is not None)

    def choose_head_parallel(self, candidates: Sequence[int], k, v, backward: bool,
                             invariant: bool = False) -> "tuple[int, AgreedCall]":
        """``head_parallel="auto"``: ``(U, this call with its schedule chosen)``, the fastest
        predicted (:mod:`ringmpi.core.cost_model`, on this communicator's measured parts) among
        ``candidates`` (:func:`ringmpi.parallel.topology.head_parallel_candidates`) jointly with
        ``schedule="auto"``'s schedules (the ring alone for ``invariant``; the given schedule
        otherwise; routed too where a mask leaves rows unseen and its plan moves fewer rows than
        the ring, from the flat ring's plan).  The same on every rank (collective).  Where a mask
        may leave rows unseen and the schedule is ``"auto"``, the chosen ``U``'s ring still
        chooses its schedule (routed needs its plan: the same model chooses the same); otherwise
        the choice is stamped on each pass's first record."""
        from dataclasses import replace

        from .cost_measure import call_key, recall, remember

        flat = self.flat_problem()  # its key: the same call, whichever U follows
        key = call_key((flat.q_pos, flat.kv_pos, self.seg_q, self.seg_kv), "head_parallel", flat._key_parts(k, v),
                       tuple(candidates), backward, invariant, self.kv_schedule)
        kept = recall(self.comm, key, self.timeout)
        if kept is None:
            kept = self._choose_jointly(candidates, k, v, backward, invariant, flat)
            remember(self.comm, key, kept, kept[0].schedule)
        best, runner = kept
        if self.kv_schedule == "auto" and self.masked and not invariant:
            return best.head_parallel, self
        return best.head_parallel, replace(self, kv_schedule=best.schedule, choice=(best, runner))

    def _choose_jointly(self, candidates, k, v, backward, invariant, flat):
        """``(best, runner-up)`` of :meth:`choose_head_parallel` (collective)."""
        from .cost_measure import choose_plan

        routed_rows = None
        if invariant:
            schedules = ("ring",)
        elif self.kv_schedule == "auto":
            schedules = ("ring", "allgather")
        else:
            schedules = (self.kv_schedule,)
        if self.kv_schedule == "auto" and self.masked and not invariant:
            # routed weighed with the others, from the flat ring's plan (as LocalProblem.predictions)
            from .route_plan import gather_plan

            plan = gather_plan(self.comm, flat.q_pos, self.seg_q, flat.kv_pos, self.seg_kv, self.spec, flat.order,
                               timeout=self.timeout)
            shape, rows = flat._cost_shape(k, v, plan)
            if plan.routed_rows() < plan.ring_rows():
                schedules, routed_rows = schedules + ("routed",), rows
        else:
            shape = call_shape(self.place_q.n, self.place_kv.n, self.heads, k, v, self.compute_dtype, self.spec)
            shape = replace(shape, tile_pairs=busiest_tile_pairs(self.comm, self.place_q.mine, self.seg_q,
                                                                 self.place_kv.mine, self.seg_kv, self.spec,
                                                                 self.timeout),
                            segments=self.seg_q is not None)
        return choose_plan(self.comm, self.backend, k.dtype, shape, schedules, candidates, backward,
                           routed_rows=routed_rows, timeout=self.timeout)

    def flat_problem(self) -> LocalProblem:
        """The flat ring's problem: this rank's own shards, the ring of all ranks of ``comm``
        node by node (:func:`ringmpi.parallel.topology.ring_order`)."""
        return LocalProblem(self.comm, self.backend, self.compute_dtype, self.spec, self.scale,
                            kv_counts=self.place_kv.counts, q_pos=self.place_q.mine,
                            kv_pos=self.place_kv.mine, seg_q=self.seg_q, seg_kv=self.seg_kv,
                            timeout=self.timeout, order=ring_order(self.comm), kv_schedule=self.kv_schedule,
                            q_counts=self.place_q.counts, q_heads=self.heads, choice=self.choice)


def forward_pass(problem: LocalProblem, q, k, v, sinks=None, max_logit=None, invariant=None):
    """``(o (B, S_q, H, D_v) q.dtype, lse (B, H, S_q), max_logit (H,) or None, records)``.

    ``q (B, S_q, H, D)``, ``k, v`` this backend's arrays, sequence-major.  ``sinks
    (H,)``: this problem's heads' sinks (this backend's array, compute dtype).
    ``max_logit``: ``(comm, heads)`` to reduce the max logit over (``heads`` as
    :meth:`~ringmpi.core.online_softmax.SoftmaxState.local_max_logit`), or None for none.
    ``invariant``: the call's :class:`~ringmpi.parallel.invariant_passes.Maxima` to run
    :func:`ringmpi.parallel.invariant_passes.forward` instead (``invariant=True``), or None.
    """
    if invariant is not None:
        from .invariant_passes import forward
        o, lse, row_max, records = forward(problem, q, k, v, invariant, sinks=sinks)
        top = None if max_logit is None else reduce_max_logit(max_logit[0], local_max_logit(row_max, max_logit[1]))
        return o, lse, top, records
    be, ct = problem.backend, problem.compute_dtype
    qh = be.heads_view(q, ct)
    state = SoftmaxState(be, qh.shape[:3], v.shape[3], ct)
    schedule = problem.schedule(k, v)
    resident = {}  # what the backend derives from qh once per call
    for block in schedule:
        schedule.compute(be.forward_block, qh, block.k, block.v, *state.arrays(), problem.scale, block.mask,
                         resident=resident)
    records = schedule.records
    del schedule, block, resident, qh  # the ring's buffers go before the outputs are made
    top = None if max_logit is None else reduce_max_logit(max_logit[0], state.local_max_logit(max_logit[1]))
    if sinks is not None:
        state.fold_sinks(sinks)
    o, lse = state.finalize(q.dtype)
    return o, lse, top, records


def backward_pass(problem: LocalProblem, q, do, k, v, lse, o=None, dvec=None, sinks=None, sink_comm=None,
                  invariant=None, raw: bool = False):
    """``(dq (B, H, S_q, D), dk (B, H_kv, S_kv, D), dv (B, H_kv, S_kv, D_v), dsinks, records)``.

    Head-major compute-dtype gradients, scaled, of this rank's rows.  ``q, do``
    sequence-major (this backend's arrays); ``lse (B, H, S_q)``; ``dvec = rowsum(do
    * o)`` head-major, or None to compute it from ``o`` (sequence-major).  With
    ``sinks`` (compute dtype) ``dsinks (H,)`` is summed over ``sink_comm`` (this rank's
    own share when it is None: the framework bridges' convention); else None.
    ``invariant``: the call's :class:`~ringmpi.parallel.invariant_passes.Maxima` to run
    :func:`ringmpi.parallel.invariant_passes.backward` instead (``raw`` as there), or None.
    """
    if invariant is not None:
        from .invariant_passes import backward
        return backward(problem, q, do, k, v, lse, invariant, o=o, dvec=dvec, sinks=sinks, sink_comm=sink_comm,
                        raw=raw)
    be, ct = problem.backend, problem.compute_dtype
    qh, doh = be.heads_view(q, ct), be.heads_view(do, ct)
    if dvec is None:
        dvec = be.row_dot(doh, be.heads_view(o, ct))
    lse = lse.astype(ct, copy=False)
    dq = be.xp.zeros_like(qh)
    schedule = problem.schedule(k, v, grad_dtype=ct, phase="bwd")
    resident = {}  # what the backend derives from qh, doh, lse, dvec once per call
    for block in schedule:
        schedule.compute(be.backward_block, qh, doh, lse, dvec, block.k, block.v, dq, block.dk, block.dv,
                         problem.scale, block.mask, resident=resident, **block.rows)
    dk, dv = schedule.finished_grads()
    records = schedule.records
    dsinks = None if sinks is None else sink_grads(be.xp, lse, dvec, sinks, sink_comm)
    # keep only dq and the finished dk, dv (their message) before the outputs are made
    del schedule, block, resident, qh, doh, dvec
    dq *= ct.type(problem.scale)
    dk *= ct.type(problem.scale)
    return dq, dk, dv, dsinks, records


def reduce_max_logit(comm, local: np.ndarray) -> np.ndarray:
    """``(H,)`` host array: the ranks' ``local`` max logits (a state's
    :meth:`~ringmpi.core.online_softmax.SoftmaxState.local_max_logit`) reduced over ``comm``
    with ``MPI.MAX``, in ``local``'s dtype.  A NaN on any rank gives NaN (``MPI.MAX`` alone
    may drop it: it compares with ``>``), so NaN flags travel beside the values."""
    from mpi4py import MPI

    total = len(local)
    nan = np.isnan(local)
    both = np.concatenate([np.where(nan, -np.inf, local), nan]).astype(local.dtype)
    out = np.empty_like(both)
    with phase("the max logit reduction (Allreduce)"):
        comm.Allreduce(both, out, op=MPI.MAX)
    return np.where(out[total:] > 0, np.nan, out[:total]).astype(local.dtype)


def sink_grads(xp, lse, dvec, sinks, comm):
    """``dsinks (H,)`` host array in the compute dtype: ``-sum exp(sink - lse) * dvec``
    over the batch, this rank's rows and (``MPI.SUM``) all ranks of ``comm``.

    ``lse, dvec (B, H, S_local)`` compute dtype (this backend's arrays).  With ``comm``
    None the result is this rank's own rows' contribution: the framework bridges'
    convention (``ring_attention_backward(reduce_dsinks=False)``), where the usual sum
    of replicated gradients over ranks makes the total.
    """
    from mpi4py import MPI

    ct = lse.dtype
    local = np.zeros(lse.shape[1], dtype=ct)
    if lse.shape[0] and lse.shape[2]:
        p_sink = xp.exp(sinks.astype(ct)[None, :, None] - lse)
        local = np.ascontiguousarray(to_host(-(p_sink * dvec).sum(axis=(0, 2))), dtype=ct)
    if comm is None:
        return local
    out = np.empty_like(local)
    with phase("the sinks' gradient reduction (Allreduce)"):
        comm.Allreduce(local, out, op=MPI.SUM)
    return out
