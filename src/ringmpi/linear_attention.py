"""Linear-attention layers with the sequence sharded across ranks: gated delta rule, KDA, GLA, scalar decay.

Each rank passes its contiguous shard of the token axis (any lengths, empty shards included;
rank order is token order) and gets the outputs of its own tokens, exactly as one process
computing the whole sequence would (to rounding).  Per head the state ``S`` (``K x V``) follows
the layer's recurrence (``core/linear_recurrence.py``); a rank's shard moves it by one affine
map ``S -> M_r S + U_r``, computed in chunks from a zero state while also tracking ``M_r`` and
each chunk's entering map.  Only a map that another rank uses is made: the first rank's
entering state is known, and a run whose map no rank needs (on the last rank, or followed by a
document start in its shard) waits for its entering state and runs once from it, making
meanwhile the part of its outputs (or, in the backward, of its reverse recursion) that needs
no state.  The ranks compose their maps in an exclusive scan
(``parallel/state_scan.py``: ``ceil(log2 P)`` messages of ``K (K + V)`` numbers per row and
head, independent of the sequence length); each rank corrects its chunks' states and end state
from the state that arrives and only then makes its outputs, once (the same products as one
process's).  The backward is the same scan in reverse over ``dS -> M_r^T dS + c_r`` (``c_r``
from the chunks' reverse recursion), then each rank's local reverse pass.  Packed documents
(``cu_seqlens`` in global positions) cut a shard into segments: a document starting inside a
shard makes ``M_r = 0``.

Shapes (flash-linear-attention's ``chunk_gated_delta_rule`` / ``chunk_kda`` / ``chunk_gla`` /
``chunk_simple_gla``; ``g (B, T_local, HV, K)`` for the per-key decays of KDA and GLA):
``q, k (B, T_local, H, K)``, ``v (B, T_local, HV, V)`` with ``HV % H == 0`` (each q/k head
serves ``HV / H`` consecutive value heads), ``g`` the log decay and ``beta`` ``(B, T_local, HV)``,
``o (B, T_local, HV, V)``, states ``(B, HV, K, V)``, or ``(N_docs, HV, K, V)`` with
``cu_seqlens`` (then ``B = 1``).  float32 or float64; the states are in the inputs' dtype.
``initial_state`` and ``cu_seqlens`` are the same on every rank; the final state is returned on
every rank.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from .core import linear_recurrence as _rec
from .core.host import array_module, to_host
from .core.state_maps import StateMap, apply_m, identity, reset, transposed
from .core.state_segments import Segment, empty_documents, segments
from .context import RingContext, comm_of
from .parallel.comm import resolve_comm
from .parallel.state_scan import exclusive_scan
from .runtime.errors import ConfigError, agree_shards
from .runtime.watchdog import phase

DTYPES = ("float32", "float64")


@dataclass
class LinearCall:
    """One call, checked and agreed on by every rank: sizes, this rank's token range, documents."""

    comm: object
    kind: str          # the rank maps' kind (core/state_maps.py)
    delta: bool
    b: int
    h: int
    hv: int
    kdim: int
    vdim: int
    dtype: np.dtype
    scale: float
    start: int         # this rank's tokens are [start, stop) of n
    stop: int
    n: int
    bounds: np.ndarray  # document boundaries in global positions: cu_seqlens, or [0, n]
    documents: bool
    output_final_state: bool

    @property
    def state_rows(self) -> int:
        return len(self.bounds) - 1 if self.documents else self.b

    def rows(self, doc: int) -> slice:
        """The state rows of a document (all batch rows without documents)."""
        return slice(doc, doc + 1) if self.documents else slice(None)

    def state_shape(self, rows: Optional[int] = None) -> tuple:
        return ((self.state_rows if rows is None else rows), self.hv, self.kdim, self.vdim)


