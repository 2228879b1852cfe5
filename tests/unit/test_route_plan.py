"""The routed schedule's plan (issue 42): which K/V rows each rank's queries see on each other
rank, against a dense visibility count; rounds bounded by one ring slot.  In process, no MPI."""

import numpy as np
import pytest

import reference
from ringmpi.core.masks import ScoreSpec
from ringmpi.parallel import route_plan


def _rows(intervals):
    return np.concatenate([np.arange(a, b) for a, b in intervals.T]) if intervals.shape[1] else np.zeros(0, int)


def _split(rng, n, p):
    """Random placements: in order, a permutation, or documents dealt out; local order shuffled or not."""
    kind = rng.integers(3)
    order = (np.arange(n) if kind == 0 else rng.permutation(n) if kind == 1
             else np.argsort(rng.integers(0, 3, size=n), kind="stable"))
    parts = np.split(order, np.sort(rng.integers(0, n + 1, size=p - 1)))
    return [np.sort(x) if rng.integers(2) else x for x in parts]


@pytest.mark.parametrize("seed", range(6))
def test_plan_holds_exactly_the_rows_some_query_sees(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        p, n_q = int(rng.integers(1, 7)), int(rng.integers(1, 40))
        n_kv = n_q if rng.integers(2) else int(rng.integers(1, 40))
        batch, causal = int(rng.integers(1, 3)), bool(rng.integers(2))
        window = None if rng.integers(2) else tuple(None if rng.integers(3) == 0 else int(rng.integers(0, 6))
                                                    for _ in range(2))
        seg_q = seg_kv = None
        if rng.integers(2):
            seg_q = np.sort(rng.integers(0, 4, size=(batch, n_q)), axis=1)
            seg_kv = np.sort(rng.integers(0, 4, size=(batch, n_kv)), axis=1)
        spec = ScoreSpec(causal=causal, window=window, offset=n_kv - n_q)
        seen = reference.visible(n_q, n_kv, causal, window, seg_q, seg_kv).any(axis=0)  # any batch entry
        qp, kp = _split(rng, n_q, p), _split(rng, n_kv, p)
        q_runs = [route_plan.runs_of(x, None if seg_q is None else seg_q[:, x]) for x in qp]
        kv_runs = [route_plan.runs_of(x, None if seg_kv is None else seg_kv[:, x]) for x in kp]
        order = [int(r) for r in rng.permutation(p)]
        for rank in range(p):
            plan = route_plan.make_plan(rank, q_runs, kv_runs, spec, order, batch)
            assert [t for steps in plan.rounds for t in steps] == list(range(p))
            for other in range(p):
                if other == rank:
                    continue
                for reader, owner, got in ((rank, other, plan.incoming[other]), (other, rank, plan.outgoing[other])):
                    want = (np.flatnonzero(seen[np.ix_(qp[reader], kp[owner])].any(axis=0))
                            if len(qp[reader]) and len(kp[owner]) else np.zeros(0, int))
                    rows = _rows(got)
                    assert np.array_equal(rows, np.sort(rows)) and np.array_equal(rows, want)
                    assert plan.rows[reader, owner] == len(want)
                rows = _rows(plan.incoming[other])
                if len(rows):  # the receiver knows the positions and segment ids of what it gets
                    pos, seg = kv_runs[other].positions(rows)
                    assert np.array_equal(pos, kp[other][rows])
                    if seg_kv is not None:
                        assert np.array_equal(seg, seg_kv[:, kp[other][rows]])


def test_rounds_never_hold_more_than_one_slot_per_rank():
    rng = np.random.default_rng(1)
    n, p = 240, 6
    seg = np.repeat(np.arange(8), 30)[None]
    for causal, window in ((True, None), (False, None), (True, (20, 0))):
        spec = ScoreSpec(causal=causal, window=window)
        parts = [np.sort(x) for x in np.array_split(rng.permutation(n), p)]
        runs = [route_plan.runs_of(x, seg[:, x]) for x in parts]
        plan = route_plan.make_plan(0, runs, runs, spec, list(range(p)), 1)
        cap = max(len(x) for x in parts)
        for steps in plan.rounds[1:]:
            for rank in range(p):
                got = sum(plan.rows[rank, (rank - t) % p] for t in steps)
                sent = sum(plan.rows[(rank + t) % p, rank] for t in steps)
                assert got <= cap and sent <= cap
    # a sparse plan is one round: everything posted before the own block computes
    docs = [np.arange(40 * r, 40 * r + 40) for r in range(p)]
    runs = [route_plan.runs_of(x, np.full((1, 40), r)) for r, x in enumerate(docs)]
    plan = route_plan.make_plan(2, runs, runs, ScoreSpec(causal=True), list(range(p)), 1)
    assert plan.rounds == [[0], list(range(1, p))] and plan.routed_rows() == 0 < plan.ring_rows()


def test_runs_break_at_position_jumps_and_segment_changes():
    pos = np.array([4, 5, 6, 9, 10, 0, 1])
    seg = np.array([[0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 1, 1, 2, 2]])
    runs = route_plan.runs_of(pos, seg)
    assert runs.row.tolist() == [0, 2, 3, 5] and runs.pos.tolist() == [4, 6, 9, 0]
    assert runs.length.tolist() == [2, 1, 2, 2] and runs.seg.tolist() == [[0, 1, 1, 2], [0, 0, 1, 2]]
    assert route_plan.runs_of(np.zeros(0, np.int64), None).rows == 0
