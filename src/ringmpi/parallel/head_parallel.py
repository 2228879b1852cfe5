"""The head x ring schedule: an all-to-all over heads inside groups, a ring across groups.

``ring_attention(..., head_parallel=U)`` with ``U > 1`` lands here (the
caller's contract is unchanged: every rank passes and gets back its own
sequence shard ``(B, S_local, H, D)``).  The ``P`` ranks form ``P/U`` groups of
``U`` (:mod:`ringmpi.parallel.topology`; a group sits on one node when it can):

1. Inside each group one all-to-all (:class:`GroupExchange`, ``MPI_Ialltoallv``:
   shard lengths may be uneven or zero) turns sequence shards into head
   shards: group member ``u`` receives query heads ``[u H/U, (u+1) H/U)`` of
   all the group's tokens (the members' tokens in group order), the K/V heads
   those query heads read (:func:`kv_heads_of`: whole GQA groups, or copies
   of one K/V head when several members share it), and the tokens' segment
   ids.  Global positions need no message: every rank knows the layout.
2. The members with the same ``u`` form a ring across the ``P/U`` groups
   (:class:`ringmpi.parallel.ring_schedule.RingSchedule` on a sub-communicator: the same
   kernels, masks on global positions, double buffers and deadlines as the
   flat ring; with ``U = P`` it is a ring of one, i.e. pure all-to-all attention).
3. A second all-to-all returns ``o`` and ``lse`` to sequence shards.

The backward mirrors it: the all-to-all carries ``q, do, k, v``, ``lse`` and
``Dv = rowsum(do * o)`` (computed at home, so ``o`` itself does not travel),
the ring runs the backward, and the all-to-all back carries ``dq, dk, dv``;
the gradients of a K/V head held by several members are summed at its owner
in the compute dtype, then rounded once.

Records: :class:`ExchangeRecord` (a :class:`~ringmpi.parallel.ring.StepRecord` with a
``stage``) for each all-to-all, around the ring's own step records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np

from ..core.host import to_host
from .ring_passes import AgreedCall, LocalProblem, backward_pass, forward_pass, sink_grads
from .ring import StepRecord, poll_until
from ..runtime.watchdog import phase


def kv_heads_of(index: int, u: int, heads: int, kv_heads: int) -> List[int]:
    """The global K/V heads group member ``index`` holds, in local order.

    Member ``index`` owns query heads ``[index*H/U, (index+1)*H/U)``; query
    head ``h`` reads K/V head ``h // (H/H_kv)``.  Local query head ``i`` then
    reads local K/V head ``i // (hu / len(result))`` (the backends' GQA rule)
    with ``hu = H/U``: whole GQA groups when ``hu`` is a multiple of the group
    size, one shared K/V head when the group size is a multiple of ``hu``, else
    one copy per query head.
    """
    hu, group = heads // u, heads // kv_heads
    first = index * hu
    if hu % group == 0:
        return list(range(first // group, (first + hu) // group))
    if group % hu == 0:
        return [first // group]
    return [h // group for h in range(first, first + hu)]


def replicated(u: int, heads: int, kv_heads: int) -> bool:
    """Whether some K/V head is held more than once across a group (its gradient is then a sum)."""
    held = [h for i in range(u) for h in kv_heads_of(i, u, heads, kv_heads)]
    return len(held) != len(set(held))


@dataclass
class ExchangeRecord(StepRecord):
    """One all-to-all inside a group: seconds (in ``wait_s``) and the bytes that left or
    reached this rank (its own part excluded).  ``stage``: ``"a2a in"`` or ``"a2a out"``;
    ``head_parallel``: the ``U`` the call ran with (what ``"auto"`` chose).  A call's
    ``stats`` without such a record ran the flat ring (``U = 1``)."""

    stage: str = ""
    head_parallel: int = 1


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


class GroupExchange:
    """All-to-all of several arrays among the members of one group (host buffers).

    ``exchange(stage, send, recv)``: ``send[u]`` lists the arrays for member
    ``u`` (any shapes, C order after the copy), ``recv[u]`` the ``(shape, dtype)``
    of each array member ``u`` sends here; returns the received arrays as
    ``out[u][i]``.  One ``MPI_Ialltoallv`` of bytes per call, waited for with
    the call's deadline; device arrays are staged through the host.
    """

    def __init__(self, comm, timeout, records: list, step: int = 0):
        self.comm, self.timeout, self.records = comm, timeout, records
        self.step = step

    def exchange(self, stage: str, send: Sequence[Sequence], recv: Sequence[Sequence[Tuple]]):
        from mpi4py import MPI

        start = time.perf_counter()
        me = self.comm.Get_rank()
        parts = [[np.ascontiguousarray(to_host(a)) for a in dest] for dest in send]
        send_counts = [sum(a.nbytes for a in dest) for dest in parts]
        recv_counts = [sum(_nbytes(s, d) for s, d in src) for src in recv]
        sendbuf = np.empty(max(sum(send_counts), 1), dtype=np.uint8)
        offset = 0
        for dest in parts:
            for a in dest:
                sendbuf[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
                offset += a.nbytes
        recvbuf = np.empty(max(sum(recv_counts), 1), dtype=np.uint8)
        displ = lambda counts: np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)  # noqa: E731
        request = self.comm.Ialltoallv([sendbuf, (send_counts, displ(send_counts)), MPI.BYTE],
                                       [recvbuf, (recv_counts, displ(recv_counts)), MPI.BYTE])
        self.wait(request, stage, start, send_counts, recv_counts)
        out, offset = [], 0
        for src in recv:
            arrays = []
            for shape, dtype in src:
                n = _nbytes(shape, dtype)
                arrays.append(recvbuf[offset:offset + n].view(np.dtype(dtype)).reshape(shape))
                offset += n
            out.append(arrays)
        record = ExchangeRecord(step=self.step, stage=stage, head_parallel=self.comm.Get_size(),
                                bytes_sent=sum(c for u, c in enumerate(send_counts) if u != me),
                                bytes_recv=sum(c for u, c in enumerate(recv_counts) if u != me))
        record.wait_s = time.perf_counter() - start
        self.records.append(record)
        return out

    def wait(self, request, stage: str, start: float, send_counts, recv_counts) -> None:
        """Complete the all-to-all before the deadline (:func:`ringmpi.parallel.ring.poll_until`)."""
        poll_until(request.Test, start, self.timeout, lambda: (
            f"group rank {self.comm.Get_rank()}: the {stage} all-to-all of the head x ring "
            f"schedule did not complete within {self.timeout:g} s (sending {sum(send_counts)} "
            f"bytes, expecting {sum(recv_counts)}); a peer rank may have died or stopped sending"))


def _member_positions(call: AgreedCall, groups, members):
    """The global query and key positions of each member of this group (group order): from the
    call's layouts, or (given positions) one allgather over the group."""
    lay_q, lay_kv = call.place_q.layout, call.place_kv.layout
    if lay_q is not None and lay_kv is not None:
        return [lay_q.indices(m) for m in members], [lay_kv.indices(m) for m in members]
    with phase("head x ring: the group's token positions (allgather)", call.timeout):
        got = groups.group_comm.allgather((call.place_q.mine, call.place_kv.mine))
    return [g[0] for g in got], [g[1] for g in got]