def _shape_problem(q, k, v, g, beta, initial_state, cu_seqlens, scale, delta, per_key) -> Optional[str]:
    if q.ndim != 4 or k.shape != q.shape:
        return f"q and k must be (B, T, H, K) of one shape, got {q.shape} and {k.shape}"
    b, t, h, _ = q.shape
    if v.ndim != 4 or v.shape[:2] != (b, t):
        return f"v must be (B, T, HV, V) with q's B and T = {(b, t)}, got {v.shape}"
    if v.shape[2] % h:
        return f"v's heads HV = {v.shape[2]} must be a multiple of q's H = {h}"
    names = ("q", "k", "v") + (("g",) if g is not None else ()) + (("beta",) if delta else ())
    arrays = (q, k, v) + ((g,) if g is not None else ()) + ((beta,) if delta else ())
    if len({a.dtype for a in arrays}) != 1 or q.dtype.name not in DTYPES:
        return f"{', '.join(names)} must share one dtype of {DTYPES}, got {[a.dtype.name for a in arrays]}"
    if g is not None and g.shape != v.shape[:3] + ((q.shape[3],) if per_key else ()):
        want = "(B, T, HV, K) = %s" % (v.shape[:3] + (q.shape[3],),) if per_key else f"(B, T, HV) = {v.shape[:3]}"
        return f"g must be {want}, got {g.shape}"
    if delta and beta.shape != v.shape[:3]:
        return f"beta must be (B, T, HV) = {v.shape[:3]}, got {beta.shape}"
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        return f"scale must be finite and > 0, got {scale}"
    if cu_seqlens is not None:
        if cu_seqlens.ndim != 1 or len(cu_seqlens) < 2 or cu_seqlens[0] != 0 or np.any(np.diff(cu_seqlens) < 0):
            return "cu_seqlens must be non-decreasing document boundaries [0, ..., N] in global positions"
        if b != 1:
            return f"cu_seqlens needs B = 1 (the documents are packed along T), got B = {b}"
    if initial_state is not None:
        rows = b if cu_seqlens is None else len(cu_seqlens) - 1
        want = (rows, v.shape[2], q.shape[3], v.shape[3])
        if initial_state.shape != want:
            return f"initial_state must be {want} (rows: {'B' if cu_seqlens is None else 'documents'}), " \
                   f"got {initial_state.shape}"
    return None


def agree_call(comm, q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens,
               delta, per_key: bool = False, problem: Optional[str] = None) -> LinearCall:
    """Check the call on every rank and agree on it in one allgather (shapes, dtype, options,
    documents, every rank's length); the same :class:`ConfigError` on every rank, before any
    compute.  ``problem``: this rank's own finding beyond the call's shapes (the backward's)."""
    comm = resolve_comm(comm)
    cu = None if cu_seqlens is None else np.asarray(to_host(cu_seqlens)).astype(np.int64)
    problem = _shape_problem(q, k, v, g, beta, initial_state, cu, scale, delta, per_key) or problem
    signature = None
    if problem is None:
        signature = (q.shape[0], q.shape[2], q.shape[3], v.shape[2], v.shape[3], q.dtype.name,
                     scale, g is None, initial_state is None, bool(output_final_state),
                     None if cu is None else cu.tobytes().hex())
    lengths = agree_shards(comm, problem, signature, q.shape[1] if q.ndim == 4 else 0,
                           "B, H, K, HV, V, dtype, scale, g, initial_state, output_final_state or cu_seqlens")
    rank, n = comm.Get_rank(), sum(lengths)
    if cu is not None and cu[-1] != n:
        raise ConfigError(f"cu_seqlens ends at {cu[-1]}, but the ranks' shards hold N = {n} tokens")
    start = sum(lengths[:rank])
    kind = "dense" if delta else ("identity" if g is None else ("diagonal" if per_key else "scalar"))
    return LinearCall(comm=comm, kind=kind, delta=delta,
                      b=q.shape[0], h=q.shape[2], hv=v.shape[2], kdim=q.shape[3], vdim=v.shape[3], dtype=q.dtype,
                      scale=float(q.shape[3] ** -0.5 if scale is None else scale), start=start,
                      stop=start + lengths[rank], n=n, bounds=np.array([0, n]) if cu is None else cu,
                      documents=cu is not None, output_final_state=bool(output_final_state))


def _head_major(x):
    xp = array_module(x)
    return xp.ascontiguousarray(xp.moveaxis(x, 1, 2))


def _on_host(smap: StateMap) -> StateMap:
    """The map as NumPy arrays, what the ranks' scan sends (no copy for NumPy arrays)."""
    return StateMap(smap.kind, to_host(smap.m), to_host(smap.u))


@dataclass
class _Run:
    seg: Segment
    pieces: _rec.Chunks
    fwd: Optional[_rec.Forward]       # None while a run waits for its entering state (``waits``)
    inside: Optional[np.ndarray] = None  # the outputs' part made while it waits (``_rec.within``)


