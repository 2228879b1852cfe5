"""The cost model (issue 53): each schedule's predicted time, bytes and memory, and auto's choice.

Pure arithmetic (``ringmpi.core.cost_model``), checked against cases worked by hand: a
compute-bound ring hides its transfers, a bandwidth-bound one pays them ``P - 1`` times,
the all-gather holds every K/V row and is refused beyond a budget, a slow inter-node link
shared by a node's ranks costs the all-gather and not the node-major ring.
"""

import math
from dataclasses import replace

import numpy as np
import pytest

from ringmpi.core.cost_model import (Link, Machine, Shape, allgather_memory, choose, hiding_length, predict,
                                     predict_all, ring_memory, split_torus, torus_factor)
from ringmpi.parallel.allgather_schedule import declared_bytes

FAST = Link(latency=1e-6, bandwidth=1e12)
SLOW = Link(latency=1e-6, bandwidth=1e6)
SHAPE = Shape(n_q=8192, n_kv=8192, batch=1, heads=8, kv_heads=8, dim=64, dim_v=64, itemsize=2, grad_itemsize=4)


def test_a_compute_bound_ring_hides_its_transfers():
    machine = Machine(rate=1e12, intra=FAST, inter=FAST, ranks_per_node=8)
    p = predict(SHAPE, machine, 8, "ring")
    assert p.compute == pytest.approx(SHAPE.flops() / 8 / 1e12)
    assert p.seconds == pytest.approx(p.compute, rel=1e-9)
    assert p.exposed == pytest.approx(0, abs=1e-12)
    assert p.bytes == 7 * 1024 * SHAPE.kv_row()


def test_a_bandwidth_bound_ring_pays_each_step():
    machine = Machine(rate=1e15, intra=SLOW, inter=SLOW, ranks_per_node=8)
    p = predict(SHAPE, machine, 8, "ring")
    step = 1e-6 + 1024 * SHAPE.kv_row() / 1e6
    assert p.seconds == pytest.approx(p.compute / 8 + 7 * step)
    back = predict(SHAPE, machine, 8, "ring", backward=True)
    assert back.seconds > 2 * p.seconds  # K/V and float32 partial sums, and the hop home


def test_allgather_memory_is_the_whole_kv_and_a_budget_refuses_it():
    per_rank = ring_memory(SHAPE, 8, backward=False)
    whole = allgather_memory(SHAPE, 8, backward=False)
    assert whole > SHAPE.n_kv * SHAPE.kv_row() > per_rank
    machine = Machine(rate=1e12, intra=FAST, inter=FAST, ranks_per_node=8, memory=(per_rank + whole) / 2)
    best, runner = choose(predict_all(SHAPE, machine, 8))
    assert best.schedule != "allgather" and (runner is None or runner.schedule != "allgather")
    starved = Machine(rate=1e12, intra=FAST, inter=FAST, ranks_per_node=8, memory=1.0)
    assert choose(predict_all(SHAPE, starved, 8)) == (None, None)


def test_declared_memory_of_the_schedule_is_the_models_kv_share():
    """What AllGatherSchedule declares is what the model counts for K/V and partial sums."""
    counts = [1024] * 8
    for backward, grad in ((False, 0), (True, 4)):
        declared = declared_bytes(counts, 0, 1, 8, 64, 64, 2, grad)
        accumulators = allgather_memory(SHAPE, 8, backward) - declared
        s_q_row = 1024 * 8 * 128 * 4
        assert accumulators == pytest.approx(s_q_row * (3 if backward else 1))


def test_a_slow_shared_inter_node_link_costs_the_allgather_not_the_ring():
    """Two nodes of 8 ranks, a slow link between them: the node-major ring crosses it once per
    node and step; the all-gather sends half its bytes over it, shared by the node's 8 ranks."""
    inter = Link(latency=5e-6, bandwidth=1e9)
    machine = Machine(rate=2e11, intra=Link(1e-6, 1e11), inter=inter, ranks_per_node=8)
    ring = predict(SHAPE, machine, 16, "ring")
    gather = predict(SHAPE, machine, 16, "allgather")
    assert ring.seconds < gather.seconds
    # one node, the same ranks: the all-gather needs no slow link and fewer messages
    one_node = Machine(rate=2e11, intra=Link(1e-6, 1e11), inter=inter, ranks_per_node=16)
    assert predict(SHAPE, one_node, 16, "allgather").seconds <= predict(SHAPE, one_node, 16, "ring").seconds