class _Split:
    """Where this rank's head shard comes from and goes back to, in one group."""

    def __init__(self, call: AgreedCall, groups, heads: int, kv_heads: int):
        self.groups, self.u, self.index = groups, groups.u, groups.index
        self.hu = heads // groups.u
        self.kv = [kv_heads_of(i, groups.u, heads, kv_heads) for i in range(groups.u)]
        self.replicated = replicated(groups.u, heads, kv_heads)
        members = groups.members[groups.group]
        q_idx, kv_idx = _member_positions(call, groups, members)
        self.rows_q = [len(i) for i in q_idx]     # tokens of each member, group order
        self.rows_kv = [len(i) for i in kv_idx]
        self.q_pos = np.concatenate(q_idx)          # this group's query positions (group order)
        self.kv_pos = np.concatenate(kv_idx)
        ckv, cq = call.place_kv.counts, call.place_q.counts
        self.ring_kv_counts = [int(sum(ckv[m] for m in g)) for g in groups.members]
        self.ring_q_counts = [int(sum(cq[m] for m in g)) for g in groups.members]

    def heads(self, i: int) -> slice:
        return slice(i * self.hu, (i + 1) * self.hu)

    def cut(self, rows: List[int], i: int) -> slice:
        start = int(sum(rows[:i]))
        return slice(start, start + rows[i])

    def problem(self, call: AgreedCall, seg_q, seg_kv) -> LocalProblem:
        """The local problem of this rank's heads over its group's tokens, on the ring across
        groups, with the mask spec of those heads (:meth:`~ringmpi.core.masks.ScoreSpec.for_heads`)."""
        spec = call.spec.for_heads(self.heads(self.index).start, self.hu)
        return LocalProblem(self.groups.ring_comm, call.backend, call.compute_dtype, spec, call.scale,
                            kv_counts=self.ring_kv_counts, q_pos=self.q_pos, kv_pos=self.kv_pos,
                            seg_q=seg_q, seg_kv=seg_kv, timeout=call.timeout, kv_schedule=call.kv_schedule,
                            q_counts=self.ring_q_counts, q_heads=self.hu, choice=call.choice)