class ShardRecurrence:
    """One rank's part of a call: its segments' chunked runs, the scans, the corrections."""

    def __init__(self, call: LinearCall, q, k, v, g, beta, initial_state):
        self.call = call
        group = call.hv // call.h
        dt = call.dtype
        xp = self.xp = array_module(q)  # where the chunked runs compute: the inputs' module
        self.q = _head_major(xp.repeat(q, group, axis=2)) * dt.type(call.scale)
        self.k = _head_major(xp.repeat(k, group, axis=2))
        self.v = _head_major(v)
        t = q.shape[1]
        self.g = xp.zeros((call.b, call.hv, t), dt) if g is None else _head_major(g)
        self.beta = _head_major(beta) if call.delta else None
        self.initial = None if initial_state is None else xp.asarray(initial_state, dtype=dt)
        self.segments = segments(call.start, call.stop, call.bounds)
        self.last = call.comm.Get_rank() == call.comm.Get_size() - 1
        self.runs: List[_Run] = []
        self.map: Optional[StateMap] = None
        self.bytes_received = 0
        self.seconds = {"local": 0.0, "scan": 0.0}  # this rank's chunked runs and corrections; its scans

    def _start_state(self, seg: Segment):
        if seg.starts and self.initial is not None:
            return self.initial[self.call.rows(seg.doc)]
        return self.xp.zeros(self.call.state_shape(self.call.b), self.call.dtype)

    @property
    def head(self) -> Optional[_Run]:
        """The run that continues a document from the ranks before, if any."""
        return self.runs[0] if self.runs and not self.runs[0].seg.starts else None

    def _waits(self, seg: Segment) -> bool:
        """Whether ``seg`` runs only once its entering state is known: a run continuing a
        document whose map no rank needs, because this is the last rank or a document starts
        after it in the shard (this rank's map is then that document's).  It runs once, from the
        true state, instead of from zero while composing its map and then corrected by it."""
        return not seg.starts and (self.last or len(self.segments) > 1)

    def _before_scan(self, outputs: bool):
        """The chunk pieces of every run and the runs whose entering state is known or not
        needed (from zero, composing the map), so this rank's map (``self.map``): what the
        ranks after it wait for.  A run that waits makes the outputs' inside part meanwhile."""
        call = self.call
        self.runs = []
        for seg in self.segments:
            part = slice(seg.lo, seg.hi)
            pieces = _rec.chunks(self.q[:, :, part], self.k[:, :, part], self.v[:, :, part], self.g[:, :, part],
                                 None if self.beta is None else self.beta[:, :, part], call.delta)
            if self._waits(seg):
                self.runs.append(_Run(seg, pieces, None, _rec.within(pieces) if outputs else None))
            else:
                fwd = _rec.run_forward(pieces, self._start_state(seg), track_map=not seg.starts, outputs=False)
                self.runs.append(_Run(seg, pieces, fwd))
        head = self.head
        if not self.runs:
            self.map = identity(call.kind, call.b, call.hv, call.kdim, call.vdim, call.dtype, self.xp)
        elif head is not None and len(self.runs) == 1 and head.fwd is None:  # the last rank's: it reaches no rank
            self.map = reset(call.kind, self.xp.zeros(call.state_shape(call.b), call.dtype))
        elif head is not None and len(self.runs) == 1:
            self.map = StateMap(call.kind, head.fwd.m, head.fwd.s_end)
        else:
            self.map = reset(call.kind, self.runs[-1].fwd.s_end)

    def _scan(self, smap: StateMap, reverse: bool = False):
        """The exclusive scan of ``smap`` over the ranks (only the maps cross to the host)."""
        start = time.perf_counter()
        got, nbytes = exclusive_scan(self.call.comm, _on_host(smap), reverse=reverse)
        self.bytes_received += nbytes
        self.seconds["scan"] += time.perf_counter() - start
        return self.xp.asarray(got)

    def _after_scan(self, s_in):
        """The head run's true states and end state from ``s_in``, the state entering the shard."""
        head = self.head
        if head is None:
            return
        if head.fwd is None:
            head.fwd = _rec.run_forward(head.pieces, s_in, outputs=False)
            return
        fwd = head.fwd
        fwd.s_end = fwd.s_end + apply_m(self.call.kind, fwd.m, s_in)
        fwd.states = _rec.entered(head.pieces, fwd, s_in)

    def forward(self):
        """This rank's outputs, head-major ``(B, HV, T, V)``; the runs' end states are the true
        ones afterwards.  The outputs are made after the scan, from the chunks' true states:
        before it a rank finds only its map, so that the ranks after it wait for no more than
        that."""
        call = self.call
        start = time.perf_counter()
        self._before_scan(outputs=True)
        self.seconds["local"] += time.perf_counter() - start
        s_in = self._scan(self.map)
        start = time.perf_counter()
        self._after_scan(s_in)
        # (the segments cover the shard: every output is written)
        o = self.xp.empty((call.b, call.hv, self.q.shape[2], call.vdim), call.dtype)
        for run in self.runs:
            o[:, :, run.seg.lo:run.seg.hi] = _rec.outputs_of(run.pieces, run.fwd.states, run.inside)
        self.seconds["local"] += time.perf_counter() - start
        return o

    def final_states(self) -> np.ndarray:
        """Every document's final state, on every rank (one Allreduce: each is one rank's)."""
        from mpi4py import MPI

        call = self.call
        finals = np.zeros(call.state_shape(), call.dtype)  # reduced on the host
        for run in self.runs:
            if run.seg.ends:
                finals[call.rows(run.seg.doc)] = to_host(run.fwd.s_end)
        if call.comm.Get_rank() == 0 and self.initial is not None:
            for doc in empty_documents(call.bounds):
                finals[call.rows(doc)] = to_host(self.initial[call.rows(doc)])
        with phase("the linear-attention final states (Allreduce)"):
            call.comm.Allreduce(MPI.IN_PLACE, finals, op=MPI.SUM)
        self.bytes_received += finals.nbytes
        return self.xp.asarray(finals)

    def backward(self, do, dfinal, reduce_dinitial: bool):
        """Gradients, head-major, of q (scaled), k, v, g, beta and the initial state; ``do``
        head-major, ``dfinal`` the final states' gradient (the same on every rank) or None.
        What the head's outputs ask of the state entering this rank (``c``, the reverse scan's
        offset) needs no state, so it is made before the forward scan, while the ranks before
        wait for nothing from this one; the reverse scan follows the forward one at once."""
        from mpi4py import MPI

        call = self.call
        xp = self.xp
        start = time.perf_counter()
        self._before_scan(outputs=False)
        c = xp.zeros(call.state_shape(call.b), call.dtype)
        head = self.head
        head_reverse = None
        if head is not None:  # the head's reverse recursion, its end state's gradient from dfinal alone
            ends_here = dfinal[call.rows(head.seg.doc)] if head.seg.ends and dfinal is not None else c
            head_reverse = _rec.state_grads(head.pieces, _rec.seen_outputs(head.pieces, do[:, :, head.seg.lo:head.seg.hi]),
                                            ends_here)
            c = head_reverse[1]
        self.seconds["local"] += time.perf_counter() - start
        s_in = self._scan(self.map)
        ds_out = self._scan(transposed(self.map, c), reverse=True)
        start = time.perf_counter()
        self._after_scan(s_in)
        # every token's gradients are written by its segment's run (the segments cover the shard)
        grads = {name: xp.empty_like(x) for name, x in (("q", self.q), ("k", self.k), ("v", self.v), ("g", self.g))}
        grads["beta"] = None if self.beta is None else xp.empty_like(self.beta)
        dinitial = None if self.initial is None else xp.zeros(call.state_shape(), call.dtype)
        for i, run in enumerate(self.runs):
            seg, part = run.seg, slice(run.seg.lo, run.seg.hi)
            ds_end = ds_out if i == len(self.runs) - 1 else xp.zeros_like(ds_out)
            if seg.ends and dfinal is not None:
                ds_end = ds_end + dfinal[call.rows(seg.doc)]
            # a run that waited (the head) gets no gradient from the ranks after: its recursion above holds
            got = _rec.run_backward(run.pieces, run.fwd.states, do[:, :, part], ds_end,
                                    reverse=head_reverse if self._waits(seg) else None)
            for name in ("q", "k", "v", "g", "beta"):
                if grads[name] is not None:
                    grads[name][:, :, part] = getattr(got, "d" + name)
            if seg.starts and dinitial is not None:
                dinitial[call.rows(seg.doc)] += got.ds0
        self.seconds["local"] += time.perf_counter() - start
        if dinitial is not None:
            if call.comm.Get_rank() == 0 and dfinal is not None:
                for doc in empty_documents(call.bounds):
                    dinitial[call.rows(doc)] += dfinal[call.rows(doc)]
            if reduce_dinitial:
                host = np.ascontiguousarray(to_host(dinitial))  # reduced on the host
                with phase("the linear-attention initial states' gradient (Allreduce)"):
                    call.comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
                self.bytes_received += host.nbytes
                dinitial = xp.asarray(host)
        return grads, dinitial


