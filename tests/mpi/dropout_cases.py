"""Rank-side driver for dropout: many cases in one mpirun launch.

    mpirun -n P python tests/mpi/dropout_cases.py CASES.json

Kinds (``case["kind"]``):

* ``ref`` (default): ring forward and backward with ``dropout_p``/``dropout_seed``
  against the float64 dense reference with the same keep matrix
  (``reference.dropout_factors``, drawn from Philox directly), under the
  tolerance rule; with ``save`` the gathered global results go to the .npz of that name
  beside the cases file, so the test can compare runs across world sizes and layouts.
* ``fd``: float64 finite differences of ``sum(o * do)`` along random
  directions against the ring backward, the mask fixed by the seed.
* ``errors``: bad dropout arguments give one ConfigError, the same on every rank.
* ``torch``: ``ringmpi.torch.ring_attention`` with dropout, forward and autograd
  backward, bitwise equal to the library calls.
"""

import os
import sys

import numpy as np
from mpi4py import MPI

from case_driver import agreed_error, run_file
import reference
from finite_differences import ring_fd_worst
from ring_cases import BACKEND, converters, make_inputs, window_of
import ringmpi
from ringmpi import Layout


def _setup(comm, case):
    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, do, seg_q, seg_kv = make_inputs(case)
    lay_q, lay_kv = Layout(case["layout"], q.shape[1], size), Layout(case["layout"], k.shape[1], size)
    window = window_of(case)
    kw = dict(causal=case.get("causal", False), window=window, dropout_p=case["p"],
              dropout_seed=case["dropout_seed"],
              context=ringmpi.RingContext(comm=comm, layout=case["layout"], backend=BACKEND))
    if seg_q is not None:
        kw.update(segment_ids=(lay_q.shard(seg_q, rank), lay_kv.shard(seg_kv, rank)))
    return (q, k, v, do, seg_q, seg_kv), (lay_q, lay_kv), window, kw


def ref_case(comm, case):
    rank = comm.Get_rank()
    (q, k, v, do, seg_q, seg_kv), (lay_q, lay_kv), window, kw = _setup(comm, case)
    to_backend, to_host = converters()
    args = [to_backend(lay.shard(x, rank)) for lay, x in ((lay_q, q), (lay_kv, k), (lay_kv, v))]
    o, lse, _ = ringmpi.ring_attention(*args, **kw)
    dq, dk, dv, _ = ringmpi.ring_attention_backward(to_backend(lay_q.shard(do, rank)), *args, (o, lse), **kw)
    mine = [to_host(x) for x in (o, lse, dq, dk, dv)]
    gathered = comm.gather(mine, root=0)
    if rank != 0:
        return None
    names = ("o", "lse", "dq", "dk", "dv")
    axes = (1, 2, 1, 1, 1)
    lays = (lay_q, lay_q, lay_q, lay_kv, lay_kv)
    ours = {n: lay.unshard([g[i] for g in gathered], axis=ax)
            for i, (n, ax, lay) in enumerate(zip(names, axes, lays))}
    if case.get("save"):
        np.savez(os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), case["save"]), **ours)
    scale = 1.0 / np.sqrt(q.shape[3])
    vis = reference.visible(q.shape[1], k.shape[1], case.get("causal", False), window, seg_q, seg_kv)
    drop = reference.dropout_factors(case["dropout_seed"], case["p"], q.shape[0], q.shape[2],
                                     q.shape[1], k.shape[1])
    refs = reference.dense_forward(q, k, v, vis, scale, np.float64, drop=drop) + \
        reference.dense_backward(do, q, k, v, vis, scale, np.float64, drop=drop)
    naives = reference.dense_forward(q, k, v, vis, scale, q.dtype, drop=drop) + \
        reference.dense_backward(do, q, k, v, vis, scale, q.dtype, drop=drop)
    ok, messages = True, []
    for i, n in enumerate(names):
        good, msg = reference.tolerance_check(n, ours[n], refs[i], naives[i], gradient=i >= 2)
        ok &= good
        messages.append(msg)
    # dropout must change something (else the comparison above proves nothing about it)
    plain = reference.dense_forward(q, k, v, vis, scale, np.float64)[0]
    if reference.max_err(ours["o"], plain) < 1e-3:
        ok = False
        messages.append("o equals the no-dropout output")
    return ok, "; ".join(messages)