def _gather(exchange, stage: str, send, recv, axes):
    """One all-to-all; the arrays received from all members joined along ``axes`` (group order)."""
    got = exchange.exchange(stage, send, recv)
    return [np.concatenate([g[n] for g in got], axis=axes[n]) for n in range(len(recv[0]))]


def forward(call: AgreedCall, groups, q, k, v, return_max_logit: bool = False, invariant=None):
    """:func:`ringmpi.ring_attention` on ``groups`` (a :class:`~ringmpi.parallel.topology.HeadGroups`).

    ``q (B, S_q_local, H, D)``, ``k, v (B, S_kv_local, H_kv, D | D_v)``: this rank's
    sequence shards, checked by the call.  Returns ``(o (B, S_q_local, H, D_v)`` in the
    input dtype, ``lse (B, H, S_q_local)``, ``max_logit (H,)`` or None, records)``: this
    rank's shards.  The group's heads fold in their own sinks; each head's max logit is
    reduced over all ranks.  ``invariant``: the call's
    :class:`~ringmpi.parallel.invariant_passes.Maxima` (``invariant=True``), or None.
    """
    be = call.backend
    q, k, v = be.asarray(q), be.asarray(k), be.asarray(v)
    batch, _, heads, dim = q.shape
    kv_heads, dim_v = k.shape[2], v.shape[3]
    split = _Split(call, groups, heads, kv_heads)
    records: list = []
    exchange = GroupExchange(groups.group_comm, call.timeout, records)
    has_seg = call.seg_q is not None
    me = split.index
    send = [[q[:, :, split.heads(i)], k[:, :, split.kv[i]], v[:, :, split.kv[i]]]
            + ([call.seg_q, call.seg_kv] if has_seg else []) for i in range(split.u)]
    hkv = len(split.kv[me])
    recv = [[((batch, split.rows_q[j], split.hu, dim), q.dtype), ((batch, split.rows_kv[j], hkv, dim), k.dtype),
             ((batch, split.rows_kv[j], hkv, dim_v), v.dtype)]
            + ([((batch, split.rows_q[j]), np.int64), ((batch, split.rows_kv[j]), np.int64)] if has_seg else [])
            for j in range(split.u)]
    joined = _gather(exchange, "a2a in", send, recv, [1] * 5)
    seg_q, seg_kv = (joined[3], joined[4]) if has_seg else (None, None)
    mine = split.heads(me)
    og, lseg, max_logit, ring_records = forward_pass(
        split.problem(call, seg_q, seg_kv), *(be.asarray(x) for x in joined[:3]),
        sinks=None if call.sinks is None else call.sinks[mine],
        max_logit=(call.comm, (mine, heads)) if return_max_logit else None,
        invariant=None if invariant is None else invariant.for_kv_heads(split.kv[me]))
    # og (B, S_group, hu, D_v), lseg (B, hu, S_group)

    exchange.step = len(ring_records)
    send = [[og[:, split.cut(split.rows_q, j)], lseg[:, :, split.cut(split.rows_q, j)]]
            for j in range(split.u)]
    rows = split.rows_q[me]
    recv = [[((batch, rows, split.hu, dim_v), og.dtype), ((batch, split.hu, rows), lseg.dtype)]
            for _ in range(split.u)]
    got = exchange.exchange("a2a out", send, recv)
    o = np.empty((batch, rows, heads, dim_v), dtype=og.dtype)
    lse = np.empty((batch, heads, rows), dtype=lseg.dtype)
    for i, (o_i, lse_i) in enumerate(got):
        o[:, :, split.heads(i)] = o_i
        lse[:, split.heads(i)] = lse_i
    return be.asarray(o), be.asarray(lse), max_logit, [records[0], *ring_records, records[1]]


