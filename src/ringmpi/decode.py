"""Decode: attention of a few new tokens over a KV cache sharded across ranks.

The cache never moves.  Every rank holds the same new queries, folds its own
cache shard into an online-softmax state with the backend's block kernel
(global positions, as in the ring), finalises a partial ``(o_r, lse_r)`` and
the partials are merged by the log-sum-exp rule in one ``Allreduce`` with a
user-defined MPI operation on packed rows ``[o (D_v), lse, flag, sig, -sig]``
(``D_v``, the value head dim, is ``v_cache``'s last dim; it may differ from D):

* ``o, lse``: merged as ``lse = log(e^lse_a + e^lse_b)``,
  ``o = (e^(lse_a - lse) o_a + e^(lse_b - lse) o_b)``.  The operation is written
  symmetrically, so ``op(a, b)`` and ``op(b, a)`` are the same bits; then an
  allreduce whose ranks combine the same pairs (recursive doubling) or that
  computes each element once and distributes it (ring, Rabenseifner,
  reduce+broadcast) gives every rank the same bits.  The tests check it at
  P = 1..4 and under each of Open MPI's six allreduce algorithms.
* ``flag, sig, -sig`` (max-reduced): a rank whose own inputs are bad sets
  ``flag``; ``sig`` is a 24-bit digest of the call's arguments (q, sinks,
  cache_lengths, mask, scale, N_cache), so ``max(sig) != -max(-sig)`` means
  the ranks disagree.  Only then does a second collective agree on the message:
  a good call costs exactly one collective (plus one length exchange when
  ``layout`` is a kind name, and one broadcast of q with ``root``).

Positions: the new token ``t`` of batch entry ``b`` is at global position
``i = L_b - S_new + t`` where ``L_b`` is the entry's cache length including the
new tokens (``cache_lengths[b]``, default ``N_cache``), bottom-right aligned as
the ring's causal mask; keys at positions ``>= L_b`` are not part of entry
``b``'s cache.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Optional

import numpy as np

from .core import dtypes as _dtypes
from .core import positions as _placement
from .backends import get_backend, modifier_problem, value_dim_problem
from .runtime.errors import ConfigError, agree
from .core.host import to_host
from .core.layout import KINDS, Layout
from .core.masks import WINDOW_OFF, BlockMask
from .core.online_softmax import SoftmaxState
from .core.shapes import qkv_problem
from .options import AttentionOptions
from .context import Attention, RingContext, call_options
from .parallel.comm import resolve_comm
from .runtime.watchdog import phase

_EXTRA = 4  # lse, flag, sig, -sig after the D output columns


def merge_partials(a, b) -> None:
    """``b[...] = merge(a, b)`` for packed rows ``(n, D + 4)``; symmetric in ``a`` and ``b``.

    Columns ``[:D]`` are a normalised output, ``D`` its natural-log
    normaliser (``-inf``: saw nothing), the last three are max-reduced.
    """
    d = a.shape[1] - _EXTRA
    la, lb = a[:, d], b[:, d]
    top = np.maximum(la, lb)
    shift = np.where(np.isneginf(top), 0, top).astype(a.dtype, copy=False)
    wa, wb = np.exp(la - shift), np.exp(lb - shift)
    total = wa + wb
    seen = total > 0
    safe = np.where(seen, total, 1).astype(a.dtype, copy=False)
    b[:, :d] = (a[:, :d] * wa[:, None] + b[:, :d] * wb[:, None]) / safe[:, None]
    with np.errstate(divide="ignore"):
        b[:, d] = np.where(seen, shift + np.log(safe), -np.inf)
    np.maximum(a[:, d + 1:], b[:, d + 1:], out=b[:, d + 1:])


_OPS = {}


def _merge_op(width: int, dtype: np.dtype):
    """The committed row datatype and the user-defined MPI operation for rows of ``width``."""
    key = (width, dtype.str)
    if key not in _OPS:
        from mpi4py import MPI

        base = MPI.DOUBLE if dtype == np.float64 else MPI.FLOAT
        row = base.Create_contiguous(width).Commit()  # MPI never splits a row between op calls

        def op(inbuf, inoutbuf, datatype):
            merge_partials(np.frombuffer(inbuf, dtype=dtype).reshape(-1, width),
                           np.frombuffer(inoutbuf, dtype=dtype).reshape(-1, width))

        _OPS[key] = (row, MPI.Op.Create(op, commute=True))
    return _OPS[key]


def _describe(x) -> str:
    return f"shape {tuple(x.shape)} dtype {x.dtype}" if hasattr(x, "shape") else type(x).__name__


def _q_problem(q) -> Optional[str]:
    if getattr(q, "ndim", None) != 4:
        return f"q must be 4-D (B, S_new, H, D), got {_describe(q)}"
    if str(q.dtype) not in _dtypes.NAMES:
        return f"q has unsupported dtype {q.dtype}; expected one of {', '.join(_dtypes.NAMES)}"
    if q.shape[1] < 1 or q.shape[3] < 1:
        return f"q needs S_new >= 1 and D >= 1, got shape {tuple(q.shape)}"
    return None


def _cache_problem(q, k, v, n_local, n_cache, lengths) -> Optional[str]:
    """This rank's own problem with its cache shard (q already checked), or None."""
    for name, x in (("k_cache", k), ("v_cache", v)):
        if getattr(x, "ndim", None) != 4:
            return f"{name} must be 4-D (B, S_cache_local, H_kv, D), got {_describe(x)}"
        if x.dtype != q.dtype:
            return f"{name} dtype {x.dtype} differs from q's {q.dtype}"
    shapes = qkv_problem(q.shape, k.shape, v.shape)
    rule = None if shapes is None else shapes[0]
    if rule == "kv":
        return (f"k_cache and v_cache must agree on (B, S_cache_local, H_kv), got {tuple(k.shape)} and "
                f"{tuple(v.shape)} (only the last dim, D_v, may differ)")
    if rule == "value_dim":
        return f"v_cache's value head dim D_v must be >= 1, got shape {tuple(v.shape)}"
    if rule in ("batch", "head_dim"):
        return f"k_cache {tuple(k.shape)} does not match q {tuple(q.shape)} in batch or head dim"
    if rule == "heads":
        return f"q heads ({q.shape[2]}) must be a multiple of cache heads ({k.shape[2]})"
    b = q.shape[0]
    if k.shape[1] != n_local:
        return f"the cache shard holds {k.shape[1]} rows, the layout gives this rank {n_local}"
    if lengths is not None:
        if lengths.shape != (b,):
            return f"cache_lengths must have shape (B,) = ({b},), got {lengths.shape}"
        if lengths.min() < 0 or lengths.max() > n_cache:
            return f"cache_lengths must lie in [0, N_cache = {n_cache}], got {lengths.tolist()}"
    return None


