"""Ring attention: the public forward and backward calls.

Every rank passes its own shard; queries stay home and key/value blocks
travel around the ring (:class:`ringmpi.schedule.RingSchedule`), one hop per
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

import math
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from . import dtypes as _dtypes
from . import variants as _variants
from .backends import get_backend
from .dropout import MAX_POSITION, Dropout
from .dropout import validate as _dropout_validate
from .errors import agree
from .layout import KINDS, Layout
from .masks import MaskSpec
from .ring import default_timeout, resolve_comm
from .schedule import RingSchedule
from .topology import resolve_groups

FLOAT_DTYPES = _dtypes.NAMES


@dataclass
class _Plan:
    """Everything one call agreed on across ranks before the ring starts."""

    comm: object
    backend: object
    rank: int
    batch: int
    heads: int
    compute_dtype: np.dtype
    layout_q: Layout
    layout_kv: Layout
    spec: MaskSpec
    scale: float
    seg_q: Optional[np.ndarray]   # (B, S_q_local) int64
    seg_kv: Optional[np.ndarray]  # (B, S_kv_local) int64, this rank's only
    timeout: Optional[float]
    sinks: Optional[object] = None  # (H,) compute dtype, this backend's array

    def schedule(self, k, v, grad_dtype=None, phase: str = "fwd") -> RingSchedule:
        """The ring schedule of this call, loaded with this rank's ``k (B, S_kv_local, H_kv, D)``
        and ``v (B, S_kv_local, H_kv, D_v)``."""
        be = self.backend
        return RingSchedule(
            self.comm, be, be.to_heads(k, k.dtype), be.to_heads(v, v.dtype),
            kv_counts=self.layout_kv.counts(), q_pos=self.layout_q.indices(self.rank),
            kv_pos=self.layout_kv.indices(self.rank), spec=self.spec, seg_q=self.seg_q,
            seg_kv=self.seg_kv, grad_dtype=grad_dtype, timeout=self.timeout, phase=phase)


def _describe(x) -> str:
    return f"shape {tuple(x.shape)} dtype {x.dtype}"


def _local_problem(q, k, v, seg_q, seg_kv, extra, declared=None) -> Optional[str]:
    """This rank's shape/dtype problem, or None."""
    if declared is not None and _dtypes.declared_name(declared) is None:
        return f"dtype={declared!r} is not one of {', '.join(FLOAT_DTYPES)}"
    for name, x in (("q", q), ("k", k), ("v", v)) + tuple(extra):
        if getattr(x, "ndim", None) != 4:
            return f"{name} must be 4-D (B, S_local, H, D), got {_describe(x) if hasattr(x, 'shape') else type(x).__name__}"
        if str(x.dtype) not in FLOAT_DTYPES:
            return (f"{name} has unsupported dtype {x.dtype}; expected one of {', '.join(FLOAT_DTYPES)}"
                    + (" (pass dtype='bfloat16' to read uint16 bfloat16 bit patterns)" if str(x.dtype) == "uint16" else ""))
        if declared is not None and str(x.dtype) != _dtypes.declared_name(declared):
            return f"{name} has dtype {x.dtype} but dtype={declared!r} was given"
    if k.shape[:3] != v.shape[:3]:
        return (f"k and v must agree on (B, S_kv_local, H_kv), got k {tuple(k.shape)} and v {tuple(v.shape)}"
                " (only the last dim, D_v, may differ)")
    if v.shape[3] == 0:
        return "value head dim D_v must be >= 1"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[0] != k.shape[0]:
        return f"q and k/v batch sizes differ: {q.shape[0]} vs {k.shape[0]}"
    if q.shape[3] != k.shape[3]:
        return f"q and k/v head dims differ: {q.shape[3]} vs {k.shape[3]}"
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        return f"q heads ({q.shape[2]}) must be a multiple of k/v heads ({k.shape[2]})"
    if q.shape[3] == 0:
        return "head dim must be >= 1"
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


def _value_dim_problem(backend_name: str, d: int, d_v: int) -> Optional[str]:
    """Why a backend cannot run head dim ``d`` with value head dim ``d_v``, or None
    (NumPy runs any pair; the CUDA kernels a compiled set, :func:`ringmpi.kernels.value_dim_problem`)."""
    if d_v == d or backend_name != "cupy":
        return None
    from .kernels import value_dim_problem
    return value_dim_problem(d, d_v)