def _host(x):
    return None if x is None else np.asarray(to_host(x))


def _like(first, *xs):
    """``xs`` in ``first``'s array module: CuPy inputs stay on (or move to) the device, anything
    else becomes NumPy on the host."""
    xp = array_module(first)
    if xp is np:
        return tuple(_host(x) for x in xs)
    return tuple(None if x is None else xp.asarray(x) for x in xs)


def _forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, comm, delta, per_key=False):
    q, k, v, g, beta, initial_state = _like(q, q, k, v, g, beta, initial_state)
    call = agree_call(comm, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens, delta=delta, per_key=per_key)
    shard = ShardRecurrence(call, q, k, v, g, beta, initial_state)
    o = shard.xp.moveaxis(shard.forward(), 1, 2)
    return o, (shard.final_states() if call.output_final_state else None)


def _backward(do, q, k, v, g, beta, scale, initial_state, dfinal_state, cu_seqlens, comm, delta,
              reduce_dinitial, per_key=False):
    q, k, v, g, beta, initial_state, do, dfinal_state = _like(q, q, k, v, g, beta, initial_state, do, dfinal_state)
    problem = None
    if do.shape != v.shape:
        problem = f"do must have v's shape {v.shape}, got {do.shape}"
    elif dfinal_state is not None and (initial_state is not None and dfinal_state.shape != initial_state.shape
                                       or dfinal_state.ndim != 4):
        problem = f"dfinal_state must have the final state's shape, got {dfinal_state.shape}"
    call = agree_call(comm, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      output_final_state=dfinal_state is not None, cu_seqlens=cu_seqlens, delta=delta,
                      per_key=per_key, problem=problem)
    if dfinal_state is not None and dfinal_state.shape != call.state_shape():
        raise ConfigError(f"dfinal_state must be {call.state_shape()}, got {dfinal_state.shape}")  # agreed shapes
    shard = ShardRecurrence(call, q, k, v, g, beta, initial_state)
    dt = call.dtype
    grads, dinitial = shard.backward(_head_major(do.astype(dt, copy=False)),
                                     None if dfinal_state is None else dfinal_state.astype(dt, copy=False),
                                     reduce_dinitial)
    b, t = q.shape[:2]
    group = call.hv // call.h

    def per_qk_head(x):
        return xp.moveaxis(x, 1, 2).reshape(b, t, call.h, group, call.kdim).sum(axis=3)

    xp = shard.xp
    out = {"q": per_qk_head(grads["q"]) * dt.type(call.scale), "k": per_qk_head(grads["k"]),
           "v": xp.moveaxis(grads["v"], 1, 2), "g": None if g is None else xp.moveaxis(grads["g"], 1, 2),
           "beta": None if grads["beta"] is None else xp.moveaxis(grads["beta"], 1, 2)}
    return out, dinitial


