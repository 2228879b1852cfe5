"""The passes of ``invariant=True``: results whose bits do not depend on P, the layout or head x ring.

The flat ring and the head x ring schedule run these instead of
:func:`~ringmpi.parallel.ring_passes.forward_pass` / ``backward_pass`` when the call asks
for invariance (``LocalProblem`` and ``RingSchedule`` as there).  The arithmetic is the
backend's invariant block ops (:mod:`ringmpi.backends.invariant_tiles`): fixed 64-token
tile pairs in global positions, float partial sums added in integer fixed point
(:mod:`ringmpi.core.fixed_point`).  What depends on the whole sequence comes from exact
collectives before any sum: :class:`Maxima` (``MPI.MAX`` of ``|x|`` per batch entry and
head, the same on every rank for every P), and in the forward each row's largest visible
score, from a first ring pass over the keys alone (max is exact in any order).

* forward: pass 1 (K only) -> row maxima ``M``; pass 2 (K, V) -> ``l = sum exp(s - M)`` and
  the ``o`` numerator in fixed point; ``o = num / l``, ``lse = M + log l`` (sinks folded in
  float64 from these exact values).
* backward: one pass; ``dq`` accumulates at home, the ``dK, dV`` partial sums travel as int64
  words (a poison count per key row beside them), then are scaled once.
* ``dsinks``: each row's term on a grid from the global largest term, an int64 ``MPI.SUM``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from ..backends.fixed_sums import add as fixed_add
from ..core import dtypes as _dtypes
from ..core import fixed_point as fx
from ..core.global_tiles import TILE, Tiling
from ..core.host import to_host
from ..runtime.watchdog import phase


def _abs_max(x, axis: int) -> np.ndarray:
    """``max |x|`` over ``axis`` (the rows) in float64, NaN/Inf counted as 0 (their rows are
    poisoned), a few hundred rows at a time (no copy of ``x``)."""
    x = to_host(x)
    shape = x.shape[:axis] + x.shape[axis + 1:]
    out = np.zeros(shape)
    for lo in range(0, x.shape[axis], 256):
        part = np.abs(np.take(x, np.arange(lo, min(lo + 256, x.shape[axis])), axis=axis))
        part[~np.isfinite(part)] = 0
        np.maximum(out, part.max(axis=axis), out=out)
    return out


@dataclass(frozen=True)
class Maxima:
    """The exact global quantities an invariant call's fixed-point grids are built from.

    n_q, n_kv : global lengths; group : query heads per K/V head of the whole call;
    rescale : dropout's ``1 / (1 - p)`` (1 without); vmax_cols : (B, H_kv, D_v) largest
    ``|v|`` per batch entry, K/V head and column over every rank.  Backward only (else None):
    kmax (B, H_kv, D); dk_exp (B, H_kv, D), dv_exp (B, H_kv, D_v): the ``dK, dV`` bound
    exponents of :func:`~ringmpi.core.fixed_point.kv_exponents` over all of a K/V head's
    query heads.  :meth:`for_kv_heads` keeps a head x ring member's K/V heads.
    """

    n_q: int
    n_kv: int
    group: int
    rescale: float
    vmax_cols: np.ndarray
    kmax: Optional[np.ndarray] = None
    dk_exp: Optional[np.ndarray] = None
    dv_exp: Optional[np.ndarray] = None

    def for_kv_heads(self, kv_heads: Sequence[int]) -> "Maxima":
        """These maxima for a call over the K/V heads ``kv_heads`` (global indices, in local order)."""
        pick = list(kv_heads)
        return replace(self, **{name: getattr(self, name)[:, pick]
                                for name in ("vmax_cols", "kmax", "dk_exp", "dv_exp")
                                if getattr(self, name) is not None})


def _rescale(spec, ct) -> float:
    return 1.0 if spec.dropout is None else float(spec.dropout.rescale(ct))


def _allreduce_max(comm, parts, timeout):
    """Elementwise ``MPI.MAX`` of the float64 arrays ``parts`` over ``comm`` (one collective)."""
    from mpi4py import MPI

    flat = np.concatenate([np.ravel(p) for p in parts]).astype(np.float64)
    out = np.empty_like(flat)
    with phase("invariant: the global maxima (Allreduce)", timeout):
        comm.Allreduce(flat, out, op=MPI.MAX)
    got, at = [], 0
    for p in parts:
        got.append(out[at:at + np.size(p)].reshape(np.shape(p)))
        at += np.size(p)
    return got


def forward_maxima(call, v) -> Maxima:
    """Collective over ``call.comm``: the forward's :class:`Maxima` from this rank's ``v (B, S, H_kv, D_v)``."""
    ct = call.compute_dtype
    (vmax,) = _allreduce_max(call.comm, [_abs_max(v, 1)], call.timeout)
    heads, kv_heads = call.heads, v.shape[2]
    return Maxima(call.place_q.n, call.place_kv.n, heads // kv_heads, _rescale(call.spec, ct), vmax)


def backward_maxima(call, q, k, v, do, dvec) -> Maxima:
    """Collective over ``call.comm``: the backward's :class:`Maxima` from this rank's shards
    (sequence-major ``q, k, v, do``; ``dvec (B, H, S_q)`` head-major)."""
    ct = call.compute_dtype
    heads, kv_heads = q.shape[2], k.shape[2]
    group = heads // kv_heads
    parts = [_abs_max(v, 1), _abs_max(k, 1), _abs_max(q, 1), _abs_max(do, 1), _abs_max(dvec, 2)]
    vmax_cols, kmax, qmax, domax, dvecmax = _allreduce_max(call.comm, parts, call.timeout)
    batch = q.shape[0]
    rescale = _rescale(call.spec, ct)
    # per K/V head, over its query heads: the largest row weight exponent, |q| and |do| per column
    vmax_h = np.repeat(vmax_cols.max(axis=2), group, axis=1)
    w = fx.row_weight_exponents(v.shape[3], rescale, vmax_h, domax.max(axis=2), dvecmax)
    w_kv = w.reshape(batch, kv_heads, group).max(axis=2)
    qmax_kv = qmax.reshape(batch, kv_heads, group, -1).max(axis=2)
    domax_kv = domax.reshape(batch, kv_heads, group, -1).max(axis=2)
    dk_exp, dv_exp = fx.kv_exponents(call.place_q.n, group, rescale, w_kv, qmax_kv, domax_kv)
    return Maxima(call.place_q.n, call.place_kv.n, group, rescale, vmax_cols, kmax=kmax, dk_exp=dk_exp,
                  dv_exp=dv_exp)


def _renumber(records, first: int):
    for r in records:
        r.step += first
    return records


def forward(problem, q, k, v, maxima: Maxima, sinks=None):
    """``(o (B, S_q, H, D_v) q.dtype, lse (B, H, S_q), row maxima (B, H, S_q), records)`` of one
    local problem, invariantly: as :func:`~ringmpi.parallel.ring_passes.forward_pass`, whose
    max logit reduces the row maxima (each row's largest visible score before the sinks; NaN
    for a poisoned row).  The records are pass 1's ring steps then pass 2's (steps ``P .. 2P-1``)."""
    be, ct = problem.backend, problem.compute_dtype
    limbs = fx.limbs_for(ct)
    batch, rows, heads, _ = q.shape
    dim_v = v.shape[3]
    xp = be.xp  # the block ops' state lives with the backend (host, or the GPU); the finish is on the host
    res = be.invariant_resident(be.heads_view(q, ct), problem.q_pos, problem.seg_q, k.dtype, ct, problem.spec)
    tiles = res.tiling.count
    shape = (batch, heads, tiles, TILE)
    m = xp.full(shape, -np.inf, dtype=ct)
    poison = xp.zeros(shape, dtype=np.uint8)
    schedule = problem.schedule(k, v[..., :0])  # pass 1: the keys alone
    for block in schedule:
        schedule.compute(be.invariant_max_block, res, block.k, m, poison, problem.scale, block.mask)
    records = schedule.records
    del schedule, block
    m += 0  # one zero: -0.0 and +0.0 maxima, which the order could pick, become +0.0
    shift = xp.where(xp.isfinite(m), m, 0).astype(ct)
    e_l, e_o = fx.forward_exponents(maxima.n_kv, maxima.vmax_cols, maxima.rescale)
    grid_l, grid_o = fx.grid(np.array([e_l]), limbs), fx.grid(e_o, limbs)
    acc_l = fx.zeros(shape + (1,), limbs, xp)
    acc_o = fx.zeros(shape + (dim_v,), limbs, xp)
    schedule = problem.schedule(k, v)
    for block in schedule:
        schedule.compute(be.invariant_forward_block, res, block.k, block.v, shift, acc_l, acc_o, poison,
                         grid_l, grid_o, limbs, problem.scale, block.mask)
    records = records + _renumber(schedule.records, len(records))
    del schedule, block, res, shift
    m, poison, acc_l, acc_o = (to_host(x) for x in (m, poison, acc_l, acc_o))
    bad = poison.astype(bool)
    tiling = Tiling.of(problem.q_pos)
    row_max = np.where(bad, np.nan, np.where(tiling.valid, m, -np.inf)).astype(ct)
    row_max = tiling.from_tiles(row_max, axis=2)
    o, lse = finish_forward(tiling, m, acc_l, acc_o, grid_l, grid_o, bad, sinks, limbs, q.dtype, ct)
    return be.asarray(o), be.asarray(lse), row_max, records


def finish_forward(tiling, m, acc_l, acc_o, grid_l, grid_o, bad, sinks, limbs: int, out_dtype, ct):
    """``(o (B, S, H, D_v) out_dtype, lse (B, H, S) ct)`` in local row order from the exact maxima
    ``m (B, H, nq, TILE)`` and the integer sums ``acc_l``, ``acc_o`` on ``grid_l (1,)``, ``grid_o (B,
    H_kv, D_v)``: :func:`_finish_rows` one head at a time, in place on that head's float64
    numerators (the one temporary as large as a head's output)."""
    batch, heads = m.shape[:2]
    group = heads // grid_o.shape[1]
    slots = tiling.slots()
    dim_v = acc_o.shape[-1] // limbs
    o = np.empty((batch, tiling.rows, heads, dim_v), dtype=out_dtype)
    lse = np.empty((batch, heads, tiling.rows), dtype=ct)
    sink = None if sinks is None else to_host(sinks).astype(np.float64)
    for b in range(batch):
        for h in range(heads):
            l = fx.value(acc_l[b, h], limbs)[..., 0] / grid_l[0]
            num = fx.value(acc_o[b, h], limbs)
            num /= grid_o[b, h // group]
            lse_h = _finish_rows(m[b, h].astype(np.float64), l, num, bad[b, h], None if sink is None else sink[h])
            # rounding to the output dtype commutes with picking the rows: round first, on the
            # smaller copy
            o[b, :, h] = _dtypes.to_dtype(num, out_dtype).reshape(-1, dim_v)[slots]
            lse[b, h] = lse_h.ravel()[slots]
    return o, lse


def _finish_rows(m, l, num, bad, sink):
    """``lse (...)`` float64 of rows with exact maxima ``m``, sums ``l`` and numerators ``num (...,
    D_v)``, which become the rows' ``o`` in place: ``o = num / l``, ``lse = m + log l``; a ``sink``
    logit folded in; a row that saw nothing gets ``o = 0``, ``lse = -inf`` (or the sink); poisoned
    rows (``bad``) and rows whose maximum is NaN or +inf (a NaN or overflowing visible score) NaN."""
    bad = bad | np.isnan(m) | np.isposinf(m)
    seen = l > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf)
        num /= np.where(seen, l, 1)[..., None]
        num[~seen] = 0.0
        if sink is not None:
            total = np.logaddexp(lse, sink)
            num *= np.exp(np.where(seen, lse - total, 0))[..., None]
            lse = total
    lse = np.where(bad, np.nan, lse)
    num[bad] = np.nan
    return lse


@dataclass(frozen=True)
class BackwardGrids:
    """A backward call's fixed-point grids (float64 powers of two): ``dq_rows (B, H, nq, TILE)``
    per row, ``dq_cols (B, H_kv, D)`` (so ``dq``'s grid is their product), ``dk_cols (B, H_kv, D)``,
    ``dv_cols (B, H_kv, D_v)``."""

    dq_rows: np.ndarray
    dq_cols: np.ndarray
    dk_cols: np.ndarray
    dv_cols: np.ndarray


def backward(problem, q, do, k, v, lse, maxima: Maxima, o=None, dvec=None, sinks=None, sink_comm=None,
             raw: bool = False):
    """``(dq (B, H, S_q, D), dk (B, H_kv, S_kv, D), dv (B, H_kv, S_kv, D_v), dsinks, records)``
    of one local problem, invariantly: as :func:`~ringmpi.parallel.ring_passes.backward_pass`
    (head-major, compute dtype, scaled).  ``raw``: ``dk, dv`` stay the int64 sums (with the
    poison column), for a caller that adds several members' sums before
    :meth:`GradFinish.__call__` (head x ring with shared K/V heads); ``dk`` is then that
    :class:`GradFinish`, ``dv`` the pair ``(dk_acc, dv_acc)``."""
    be, ct = problem.backend, problem.compute_dtype
    limbs = fx.limbs_for(ct)
    qh, doh = be.heads_view(q, ct), be.heads_view(do, ct)
    if dvec is None:
        dvec = be.row_dot(doh, be.heads_view(o, ct))
    lse = lse.astype(ct, copy=False)
    batch, heads, _, dim = qh.shape
    kv_heads, dim_v = k.shape[2], v.shape[3]
    group = heads // kv_heads
    res = be.invariant_resident(qh, problem.q_pos, problem.seg_q, k.dtype, ct, problem.spec, do=doh, lse=lse,
                                dvec=dvec)
    vmax_h = np.repeat(maxima.vmax_cols.max(axis=2), group, axis=1)[:, :, None, None]
    dorow = res.tiling.to_tiles(_abs_max(doh, 3), axis=2)  # max |do| per row (flagged rows: 0)
    del qh, doh
    w_rows = fx.row_weight_exponents(dim_v, maxima.rescale, vmax_h, dorow, res.dvec)
    e_rows, e_cols = fx.dq_exponents(maxima.n_kv, w_rows, maxima.kmax)
    grids = BackwardGrids(fx.grid(e_rows, limbs), fx.inverse_power(e_cols), fx.grid(maxima.dk_exp, limbs),
                          fx.grid(maxima.dv_exp, limbs))
    shape = (batch, heads, res.tiling.count, TILE)
    xp = be.xp  # the block ops' state lives with the backend (host, or the GPU); the finish is on the host
    dq_acc = fx.zeros(shape + (dim,), limbs, xp)
    q_poison = xp.zeros(shape, dtype=np.uint8)
    schedule = problem.schedule(k, v, grad_dtype=np.int64, phase="bwd",
                                grad_dims=(limbs * dim, limbs * dim_v + 1))
    for block in schedule:
        schedule.compute(be.invariant_backward_block, res, block.k, block.v, dq_acc, q_poison, block.dk, block.dv,
                         grids, limbs, problem.scale, block.mask, **block.rows)
    dk_acc, dv_acc = (to_host(x) for x in schedule.finished_grads())
    dq_acc, q_poison = to_host(dq_acc), to_host(q_poison)
    records = schedule.records
    tiling = res.tiling
    dsinks = None if sinks is None else be.asarray(sink_grads(lse, dvec, sinks, sink_comm, problem.timeout))
    del schedule, block, res
    scale = float(problem.scale)
    slots = tiling.slots()
    dq = np.empty((batch, heads, tiling.rows, dim), dtype=ct)
    for b in range(batch):
        for h in range(heads):
            part = fx.value(dq_acc[b, h], limbs)  # a new float64 array: the steps below go in place
            part /= grids.dq_rows[b, h][..., None]
            part /= grids.dq_cols[b, h // group]
            part *= scale
            part[q_poison[b, h].astype(bool)] = np.nan
            dq[b, h] = part.astype(ct, copy=False).reshape(-1, dim)[slots]  # round, then pick the rows
    del dq_acc
    finish = GradFinish(grids.dk_cols, grids.dv_cols, limbs, scale, ct)
    if raw:
        return dq, finish, (dk_acc, dv_acc), dsinks, records
    dk, dv = finish(dk_acc, dv_acc)
    return dq, dk, dv, dsinks, records


@dataclass(frozen=True)
class GradFinish:
    """Turns the int64 ``dK, dV`` sums ``(B, H_kv, S, limbs * D)``, ``(..., limbs * D_v + 1)`` (last
    column: poison counts) into head-major compute-dtype gradients, ``dk`` scaled."""

    dk_cols: np.ndarray
    dv_cols: np.ndarray
    limbs: int
    scale: float
    dtype: np.dtype

    def __call__(self, dk_acc, dv_acc):
        limbs = self.limbs
        dk_acc, dv_acc = to_host(dk_acc), to_host(dv_acc)
        batch, kv_heads, rows = dk_acc.shape[:3]
        dim, dim_v = dk_acc.shape[3] // limbs, (dv_acc.shape[3] - 1) // limbs
        dk = np.empty((batch, kv_heads, rows, dim), dtype=self.dtype)
        dv = np.empty((batch, kv_heads, rows, dim_v), dtype=self.dtype)
        for b in range(batch):
            for h in range(kv_heads):
                bad = dv_acc[b, h, :, -1] > 0
                grad = fx.value(dk_acc[b, h], limbs)  # a new float64 array: divided in place
                grad /= self.dk_cols[b, h]
                grad *= self.scale
                dk[b, h] = grad
                grad = fx.value(dv_acc[b, h, :, :-1], limbs)
                grad /= self.dv_cols[b, h]
                dv[b, h] = grad
                dk[b, h][bad] = np.nan
                dv[b, h][bad] = np.nan
        return dk, dv

    def for_kv_heads(self, kv_heads: Sequence[int]) -> "GradFinish":
        pick = list(kv_heads)
        return replace(self, dk_cols=self.dk_cols[:, pick], dv_cols=self.dv_cols[:, pick])


def grad_finish(maxima: Maxima, ct, scale: float) -> GradFinish:
    """The :class:`GradFinish` of every K/V head of ``maxima``."""
    limbs = fx.limbs_for(ct)
    return GradFinish(fx.grid(maxima.dk_exp, limbs), fx.grid(maxima.dv_exp, limbs), limbs, float(scale),
                      np.dtype(ct))


def sink_grads(lse, dvec, sinks, comm, timeout=None) -> np.ndarray:
    """``dsinks (H,)`` compute dtype: ``-sum exp(sink - lse) dvec`` over the batch, this rank's rows
    and (``MPI.SUM`` of int64 words) the ranks of ``comm``, the same bits for every P: each row's
    term (one float per row, the same on any rank) is added on a grid from the largest term over
    all ranks (``MPI.MAX``).  A head with a NaN/Inf term gives NaN.  ``comm`` None: this rank's
    own rows only (the framework bridges' share; their sum over ranks is the framework's)."""
    ct = lse.dtype
    limbs = fx.limbs_for(ct)
    heads = lse.shape[1]
    if lse.shape[0] and lse.shape[2]:
        terms = np.exp(to_host(sinks).astype(ct)[None, :, None] - to_host(lse)) * to_host(dvec)
    else:
        terms = np.zeros((0, heads, 0), dtype=ct)
    terms = -terms.transpose(1, 0, 2).reshape(heads, -1)     # (H, rows)
    finite = np.isfinite(terms)
    local = np.concatenate([_abs_max(terms, 1), (~finite).any(axis=1).astype(np.float64)])
    rows = terms.shape[1]
    if comm is not None:
        from mpi4py import MPI
        (local,) = _allreduce_max(comm, [local], timeout)
        with phase("invariant: the sinks' row count (Allreduce)", timeout):
            rows = comm.allreduce(rows, op=MPI.SUM)
    tmax, nan = local[:heads], local[heads:] > 0
    grid = fx.grid(fx.exponent(tmax) + fx.count_exponent(rows), limbs)
    acc = fx.zeros((heads, 1, 1), limbs)
    x = np.where(finite, terms, 0).astype(ct)[:, :, None, None]        # (H, rows, 1, 1)
    for h in range(heads):
        fixed_add(acc[h][None], x[h], cols=grid[h:h + 1], limbs=limbs)
    if comm is not None:
        from mpi4py import MPI
        total = np.empty_like(acc)
        with phase("invariant: the sinks' gradient (Allreduce)", timeout):
            comm.Allreduce(acc, total, op=MPI.SUM)
        acc = total
    out = fx.value(acc, limbs).reshape(heads) / grid
    out[nan] = np.nan
    return out.astype(ct)


def decode(comm, be, q, k_cache, v_cache, options, pos, n_cache, lengths, sig: float, timeout=None):
    """``invariant=True`` for :func:`ringmpi.decode_attention`: ``(o (B, S_new, H, D_v) q.dtype,
    lse (B, H, S_new))`` on every rank, the bits :func:`forward` gives those rows in a ring over
    the ``L_b`` tokens of each entry's cache (``cache_lengths``).

    Each new token sits at its slot of its 64-token query tile (the tile's other rows zero: a
    GEMM row depends on its own row alone) and meets this rank's cache tiles (``pos``, whole
    tiles of global positions, ascending) through the ring forward's block ops; the row maxima
    (with ``|v|``'s column maxima, the poison flags and ``sig``, the call's digest: ``MPI.MAX``)
    then the integer sums (``MPI.SUM``) are reduced over ``comm``, exact in any order.  Costs a
    whole tile's GEMMs per new token and two collectives.  ConfigError on every rank when the
    ranks' digests differ."""
    from ..runtime.errors import ConfigError
    from ..core.masks import BlockMask

    batch, s_new, heads, _ = q.shape
    dim_v = v_cache.shape[3]
    ct = be.compute_dtype(q.dtype)
    limbs = fx.limbs_for(ct)
    spec, scale = options.score_spec(heads), options.scale(q.shape[3])
    qh = be.heads_view(q, ct)
    kh, vh = k_cache.transpose(0, 2, 1, 3), v_cache.transpose(0, 2, 1, 3)
    if lengths is None or (lengths == lengths[0]).all():
        parts = [(slice(None), n_cache if lengths is None else int(lengths[0]))]
    else:
        parts = [(slice(b, b + 1), int(lengths[b])) for b in range(batch)]
    o_out = np.zeros((batch, s_new, heads, dim_v), dtype=q.dtype)
    lse_out = np.zeros((batch, heads, s_new), dtype=ct)
    xp = be.xp  # the block ops' state lives with the backend; the collectives and the finish on the host
    for rows, length in parts:
        held = int(np.searchsorted(pos, length))  # this rank's rows of the entry's cache
        q_pos = np.arange(length - s_new, length, dtype=np.int64)
        res = be.invariant_resident(qh[rows], q_pos, None, k_cache.dtype, ct, spec)
        entries = res.q.shape[0]
        shape = (entries, heads, res.tiling.count, TILE)
        m = xp.full(shape, -np.inf, dtype=ct)
        poison = xp.zeros(shape, dtype=np.uint8)
        mask = BlockMask(spec, q_pos, pos[:held])
        kr, vr = kh[rows, :, :held], vh[rows, :, :held]
        if held:
            be.invariant_max_block(res, kr, m, poison, scale, mask)
        m, poison = to_host(m), to_host(poison)
        vmax = _abs_max(v_cache[rows, :held], 1)
        nan = np.isnan(m)
        got = _allreduce_max(comm, [np.where(nan, -np.inf, m), nan, poison, vmax, np.array([sig, -sig])], timeout)
        m_all, nan_all, poison_all, vmax, sigs = got
        if sigs[0] != -sigs[1]:
            raise ConfigError("ranks disagree on decode_attention's arguments (q, sinks, cache_lengths, causal, "
                              "window, softmax_scale, softcap, alibi_slopes, invariant or N_cache must be the same "
                              "on every rank)")
        m = np.where(nan_all > 0, np.nan, m_all).astype(ct)
        m += 0
        shift = xp.asarray(np.where(np.isfinite(m), m, 0).astype(ct))
        e_l, e_o = fx.forward_exponents(length, vmax, 1.0)
        grid_l, grid_o = fx.grid(np.array([e_l]), limbs), fx.grid(e_o, limbs)
        acc_l, acc_o = fx.zeros(shape + (1,), limbs, xp), fx.zeros(shape + (dim_v,), limbs, xp)
        poison = xp.asarray(poison)
        if held:
            be.invariant_forward_block(res, kr, vr, shift, acc_l, acc_o, poison, grid_l, grid_o, limbs, scale, mask)
        acc_l, acc_o, poison = to_host(acc_l), to_host(acc_o), to_host(poison)
        (sums,) = _allreduce_sum(comm, [np.concatenate([acc_l.ravel(), acc_o.ravel(), poison.ravel().astype(np.int64)])],
                                 timeout)
        acc_l = sums[:acc_l.size].reshape(acc_l.shape)
        acc_o = sums[acc_l.size:acc_l.size + acc_o.size].reshape(acc_o.shape)
        bad = (sums[acc_l.size + acc_o.size:].reshape(shape) > 0) | (poison_all.reshape(shape) > 0)
        o, lse = finish_forward(res.tiling, m, acc_l, acc_o, grid_l, grid_o, bad, options.sinks, limbs, q.dtype, ct)
        o_out[rows] = o
        lse_out[rows] = lse
    return o_out, lse_out


def _allreduce_sum(comm, parts, timeout):
    """Elementwise ``MPI.SUM`` of the int64 arrays ``parts`` over ``comm`` (exact)."""
    from mpi4py import MPI

    flat = np.concatenate([np.ravel(p) for p in parts]).astype(np.int64)
    out = np.empty_like(flat)
    with phase("invariant: the integer sums (Allreduce)", timeout):
        comm.Allreduce(flat, out, op=MPI.SUM)
    return [out]
