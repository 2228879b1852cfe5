"""Rank-side job for the failure tests: ring attention under abort_on_error.

    mpirun -n P python tests/mpi/fault_job.py [--timeout S | --default-timeout S] [--backward] [--repeat K] [--packed]

Faults come from ``RINGMPI_FAULT`` (see ``ringmpi.runtime.faults.fault_point``).  With
``--packed`` the tokens are a pack of documents on the balanced layout and K/V move by
the routed schedule (issue 42).  With ``--repeat K`` rank 0 checks that K runs give bitwise-identical results and
prints ``IDENTICAL`` or ``DIFFERENT``.
"""

import argparse

import numpy as np
from mpi4py import MPI

import ringmpi
from ringmpi import Layout


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--default-timeout", type=float, default=None,
                        help="watchdog.set_default (what ringmpi run --timeout sets) instead of timeout=")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--n", type=int, default=301)
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--schedule", default=None)
    args = parser.parse_args()
    if args.default_timeout is not None:
        from ringmpi.runtime import watchdog
        watchdog.set_default(args.default_timeout)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(7)
    q, k, v, do = (rng.standard_normal((2, args.n, 4, 32)).astype(np.float32) for _ in range(4))
    lay = Layout("zigzag", args.n, size)
    run = dict(comm=comm, layout="zigzag", timeout=args.timeout, backend="numpy", schedule=args.schedule)
    kw = dict(causal=True)
    if args.packed:  # a long document over every rank and short ones: every rank reads from others
        docs = [args.n // 2] + [10] * ((args.n - args.n // 2) // 10)
        docs[-1] += args.n - sum(docs)
        lay = Layout("balanced", args.n, size, documents=docs, causal=True)
        run.update(layout=lay, schedule="routed")
        kw.update(segment_ids=lay.segment_ids(rank, 2))
    kw["context"] = ringmpi.RingContext(**run)
    local = [lay.shard(x, rank) for x in (q, k, v, do)]
    digests = []
    with ringmpi.abort_on_error():
        for _ in range(args.repeat):
            o, lse, _ = ringmpi.ring_attention(*local[:3], **kw)
            outs = [o, lse]
            if args.backward:
                outs += ringmpi.ring_attention_backward(local[3], *local[:3], (o, lse), **kw)[:3]
            digests.append(b"".join(np.ascontiguousarray(x).tobytes() for x in outs))
    same = comm.gather(all(d == digests[0] for d in digests), root=0)
    if rank == 0:
        print("IDENTICAL" if all(same) else "DIFFERENT", flush=True)


if __name__ == "__main__":
    main()