def test_latency_bound_small_calls_prefer_fewer_messages():
    small = Shape(n_q=256, n_kv=256, heads=2, kv_heads=2, dim=16, dim_v=16)
    machine = Machine(rate=1e12, intra=Link(50e-6, 1e10), inter=Link(50e-6, 1e10), ranks_per_node=16)
    ordered = predict_all(small, machine, 16)
    assert ordered[0].schedule == "allgather"
    assert [p.seconds for p in ordered] == sorted(p.seconds for p in ordered)


def test_routed_moves_what_its_plan_says():
    machine = Machine(rate=1e15, intra=SLOW, inter=SLOW, ranks_per_node=8)
    few = predict(SHAPE, machine, 8, "routed", routed_rows=100)
    assert few.bytes == 100 * SHAPE.kv_row()
    assert few.seconds < predict(SHAPE, machine, 8, "ring").seconds


def test_head_parallel_adds_its_all_to_alls_and_shares_the_node_link():
    machine = Machine(rate=1e12, intra=Link(1e-6, 1e11), inter=Link(5e-6, 1e9), ranks_per_node=4)
    flat = predict(SHAPE, machine, 16, "ring")
    grouped = predict(SHAPE, machine, 16, "ring", head_parallel=4)
    assert grouped.head_parallel == 4 and grouped.name == "head x ring, U=4"
    assert grouped.bytes > 0 and grouped.seconds > 0
    assert {p.head_parallel for p in predict_all(SHAPE, machine, 16, head_parallel=(1, 2, 3, 4))} == {1, 2, 4}
    assert grouped.compute == pytest.approx(flat.compute)


def test_hiding_length_is_where_a_steps_compute_meets_its_transfer():
    machine = Machine(rate=1e12, intra=Link(20e-6, 2e10), inter=Link(20e-6, 2e10), ranks_per_node=8)
    s = hiding_length(SHAPE, machine, 8)
    per_pair = SHAPE.flops() / (SHAPE.n_q * SHAPE.n_kv) / machine.rate
    assert per_pair * s * s == pytest.approx(20e-6 + s * SHAPE.kv_row() / 2e10, rel=1e-9)
    n = int(math.ceil(s)) * 8 * 2  # twice the length per rank: hidden
    assert predict(Shape(**{**SHAPE.__dict__, "n_q": n, "n_kv": n}), machine, 8, "ring").exposed < 1e-9


def test_resident_memory_adds_the_tile_workspace():
    from ringmpi.core.cost_model import WORKSPACE_TILES, resident_memory, workspace_memory

    for backward in (False, True):
        extra = resident_memory(SHAPE, 8, "allgather", backward) - allgather_memory(SHAPE, 8, backward)
        assert extra == workspace_memory(SHAPE) == WORKSPACE_TILES * 512 * 512 * SHAPE.grad_itemsize
        assert resident_memory(SHAPE, 8, "ring", backward) == ring_memory(SHAPE, 8, backward) + extra
    assert predict(SHAPE, Machine(rate=1e12, intra=FAST, inter=FAST), 8, "allgather").memory == \
        resident_memory(SHAPE, 8, "allgather", False)


# head_parallel="auto" (issue 53): U and the schedule chosen together by predicted time, among the
# U a node layout allows (two nodes of four ranks: U in 1, 2, 4)
LONG = Shape(n_q=32768, n_kv=32768, batch=1, heads=8, kv_heads=8, dim=64, dim_v=64)
NODE_LAYOUT = [0] * 4 + [1] * 4


