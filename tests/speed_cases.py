"""Rank-side driver for the speed paths of issue 15: many cases in one mpirun launch.

    mpirun -n P python tests/speed_cases.py CASES.json

Each case runs ``ring_attention_backward`` twice on the same shards: as the
library runs it (the last hop of dK/dV sent home in pieces while the last
step computes) and with the pieces switched off (the whole sums sent after
the last step, as before), and checks on every rank that ``dq, dk, dv`` are
bitwise equal and that the pieces were used.  Rank 0 prints one
``CASE <json>`` line per case (``case_driver.run_all``).
"""

import gc
import json
import os
import sys
import tracemalloc

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from case_driver import run_all  # noqa: E402
import ringmpi  # noqa: E402
from ringmpi import Layout  # noqa: E402
from ringmpi import schedule as schedule_mod  # noqa: E402


def _inputs(case):
    rng = np.random.default_rng(case["seed"])
    b, n, h, hkv, d = case["B"], case["N"], case["H"], case["Hkv"], case["D"]
    q, do = rng.standard_normal((2, b, n, h, d)).astype(np.float32)
    k, v = rng.standard_normal((2, b, n, hkv, d)).astype(np.float32)
    seg = None
    if case.get("segments"):
        seg = np.broadcast_to(np.arange(n) * case["segments"] // n, (b, n)).astype(np.int64).copy()
    return q, k, v, do, seg


def run_case(comm, case):
    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, do, seg = _inputs(case)
    lay = Layout(case["layout"], q.shape[1], size)
    kw = dict(comm=comm, layout=case["layout"], causal=case["causal"], backend="numpy")
    if seg is not None:
        kw.update(segment_ids_q=lay.shard(seg, rank), segment_ids_kv=lay.shard(seg, rank))
    q, k, v, do = (lay.shard(x, rank) for x in (q, k, v, do))
    o, lse = ringmpi.ring_attention(q, k, v, **kw)

    calls = []
    original = schedule_mod.GradChannel.last_step

    def counting(self, *args):
        calls.append(args[0])
        return original(self, *args)

    schedule_mod.GradChannel.last_step = counting
    try:
        pieces = ringmpi.ring_attention_backward(do, q, k, v, o, lse, **kw)
    finally:
        schedule_mod.GradChannel.last_step = original
    whole_hop = schedule_mod.GradChannel.sends_in_pieces
    schedule_mod.GradChannel.sends_in_pieces = lambda self, step: False
    try:
        whole = ringmpi.ring_attention_backward(do, q, k, v, o, lse, **kw)
    finally:
        schedule_mod.GradChannel.sends_in_pieces = whole_hop
    problems = []
    if size > 1 and calls != [size - 1]:
        problems.append(f"rank {rank}: the last hop went in pieces at steps {calls}, expected [{size - 1}]")
    for name, a, b in zip(("dq", "dk", "dv"), pieces, whole):
        if not np.array_equal(a, b, equal_nan=True):
            problems.append(f"rank {rank}: {name} differs from the whole-hop run "
                            f"(max {np.nanmax(np.abs(a.astype(np.float64) - b)):.3g})")
    # nothing of a call outlives it (no reference cycle through the last step's callback)
    gc.disable()
    try:
        tracemalloc.start()
        ringmpi.ring_attention_backward(do, q, k, v, o, lse, **kw)
        first = tracemalloc.get_traced_memory()[0]
        for _ in range(2):
            ringmpi.ring_attention_backward(do, q, k, v, o, lse, **kw)
        grown = tracemalloc.get_traced_memory()[0] - first
        tracemalloc.stop()
    finally:
        gc.enable()
    if grown > 8 * 1024:  # a kept call holds its ring buffers: > 14 KB for every case here
        problems.append(f"rank {rank}: two more backward calls left {grown} bytes allocated")
    problems = sum(comm.allgather(problems), [])
    return (not problems), "; ".join(problems) or "bitwise equal"


def main():
    comm = MPI.COMM_WORLD
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    run_all(comm, cases, lambda case: run_case(comm, case))


if __name__ == "__main__":
    main()