def _output_shape(q, v) -> tuple:
    """``(B, S_q_local, H, D_v)``: the shape of ``o`` (and ``do``) for these ``q``, ``v``."""
    return tuple(q.shape[:3]) + (v.shape[3],)


def _first_nonfinite(name: str, x, layout_positions) -> Optional[str]:
    xh = np.asarray(x.get() if hasattr(x, "get") else x)
    finite = _dtypes.isfinite(xh)
    if finite.all():
        return None
    b, s, h, d = np.unravel_index(int(np.argmin(finite)), xh.shape)
    return (f"{name} has a non-finite value ({xh[b, s, h, d]}) at global index "
            f"[{b}, {layout_positions[s]}, {h}, {d}] (b, token, head, dim)")


def _plan(q, k, v, comm, layout, causal, window, segment_ids_q, segment_ids_kv,
          softmax_scale, backend, timeout, check_finite, extra=(), declared=None,
          sinks=None, softcap=None, exact_max=False,
          dropout_p=0.0, dropout_seed=None, dropout_offsets=None) -> _Plan:
    comm = resolve_comm(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    be = get_backend(backend, (q, k, v))
    q, k, v = be.asarray(q), be.asarray(k), be.asarray(v)
    seg_q = None if segment_ids_q is None else np.asarray(_host(segment_ids_q))
    seg_kv = None if segment_ids_kv is None else np.asarray(_host(segment_ids_kv))
    agree(comm, _local_problem(q, k, v, seg_q, seg_kv, extra, declared)
          or _value_dim_problem(be.name, q.shape[3], v.shape[3])  # one collective: v is 4-D here
          or _variants.softcap_problem(softcap) or _variants.sinks_problem(sinks, q.shape[2])
          or _dropout_problem(dropout_p, dropout_seed, dropout_offsets, q.shape[2]))

    signature = (q.shape[0], q.shape[2], k.shape[2], q.shape[3], v.shape[3], str(q.dtype))
    drop_key = _dropout_key(dropout_p, dropout_seed, dropout_offsets, q.shape[2])
    shapes = comm.allgather((signature, q.shape[1], k.shape[1], (_variants.digest(sinks, softcap), drop_key)))
    sigs = {s for s, _, _, _ in shapes}
    problem = None
    if len({d[0] for _, _, _, d in shapes}) > 1:
        problem = "ranks disagree on sinks or softcap: every rank must pass the same values"
    if problem is None and len({d[1] for _, _, _, d in shapes}) > 1:
        problem = ("ranks disagree on (dropout_p, dropout_seed, dropout_offsets): "
                   + "; ".join(f"rank {r}: {d[1]}" for r, (_, _, _, d) in enumerate(shapes)))
    if problem is None and len(sigs) > 1:
        problem = ("ranks disagree on (batch, heads, kv_heads, head_dim, value_head_dim, dtype): "
                   + "; ".join(f"rank {r}: {s}" for r, (s, _, _, _) in enumerate(shapes)))
    n_q = sum(n for _, n, _, _ in shapes)
    n_kv = sum(n for _, _, n, _ in shapes)
    kind = layout.kind if isinstance(layout, Layout) else layout
    if problem is None and kind not in KINDS:
        problem = f"unknown layout {kind!r}: expected one of {', '.join(KINDS)}"
    if problem is None and (n_q < 1 or n_kv < 1):
        problem = f"global sequence lengths must be >= 1, got N_q={n_q}, N_kv={n_kv}"
    if problem is None:
        problem = _dropout_size_problem(drop_key, q.shape[0], n_q, n_kv)
    if problem is None and isinstance(layout, Layout):
        if layout.world_size != size or layout.n != n_q:
            problem = (f"layout {layout} does not match the communicator: world size {size}, "
                       f"global query length {n_q}")
    if problem is None:
        layout_q, layout_kv = Layout(kind, n_q, size), Layout(kind, n_kv, size)
        want_q, want_kv = layout_q.counts(), layout_kv.counts()
        bad = [r for r, (_, nq, nkv, _) in enumerate(shapes) if nq != want_q[r] or nkv != want_kv[r]]
        if bad:
            r = bad[0]
            problem = (f"shard lengths do not match the {kind} layout of N_q={n_q}, N_kv={n_kv} "
                       f"over {size} ranks: rank {r} holds q {shapes[r][1]} / kv {shapes[r][2]} rows, "
                       f"the layout gives q {want_q[r]} / kv {want_kv[r]}")
    if problem is None and window is not None:
        if len(window) != 2 or any(w is not None and (int(w) != w or w < 0) for w in window):
            problem = f"window must be (left, right) with non-negative ints or None, got {window!r}"
    agree(comm, problem)

    if check_finite:
        finite_problem = None
        for name, x, lay in (("q", q, layout_q), ("k", k, layout_kv), ("v", v, layout_kv)) + tuple(
                (n, x, layout_q) for n, x in extra):
            finite_problem = _first_nonfinite(name, x, lay.indices(rank))
            if finite_problem:
                break
        agree(comm, finite_problem)

    if seg_q is not None:
        seg_q = seg_q.astype(np.int64, copy=False)
        seg_kv = seg_kv.astype(np.int64, copy=False)
    dim = q.shape[3]
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(dim)
    dropout = None if drop_key is None else Dropout(p=drop_key[0], seed=drop_key[1], heads=drop_key[4],
                                                    batch_offset=drop_key[2], head_offset=drop_key[3])
    spec = MaskSpec(causal=bool(causal),
                    window=None if window is None else tuple(None if w is None else int(w) for w in window),
                    offset=n_kv - n_q, softcap=None if softcap is None else float(softcap),
                    exact_max=bool(exact_max), dropout=dropout)
    return _Plan(comm=comm, backend=be, rank=rank, batch=q.shape[0], heads=q.shape[2],
                 compute_dtype=be.compute_dtype(q.dtype),
                 layout_q=layout_q, layout_kv=layout_kv, spec=spec, scale=scale, seg_q=seg_q,
                 seg_kv=seg_kv,
                 timeout=default_timeout() if timeout is None else timeout,
                 sinks=None if sinks is None else be.asarray(sinks).astype(be.compute_dtype(q.dtype)))


def _dropout_problem(p, seed, offsets, heads: int) -> Optional[str]:
    """This rank's problem with its dropout options (None when fine)."""
    problem = _dropout_validate(p, seed)
    if problem is None and offsets is not None:
        ok = len(offsets) == 3 and all(isinstance(x, (int, np.integer)) for x in offsets)
        if not (ok and min(offsets) >= 0 and offsets[1] + heads <= offsets[2]):
            problem = f"dropout_offsets must be (batch_offset, head_offset, total_heads) covering this call, got {offsets!r}"
    return problem


def _dropout_key(p, seed, offsets, heads: int):
    """``(p, seed, batch_offset, head_offset, total_heads)`` of checked options, None
    without dropout: what every rank must agree on."""
    if float(p) == 0:
        return None
    b0, h0, total = (0, 0, heads) if offsets is None else offsets
    return float(p), int(seed), int(b0), int(h0), int(total)


def _dropout_size_problem(key, batch: int, n_q: int, n_kv: int) -> Optional[str]:
    """The problem with dropout's counter ranges for these global sizes (None when fine)."""
    if key is None:
        return None
    if max(n_q, n_kv) > MAX_POSITION:
        return f"dropout needs sequence lengths <= 2^48, got N_q={n_q}, N_kv={n_kv}"
    if (key[2] + batch) * key[4] > 1 << 32:
        return "dropout needs (batch entries x heads) <= 2^32"
    return None


def _host(x):
    return x.get() if hasattr(x, "get") else x


def ring_attention(q, k, v, *, comm=None, layout: Union[str, Layout] = "contiguous",
                   causal: bool = False, window=None, segment_ids_q=None, segment_ids_kv=None,
                   softmax_scale: Optional[float] = None, backend: str = "auto",
                   timeout: Optional[float] = None, check_finite: bool = False,
                   stats: Optional[list] = None, dtype: Optional[str] = None,
                   head_parallel: Union[int, str, None] = None,
                   sinks=None, softcap: Optional[float] = None, return_max_logit: bool = False,
                   dropout_p: float = 0.0, dropout_seed: Optional[int] = None, dropout_offsets=None):
    """Exact softmax attention over a sequence sharded across the ranks of ``comm``.

    Collective: every rank of ``comm`` calls it with its own shard.

    Parameters
    ----------
    q : (B, S_q_local, H, D) float16, bfloat16 (``ml_dtypes.bfloat16``), float32 or
        float64; NumPy on CPU, CuPy on GPU.  This rank's queries: the global
        tokens ``Layout(layout, N_q, P).indices(rank)``.
    k, v : (B, S_kv_local, H_kv, D) and (B, S_kv_local, H_kv, D_v), same dtype as
        ``q``; ``H % H_kv == 0`` (GQA/MQA).  The value head dim ``D_v`` may differ
        from ``D`` (as in MLA: D = 192, D_v = 128; on GPU see
        :func:`ringmpi.kernels.value_dim_problem`).
        This rank's keys/values, sharded like ``q`` by a layout of the same kind
        over their own global length ``N_kv`` (which may differ from ``N_q``).
    comm : mpi4py communicator, optional
        None means a library-owned duplicate of ``COMM_WORLD``.
    layout : "contiguous" | "zigzag" | "striped" | Layout
        How tokens are spread over ranks; a ``Layout`` must match ``N_q`` and ``P``.
    causal : bool
        Query ``i`` sees keys ``j <= i + N_kv - N_q`` (bottom-right aligned, as
        FlashAttention >= 2.1; the usual causal mask when ``N_q == N_kv``).
    window : (left, right) or None
        Sliding window in global positions, ``i + off - left <= j <= i + off + right``
        with ``off = N_kv - N_q``; ``None`` on a side is unbounded.  Combined with
        ``causal`` when both are given.
    segment_ids_q, segment_ids_kv : (B, S_q_local), (B, S_kv_local) ints, optional
        Packed documents: a query sees only keys with the same id.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(D)``.
    backend : "auto" | "numpy" | "cupy"
    timeout : float, optional
        Deadline in seconds for each ring wait (default: ``RINGMPI_TIMEOUT`` or none).
    check_finite : bool
        Reject NaN/Inf inputs, naming the global index of the first one.
        Without the check (the default) a NaN/Inf reaches exactly the queries
        that see it: a query's ``o``, ``lse`` are dense attention over its
        visible keys alone (a masked key never influences it; a NaN or +Inf
        score makes its row NaN, a -Inf score is a weight of zero), and every
        other query's outputs are bitwise those of a run without the bad value.
    stats : list, optional
        When given, one :class:`ringmpi.ring.StepRecord` per ring step is appended.
    dtype : str, optional
        The dtype every input must have.  ``"bfloat16"`` also accepts ``uint16``
        arrays holding bfloat16 bit patterns (then the outputs are ``uint16``
        bit patterns too); a ``uint16`` array is never read as bfloat16 without it.
    head_parallel : int or "auto", optional
        ``U`` ranks per group of the two-level head x ring schedule
        (:mod:`ringmpi.head_parallel`): an all-to-all over heads inside groups of
        ``U`` ranks, a ring across the ``P/U`` groups.  ``U`` must divide ``P`` and
        ``H``; ``"auto"`` takes the ranks of a node (:mod:`ringmpi.topology`).
        Default ``RINGMPI_HEAD_PARALLEL``, else 1: the flat ring.  Shards in and
        out are the same for every ``U``.
    sinks : (H,) float16, bfloat16, float32 or float64, optional, the same on every rank
        Attention sinks (gpt-oss): every query's softmax denominator gains
        ``exp(sinks[h])``, a virtual key with zero value that every query sees;
        ``lse`` includes it.  Used in the compute dtype (16-bit sinks in float32).
    softcap : float > 0, optional, the same on every rank
        Logit softcap (Gemma 2): scores become ``softcap * tanh(scale * q.k / softcap)``
        before the mask.
    return_max_logit : bool
        Also return ``max_logit`` (the NumPy tiles then keep an exact running
        maximum instead of their lagging shift: a little slower).
    dropout_p : float in [0, 1)
        Dropout on the attention weights: weight ``(b, h, i, j)`` is kept (and
        scaled by ``1 / (1 - p)``) by a pure function of ``(dropout_seed, b, h,
        global i, global j)`` (:mod:`ringmpi.dropout`), so the same seed gives the
        same mask for every number of ranks, layout and backend.  ``lse`` is the
        one without dropout (as FlashAttention's).
    dropout_seed : int in [0, 2^64), required when ``dropout_p > 0``; the same on every rank.
    dropout_offsets : (batch_offset, head_offset, total_heads), optional
        Where this call's batch entry 0 and head 0 sit in a larger tensor whose
        mask it should draw (a call over a slice); default ``(0, 0, H)``.

    Returns
    -------
    o : (B, S_q_local, H, D_v), the input dtype
    lse : (B, H, S_q_local) natural-log softmax normaliser, float32 (float64 for
        float64 inputs); ``-inf`` (and ``o = 0``) for a query that sees no key
        (with sinks: ``lse = sinks[h]``, ``o = 0``).
    max_logit : (H,) NumPy array, float32 (float64 for float64 inputs), only with
        ``return_max_logit``: per head, the largest score (after scale and
        softcap, masked keys excluded, sinks not counted) over the batch and the
        whole sequence, the same on every rank; ``-inf`` for a head whose
        queries see no key.
    """
    (q, k, v), bits = _dtypes.view_declared(dtype, q, k, v)
    plan = _plan(q, k, v, comm, layout, causal, window, segment_ids_q, segment_ids_kv,
                 softmax_scale, backend, timeout, check_finite, declared=dtype,
                 sinks=sinks, softcap=softcap, exact_max=return_max_logit,
                 dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offsets=dropout_offsets)
    groups = resolve_groups(plan.comm, plan.heads, head_parallel)
    if groups is not None:
        from . import head_parallel as _two_level
        return _two_level.forward(plan, groups, q, k, v, stats=stats, bits=bits,
                                  return_max_logit=return_max_logit)
    be, ct = plan.backend, plan.compute_dtype
    xp = be.xp
    qh = be.to_heads(be.asarray(q), ct)
    shape = qh.shape
    o_acc = xp.zeros(shape[:3] + (v.shape[3],), dtype=ct)
    m = xp.full(shape[:3], -np.inf, dtype=ct)
    l = xp.zeros(shape[:3], dtype=ct)

    schedule = plan.schedule(be.asarray(k), be.asarray(v))
    resident = {}  # what the backend derives from qh once per call
    for block in schedule:
        schedule.compute(be.forward_block, qh, block.k, block.v, o_acc, m, l, plan.scale, block.mask,
                         resident=resident)
    records = schedule.records
    del schedule, block, resident  # the ring's buffers go before the outputs are made
    max_logit = _variants.max_logits(m, plan.comm) if return_max_logit else None
    if plan.sinks is not None:
        _variants.fold_sinks(xp, o_acc, m, l, plan.sinks)
    o, lse = be.finalize(o_acc, m, l, q.dtype)
    if stats is not None:
        stats.extend(records)
    if return_max_logit:
        return (o.view(np.uint16) if bits else o), lse, max_logit
    return (o.view(np.uint16) if bits else o), lse


def ring_attention_backward(do, q, k, v, o, lse, *, comm=None,
                            layout: Union[str, Layout] = "contiguous", causal: bool = False,
                            window=None, segment_ids_q=None, segment_ids_kv=None,
                            softmax_scale: Optional[float] = None, backend: str = "auto",
                            timeout: Optional[float] = None, check_finite: bool = False,
                            stats: Optional[list] = None, dtype: Optional[str] = None,
                            head_parallel: Union[int, str, None] = None,
                            sinks=None, softcap: Optional[float] = None,
                            dropout_p: float = 0.0, dropout_seed: Optional[int] = None,
                            dropout_offsets=None, reduce_dsinks: bool = True):
    """Gradients of :func:`ring_attention` with respect to ``q``, ``k``, ``v`` (and ``sinks``).

    Collective; every keyword must match the forward call.

    Parameters
    ----------
    do : (B, S_q_local, H, D_v), like ``o``: the gradient of the loss w.r.t. ``o``.
    q, k, v : as for :func:`ring_attention`.
    o : (B, S_q_local, H, D_v), the forward output.
    lse : (B, H, S_q_local), the forward's log-sum-exp.
    dropout_p, dropout_seed, dropout_offsets : the forward's values: the mask
        is regenerated, never stored.
    reduce_dsinks : bool
        True (the default): ``dsinks`` is summed over all ranks (the same on every
        rank).  False: ``dsinks`` is this rank's own queries' contribution, so that
        a framework's sum of replicated gradients over ranks (an Allreduce, DDP,
        FSDP) gives the total; ``ringmpi.torch`` asks for this.

    Returns
    -------
    dq : (B, S_q_local, H, D); dk : (B, S_kv_local, H_kv, D);
    dv : (B, S_kv_local, H_kv, D_v); all in the
    input dtype (``uint16`` bit patterns for ``dtype="bfloat16"`` with uint16
    inputs), for this rank's own shards.  K/V travel the ring in the input
    dtype (bfloat16: 2 bytes per element); their gradients are accumulated in
    float32 (float64 for float64 inputs) as they travel.
    dsinks : (H,) NumPy array in ``sinks``' dtype, only when ``sinks`` is given:
        the gradient w.r.t. the sinks, summed over the batch and all ranks (the
        same on every rank), or this rank's share with ``reduce_dsinks=False``.
    """
    (do, q, k, v, o), bits = _dtypes.view_declared(dtype, do, q, k, v, o)
    plan = _plan(q, k, v, comm, layout, causal, window, segment_ids_q, segment_ids_kv,
                 softmax_scale, backend, timeout, check_finite, extra=(("do", do), ("o", o)),
                 declared=dtype, sinks=sinks, softcap=softcap, dropout_p=dropout_p,
                 dropout_seed=dropout_seed, dropout_offsets=dropout_offsets)
    be, ct = plan.backend, plan.compute_dtype
    xp = be.xp
    lse = be.asarray(lse)
    want = (plan.batch, plan.heads, q.shape[1])
    agree(plan.comm, None if tuple(lse.shape) == want else
          f"lse must have shape (B, H, S_q_local) = {want}, got {tuple(lse.shape)}")
    groups = resolve_groups(plan.comm, plan.heads, head_parallel)
    if groups is not None:
        from . import head_parallel as _two_level
        return _two_level.backward(plan, groups, do, q, k, v, o, lse, stats=stats, bits=bits,
                                   sinks_dtype=None if sinks is None else sinks.dtype,
                                   reduce_dsinks=reduce_dsinks)
    qh = be.to_heads(be.asarray(q), ct)
    doh = be.to_heads(be.asarray(do), ct)
    dvec = be.row_dot(doh, be.to_heads(be.asarray(o), ct))
    lse = lse.astype(ct, copy=False)
    dq = xp.zeros_like(qh)

    schedule = plan.schedule(be.asarray(k), be.asarray(v), grad_dtype=ct, phase="bwd")
    resident = {}  # what the backend derives from qh, doh, lse, dvec once per call
    for block in schedule:
        pieces = {} if block.kv_done is None else {"kv_done": block.kv_done}
        schedule.compute(be.backward_block, qh, doh, lse, dvec, block.k, block.v, dq, block.dk, block.dv,
                         plan.scale, block.mask, resident=resident, **pieces)
    dk, dv = schedule.finished_grads()
    records = schedule.records
    dsinks = None if plan.sinks is None else _variants.sink_grads(xp, lse, dvec, plan.sinks, plan.comm,
                                                                        reduce_dsinks)
    # keep only dq and the finished dk, dv (their message) before the outputs are made
    del schedule, block, pieces, resident, qh, doh, dvec
    dq *= ct.type(plan.scale)
    dk *= ct.type(plan.scale)
    out_dtype = q.dtype
    result = tuple(be.from_heads(g, out_dtype) for g in (dq, dk, dv))
    if bits:
        result = tuple(g.view(np.uint16) for g in result)
    if stats is not None:
        stats.extend(records)
    return result if dsinks is None else result + (dsinks.astype(sinks.dtype),)
