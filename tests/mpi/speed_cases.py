"""Rank-side driver for the backward's gradient channels: many cases in one mpirun launch.

    mpirun -n P python tests/mpi/speed_cases.py CASES.json

Each case runs ``ring_attention_backward`` on the same shards twice: as the library
runs it in host memory (``HostGradChannel``: two dK/dV buffers, the partial sums
received into them in pieces, added to in place, each piece sent on once final) and
with the whole-message channel of device memory (``GradChannel``: three buffers,
forced by ``schedule.HOST_GRADS_IN_PLACE = False``).  On every rank: both agree with
the float64 dense reference under the tolerance rule and with each other bitwise, the
pieces were asked for and reported by the block op, a repeat gives the same bits and
nothing outlives a call; in a
``memory`` case the in-place run's tracemalloc peak is about one dK/dV buffer lower (less
the block op's key tile of scratch).
Rank 0 prints one ``CASE <json>`` line per case (``case_driver.run_all``).
"""

import gc
import json
import sys
import tracemalloc

import numpy as np
from mpi4py import MPI

from case_driver import run_all
import reference
from random_inputs import attention_inputs
import ringmpi
from ringmpi import Layout
from ringmpi.parallel import channels
from ringmpi.parallel import ring_schedule as schedule_mod
from ringmpi.backends import numpy_backend


def _backward_peak(call):
    """``(result, tracemalloc peak bytes)`` of ``call()``."""
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def run_case(comm, case):
    rank, size = comm.Get_rank(), comm.Get_size()
    b, n = case["B"], case["N"]
    q_all, k_all, v_all, do_all = attention_inputs(case["seed"], b, n, case["H"], case["Hkv"], case["D"],
                                                   dtype=np.float32)
    seg = None  # contiguous runs of ids: documents
    if case.get("segments"):
        seg = np.broadcast_to(np.arange(n) * case["segments"] // n, (b, n)).astype(np.int64).copy()
    lay = Layout(case["layout"], q_all.shape[1], size)
    kw = dict(causal=case["causal"], context=ringmpi.RingContext(comm=comm, layout=case["layout"], backend="numpy"))
    if seg is not None:
        kw.update(segment_ids=lay.shard(seg, rank))
    q, k, v, do = (lay.shard(x, rank) for x in (q_all, k_all, v_all, do_all))
    out = ringmpi.ring_attention(q, k, v, **kw)

    def backward():
        return ringmpi.ring_attention_backward(do, q, k, v, out, **kw)

    calls = {"kv_need": 0, "kv_done": 0}
    originals = {name: getattr(channels.HostGradChannel, name) for name in calls}

    def counting(name):
        def hook(self, n):
            calls[name] += 1
            return originals[name](self, n)
        return hook

    backward()  # the first call's one-time allocations (imports, caches) are in neither peak
    schedule_mod.HOST_GRADS_IN_PLACE = False
    try:
        backward()
    finally:
        schedule_mod.HOST_GRADS_IN_PLACE = True
    for name in calls:
        setattr(channels.HostGradChannel, name, counting(name))
    try:
        in_place, peak_in_place = _backward_peak(backward)
    finally:
        for name, fn in originals.items():
            setattr(channels.HostGradChannel, name, fn)
    schedule_mod.HOST_GRADS_IN_PLACE = False
    try:
        whole, peak_whole = _backward_peak(backward)
    finally:
        schedule_mod.HOST_GRADS_IN_PLACE = True
    problems = []
    if size > 1 and not (calls["kv_need"] and calls["kv_done"]):
        problems.append(f"rank {rank}: the block op never asked for or reported rows ({calls})")
    # one dK/dV buffer of the largest block, in float32, less the block op's key tile of scratch
    rows = int(max(lay.counts()))
    buffer = 4 * case["B"] * case["Hkv"] * rows * 2 * case["D"]
    saved = buffer * (1 - min(rows, numpy_backend.TILE_KV) / rows)
    # (a memory case: blocks large enough that the pieces' Python objects, O(B H_kv) and
    # some 30 KB here, are small beside a buffer)
    if case.get("memory") and size > 1 and peak_in_place > peak_whole - 0.75 * saved:
        problems.append(f"rank {rank}: in place peaked at {peak_in_place} bytes, whole messages at "
                        f"{peak_whole}: not a dK/dV buffer less its key tile ({saved:.0f} bytes) less")
    vis = reference.visible(q_all.shape[1], k_all.shape[1], causal=case["causal"], seg_q=seg, seg_kv=seg)
    scale = 1.0 / np.sqrt(case["D"])
    refs = reference.dense_backward(do_all, q_all, k_all, v_all, vis, scale, np.float64)
    naives = reference.dense_backward(do_all, q_all, k_all, v_all, vis, scale, np.float32)
    for label, grads in (("in place", in_place), ("whole messages", whole)):
        for i, name in enumerate(("dq", "dk", "dv")):
            ok, msg = reference.tolerance_check(name, grads[i], lay.shard(refs[i], rank),
                                                lay.shard(naives[i], rank), gradient=True)
            if not ok:
                problems.append(f"rank {rank}, {label}: {msg}")
    again = backward()
    for name, a, b, c in zip(("dq", "dk", "dv"), in_place, again, whole):
        if not np.array_equal(a, b, equal_nan=True):
            problems.append(f"rank {rank}: {name} differs on repeat")
        if not np.array_equal(a, c, equal_nan=True):
            problems.append(f"rank {rank}: {name} in place differs from whole messages "
                            f"(max {np.nanmax(np.abs(a.astype(np.float64) - c)):.3g})")
    # nothing of a call outlives it (no reference cycle through the channel's callbacks)
    gc.disable()
    try:
        tracemalloc.start()
        backward()
        first = tracemalloc.get_traced_memory()[0]
        for _ in range(2):
            backward()
        grown = tracemalloc.get_traced_memory()[0] - first
        tracemalloc.stop()
    finally:
        gc.enable()
    if grown > 8 * 1024:  # a kept call holds its ring buffers: > 14 KB for every case here
        problems.append(f"rank {rank}: two more backward calls left {grown} bytes allocated")
    problems = sum(comm.allgather(problems), [])
    return (not problems), "; ".join(problems) or "in place is bitwise whole messages; both meet the reference"


def main():
    comm = MPI.COMM_WORLD
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    run_all(comm, cases, lambda case: run_case(comm, case))


if __name__ == "__main__":
    main()
