"""Rank-side driver: ring attention with a value head dim D_v different from D.

    mpirun -n P python tests/dv_cases.py CASES.json

A case is a ``ring_cases.py`` case with one more key, ``Dv``: ``v`` and ``do``
are ``(B, N, Hkv, Dv)`` and ``(B, N, H, Dv)``; ``q`` and ``k`` keep ``D``.  Every
rank builds the same global inputs from the case's seed, runs
``ring_attention`` and the backward on its shard, counts what travelled the
ring (K and V at their own sizes, dK and dV at theirs), and rank 0 compares
the gathered outputs with the float64 dense reference of ``reference.py``
under the tolerance rule (``ring_cases.check``).  ``kind: "errors"`` cases
check the shape errors of a mismatched ``v``/``o``/``do``.
"""

import json
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ring_cases  # noqa: E402
from case_driver import run_all  # noqa: E402
import ringmpi  # noqa: E402
import ringmpi.dtypes  # noqa: E402
from ringmpi import Layout  # noqa: E402


def make_inputs(case):
    """``ring_cases.make_inputs`` with ``v``, ``do`` drawn ``Dv`` wide (their own stream)."""
    q, k, _, _, seg_q, seg_kv = ring_cases.make_inputs(case)
    rng = np.random.default_rng([case.get("seed", 0), 17])
    b, h, hkv, dv = case["B"], case["H"], case["Hkv"], case["Dv"]
    n_q, n_kv = q.shape[1], k.shape[1]
    cast = lambda x: ringmpi.dtypes.to_dtype(x, q.dtype)  # noqa: E731
    v = cast(rng.standard_normal((b, n_kv, hkv, dv)))
    do = cast(rng.standard_normal((b, n_q, h, dv)))
    return q, k, v, do, seg_q, seg_kv


def run_case(comm, case):
    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, do, seg_q, seg_kv = make_inputs(case)
    lay_q, lay_kv = Layout(case["layout"], q.shape[1], size), Layout(case["layout"], k.shape[1], size)
    window = None if case.get("window") is None else tuple(case["window"])
    kw = dict(comm=comm, layout=case["layout"], causal=case.get("causal", False), window=window,
              softmax_scale=case.get("scale"), backend=ring_cases.BACKEND)
    if seg_q is not None:
        kw.update(segment_ids_q=lay_q.shard(seg_q, rank), segment_ids_kv=lay_kv.shard(seg_kv, rank))
    to_backend, to_host = ring_cases._converters()
    args = [to_backend(lay.shard(x, rank)) for lay, x in ((lay_q, q), (lay_kv, k), (lay_kv, v))]
    fwd_stats, bwd_stats = [], []
    o, lse = ringmpi.ring_attention(*args, stats=fwd_stats, **kw)
    dq, dk, dv = ringmpi.ring_attention_backward(to_backend(lay_q.shard(do, rank)), *args, o, lse,
                                                 stats=bwd_stats, **kw)
    results = {name: to_host(x) for name, x in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv))}
    # K travels D wide and V D_v wide (P-1 hops), dK/dV likewise in the compute dtype (P hops)
    sent = [comm.allreduce(sum(r.bytes_sent for r in st)) for st in (fwd_stats, bwd_stats)]
    meta = 8 * k.shape[1] * (1 + (k.shape[0] if seg_kv is not None else 0))
    kv_bytes = (k.size + v.size) * q.dtype.itemsize + meta
    grad_bytes = (k.size + v.size) * (8 if q.dtype == np.float64 else 4)
    want = [(size - 1) * kv_bytes, (size - 1) * kv_bytes + size * grad_bytes]
    if sent != want:
        results["traffic"] = f"ring bytes sent (forward, backward) {sent}, expected {want}"
    gathered = comm.gather(results, root=0)
    if rank != 0:
        return None
    return ring_cases.check(dict(case, backward=True), gathered, lay_q, lay_kv, q, k, v, do, seg_q, seg_kv,
                            window)


def errors_case(comm, case):
    """Shapes that do not fit together: one ConfigError, the same on every rank."""
    from ringmpi.errors import ConfigError

    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, do, _, _ = make_inputs(case)
    lay = Layout(case["layout"], q.shape[1], size)
    to_backend, _ = ring_cases._converters()
    qs, ks, vs, dos = (to_backend(lay.shard(x, rank)) for x in (q, k, v, do))
    kw = dict(comm=comm, layout=case["layout"], backend=ring_cases.BACKEND)
    o, lse = ringmpi.ring_attention(qs, ks, vs, **kw)
    attempts = {
        "v with other heads": (lambda: ringmpi.ring_attention(qs, ks, vs[:, :, :1], **kw),
                               "k and v must agree on (B, S_kv_local, H_kv)"),
        "do D wide": (lambda: ringmpi.ring_attention_backward(to_backend(lay.shard(q, rank)), qs, ks, vs, o, lse, **kw),
                      "do must have shape (B, S_q_local, H, D_v)"),
        "o D wide": (lambda: ringmpi.ring_attention_backward(dos, qs, ks, vs, to_backend(lay.shard(q, rank)), lse, **kw),
                     "o must have shape (B, S_q_local, H, D_v)"),
    }
    problems = []
    for what, (call, want) in attempts.items():
        try:
            call()
            got = None
        except ConfigError as exc:
            got = str(exc)
        every = comm.allgather(got)
        if got is None or want not in got or len(set(every)) != 1:
            problems.append(f"{what}: wanted one ConfigError containing {want!r}, ranks got {every}")
    return not problems, "; ".join(problems) or f"{len(attempts)} errors raised alike on {size} ranks"


def main():
    comm = MPI.COMM_WORLD
    with open(sys.argv[1]) as fh:
        cases = json.load(fh)
    kinds = {"errors": errors_case}
    run_all(comm, cases, lambda case: kinds.get(case.get("kind"), run_case)(comm, case))


if __name__ == "__main__":
    main()
