"""The head x ring schedule (``head_parallel=U``): planning in-process, the core matrix under mpirun.

One launch per world size runs every case of that size
(``head_parallel_cases.py``): ``U = 2`` at P = 2 and 4, ``U = 4`` at P = 4,
``U = 3`` at P = 6 (each against the float64 reference under the tolerance
rule, forward and backward), ``U = 1`` in every spelling bitwise equal to the
flat ring, ``"auto"`` under ``RINGMPI_NODE_SIZE`` with a fast link inside a node and a slow
one between given to the cost model (it chooses head x ring), and unusable choices.
"""

import itertools

import pytest

import packed_cases
from mpi_util import CaseLaunches
from ringmpi import RingContext
from ringmpi.parallel.head_parallel import kv_heads_of, replicated
from ringmpi.parallel.topology import (group_members, head_parallel_candidates,
                                       head_parallel_problem, head_parallel_setting, spans_nodes)

LAYOUTS = ("contiguous", "zigzag", "striped")
DIMS = (8, 59, 64)


def heads_for(u):
    """(H, H_kv) with H % U == 0: no GQA, whole GQA groups per member, and H_kv < U."""
    return [(2 * u, 2 * u), (2 * u, u), (2 * u, 1)] + ([(2 * u, 2)] if u == 3 else [])


def cases_for(p, us):
    cases, spin = [], itertools.count()

    def add(name, u, **kw):
        i = next(spin)
        hs = heads_for(u)
        h, hkv = hs[i % len(hs)]
        case = dict(id=f"P{p}-U{u}-{name}", U=u, B=1, H=h, Hkv=hkv, D=DIMS[i % len(DIMS)], dtype="float32",
                    backward=True, seed=7000 + 100 * p + i)
        case.update(kw)
        cases.append(case)

    for u in us:
        for layout in LAYOUTS:
            add(f"n1-{layout}-causal", u, n_q=1, layout=layout, causal=True)  # N < P: empty shards
            add(f"n{p + 1}-{layout}-full", u, n_q=p + 1, layout=layout)
            add(f"n97-{layout}-causal", u, n_q=97, layout=layout, causal=True, B=2)
            add(f"n256-{layout}-full", u, n_q=256, layout=layout)
            add(f"window-{layout}", u, n_q=200, layout=layout, causal=True, window=[16, 0])
            add(f"segments-{layout}", u, n_q=256, layout=layout, segments=5, B=2)
            add(f"qlong-causal-{layout}", u, n_q=256, n_kv=97, layout=layout, causal=True)  # rows see nothing
            add(f"kvlong-window-{layout}", u, n_q=64, n_kv=200, layout=layout, window=[10, 10], causal=True)
            add(f"float64-{layout}", u, n_q=97, layout=layout, causal=True, dtype="float64", segments=3)
        add("bfloat16-bits", u, n_q=97, layout="zigzag", causal=True, dtype="bfloat16", bits=True, B=2)
        add("float16", u, n_q=97, layout="striped", window=[8, 8], dtype="float16")
        add("scale", u, n_q=64, layout="contiguous", scale=0.5)
    return cases


def launch_cases(p):
    if p == 2:
        cases = cases_for(2, (2,))
    elif p == 4:
        cases = cases_for(4, (2, 4))
        # head_parallel="auto" by predicted cost (issue 53): two pretend nodes of two ranks, a fast link
        # inside a node and a slow one between (given to the cost model): groups of two on each node,
        # alone (the ring inside) and jointly with schedule="auto" (the ring or the all-gather inside)
        links = [[1e-6, 1e10], [1e-3, 1e7]]
        cases.append(dict(id="P4-auto-node2", U="auto", expect_U=2, env={"RINGMPI_NODE_SIZE": 2}, B=2, H=8,
                          Hkv=2, D=16, n_q=97, layout="zigzag", causal=True, segments=3, backward=True, seed=11,
                          links=links, chosen=["head x ring, U=2"]))
        cases.append(dict(id="P4-auto-both", U="auto", expect_U=2, env={"RINGMPI_NODE_SIZE": 2}, B=1, H=4,
                          Hkv=4, D=16, n_q=128, layout="contiguous", backward=True, seed=17, schedule="auto",
                          links=links, chosen=["head x ring, U=2", "head x allgather, U=2"]))
        cases.append(dict(id="P4-env-U2", U=None, expect_U=2, env={"RINGMPI_HEAD_PARALLEL": 2}, B=1, H=4,
                          Hkv=4, D=16, n_q=50, layout="contiguous", causal=True, backward=True, seed=12))
        cases.append(dict(id="P4-U2-torch", kind="torch", head_parallel=2, B=2, H=4, Hkv=1, D=8, n_q=45,
                          layout="zigzag", causal=True, segments=3, seed=16))
        cases.append(dict(id="P4-U1-bitwise", kind="bitwise", B=2, H=4, Hkv=2, D=16, n_q=97, layout="zigzag",
                          causal=True, segments=3, seed=13))
        cases.append(dict(id="P4-errors", kind="errors", B=1, H=6, Hkv=3, D=8, n_q=20, layout="contiguous",
                          seed=14, attempts=[[3, "head_parallel=3 must divide the number of ranks (4)"],
                                             [4, "head_parallel=4 must divide the number of query heads H (6)"],
                                             [0, "head_parallel must be a positive integer or 'auto', got 0"]]))
    else:
        cases = cases_for(6, (3,))[::2]  # every other case of the matrix: P = 6 on two cores is slow
        cases.append(dict(id="P6-U6-gqa", U=6, B=1, H=6, Hkv=2, D=8, n_q=40, layout="zigzag", causal=True,
                          segments=2, backward=True, seed=15))
        cases += packed_cases.cases_for(6)  # packed documents at P = 6 (issue 42), routed U = 3 among them
    return cases


