"""Ring attention: the public forward and backward calls.

Every rank passes its own shard; queries stay home and key/value blocks
travel around the ring (:class:`ringmpi.parallel.ring_schedule.RingSchedule`), one hop per
step, while the block ops of a backend (:mod:`ringmpi.backends`) fold each
visiting block into this rank's state.  This module plans a call (checks
agreed across ranks, layouts, the mask spec) and runs one short loop over
the schedule per direction.

Backward: K/V travel exactly as in the forward.  Each visiting block's
float32 ``dK, dV`` contributions are added to the partial sums that arrive
from ``prev`` (one step behind the K/V, so that transfer also overlaps
compute), and after the last step the finished ``dK, dV`` take one more hop
to their owner.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import numpy as np

from .core import dtypes as _dtypes
from .core.host import to_host
from .backends import get_backend
from .backends import device_problem, modifier_problem
from .backends import value_dim_problem as _value_dim_problem
from .runtime.errors import agree
from .runtime.faults import fault_point
from .core import positions as _positions
from .core.layout import BALANCED, KINDS, Layout
from .core.masks import WINDOW_OFF
from .core.shapes import qkv_problem
from .parallel.ring_passes import AgreedCall, backward_pass, forward_pass
from .options import AttentionOptions
from .context import Attention, Gradients, RingContext, call_options, pair
from .parallel import cost_measure as _cost_measure
from .parallel.comm import resolve_comm
from .parallel.topology import resolve_groups
from .runtime.watchdog import deadline, phase


def _describe(x) -> str:
    return f"shape {tuple(x.shape)} dtype {x.dtype}"


def _local_problem(q, k, v, seg_q, seg_kv, extra, declared=None) -> Optional[str]:
    """This rank's shape/dtype problem, or None."""
    for name, x in (("q", q), ("k", k), ("v", v)) + tuple(extra):
        if getattr(x, "ndim", None) != 4:
            return f"{name} must be 4-D (B, S_local, H, D), got {_describe(x) if hasattr(x, 'shape') else type(x).__name__}"
        if str(x.dtype) not in _dtypes.NAMES:
            return (f"{name} has unsupported dtype {x.dtype}; expected one of {', '.join(_dtypes.NAMES)}"
                    + (" (pass dtype='bfloat16' to read uint16 bfloat16 bit patterns)" if str(x.dtype) == "uint16" else ""))
        if declared is not None and str(x.dtype) != _dtypes.declared_name(declared):
            return f"{name} has dtype {x.dtype} but dtype={declared!r} was given"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    shapes = qkv_problem(q.shape, k.shape, v.shape)
    if shapes is not None:
        return shapes[1]
    for name, x in tuple(extra):
        want = _output_shape(q, v)
        if x.shape != want:
            return f"{name} must have shape (B, S_q_local, H, D_v) = {want}, got {tuple(x.shape)}"
    if (seg_q is None) != (seg_kv is None):
        return "give both segment_ids_q and segment_ids_kv, or neither"
    if seg_q is not None:
        for name, seg, ref in (("segment_ids_q", seg_q, q), ("segment_ids_kv", seg_kv, k)):
            if seg.shape != ref.shape[:2]:
                return f"{name} must have shape (B, S_local) = {tuple(ref.shape[:2])}, got {tuple(seg.shape)}"
            if seg.dtype.kind not in "iu":
                return f"{name} must be integers, got dtype {seg.dtype}"
    return None


def _output_shape(q, v) -> tuple:
    """``(B, S_q_local, H, D_v)``: the shape of ``o`` (and ``do``) for these ``q``, ``v``."""
    return tuple(q.shape[:3]) + (v.shape[3],)


def _first_nonfinite(name: str, x, layout_positions) -> Optional[str]:
    xh = to_host(x)
    finite = _dtypes.isfinite(xh)
    if finite.all():
        return None
    b, s, h, d = np.unravel_index(int(np.argmin(finite)), xh.shape)
    return (f"{name} has a non-finite value ({xh[b, s, h, d]}) at global index "
            f"[{b}, {layout_positions[s]}, {h}, {d}] (b, token, head, dim)")