def gated_delta_rule(q, k, v, g, beta, *, scale: Optional[float] = None, initial_state=None,
                     output_final_state: bool = False, cu_seqlens=None, context: Optional[RingContext] = None):
    """The gated delta rule over the sequence sharded across ``comm``'s ranks; collective.

    ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = S_t^T (scale q_t)``,
    as flash-linear-attention's ``chunk_gated_delta_rule`` (its argument names and shapes, module
    docstring; q and k are used as given: normalise them first if the model does).

    q, k: (B, T_local, H, K) this rank's contiguous shard of the tokens (in rank order).
    v: (B, T_local, HV, V), HV a multiple of H.  g: (B, T_local, HV) log decay (<= 0 for a decay).
    beta: (B, T_local, HV).  scale: default K ** -0.5.
    initial_state: (B, HV, K, V), or (N_docs, HV, K, V) with cu_seqlens; the same on every rank.
    cu_seqlens: document boundaries [0, ..., N] in global positions (B = 1), the same on every rank.
    Returns ``(o, final_state)``: o (B, T_local, HV, V); final_state like initial_state, on every
    rank, or None unless ``output_final_state``.
    """
    return _forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, comm_of(context), True)


def gated_delta_rule_backward(do, q, k, v, g, beta, *, dfinal_state=None, scale: Optional[float] = None,
                              initial_state=None, cu_seqlens=None, context: Optional[RingContext] = None,
                              reduce_dinitial: bool = True):
    """Gradients of :func:`gated_delta_rule`: ``(dq, dk, dv, dg, dbeta, dinitial_state)``.

    ``do`` (B, T_local, HV, V) is this rank's outputs' gradient, ``dfinal_state`` the final
    state's (the same on every rank; None: the final state was not used).  The forward is
    recomputed (its scan included).  ``dinitial_state`` (None without ``initial_state``) is the
    whole gradient on every rank, or with ``reduce_dinitial=False`` this rank's share (what a
    framework bridge gives a replicated input: the sum over ranks is the gradient).
    """
    grads, dinitial = _backward(do, q, k, v, g, beta, scale, initial_state, dfinal_state, cu_seqlens, comm_of(context),
                                True, reduce_dinitial)
    return grads["q"], grads["k"], grads["v"], grads["g"], grads["beta"], dinitial