HEAD_PARALLEL = CaseLaunches("head_parallel_cases.py", (2, 4, 6), launch_cases, timeout=400)
results = HEAD_PARALLEL.fixture()


@pytest.mark.mpi
@pytest.mark.parametrize("p,case", HEAD_PARALLEL.params())
def test_head_parallel_case(results, p, case):
    ok, msg = results(p)[case["id"]]
    assert ok, msg


# ---------------------------------------------------------------------------- planning, no MPI
@pytest.mark.parametrize("heads,kv_heads,u", [(8, 8, 2), (8, 2, 2), (8, 2, 4), (8, 1, 4), (12, 2, 3),
                                              (6, 2, 3), (6, 3, 2), (12, 4, 6), (4, 4, 4)])
def test_kv_heads_follow_the_query_heads(heads, kv_heads, u):
    hu, group = heads // u, heads // kv_heads
    for index in range(u):
        held = kv_heads_of(index, u, heads, kv_heads)
        assert hu % len(held) == 0
        per = hu // len(held)
        for local in range(hu):  # local query head -> local kv head by the backends' GQA rule
            assert held[local // per] == (index * hu + local) // group
    every = [h for i in range(u) for h in kv_heads_of(i, u, heads, kv_heads)]
    assert set(every) == set(range(kv_heads))
    assert replicated(u, heads, kv_heads) == (len(every) > kv_heads)


def test_groups_stay_on_a_node_when_they_can():
    nodes = [0, 0, 0, 0, 1, 1, 1, 1]
    assert group_members(nodes, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert not spans_nodes(nodes, 4)
    assert spans_nodes(nodes, 8)
    # round-robin placement: a node's ranks are not consecutive
    assert group_members([0, 1, 0, 1], 2) == [[0, 2], [1, 3]]
    assert not spans_nodes([0, 1, 0, 1], 2)
    # U not dividing a node's rank count: consecutive ranks of the communicator
    assert group_members([0, 0, 0, 1, 1, 1], 2) == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("nodes,heads,want", [
    ([0, 0, 1, 1], 8, 2), ([0, 0, 0, 0], 8, 4), ([0, 0, 0, 0], 6, 2), ([0, 1, 2, 3], 8, 1),
    ([0, 0, 0, 1, 1, 1], 6, 3), ([0, 0, 0, 1, 1, 1], 4, 1), ([0] * 8, 12, 4)])
def test_auto_weighs_the_divisors_of_node_and_heads(nodes, heads, want):
    """The U that head_parallel="auto" weighs (the cost model picks among them): every divisor of
    the heads and of each node's rank count, the largest ``want``; each runs, none spans nodes."""
    us = head_parallel_candidates(nodes, heads)
    assert us[0] == 1 and us[-1] == want
    assert all(want % u == 0 for u in us) and [u for u in range(1, want + 1) if want % u == 0] == us
    for u in us:
        assert head_parallel_problem(u, len(nodes), heads) is None
        assert not spans_nodes(nodes, u)


def test_problems_and_settings(monkeypatch):
    assert head_parallel_problem(3, 4, 6) == "head_parallel=3 must divide the number of ranks (4)"
    assert head_parallel_problem(4, 4, 6) == "head_parallel=4 must divide the number of query heads H (6)"
    assert head_parallel_problem(2, 4, 6) is None
    monkeypatch.delenv("RINGMPI_HEAD_PARALLEL", raising=False)
    assert head_parallel_setting(None) == 1
    assert head_parallel_setting(RingContext().head_parallel) == 1
    assert head_parallel_setting("AUTO") == "auto"
    assert head_parallel_setting("3") == 3
    # the environment is read when a context is built (its default), not by the setting itself
    monkeypatch.setenv("RINGMPI_HEAD_PARALLEL", "auto")
    assert head_parallel_setting(None) == 1
    assert head_parallel_setting(RingContext().head_parallel) == "auto"
    assert RingContext(head_parallel=2).head_parallel == 2
    assert head_parallel_setting(2) == 2
    for bad in (0, -1, 1.5, "x", True):
        with pytest.raises(ValueError):
            head_parallel_setting(bad)


# ---------------------------------------------------------------------------- the group all-to-all, in-process
def test_group_exchange_moves_every_part_and_records_it():
    import numpy as np
    from mpi4py import MPI

    from ringmpi.parallel.head_parallel import ExchangeRecord, GroupExchange

    records = []
    parts = [np.arange(12, dtype=np.float32).reshape(3, 4), np.zeros((0, 5)), np.array([7, 8], np.int64)]
    got = GroupExchange(MPI.COMM_SELF, 5, records).exchange(
        "a2a in", [parts], [[((3, 4), np.float32), ((0, 5), np.float64), ((2,), np.int64)]])
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got[0], parts))
    assert len(records) == 1 and isinstance(records[0], ExchangeRecord) and records[0].stage == "a2a in"
    assert records[0].bytes_sent == 0  # its own part never leaves the rank


def test_group_exchange_wait_has_a_deadline():
    import time

    import numpy as np
    from mpi4py import MPI

    from ringmpi.runtime.errors import RingTimeout
    from ringmpi.parallel.head_parallel import GroupExchange

    buf = np.empty(4, dtype=np.uint8)
    never = MPI.COMM_SELF.Irecv([buf, MPI.BYTE], source=0, tag=999)  # no matching send: stays pending
    start = time.perf_counter()
    try:
        with pytest.raises(RingTimeout, match="a2a out all-to-all of the head x ring schedule did not complete"):
            GroupExchange(MPI.COMM_SELF, 0.05, []).wait(never, "a2a out", start, [8], [8])
        assert time.perf_counter() - start < 5
    finally:
        never.Cancel()
        never.Wait()