def _plan(q, k, v, options: AttentionOptions, comm, layout, segment_ids_q, segment_ids_kv,
          backend, extra=(), positions_q=None, positions_kv=None) -> AgreedCall:
    """Check and agree on one call across the ranks of ``comm`` (every problem a ConfigError
    on every rank, before any compute) and plan it."""
    comm = resolve_comm(comm)
    be = get_backend(backend, (q, k, v))
    q, k, v = be.asarray(q), be.asarray(k), be.asarray(v)
    seg_q = None if segment_ids_q is None else to_host(segment_ids_q)
    seg_kv = None if segment_ids_kv is None else to_host(segment_ids_kv)
    pos_q = _positions.as_positions(positions_q)
    pos_kv = pos_q if positions_kv is None else _positions.as_positions(positions_kv)
    agree(comm, options.dtype_problem() or _local_problem(q, k, v, seg_q, seg_kv, extra, options.dtype)
          or _positions_problem(pos_q, pos_kv, q, k)
          or _value_dim_problem(be.name, q.shape[3], v.shape[3])  # one collective: v is 4-D here
          or device_problem(be, k.dtype, q.shape[3], v.shape[3])
          or options.problem(q.shape[2]) or modifier_problem(be, options.modifier_names()))
    place_q, place_kv = _agree_placements(q, k, v, options, comm, layout, pos_q, pos_kv, seg_q is not None)
    if options.invariant:
        agree(comm, _invariant_problem(be, place_q, place_kv))
    if options.check_finite:
        _agree_finite(comm, (("q", q, place_q), ("k", k, place_kv), ("v", v, place_kv))
                      + tuple((n, x, place_q) for n, x in extra))
    if seg_q is not None:
        seg_q = seg_q.astype(np.int64, copy=False)
        seg_kv = seg_kv.astype(np.int64, copy=False)
    ct = be.compute_dtype(q.dtype)
    balanced = isinstance(layout, Layout) and layout.kind == BALANCED and pos_q is None
    return AgreedCall(comm=comm, backend=be, batch=q.shape[0], heads=q.shape[2], compute_dtype=ct,
                      kv_schedule=options.kv_schedule(balanced),
                      place_q=place_q, place_kv=place_kv,
                      spec=options.score_spec(q.shape[2], offset=place_kv.n - place_q.n),
                      scale=options.scale(q.shape[3]), seg_q=seg_q, seg_kv=seg_kv,
                      timeout=deadline(options.timeout),
                      sinks=None if options.sinks is None else be.asarray(options.sinks).astype(ct))


def _groups(plan: AgreedCall, options: AttentionOptions, k, v, backward: bool):
    """``(head x ring groups or None, the call)``: ``head_parallel="auto"`` chooses ``U`` and
    the schedule by predicted cost (:meth:`AgreedCall.choose_head_parallel`), the call then
    carrying its choice."""
    chosen = [plan]

    def choose(candidates):
        u, chosen[0] = plan.choose_head_parallel(candidates, k, v, backward, invariant=bool(options.invariant))
        return u

    groups = resolve_groups(plan.comm, plan.heads, options.head_parallel, choose)
    return groups, chosen[0]


def _invariant_problem(be, place_q, place_kv) -> Optional[str]:
    """This rank's problem with ``invariant=True``: a backend without the mode, or a shard that is
    not whole 64-token tiles of global positions (:mod:`ringmpi.core.global_tiles`); or None."""
    if not getattr(be, "INVARIANT", False):
        return f"invariant=True runs on the numpy and cupy backends, not on {be.name}"
    from .core.global_tiles import shard_problem

    return (shard_problem("query", place_q.mine, place_q.n)
            or shard_problem("key/value", place_kv.mine, place_kv.n))


def _positions_problem(pos_q, pos_kv, q, k) -> Optional[str]:
    """This rank's problem with its given positions (shapes, integer dtype), or None."""
    if pos_q is None and pos_kv is not None:
        return "positions_kv needs positions_q (give both, or positions_q alone for self-attention)"
    return (_positions.local_problem("positions_q", pos_q, q.shape[1])
            or _positions.local_problem("positions_kv", pos_kv, k.shape[1]))


class _RankPlan(NamedTuple):
    """What each rank contributes to the planning allgather."""

    signature: tuple        # (batch, heads, kv_heads, head_dim, value_head_dim, dtype)
    s_q: int                # this rank's query rows
    s_kv: int               # this rank's key/value rows
    digest: object          # the options' digest (sinks, softcap, masks, ...)
    dropout: object         # the dropout key (p, seed, offsets), or None
    given: Optional[tuple]  # the summaries of given positions_q, positions_kv, or None
    segments: bool          # whether segment ids were given