def fd_case(comm, case):
    case = dict(case, dtype="float64")
    (q, k, v, do, _, _), (lay_q, lay_kv), _, kw = _setup(comm, case)
    worst = ring_fd_worst(comm, lay_q, lay_kv, q, k, v, do, kw, converters(), np.random.default_rng(7),
                          probes=3, eps=1e-5, directions=True)
    return worst < 1e-7, f"finite-difference worst relative error {worst:.3g}"


def torch_case(comm, case):
    """ringmpi.torch with dropout: autograd gives the library's forward and backward, bitwise."""
    import torch

    import ringmpi.torch as rt

    rank = comm.Get_rank()
    case = dict(case, dtype="float64")
    (q, k, v, do, _, _), (lay_q, lay_kv), _, kw = _setup(comm, case)
    local = [lay.shard(x, rank) for lay, x in ((lay_q, q), (lay_kv, k), (lay_kv, v))]
    o, lse, _ = ringmpi.ring_attention(*local, **kw)
    want = (o,) + tuple(ringmpi.ring_attention_backward(lay_q.shard(do, rank), *local, (o, lse), **kw)[:3])
    tensors = [torch.tensor(x, requires_grad=True) for x in local]
    kw["context"] = kw["context"].replace(backend="auto")  # the tensors' device
    out = rt.ring_attention(*tensors, **kw).o
    out.backward(torch.tensor(lay_q.shard(do, rank)))
    got = [out.detach().numpy()] + [t.grad.numpy() for t in tensors]
    same = all(np.array_equal(a, b) for a, b in zip(got, want))
    return comm.allreduce(int(same), op=MPI.MIN) == 1, "torch forward/backward bitwise equal to the library's"


def errors_case(comm, case):
    """Bad dropout arguments: one ConfigError, the same on every rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, _, _, _ = make_inputs(case)
    lay = Layout(case["layout"], q.shape[1], size)
    to_backend, _ = converters()
    args = [to_backend(lay.shard(x, rank)) for x in (q, k, v)]
    attempts = {
        "p = 1": (dict(dropout_p=1.0, dropout_seed=1), "dropout_p must be in [0, 1)"),
        "p < 0": (dict(dropout_p=-0.1, dropout_seed=1), "dropout_p must be in [0, 1)"),
        "no seed": (dict(dropout_p=0.5), "needs a dropout_seed"),
        "negative seed": (dict(dropout_p=0.5, dropout_seed=-1), "dropout_seed must be in [0, 2^64)"),
        "float seed": (dict(dropout_p=0.5, dropout_seed=1.5), "dropout_seed must be an int"),
        "seeds differ": (dict(dropout_p=0.5, dropout_seed=rank), "ranks disagree on (dropout_p, dropout_seed"),
    }
    problems = []
    for what, (extra, want) in attempts.items():
        if what == "seeds differ" and size == 1:
            continue
        problem = agreed_error(comm, lambda: ringmpi.ring_attention(
            *args, context=ringmpi.RingContext(comm=comm, layout=case["layout"], backend=BACKEND), **extra), want)
        if problem:
            problems.append(f"{what}: {problem}")
    return not problems, "; ".join(problems) or f"{len(attempts)} errors raised alike on {size} ranks"


def main():
    run_file(MPI.COMM_WORLD, {"fd": fd_case, "errors": errors_case, "torch": torch_case}, ref_case)


if __name__ == "__main__":
    main()