def test_head_parallel_candidates_follow_heads_and_nodes():
    from ringmpi.parallel.topology import head_parallel_candidates

    assert head_parallel_candidates(NODE_LAYOUT, 8) == [1, 2, 4]
    assert head_parallel_candidates(NODE_LAYOUT, 6) == [1, 2]      # U divides H
    assert head_parallel_candidates([0, 0, 1, 1, 1, 1], 8) == [1, 2]  # and every node's ranks
    assert head_parallel_candidates(list(range(4)), 8) == [1]         # one rank per node: the flat ring


def test_auto_takes_head_x_ring_where_the_inter_node_link_is_slow():
    """Fast links inside a node, a slow one between: groups of four on each node shrink the ring's
    slow hops to one per group step with a quarter of the bytes each; the all-to-alls are cheap."""
    from ringmpi.parallel.topology import head_parallel_candidates

    machine = Machine(rate=1e12, intra=Link(1e-6, 1e11), inter=Link(5e-6, 1e8), ranks_per_node=4)
    candidates = head_parallel_candidates(NODE_LAYOUT, LONG.heads)
    best, runner = choose(predict_all(LONG, machine, 8, ("ring", "allgather"), head_parallel=candidates))
    assert (best.schedule, best.head_parallel) == ("ring", 4) and best.name == "head x ring, U=4"
    flat = predict(LONG, machine, 8, "ring")
    assert best.seconds < runner.seconds and best.seconds < 0.8 * flat.seconds
    back, _ = choose(predict_all(LONG, machine, 8, ("ring", "allgather"), head_parallel=candidates, backward=True))
    assert back.head_parallel == 4 and back.seconds < predict(LONG, machine, 8, "ring", backward=True).seconds


def test_auto_keeps_the_flat_ring_where_every_link_is_fast():
    """Compute-bound everywhere: the ring hides its transfers, head x ring only adds its all-to-alls."""
    from ringmpi.parallel.topology import head_parallel_candidates

    machine = Machine(rate=1e12, intra=Link(1e-6, 1e11), inter=Link(1e-6, 1e11), ranks_per_node=4)
    best, _ = choose(predict_all(LONG, machine, 8, ("ring",),
                                 head_parallel=head_parallel_candidates(NODE_LAYOUT, LONG.heads)))
    assert (best.schedule, best.head_parallel) == ("ring", 1)


def test_a_member_holds_the_kv_heads_of_its_query_heads():
    from ringmpi.core.cost_model import member_kv_heads
    from ringmpi.parallel.head_parallel import kv_heads_of

    for heads, kv_heads in ((8, 8), (8, 2), (8, 1), (6, 3), (12, 8)):
        for u in (1, 2, 3, 4, 6):
            if heads % u == 0 and (heads % kv_heads == 0):
                assert member_kv_heads(heads, kv_heads, u) == len(kv_heads_of(0, u, heads, kv_heads))


def test_a_backward_rate_times_the_backward_only():
    machine = Machine(rate=1e12, intra=FAST, inter=FAST, ranks_per_node=8)
    slower = Machine(rate=1e12, intra=FAST, inter=FAST, ranks_per_node=8, backward_rate=5e11)
    assert predict(SHAPE, slower, 8, "ring").seconds == predict(SHAPE, machine, 8, "ring").seconds
    assert predict(SHAPE, slower, 8, "ring", backward=True).compute == \
        pytest.approx(2 * predict(SHAPE, machine, 8, "ring", backward=True).compute)