def _agree_placements(q, k, v, options: AttentionOptions, comm, layout, pos_q, pos_kv, segments=False):
    """``(place_q, place_kv)`` (:class:`~ringmpi.core.positions.Placement`) once every rank agrees on
    shapes, options and shard lengths (the layout's) or positions (the given ones), in one allgather."""
    rank, size = comm.Get_rank(), comm.Get_size()
    signature = (q.shape[0], q.shape[2], k.shape[2], q.shape[3], v.shape[3], str(q.dtype))
    drop_key = options.dropout_key(q.shape[2])
    given = None if pos_q is None else (_positions.summary(pos_q), _positions.summary(pos_kv))
    fault_point("plan", rank)
    with phase("the ranks' agreement on the call's shapes (allgather)", options.timeout):
        shapes = comm.allgather(_RankPlan(signature, q.shape[1], k.shape[1], options.digest(), drop_key, given,
                                          segments))
    problem = _disagreement(shapes)
    n_q = sum(s.s_q for s in shapes)
    n_kv = sum(s.s_kv for s in shapes)
    kind = layout.kind if isinstance(layout, Layout) else layout
    if problem is None and len({s.given is None for s in shapes}) > 1:
        problem = "give positions_q (and positions_kv) on every rank or on none"
    if problem is None and len({s.segments for s in shapes}) > 1:
        problem = "give segment_ids_q and segment_ids_kv on every rank or on none"
    if problem is None and kind == BALANCED and not isinstance(layout, Layout) and given is None:
        problem = ("the balanced layout is made from the documents: pass "
                   "layout=ringmpi.Layout('balanced', n, P, documents=..., causal=..., window=...)")
    if problem is None and kind not in KINDS + (BALANCED,):
        problem = f"unknown layout {kind!r}: expected one of {', '.join(KINDS + (BALANCED,))}"
    if problem is None and (n_q < 1 or n_kv < 1):
        problem = f"global sequence lengths must be >= 1, got N_q={n_q}, N_kv={n_kv}"
    if problem is None:
        problem = options.size_problem(q.shape[2], q.shape[0], n_q, n_kv)
    if problem is None and given is not None:
        problem = (_positions.placement_problem("positions_q", [s.given[0] for s in shapes])
                   or _positions.placement_problem("positions_kv", [s.given[1] for s in shapes]))
        agree(comm, problem)
        return (_positions.given(pos_q.astype(np.int64, copy=False), [s.s_q for s in shapes]),
                _positions.given(pos_kv.astype(np.int64, copy=False), [s.s_kv for s in shapes]))
    if problem is None and isinstance(layout, Layout):
        if layout.world_size != size or layout.n != n_q:
            problem = (f"layout {layout} does not match the communicator: world size {size}, "
                       f"global query length {n_q}")
        elif kind == BALANCED and n_kv != n_q:
            problem = (f"the balanced layout places one sequence: queries and keys must have the same "
                       f"length, got N_q={n_q}, N_kv={n_kv}")
    if problem is None:
        if kind == BALANCED:
            layout_q = layout_kv = layout
        else:
            layout_q, layout_kv = Layout(kind, n_q, size), Layout(kind, n_kv, size)
        want_q, want_kv = layout_q.counts(), layout_kv.counts()
        bad = [r for r, s in enumerate(shapes) if s.s_q != want_q[r] or s.s_kv != want_kv[r]]
        if bad:
            r = bad[0]
            problem = (f"shard lengths do not match the {kind} layout of N_q={n_q}, N_kv={n_kv} "
                       f"over {size} ranks: rank {r} holds q {shapes[r].s_q} / kv {shapes[r].s_kv} rows, "
                       f"the layout gives q {want_q[r]} / kv {want_kv[r]}")
    agree(comm, problem)
    return _positions.from_layout(layout_q, rank), _positions.from_layout(layout_kv, rank)


def _disagreement(shapes) -> Optional[str]:
    """The message when the ranks' :class:`_RankPlan` s differ in what must be the same."""
    if len({s.digest for s in shapes}) > 1:
        return ("ranks disagree on sinks or softcap (or alibi_slopes, causal, window, softmax_scale, "
                "check_finite, return_max_logit, invariant): every rank must pass the same values")
    if len({s.dropout for s in shapes}) > 1:
        return ("ranks disagree on (dropout_p, dropout_seed, dropout_offsets): "
                + "; ".join(f"rank {r}: {s.dropout}" for r, s in enumerate(shapes)))
    if len({s.signature for s in shapes}) > 1:
        return ("ranks disagree on (batch, heads, kv_heads, head_dim, value_head_dim, dtype): "
                + "; ".join(f"rank {r}: {s.signature}" for r, s in enumerate(shapes)))
    return None