def backward(call: AgreedCall, groups, do, q, k, v, o, lse, *, sink_comm, invariant=None, dvec=None):
    """:func:`ringmpi.ring_attention_backward` on ``groups``.

    ``do, o (B, S_q_local, H, D_v)``, ``q (B, S_q_local, H, D)``, ``k, v (B, S_kv_local,
    H_kv, D | D_v)``, ``lse (B, H, S_q_local)``: this rank's shards.  Returns ``((dq, dk,
    dv)`` for this rank's shards in the input dtype, ``dsinks`` (H,) in the compute dtype
    with the call's sinks (from the home rows' ``lse`` and ``dvec``, summed over the ranks
    of ``sink_comm``, this rank's own share when it is None) else None, records)``.
    ``invariant``: the call's :class:`~ringmpi.parallel.invariant_passes.Maxima`
    (``invariant=True``; a K/V head held by several members then has its int64 sums added at
    its owner, then scaled once), or None; ``dvec``: ``rowsum(do * o)`` head-major, or None.
    """
    be, ct = call.backend, call.compute_dtype
    do, q, k, v, o = (be.asarray(x) for x in (do, q, k, v, o))
    batch, rows, heads, dim = q.shape
    kv_heads, dim_v = k.shape[2], v.shape[3]
    split = _Split(call, groups, heads, kv_heads)
    records: list = []
    exchange = GroupExchange(groups.group_comm, call.timeout, records)
    has_seg = call.seg_q is not None
    if dvec is None:
        dvec = be.row_dot(be.to_heads(do, ct), be.to_heads(o, ct))   # (B, H, S_q_local): o stays home
    lse = be.asarray(lse).astype(ct, copy=False)
    send = [[q[:, :, split.heads(i)], do[:, :, split.heads(i)], k[:, :, split.kv[i]], v[:, :, split.kv[i]],
             lse[:, split.heads(i)], dvec[:, split.heads(i)]] + ([call.seg_q, call.seg_kv] if has_seg else [])
            for i in range(split.u)]
    hkv = len(split.kv[split.index])
    recv = []
    for j in range(split.u):
        rq, rkv = split.rows_q[j], split.rows_kv[j]
        recv.append([((batch, rq, split.hu, dim), q.dtype), ((batch, rq, split.hu, dim_v), do.dtype),
                     ((batch, rkv, hkv, dim), k.dtype), ((batch, rkv, hkv, dim_v), v.dtype),
                     ((batch, split.hu, rq), ct), ((batch, split.hu, rq), ct)]
                    + ([((batch, rq), np.int64), ((batch, rkv), np.int64)] if has_seg else []))
    joined = _gather(exchange, "a2a in", send, recv, [1, 1, 1, 1, 2, 2, 1, 1])
    qg, dog, kg, vg, lseg, dvecg = (be.asarray(x) for x in joined[:6])
    seg_q, seg_kv = (joined[6], joined[7]) if has_seg else (None, None)
    raw = invariant is not None and split.replicated
    dq, dkh, dvh, _, ring_records = backward_pass(
        split.problem(call, seg_q, seg_kv), qg, dog, kg, vg, lseg, dvec=dvecg,
        invariant=None if invariant is None else invariant.for_kv_heads(split.kv[split.index]), raw=raw)
    exchange.step = len(ring_records)
    finish = None
    if raw:  # int64 sums: added exactly at the owner, scaled there (the flat ring's bits)
        from .invariant_passes import grad_finish
        finish, (dkh, dvh) = grad_finish(invariant, ct, call.scale), dvh
    result = _return_grads(be, exchange, split, q.dtype, ct, dq, dkh, dvh, batch, rows, kv_heads, finish)
    if call.sinks is None:
        dsinks = None
    elif invariant is not None:
        from .invariant_passes import sink_grads as invariant_sink_grads
        dsinks = invariant_sink_grads(lse, dvec, call.sinks, sink_comm, call.timeout)
    else:
        dsinks = sink_grads(be.xp, lse, dvec, call.sinks, sink_comm)
    return result, dsinks, [records[0], *ring_records, records[1]]