def simple_gla(q, k, v, g=None, *, scale: Optional[float] = None, initial_state=None,
               output_final_state: bool = False, cu_seqlens=None, context: Optional[RingContext] = None):
    """Scalar-decay linear attention (Mamba-2's SSD form, RetNet, flash-linear-attention's
    ``chunk_simple_gla``) over the sharded sequence; ``g=None``: plain linear attention.

    ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T (scale q_t)``; shapes and returns as
    :func:`gated_delta_rule` (no beta).  Collective.
    """
    return _forward(q, k, v, g, None, scale, initial_state, output_final_state, cu_seqlens, comm_of(context), False)


def simple_gla_backward(do, q, k, v, g=None, *, dfinal_state=None, scale: Optional[float] = None,
                        initial_state=None, cu_seqlens=None, context: Optional[RingContext] = None,
                        reduce_dinitial: bool = True):
    """Gradients of :func:`simple_gla`: ``(dq, dk, dv, dg, dinitial_state)`` (dg None without g),
    as :func:`gated_delta_rule_backward`."""
    grads, dinitial = _backward(do, q, k, v, g, None, scale, initial_state, dfinal_state, cu_seqlens, comm_of(context),
                                False, reduce_dinitial)
    return grads["q"], grads["k"], grads["v"], grads["g"], dinitial


def kda(q, k, v, g, beta, *, scale: Optional[float] = None, initial_state=None, output_final_state: bool = False,
        cu_seqlens=None, context: Optional[RingContext] = None):
    """Kimi Delta Attention (flash-linear-attention's ``chunk_kda``): :func:`gated_delta_rule` with a
    decay per key, ``S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``;
    ``g (B, T_local, HV, K)``, everything else as :func:`gated_delta_rule`.  Collective."""
    return _forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, comm_of(context),
                    True, True)


def kda_backward(do, q, k, v, g, beta, *, dfinal_state=None, scale: Optional[float] = None, initial_state=None,
                 cu_seqlens=None, context: Optional[RingContext] = None,
                 reduce_dinitial: bool = True):
    """Gradients of :func:`kda`: ``(dq, dk, dv, dg, dbeta, dinitial_state)``, as
    :func:`gated_delta_rule_backward`."""
    grads, dinitial = _backward(do, q, k, v, g, beta, scale, initial_state, dfinal_state, cu_seqlens, comm_of(context),
                                True, reduce_dinitial, per_key=True)
    return grads["q"], grads["k"], grads["v"], grads["g"], grads["beta"], dinitial


def gla(q, k, v, g, *, scale: Optional[float] = None, initial_state=None, output_final_state: bool = False,
        cu_seqlens=None, context: Optional[RingContext] = None):
    """Gated linear attention (flash-linear-attention's ``chunk_gla``): a decay per key,
    ``S_t = Diag(exp(g_t)) S_{t-1} + k_t v_t^T``; ``g (B, T_local, HV, K)``, everything else as
    :func:`simple_gla`.  Collective."""
    return _forward(q, k, v, g, None, scale, initial_state, output_final_state, cu_seqlens, comm_of(context),
                    False, True)


def gla_backward(do, q, k, v, g, *, dfinal_state=None, scale: Optional[float] = None, initial_state=None,
                 cu_seqlens=None, context: Optional[RingContext] = None,
                 reduce_dinitial: bool = True):
    """Gradients of :func:`gla`: ``(dq, dk, dv, dg, dinitial_state)``."""
    grads, dinitial = _backward(do, q, k, v, g, None, scale, initial_state, dfinal_state, cu_seqlens, comm_of(context),
                                False, reduce_dinitial, per_key=True)
    return grads["q"], grads["k"], grads["v"], grads["g"], dinitial