def _agree_finite(comm, named) -> None:
    """ConfigError on every rank when any rank's ``(name, array, placement)`` holds a NaN/Inf."""
    problem = None
    for name, x, place in named:
        problem = _first_nonfinite(name, x, place.mine)
        if problem:
            break
    agree(comm, problem)


def ring_attention(q, k, v, *, causal: bool = False, window=WINDOW_OFF, softmax_scale: Optional[float] = None,
                   softcap: float = 0.0, alibi_slopes=None, sinks=None, dropout_p: float = 0.0,
                   dropout_seed: Optional[int] = None, segment_ids=None, positions=None,
                   return_max_logit: bool = False, context: Optional[RingContext] = None) -> Attention:
    """Exact softmax attention over a sequence sharded across the ranks of ``context.comm``.

    Collective: every rank of the communicator calls it with its own shard.  The attention's maths
    are the keywords, with flash-attn's names and conventions, documented here once for every
    public call (:func:`ring_attention_backward`, :func:`ringmpi.decode_attention`,
    :func:`ringmpi.torch.ring_attention` refer to this list); where and how it runs (the
    communicator, layout, backend, schedule, deadline, checks, stats) is ``context``
    (:class:`ringmpi.RingContext`; None: the default one).

    Parameters
    ----------
    q : (B, S_q_local, H, D) float16, bfloat16 (``ml_dtypes.bfloat16``), float32 or
        float64; NumPy on CPU, CuPy on GPU.  This rank's queries: the global
        tokens ``Layout(context.layout, N_q, P).indices(rank)``.
    k, v : (B, S_kv_local, H_kv, D) and (B, S_kv_local, H_kv, D_v), same dtype as
        ``q``; ``H % H_kv == 0`` (GQA/MQA).  The value head dim ``D_v`` may differ
        from ``D`` (as in MLA: D = 192, D_v = 128; on GPU see
        :func:`ringmpi.kernels.value_dim_problem`).
        This rank's keys/values, sharded like ``q`` by a layout of the same kind
        over their own global length ``N_kv`` (which may differ from ``N_q``).
    causal : bool
        Query ``i`` sees keys ``j <= i + N_kv - N_q`` (bottom-right aligned, as
        FlashAttention >= 2.1; the usual causal mask when ``N_q == N_kv``).
    window : (left, right)
        Sliding window in global positions, ``i + off - left <= j <= i + off + right``
        with ``off = N_kv - N_q``; -1 on a side is unbounded (flash-attn's ``window_size``).
        Combined with ``causal`` when both are given.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(D)``.
    softcap : float >= 0
        Logit softcap (Gemma 2): scores become ``softcap * tanh(scale * q.k / softcap)``
        before the mask; 0.0 is off.
    alibi_slopes : (H,) float32, optional, the same on every rank
        ALiBi (FlashAttention 2's convention): the score of query ``i`` and key
        ``j`` of head ``h`` gains ``-alibi_slopes[h] * |i + N_kv - N_q - j|`` in
        global positions (after scale and softcap, before the mask).
    sinks : (H,) float16, bfloat16, float32 or float64, optional, the same on every rank
        Attention sinks (gpt-oss): every query's softmax denominator gains
        ``exp(sinks[h])``, a virtual key with zero value that every query sees;
        ``lse`` includes it.  Used in the compute dtype (float32 for 16-bit inputs).
    dropout_p : float in [0, 1)
        Dropout on the attention weights: weight ``(b, h, i, j)`` is kept (and
        scaled by ``1 / (1 - p)``) by a pure function of ``(dropout_seed, b, h,
        global i, global j)`` (:mod:`ringmpi.core.dropout`), so the same seed gives the
        same mask for every number of ranks, layout and backend.  ``lse`` is the
        one without dropout (as FlashAttention's).
    dropout_seed : int in [0, 2^64), required when ``dropout_p > 0``; the same on every rank.
    segment_ids : (B, S_local) ints, or a tuple ``(segment_ids_q, segment_ids_kv)``, optional
        Packed documents: a query sees only keys with the same id.  One array serves
        queries and keys alike (self-attention).
    positions : (S_local,) ints, or a tuple ``(positions_q, positions_kv)``, optional
        This rank's tokens' global positions, in local order: any assignment of
        tokens to ranks (whole documents per rank, a permutation), instead of the
        context's layout.  Over all ranks they must be ``0 .. N-1`` once each (``N``:
        the sum of the shard lengths; shards may have any lengths), checked inside
        the call's planning allgather (range, repeats on a rank, counts and power sums
        across ranks: see :mod:`ringmpi.core.positions`), a ConfigError on every rank
        otherwise.  Masks, ALiBi and dropout use them.  One array serves queries and
        keys alike (self-attention).  Give them on every rank or on none.
    return_max_logit : bool
        Also compute ``max_logit`` (the NumPy tiles then keep an exact running
        maximum instead of their lagging shift: a little slower).
    context : :class:`ringmpi.RingContext`, optional

    Returns
    -------
    :class:`ringmpi.Attention` ``(o, lse, max_logit)``:

    o : (B, S_q_local, H, D_v), the input dtype
    lse : (B, H, S_q_local) natural-log softmax normaliser, float32 (float64 for
        float64 inputs); ``-inf`` (and ``o = 0``) for a query that sees no key
        (with sinks: ``lse = sinks[h]``, ``o = 0``).
    max_logit : (H,) NumPy array, float32 (float64 for float64 inputs), with
        ``return_max_logit`` (else None): per head, the largest score (after scale and
        softcap, masked keys excluded, sinks not counted) over the batch and the
        whole sequence, the same on every rank; ``-inf`` for a head whose
        queries see no key.
    """
    ctx = RingContext.of(context)
    options = call_options(ctx, causal=causal, window=window, softmax_scale=softmax_scale, softcap=softcap,
                           alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p, dropout_seed=dropout_seed,
                           return_max_logit=return_max_logit)
    seg_q, seg_kv = pair(segment_ids, "segment_ids")
    pos_q, pos_kv = pair(positions, "positions")
    return forward(q, k, v, options, comm=ctx.comm, layout=ctx.layout, backend=ctx.backend, stats=ctx.stats,
                   segment_ids_q=seg_q, segment_ids_kv=seg_kv, positions_q=pos_q, positions_kv=pos_kv)