def _return_grads(be, exchange, split, out_dtype, ct, dq, dkh, dvh, batch, rows, kv_heads, finish=None):
    """The all-to-all back: ``(dq, dk, dv)`` of this rank's sequence shards in ``out_dtype``;
    the gradients of a K/V head held by several members are summed at its owner in the
    compute dtype ``ct``, then rounded once.  ``finish``: ``dkh, dvh`` are the invariant
    backward's int64 sums (:class:`~ringmpi.parallel.invariant_passes.GradFinish` of every K/V
    head): added exactly at the owner, then finished."""
    dim, dim_v = dkh.shape[3], dvh.shape[3]
    kv_dtype = np.int64 if finish is not None else ct if split.replicated else out_dtype
    # a sum of copies is rounded once, at home
    dqg = be.from_heads(dq, out_dtype)                  # (B, S_group, hu, D)
    dkg, dvg = be.from_heads(dkh, kv_dtype), be.from_heads(dvh, kv_dtype)
    send = [[dqg[:, split.cut(split.rows_q, j)], dkg[:, split.cut(split.rows_kv, j)],
             dvg[:, split.cut(split.rows_kv, j)]] for j in range(split.u)]
    rkv = split.rows_kv[split.index]
    recv = [[((batch, rows, split.hu, dq.shape[3]), out_dtype), ((batch, rkv, len(split.kv[i]), dim), kv_dtype),
             ((batch, rkv, len(split.kv[i]), dim_v), kv_dtype)] for i in range(split.u)]
    got = exchange.exchange("a2a out", send, recv)
    dq_out = np.empty((batch, rows, split.u * split.hu, dq.shape[3]), dtype=out_dtype)
    dk_sum = np.zeros((batch, rkv, kv_heads, dim), dtype=kv_dtype)
    dv_sum = np.zeros((batch, rkv, kv_heads, dim_v), dtype=kv_dtype)
    for i, (dq_i, dk_i, dv_i) in enumerate(got):
        dq_out[:, :, split.heads(i)] = dq_i
        for local, head in enumerate(split.kv[i]):
            dk_sum[:, :, head] += dk_i[:, :, local]
            dv_sum[:, :, head] += dv_i[:, :, local]
    if finish is not None:
        dk_sum, dv_sum = (be.from_heads(g, out_dtype) for g in finish(be.to_heads(dk_sum, np.int64),
                                                                      be.to_heads(dv_sum, np.int64)))
    result = [dq_out, dk_sum.astype(out_dtype, copy=False), dv_sum.astype(out_dtype, copy=False)]
    return tuple(be.asarray(g) for g in result)
