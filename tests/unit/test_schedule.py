"""RingSchedule in-process on COMM_SELF: the blocks it yields, its records, the
gradient channel, and the loop the public calls are built from.  The
multi-rank behaviour runs in the shared launches of test_ring_mpi.py."""

import numpy as np
import pytest
from mpi4py import MPI

import ringmpi
from random_inputs import attention_inputs
from ringmpi.backends.numpy_backend import NumpyBackend
from ringmpi.core.masks import ScoreSpec
from ringmpi.parallel.ring_schedule import RingSchedule


SHAPE = (2, 11, 4, 2, 6)  # B, S, H, H_kv, D of attention_inputs


def _schedule(k, v, seg, grad_dtype=None, **kw):
    be = NumpyBackend()
    s = k.shape[1]
    return RingSchedule(MPI.COMM_SELF, be, be.to_heads(k, k.dtype), be.to_heads(v, v.dtype),
                        kv_counts=[s], q_pos=np.arange(s, dtype=np.int64) + 100,
                        kv_pos=np.arange(s, dtype=np.int64) + 100, spec=ScoreSpec(causal=True),
                        seg_q=seg, seg_kv=seg, grad_dtype=grad_dtype, **kw)


def test_yields_the_own_block_with_its_positions_and_segments_from_the_message():
    q, k, v, seg = attention_inputs(0, *SHAPE, do=False, dtype=np.float32, segments=3)
    schedule = _schedule(k, v, seg)
    blocks = list(schedule)
    assert [(b.step, b.src) for b in blocks] == [(0, 0)]
    block = blocks[0]
    assert np.array_equal(block.k, k.transpose(0, 2, 1, 3)) and np.array_equal(block.v, v.transpose(0, 2, 1, 3))
    assert block.mask.kv_pos.tolist() == list(range(100, 111))
    assert np.array_equal(block.mask.seg_kv, seg)
    # segment ids and positions travel inside the ring message, not as separate per-rank copies
    assert np.shares_memory(block.mask.seg_kv, schedule.kv.meta[0].mpi_buffer())
    assert np.shares_memory(block.mask.kv_pos, schedule.kv.meta[0].mpi_buffer())
    assert block.dk is None


def test_forward_loop_over_the_schedule_equals_ring_attention_bitwise():
    q, k, v, seg = attention_inputs(1, *SHAPE, do=False, dtype=np.float32, segments=3)
    be = NumpyBackend()
    qh = be.to_heads(q, np.float32)
    o_acc = np.zeros(qh.shape, np.float32)
    m = np.full(qh.shape[:3], -np.inf, np.float32)
    l = np.zeros(qh.shape[:3], np.float32)
    schedule = _schedule(k, v, seg)
    scale = 1 / np.sqrt(q.shape[-1])
    for block in schedule:
        tiles = schedule.compute(be.forward_block, qh, block.k, block.v, o_acc, m, l, scale, block.mask)
    o, lse = be.finalize(o_acc, m, l, q.dtype)
    # the public call with positions shifted by 100 on both sides: the same causal mask
    want_o, want_lse, _ = ringmpi.ring_attention(q, k, v, causal=True, segment_ids=seg,
                                                 context=ringmpi.RingContext(MPI.COMM_SELF))
    assert o.tobytes() == want_o.tobytes() and lse.tobytes() == want_lse.tobytes()
    rec = schedule.records[0]
    assert (rec.tiles_computed, rec.tiles_skipped) == tiles and rec.compute_s > 0
    assert rec.bytes_sent == rec.bytes_recv == 0  # one rank: nothing moves


def test_backward_schedule_brings_the_finished_grads_home():
    q, k, v, seg = attention_inputs(2, *SHAPE, do=False, dtype=np.float32, segments=3)
    be = NumpyBackend()
    self_ring = ringmpi.RingContext(MPI.COMM_SELF)
    o, lse, _ = ringmpi.ring_attention(q, k, v, causal=True, segment_ids=seg, context=self_ring)
    do = np.random.default_rng(3).standard_normal(q.shape).astype(np.float32)
    want = ringmpi.ring_attention_backward(do, q, k, v, (o, lse), causal=True, segment_ids=seg,
                                           context=self_ring)[:3]
    qh, doh = be.to_heads(q, np.float32), be.to_heads(do, np.float32)
    dvec = be.row_dot(doh, be.to_heads(o, np.float32))
    dq = np.zeros_like(qh)
    schedule = _schedule(k, v, seg, grad_dtype=np.float32, phase="bwd")
    with pytest.raises(RuntimeError, match="iterated to its end"):
        schedule.finished_grads()
    scale = 1 / np.sqrt(q.shape[-1])
    for block in schedule:
        assert not block.dk.any() and block.dk.dtype == np.float32
        schedule.compute(be.backward_block, qh, doh, lse, dvec, block.k, block.v, dq, block.dk, block.dv,
                         scale, block.mask)
    dk, dv = schedule.finished_grads()
    dq *= np.float32(scale)
    dk *= np.float32(scale)
    got = (be.from_heads(dq, q.dtype), be.from_heads(dk, q.dtype), be.from_heads(dv, q.dtype))
    assert all(g.tobytes() == w.tobytes() for g, w in zip(got, want))
    # one record per step plus the final hop home
    assert [r.step for r in schedule.records] == [0, 1]


def test_fault_points_fire_per_phase(monkeypatch):
    from ringmpi.runtime.faults import InjectedFault
    q, k, v, seg = attention_inputs(4, *SHAPE, do=False, dtype=np.float32, segments=3)
    monkeypatch.setenv("RINGMPI_FAULT", "raise:0:0:bwd")
    assert len(list(_schedule(k, v, seg))) == 1  # forward phase: no fault
    with pytest.raises(InjectedFault):
        list(_schedule(k, v, seg, grad_dtype=np.float32, phase="bwd"))


def test_refuses_counts_that_do_not_match_the_ring():
    q, k, v, seg = attention_inputs(5, *SHAPE, do=False, dtype=np.float32, segments=3)
    be = NumpyBackend()
    with pytest.raises(ValueError, match="kv_counts"):
        RingSchedule(MPI.COMM_SELF, be, be.to_heads(k, k.dtype), be.to_heads(v, v.dtype), kv_counts=[5, 6],
                     q_pos=np.arange(11), kv_pos=np.arange(11), spec=ScoreSpec())


def test_a_wait_inside_the_block_op_counts_as_waiting_not_computing():
    """``timed_compute``: a ring wait the block op makes itself (the backward's ``kv_need`` for the
    arriving dK/dV sums) goes to ``wait_s`` alone, so a step's ``compute_s + wait_s`` stays within
    the time the step took (the bench's timeline identity)."""
    import time

    from ringmpi.parallel.ring import Ring
    from ringmpi.parallel.ring_schedule import timed_compute

    ring = Ring(MPI.COMM_SELF)

    def block_op(tick):
        start = time.perf_counter()  # a wait booked as Ring.wait books one: on the current step's record
        time.sleep(0.05)
        ring.record(ring.step).wait_s += time.perf_counter() - start
        return 3, 1

    start = time.perf_counter()
    assert timed_compute(NumpyBackend(), ring, block_op) == (3, 1)
    took = time.perf_counter() - start
    rec = ring.records[0]
    assert rec.wait_s >= 0.05 and rec.compute_s >= 0
    assert rec.compute_s + rec.wait_s <= took
    assert (rec.tiles_computed, rec.tiles_skipped) == (3, 1)