def forward(q, k, v, options: AttentionOptions, *, comm=None, layout: Union[str, Layout] = "contiguous",
            segment_ids_q=None, segment_ids_kv=None, backend: str = "auto", stats: Optional[list] = None,
            positions_q=None, positions_kv=None) -> Attention:
    """:func:`ring_attention` with its options as one :class:`~ringmpi.options.AttentionOptions`
    (the file job's, the torch op's and the bench's entry)."""
    (q, k, v), bits = _dtypes.view_declared(options.dtype, q, k, v)
    plan = _plan(q, k, v, options, comm, layout, segment_ids_q, segment_ids_kv, backend,
                 positions_q=positions_q, positions_kv=positions_kv)
    groups, plan = _groups(plan, options, k, v, backward=False)
    maxima = None
    if options.invariant:
        from .parallel.invariant_passes import forward_maxima
        maxima = forward_maxima(plan, v)
    if groups is not None:
        from .parallel import head_parallel as _two_level
        o, lse, max_logit, records = _two_level.forward(plan, groups, q, k, v,
                                                        return_max_logit=options.return_max_logit,
                                                        invariant=maxima)
    else:
        be = plan.backend
        o, lse, max_logit, records = forward_pass(
            plan.flat_problem(), be.asarray(q), be.asarray(k), be.asarray(v), sinks=plan.sinks,
            max_logit=(plan.comm, None) if options.return_max_logit else None, invariant=maxima)
    if stats is not None:
        stats.extend(records)
    o = o.view(np.uint16) if bits else o
    return Attention(o, lse, max_logit if options.return_max_logit else None)