def _given_positions(comm, positions_kv, n_local):
    """(N_cache, this rank's given cache positions) after one allgather of their summaries
    (:mod:`ringmpi.core.positions`); ConfigError on every rank when any rank's are wrong."""
    pos = _placement.as_positions(positions_kv)
    problem = _placement.local_problem("positions_kv", pos, n_local)
    if problem is None and np.any(np.diff(pos) <= 0):
        problem = "positions_kv must be ascending (the cache shard's rows in global order)"
    with phase("decode: the cache positions' summaries (allgather)"):
        every = comm.allgather((problem, None if problem else _placement.summary(pos)))
    problem = next((f"rank {r}: {p}" for r, (p, _) in enumerate(every) if p), None)
    problem = problem or _placement.placement_problem("positions_kv", [s for _, s in every])
    if problem:
        raise ConfigError(problem)
    return sum(s[0] for _, s in every), pos.astype(np.int64, copy=False), None


def _positions(layout, comm, n_local, positions_kv=None):
    """(N_cache, this rank's global positions, a problem or None); a kind name or given
    positions cost one allgather."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if positions_kv is not None:
        return _given_positions(comm, positions_kv, n_local)
    if isinstance(layout, str):
        if layout not in KINDS:
            raise ConfigError(f"unknown layout {layout!r}: expected one of {', '.join(KINDS)}")
        with phase("decode: gathering the cache shard lengths (allgather)"):
            counts = comm.allgather(int(n_local))
        n = sum(counts)
        if n == 0:
            return 0, np.zeros(0, dtype=np.int64), None
        want = Layout(layout, n, size).counts()
        if list(want) != counts:
            raise ConfigError(f"cache shard lengths {counts} do not match the {layout} layout of "
                              f"N_cache={n} over {size} ranks ({want.tolist()})")
        return n, Layout(layout, n, size).indices(rank), None
    if getattr(layout, "world_size", size) != size:
        return 0, np.zeros(0, dtype=np.int64), f"layout {layout} is for {layout.world_size} ranks, not {size}"
    return int(layout.n), np.asarray(layout.indices(rank), dtype=np.int64), None


class DecodeRecord(NamedTuple):
    """One decode call's times, appended to ``context.stats``: ``compute_s`` (local attention) and
    ``merge_s`` (packing, the collective, unpacking; it includes waiting for the slowest rank)."""

    compute_s: float
    merge_s: float


def decode_attention(q, k_cache, v_cache, *, cache_lengths=None, causal: bool = False, window=WINDOW_OFF,
                     softmax_scale: Optional[float] = None, softcap: float = 0.0, alibi_slopes=None, sinks=None,
                     positions=None, root: Optional[int] = None,
                     context: Optional[RingContext] = None) -> Attention:
    """Attention of ``S_new`` new tokens over a KV cache sharded across the ranks of ``context.comm``.

    Collective.  No K/V leaves its rank: each rank attends to its own shard and
    the partial results are merged in one ``Allreduce``.

    Parameters
    ----------
    q : (B, S_new, H, D) float16/bfloat16/float32/float64
        The new tokens' queries, the same on every rank (its shape sizes the
        collective, so a rank with another shape is an erroneous MPI program;
        other differences raise ConfigError); with ``root``, only root's ``q``
        is read (others may pass None) and it is broadcast.
    k_cache, v_cache : (B, S_cache_local, H_kv, D), (B, S_cache_local, H_kv, D_v), q's
        dtype; ``H % H_kv == 0``.  This rank's cache shard, rows in ascending
        global position.  ``D_v`` sizes the collective like q's shape: the same
        on every rank.
    cache_lengths : (B,) ints in ``[0, N_cache]``, optional
        Ragged caches: entry ``b`` holds positions ``< L_b`` (its new tokens
        included) and its new token ``t`` sits at ``L_b - S_new + t``.
        Default: every entry is ``N_cache`` long.
    causal, window, softmax_scale, softcap, alibi_slopes, sinks
        As in :func:`ringmpi.ring_attention`, where they are documented, with each new token
        at its global position (above), so that new token ``i`` sees keys ``j <= i`` when
        causal and ``i - left <= j <= i + right`` in a window.
    positions : (S_cache_local,) ascending ints, optional
        This rank's cache rows' global positions, any assignment of the ``N_cache``
        positions to ranks (the context's layout is then not used): over all ranks ``0 ..
        N_cache-1`` once each, checked in one allgather (:mod:`ringmpi.core.positions`),
        a ConfigError on every rank otherwise.  The new tokens' positions follow
        from ``cache_lengths`` as always.
    root : int, optional
        Return the result on ``root`` only (``Attention(None, None)`` elsewhere).
    context : :class:`ringmpi.RingContext`, optional
        Its ``layout`` places the cache: a kind name spreads ``N_cache = sum of the shard
        lengths`` (one extra allgather of the lengths); an object with ``n``, ``world_size``
        and ``indices(rank)`` (a :class:`~ringmpi.core.layout.Layout`, ``KVCache.placement``)
        costs nothing.  With ``invariant``, the bits :func:`ringmpi.ring_attention` with
        ``invariant`` gives these rows in a ring over the entry's ``L_b`` tokens (any P,
        layout, head x ring), so generation and training agree exactly; every cache shard
        must be whole 64-token tiles of global positions (``KVCache`` shards of a contiguous
        layout with ``N / P`` a multiple of 64).  It selects the collectives, so like ``q``'s
        shape it must be the same on every rank.  Each new token then costs the GEMMs of a
        whole 64-row query tile, and the call two collectives after the checks
        (:func:`ringmpi.parallel.invariant_passes.decode`).  Its ``stats`` receive one
        :class:`DecodeRecord` per call.

    Returns
    -------
    :class:`ringmpi.Attention` ``(o, lse, None)``:

    o : (B, S_new, H, D_v), q's dtype
    lse : (B, H, S_new), float32 (float64 for float64 inputs); ``-inf`` and
        ``o = 0`` for a query that sees no key (and no sink).
    Identical bits on every rank.
    """
    ctx = RingContext.of(context)
    options = call_options(ctx, causal=causal, window=window, softmax_scale=softmax_scale, softcap=softcap,
                           alibi_slopes=alibi_slopes, sinks=sinks)
    return decode(q, k_cache, v_cache, options, comm=ctx.comm, cache_lengths=cache_lengths, layout=ctx.layout,
                  root=root, backend=ctx.backend, stats=ctx.stats, positions_kv=positions)


def decode(q, k_cache, v_cache, options: AttentionOptions, *, comm=None, cache_lengths=None,
           layout="contiguous", root: Optional[int] = None, backend: str = "auto",
           stats: Optional[list] = None, positions_kv=None) -> Attention:
    """:func:`decode_attention` with its options as one :class:`~ringmpi.options.AttentionOptions`
    (``causal``, ``window``, ``softmax_scale``, ``sinks``, ``softcap``, ``alibi_slopes`` are read)."""
    comm = resolve_comm(comm)
    rank = comm.Get_rank()
    if root is not None:
        if not 0 <= int(root) < comm.Get_size():
            raise ConfigError(f"root {root} outside the communicator of size {comm.Get_size()}")
        with phase(f"decode: broadcasting q from rank {root}"):
            q = comm.bcast(to_host(q) if rank == root else None, root=root)
    be = get_backend(backend, (q, k_cache, v_cache))
    q, k_cache, v_cache = be.asarray(q), be.asarray(k_cache), be.asarray(v_cache)
    problem = _q_problem(q)
    if problem:  # q is the same on every rank: every rank finds the same problem
        raise ConfigError(problem)

    n_local = k_cache.shape[1] if getattr(k_cache, "ndim", 0) == 4 else -1
    n_cache, pos, problem = _positions(layout, comm, n_local, positions_kv)
    problem = problem or options.problem(q.shape[2]) or modifier_problem(be, options.modifier_names())
    if problem:  # this rank still joins the collectives, with options that build a spec
        options = AttentionOptions(causal=options.causal, invariant=options.invariant)
    start = time.perf_counter()
    lengths = None if cache_lengths is None else to_host(cache_lengths).astype(np.int64)
    if problem is None:
        problem = _cache_problem(q, k_cache, v_cache, len(pos), n_cache, lengths)
    if problem is None:
        problem = value_dim_problem(be.name, q.shape[3], v_cache.shape[3])
    dim = v_cache.shape[3] if getattr(v_cache, "ndim", 0) == 4 else q.shape[3]  # D_v: the packed output width
    if options.invariant:
        return _invariant(comm, be, q, k_cache, v_cache, options, pos, n_cache, lengths, problem, root, stats,
                          start)
    o_part, lse_part = _local_part(be, q, k_cache, v_cache, options, pos, n_cache, lengths, dim,
                                   run=problem is None)
    be.synchronize()
    merge_start = time.perf_counter()
    merged = _merge(comm, q, o_part, lse_part, options, lengths, n_cache, problem, dim)
    if stats is not None:
        stats.append(DecodeRecord(compute_s=merge_start - start, merge_s=time.perf_counter() - merge_start))
    if root is not None and rank != root:
        return Attention(None, None)
    o = be.from_heads(be.asarray(merged[..., :dim]).transpose(0, 2, 1, 3), q.dtype)
    return Attention(o, be.asarray(np.ascontiguousarray(merged[..., dim].transpose(0, 2, 1))))


def _invariant(comm, be, q, k_cache, v_cache, options, pos, n_cache, lengths, problem, root, stats, start):
    """:func:`decode` with ``invariant=True`` (:func:`ringmpi.parallel.invariant_passes.decode`)."""
    from .core.global_tiles import shard_problem
    from .parallel import invariant_passes

    if problem is None and not getattr(be, "INVARIANT", False):
        problem = f"decode_attention(invariant=True) runs on the numpy and cupy backends, not on {be.name}"
    if problem is None:
        problem = shard_problem("cache", pos, n_cache)
    agree(comm, problem)
    sig = float(options.digest(to_host(q), lengths, extra=(tuple(q.shape), str(q.dtype), n_cache)) & 0xFFFFFF)
    o, lse = invariant_passes.decode(comm, be, q, k_cache, v_cache, options, pos, n_cache, lengths, sig)
    if stats is not None:
        stats.append(DecodeRecord(compute_s=time.perf_counter() - start, merge_s=0.0))
    if root is not None and comm.Get_rank() != root:
        return Attention(None, None)
    return Attention(be.asarray(o), be.asarray(lse))


def _local_part(be, q, k_cache, v_cache, options, pos, n_cache, lengths, dim, run: bool):
    """This rank's ``(o (B, S_new, H, D_v), lse (B, H, S_new))`` in the compute dtype over its
    own cache rows (nothing seen when ``run`` is False: the rank only joins the merge)."""
    batch, s_new = q.shape[:2]
    ct = be.compute_dtype(q.dtype)
    scale, spec = options.scale(q.shape[3]), options.score_spec(q.shape[2])
    qh = be.heads_view(q, ct)
    state = SoftmaxState(be, qh.shape[:3], dim, ct)
    if run and len(pos):
        kh, vh = k_cache.transpose(0, 2, 1, 3), v_cache.transpose(0, 2, 1, 3)  # views of the shard
        if lengths is None or (lengths == lengths[0]).all():
            groups = [(slice(None), n_cache if lengths is None else int(lengths[0]))]
        else:
            groups = [(slice(b, b + 1), int(lengths[b])) for b in range(batch)]
        for rows, length in groups:
            valid = int(np.searchsorted(pos, length))  # local rows are in ascending position
            if valid == 0:
                continue
            mask = BlockMask(spec, np.arange(length - s_new, length, dtype=np.int64), pos[:valid])
            state.fold(qh[rows], kh[rows, :, :valid], vh[rows, :, :valid], scale, mask, rows=rows)
    return state.finalize(ct)


def _merge(comm, q, o_part, lse_part, options, lengths, n_cache, problem, dim) -> np.ndarray:
    """The merged ``(B, S_new, H, D_v + 4)`` rows on every rank: one Allreduce of the packed
    partial results with the agreement flag and digest, then the sinks folded in; raises
    ConfigError on every rank when any rank had a problem or the ranks disagree."""
    batch, s_new, heads = q.shape[:3]
    ct = o_part.dtype
    packed = np.empty((batch, s_new, heads, dim + _EXTRA), dtype=ct)
    packed[..., :dim] = to_host(o_part)
    packed[..., dim] = to_host(lse_part).transpose(0, 2, 1)
    host_q = to_host(q)
    sig = float(options.digest(host_q, lengths, extra=(tuple(q.shape), str(q.dtype), n_cache)) & 0xFFFFFF)
    packed[..., dim + 1] = 0.0 if problem is None else 1.0
    packed[..., dim + 2] = sig
    packed[..., dim + 3] = -sig
    row, op = _merge_op(dim + _EXTRA, ct)
    merged = np.empty_like(packed)
    with phase("the decode merge (Allreduce)"):
        comm.Allreduce([packed, batch * s_new * heads, row], [merged, batch * s_new * heads, row], op=op)
    flat = merged.reshape(-1, dim + _EXTRA)
    if flat[0, dim + 1] > 0 or flat[0, dim + 2] != -flat[0, dim + 3]:
        agree(comm, problem)  # raises: some rank failed its checks
        raise ConfigError("ranks disagree on decode_attention's arguments (q, sinks, cache_lengths, "
                          "causal, window, softmax_scale, softcap, alibi_slopes or N_cache must be the same on every rank)")
    if options.sinks is not None:  # the sink is one more partial result: o = 0, lse = sink
        sink_rows = np.zeros_like(merged)
        sink_rows[..., dim] = np.asarray(to_host(options.sinks), dtype=np.float64).astype(ct)[None, None, :]
        merge_partials(sink_rows.reshape(-1, dim + _EXTRA), flat)
    return merged