def test_a_torus_widens_the_collectives_not_the_rings_hop():
    """A 4 x 4 torus with wraparound: a rank receives a gather over its 4 links, an all-to-all is held
    to the bisection (8 links a direction across the cut: n^2 / (4 (n - 1)) / 8 of a link's time a
    byte); the ring's neighbour hop stays one link; no torus (a switch) changes nothing."""
    assert split_torus((4, 4), 16) == ((), ((4, True), (4, True)))
    assert split_torus((4, 4), 4) == (((4, True),), ((4, True),))
    assert split_torus((4, 4), 3) is None and split_torus(None, 1) is None
    assert torus_factor(((4, True), (4, True)), "gather") == pytest.approx(1 / 4)
    assert torus_factor(((4, True), (4, True)), "alltoall") == pytest.approx(256 / 60 / 8)
    assert torus_factor((), "gather") == 1.0
    link = Link(1e-6, 1e9)
    switch = Machine(rate=1e12, intra=link, inter=link, ranks_per_node=16)
    torus = Machine(rate=1e12, intra=link, inter=link, ranks_per_node=16, torus=(4, 4))
    assert predict(SHAPE, torus, 16, "ring").seconds == predict(SHAPE, switch, 16, "ring").seconds
    assert predict(SHAPE, torus, 16, "allgather").seconds < predict(SHAPE, switch, 16, "allgather").seconds
    assert predict(SHAPE, torus, 16, "ring", 8).seconds < predict(SHAPE, switch, 16, "ring", 8).seconds
    mismatched = Machine(rate=1e12, intra=link, inter=link, ranks_per_node=16, torus=(2, 2))
    assert predict(SHAPE, mismatched, 16, "allgather").seconds == predict(SHAPE, switch, 16, "allgather").seconds


def test_the_tiles_computed_and_the_block_scans_are_what_a_rank_pays():
    """Issue 53's grid: a partially masked tile is computed whole (``tile_pairs``, not the visible
    pairs), every block op scans its visiting rows (``block_overhead``: the ring a whole block each
    step, routed only the rows it receives), segment ids run at their own rate; all three
    default to the plain model (a described machine)."""
    machine = Machine(rate=1e12, intra=FAST, inter=FAST, ranks_per_node=8)
    sparse = Shape(**{**vars(SHAPE), "density": 0.1})
    tiled = Shape(**{**vars(sparse), "tile_pairs": 0.2 * 8192 * 8192 / 8})
    assert predict(tiled, machine, 8, "ring").compute == pytest.approx(2 * predict(sparse, machine, 8, "ring").compute)
    scans = Machine(rate=1e12, intra=FAST, inter=FAST, ranks_per_node=8, block_overhead=1e-7)
    shard = 8192 // 8
    ring, plain = predict(sparse, scans, 8, "ring"), predict(sparse, machine, 8, "ring")
    assert ring.seconds - plain.seconds == pytest.approx(8 * shard * 8 * 1e-7, rel=1e-3)
    routed = predict(sparse, scans, 8, "routed", routed_rows=100)
    assert routed.seconds - predict(sparse, machine, 8, "routed", routed_rows=100).seconds == \
        pytest.approx((shard + 100) * 8 * 1e-7, rel=1e-3)
    docs = Shape(**{**vars(sparse), "segments": True})
    slower = Machine(rate=1e12, intra=FAST, inter=FAST, ranks_per_node=8, segment_rate=0.5e12)
    assert predict(docs, slower, 8, "ring").compute == pytest.approx(2 * predict(sparse, slower, 8, "ring").compute)
    assert predict(docs, machine, 8, "ring").compute == predict(sparse, machine, 8, "ring").compute


def test_routed_rows_from_the_own_node_stay_off_the_slow_link():
    """``routed_split``: the plan's rows from the rank's own node cross the intra link, only those
    the node's ranks receive from other nodes the inter link."""
    machine = Machine(rate=1e15, intra=FAST, inter=SLOW, ranks_per_node=2)
    row = SHAPE.kv_row()
    near = Shape(**{**vars(SHAPE), "routed_split": (1000.0, 0.0)})
    far = Shape(**{**vars(SHAPE), "routed_split": (0.0, 1000.0)})
    assert predict(near, machine, 4, "routed", routed_rows=1000).exposed < 1e-3
    assert predict(far, machine, 4, "routed", routed_rows=1000).seconds == pytest.approx(1000 * row / 1e6, rel=0.01)