def ring_attention_backward(do, q, k, v, out, *, causal: bool = False, window=WINDOW_OFF,
                            softmax_scale: Optional[float] = None, softcap: float = 0.0, alibi_slopes=None,
                            sinks=None, dropout_p: float = 0.0, dropout_seed: Optional[int] = None,
                            segment_ids=None, positions=None, context: Optional[RingContext] = None) -> Gradients:
    """Gradients of :func:`ring_attention` with respect to ``q``, ``k``, ``v`` (and ``sinks``).

    Collective; every keyword must be the forward's (the dropout mask is regenerated, never
    stored).  The context may differ from the forward's in ``schedule`` (results agree to
    rounding) and ``reduce_dsinks``.

    Parameters
    ----------
    do : (B, S_q_local, H, D_v), like ``o``: the gradient of the loss w.r.t. ``o``.
    q, k, v : as for :func:`ring_attention`.
    causal, window, softmax_scale, softcap, alibi_slopes, sinks, dropout_p, dropout_seed, segment_ids, positions
        The forward's, as documented in :func:`ring_attention`.
    out : the forward's result (:class:`ringmpi.Attention`), or ``(o, lse)``:
        ``o (B, S_q_local, H, D_v)`` and ``lse (B, H, S_q_local)``.

    Returns
    -------
    :class:`ringmpi.Gradients` ``(dq, dk, dv, dsinks)``:

    dq : (B, S_q_local, H, D); dk : (B, S_kv_local, H_kv, D);
    dv : (B, S_kv_local, H_kv, D_v); all in the
    input dtype (``uint16`` bit patterns for ``dtype="bfloat16"`` with uint16
    inputs), for this rank's own shards.  K/V travel the ring in the input
    dtype (bfloat16: 2 bytes per element); their gradients are accumulated in
    float32 (float64 for float64 inputs) as they travel.
    dsinks : (H,) NumPy array in ``sinks``' dtype, when ``sinks`` is given (else None):
        the gradient w.r.t. the sinks, summed over the batch and all ranks (the
        same on every rank), or this rank's share with ``context.reduce_dsinks=False``.
    """
    ctx = RingContext.of(context)
    options = call_options(ctx, causal=causal, window=window, softmax_scale=softmax_scale, softcap=softcap,
                           alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p, dropout_seed=dropout_seed)
    seg_q, seg_kv = pair(segment_ids, "segment_ids")
    pos_q, pos_kv = pair(positions, "positions")
    o, lse = out[0], out[1]
    return backward(do, q, k, v, o, lse, options, comm=ctx.comm, layout=ctx.layout, backend=ctx.backend,
                    stats=ctx.stats, reduce_dsinks=ctx.reduce_dsinks, segment_ids_q=seg_q, segment_ids_kv=seg_kv,
                    positions_q=pos_q, positions_kv=pos_kv)


def backward(do, q, k, v, o, lse, options: AttentionOptions, *, comm=None,
             layout: Union[str, Layout] = "contiguous", segment_ids_q=None, segment_ids_kv=None,
             backend: str = "auto", stats: Optional[list] = None, reduce_dsinks: bool = True,
             positions_q=None, positions_kv=None) -> Gradients:
    """:func:`ring_attention_backward` with its options as one :class:`~ringmpi.options.AttentionOptions`."""
    (do, q, k, v, o), bits = _dtypes.view_declared(options.dtype, do, q, k, v, o)
    plan = _plan(q, k, v, options, comm, layout, segment_ids_q, segment_ids_kv, backend,
                 extra=(("do", do), ("o", o)), positions_q=positions_q, positions_kv=positions_kv)
    be = plan.backend
    lse = be.asarray(lse)
    want = (plan.batch, plan.heads, q.shape[1])
    agree(plan.comm, None if tuple(lse.shape) == want else
          f"lse must have shape (B, H, S_q_local) = {want}, got {tuple(lse.shape)}")
    groups, plan = _groups(plan, options, k, v, backward=True)
    sink_comm = plan.comm if reduce_dsinks else None  # None: this rank's own share of dsinks
    maxima = dvec = None
    if options.invariant:
        from .parallel.invariant_passes import backward_maxima
        ct = plan.compute_dtype
        dvec = be.row_dot(be.heads_view(be.asarray(do), ct), be.heads_view(be.asarray(o), ct))
        maxima = backward_maxima(plan, q, k, v, do, dvec)
    if groups is not None:
        from .parallel import head_parallel as _two_level
        result, dsinks, records = _two_level.backward(plan, groups, do, q, k, v, o, lse, sink_comm=sink_comm,
                                                      invariant=maxima, dvec=dvec)
    else:
        dq, dk, dv, dsinks, records = backward_pass(
            plan.flat_problem(), be.asarray(q), be.asarray(do), be.asarray(k), be.asarray(v), lse,
            o=be.asarray(o), dvec=dvec, sinks=plan.sinks, sink_comm=sink_comm, invariant=maxima)
        result = tuple(be.from_heads(g, q.dtype) for g in (dq, dk, dv))
    if bits:
        result = tuple(g.view(np.uint16) for g in result)
    if stats is not None:
        stats.extend(records)
    return Gradients(*result, None if dsinks is None else dsinks.astype(options.sinks.dtype))


def _minimal_call(q, k, v, context):
    """What the cost model times as a call's own cost: a causal forward (``cost_measure.call_costs``)."""
    return ring_attention(q, k, v, causal=True, context=context)


_cost_measure.MINIMAL_CALL = _minimal_call
