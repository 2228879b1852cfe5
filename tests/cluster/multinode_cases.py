"""Rank-side driver for the multi-node tests: cases run across the hosts of the namespace cluster.

    mpirun -n P --host h1:2,h2:2 python tests/cluster/multinode_cases.py CASES.json

Case kinds:

* ``ring`` (default): ``ring_cases.run_case`` (ring forward and backward against the
  float64 reference, the ring's byte counts), then the same call again
  measured: every host's first rank reads its host link's transmitted bytes
  (``/proc/net/dev``, eth0) before and after, and the message reports
  ``link=<bytes all hosts sent> ring=<ring bytes sent to a rank on another host>``
  (the ring's own records and the library's ring order), and whether a
  repeat was bitwise identical.
* ``head_parallel``: ``head_parallel_cases.run_case`` (``case["U"]``, e.g. "auto",
  with ``expect_U``), then a check that the call's stats report the U chosen.
* ``nodes``: the hosts as MPI sees them, and that no ``RINGMPI_NODE_SIZE`` is set.
"""

import json
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "mpi"))  # the drivers it reuses
import head_parallel_cases  # noqa: E402
import ring_cases  # noqa: E402
from case_driver import run_file  # noqa: E402
import ringmpi  # noqa: E402
from ringmpi.parallel.head_parallel import ExchangeRecord  # noqa: E402
from ringmpi.parallel.topology import ring_order  # noqa: E402


def link_tx_bytes(dev="eth0"):
    """Bytes this host's ``dev`` has transmitted (``/proc/net/dev`` shows the caller's network)."""
    with open("/proc/net/dev") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            if name.strip() == dev:
                return int(rest.split()[8])
    return 0


def host_leader(comm):
    """Whether this rank is the lowest rank of its host."""
    names = comm.allgather(MPI.Get_processor_name())
    return names.index(names[comm.Get_rank()]) == comm.Get_rank(), names


def ring_case(comm, case):
    result = ring_cases.run_case(comm, case)  # (ok, msg) on rank 0
    leader, names = host_leader(comm)
    _, _, kw, local = ring_cases.shard_case(comm, case)
    order = ring_order(comm)
    nxt = order[(order.index(comm.Get_rank()) + 1) % comm.Get_size()]
    crosses = names[nxt] != names[comm.Get_rank()]
    digests, ring_bytes, link = [], 0, 0
    for measured in (True, False):
        stats = []
        comm.Barrier()
        before = link_tx_bytes() if leader else 0
        call = ring_cases.with_context(kw, stats=stats)
        o, lse, _ = ringmpi.ring_attention(local["q"], local["k"], local["v"], **call)
        grads = ringmpi.ring_attention_backward(local["do"], local["q"], local["k"], local["v"], (o, lse),
                                                **call)[:3]
        comm.Barrier()
        if measured:
            link = comm.allreduce(link_tx_bytes() - before if leader else 0)
            ring_bytes = comm.allreduce(sum(r.bytes_sent for r in stats) if crosses else 0)
        digests.append(b"".join(np.ascontiguousarray(x).tobytes() for x in (o, lse, *grads)))
    same = comm.allreduce(int(digests[0] == digests[1]), op=MPI.MIN)
    if comm.Get_rank() != 0:
        return None
    ok, msg = result
    return ok, f"{msg} link={link} ring={ring_bytes} bitwise={bool(same)} order={','.join(map(str, order))}"


def head_parallel_case(comm, case):
    """``head_parallel_cases.run_case``; with ``case["links"]`` that is the whole check (auto
    must choose ``case["chosen"]`` on the given link figures), else a second call on the measured
    links whose stats must report one U of ``case["expect_U"]`` on every rank."""
    result = head_parallel_cases.run_case(comm, case)
    if case.get("links"):
        return result
    _, _, kw, local = ring_cases.shard_case(comm, case)
    stats = []
    ringmpi.ring_attention(local["q"], local["k"], local["v"],
                           **ring_cases.with_context(kw, stats=stats, head_parallel=case["U"]))
    chosen = next((r.head_parallel for r in stats if isinstance(r, ExchangeRecord)), 1)
    every = comm.allgather(chosen)
    if comm.Get_rank() != 0:
        return None
    ok, msg = result
    if len(set(every)) != 1 or every[0] not in case["expect_U"]:
        return False, f"stats report U {every}, expected one of {case['expect_U']} on every rank; {msg}"
    return ok, f"{msg}; stats report U={chosen}"


def nodes_case(comm, case):
    names = comm.gather(MPI.Get_processor_name(), root=0)
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
    sizes = comm.gather(shared.Get_size(), root=0)
    shared.Free()
    env = comm.gather("RINGMPI_NODE_SIZE" in os.environ, root=0)
    if comm.Get_rank() != 0:
        return None
    return not any(env), json.dumps({"names": names, "shared_sizes": sizes, "node_size_set": any(env)})


if __name__ == "__main__":
    run_file(MPI.COMM_WORLD, {"head_parallel": head_parallel_case, "nodes": nodes_case}, ring_case)