def test_a_calls_own_cost_is_added_to_its_schedule_and_u_alone():
    """``Machine.call_seconds``: a minimal call's time per (schedule, U), added whole to that
    schedule's prediction (``Prediction.fixed``), never counted as exposed communication; 0 for a
    pair it does not name (a described machine names none)."""
    bare = Machine(rate=1e12, intra=FAST, inter=FAST, ranks_per_node=8)
    timed = Machine(rate=1e12, intra=FAST, inter=FAST, ranks_per_node=8,
                    call_seconds=(("ring", 1, 0.03), ("allgather", 1, 0.05), ("ring", 2, 0.04)))
    assert timed.call_cost("ring") == 0.03 and timed.call_cost("ring", 2) == 0.04
    assert timed.call_cost("routed") == 0.0 and bare.call_cost("ring") == 0.0
    for schedule, u, fixed in (("ring", 1, 0.03), ("allgather", 1, 0.05), ("ring", 2, 0.04), ("routed", 1, 0.0)):
        before, after = predict(SHAPE, bare, 8, schedule, u), predict(SHAPE, timed, 8, schedule, u)
        assert after.fixed == fixed
        assert after.seconds == pytest.approx(before.seconds + fixed)
        assert after.exposed == pytest.approx(before.exposed)
    # a small call's choice follows the calls' own costs where the blocks cost next to nothing
    every = replace(timed, call_seconds=timed.call_seconds + (("routed", 1, 0.02), ("routed", 2, 0.06),
                                                              ("allgather", 2, 0.07)))
    tiny = Shape(n_q=64, n_kv=64, heads=8, kv_heads=8)
    assert choose(predict_all(tiny, every, 8, head_parallel=(1, 2)))[0].name == "routed"


def test_a_links_sustained_bandwidth_is_what_the_larger_message_adds():
    """A token bucket lets its burst through at the wire's speed: a 1 MiB message inside the burst
    says nothing of the rate; the 3 MiB a 4 MiB message adds does.  Never above the larger
    message's own rate: a slowed smaller message leaves too small a difference."""
    from ringmpi.parallel.cost_measure import sustained_bandwidth

    one, big, wire, rate, burst = 1 << 20, 1 << 22, 2e9, 125e6, 1.25e6

    def bucket(nbytes):  # seconds to receive nbytes through a full token bucket
        return nbytes / wire + max(nbytes - burst, 0) / rate

    got = sustained_bandwidth(one, bucket(one), big, bucket(big), 3e-6)
    assert 0.9 * rate < got < 1.15 * rate  # the 1 MiB message's own rate would say 2 GB/s
    assert sustained_bandwidth(one, 1e-3, big, 4e-3, 0.0) == pytest.approx(3 * one / 3e-3)
    noisy = sustained_bandwidth(one, 3e-3, big, 3.1e-3, 0.0)  # the smaller message was slowed
    assert noisy == pytest.approx(big / 3.1e-3)
    assert sustained_bandwidth(one, 5e-3, big, 4e-3, 0.0) == pytest.approx(big / 4e-3)  # no difference at all


def test_a_measured_loaded_link_times_the_rings_that_cross_it_together():
    """Where several rings cross a node's link at once (head x ring's), their hop is the link as
    measured with every rank of the node crossing it (``inter_pairs``: all their flows
    together), shared among them; a lone ring's hop keeps the one-flow figure."""
    base = Machine(rate=1e15, intra=FAST, inter=Link(1e-6, 24e6), ranks_per_node=2)
    loaded = replace(base, inter_pairs=Link(1e-6, 12e6))  # two flows move half what one does
    assert loaded.shared_hop(2) == Link(1e-6, 12e6) and loaded.shared_hop(1) == base.inter
    assert base.shared_hop(2) == base.inter  # not measured: the one-flow link, shared
    assert predict(SHAPE, loaded, 4, "ring").seconds == pytest.approx(predict(SHAPE, base, 4, "ring").seconds)
    grouped, slow = predict(SHAPE, base, 4, "ring", head_parallel=2), predict(SHAPE, loaded, 4, "ring", head_parallel=2)
    step = (SHAPE.n_kv / 2) * SHAPE.kv_row() / 2  # a member's half of the heads, half the rows
    assert slow.seconds - grouped.seconds == pytest.approx(step / 6e6 - step / 12e6, rel=1e-3)


def test_a_ranks_counterparts_are_its_index_on_the_next_and_previous_node():
    from ringmpi.parallel.topology import counterparts

    two = ["a", "a", "b", "b"]
    assert [counterparts(two, r) for r in range(4)] == [(2, 2), (3, 3), (0, 0), (1, 1)]
    uneven = ["a", "a", "b", "c", "c"]  # b has no second rank: rank 1 sends to none
    assert counterparts(uneven, 1) == (None, 4) and counterparts(uneven, 3) == (0, 2)
    assert counterparts(["a", "a"], 0) == (None, None)


def test_call_costs_time_a_minimal_call_once_per_communicator():
    """On one rank (COMM_SELF's duplicate): each (schedule, U) asked is timed once (a second ask
    returns the kept figure), positive and well under a second; after ``assume_links`` (a
    described machine) there are none."""
    from mpi4py import MPI

    import ringmpi.attention  # noqa: F401 - the public call the minimal call times (cost_measure.MINIMAL_CALL)
    from ringmpi.backends import get_backend
    from ringmpi.core.cost_model import Link as L
    from ringmpi.parallel import cost_measure

    comm = MPI.COMM_SELF.Dup()
    try:
        be = get_backend("numpy")
        got = cost_measure.call_costs(comm, be, [("ring", 1), ("allgather", 1)])
        assert [(s, u) for s, u, _ in got] == [("ring", 1), ("allgather", 1)]
        assert all(0 < t < 1 for _, _, t in got)
        assert cost_measure.call_costs(comm, be, [("ring", 1)]) == got[:1]  # kept, not timed again
        cost_measure.assume_links(comm, L(1e-6, 1e10), L(1e-6, 1e10))
        assert cost_measure.call_costs(comm, be, [("ring", 1)]) == ()
    finally:
        comm.Free()


def test_auto_decisions_are_kept_for_identical_calls(monkeypatch):
    """``call_key`` tells calls apart by their positions, segment ids, parts and the budget's
    setting; ``recall`` gives back what ``remember`` kept under the same key (on one rank: every
    rank holds it), nothing for another key, nothing for an all-gather decision (not kept), and
    nothing once ``assume_links`` changed the links."""
    from mpi4py import MPI

    from ringmpi.core.cost_model import Link as L
    from ringmpi.parallel import cost_measure

    pos, seg = np.arange(8), np.zeros((1, 8), dtype=np.int64)
    key = cost_measure.call_key((pos, pos, seg, None), "schedule", (4, 64))
    assert key == cost_measure.call_key((np.arange(8), pos, seg, None), "schedule", (4, 64))
    others = [cost_measure.call_key((pos + 1, pos, seg, None), "schedule", (4, 64)),
              cost_measure.call_key((pos, pos, seg + 1, None), "schedule", (4, 64)),
              cost_measure.call_key((pos, pos, None, None), "schedule", (4, 64)),
              cost_measure.call_key((pos, pos, seg, None), "schedule", (4, 128))]
    monkeypatch.setenv("RINGMPI_MEMORY_BUDGET", "1000000")
    others.append(cost_measure.call_key((pos, pos, seg, None), "schedule", (4, 64)))
    monkeypatch.delenv("RINGMPI_MEMORY_BUDGET")
    assert len({key, *others}) == 6
    comm = MPI.COMM_SELF.Dup()
    try:
        assert cost_measure.recall(comm, key) is None
        assert cost_measure.remember(comm, key, "ring", "ring") == "ring"
        assert cost_measure.recall(comm, key) == "ring"
        assert cost_measure.recall(comm, others[0]) is None
        # an all-gather decision holds every K/V row: not kept, weighed again by the next call
        assert cost_measure.remember(comm, others[0], "allgather", "allgather") == "allgather"
        assert cost_measure.recall(comm, others[0]) is None
        cost_measure.assume_links(comm, L(1e-6, 1e10), L(1e-6, 1e10))
        assert cost_measure.recall(comm, key) is None
    finally:
        comm.Free()
