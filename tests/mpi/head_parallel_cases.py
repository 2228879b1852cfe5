"""Rank-side driver: the head x ring schedule (``head_parallel=U``) in one mpirun launch.

    mpirun -n P python tests/mpi/head_parallel_cases.py CASES.json

Case kinds:

* (default) ``ring_attention`` and its backward in a context of ``head_parallel=case["U"]``
  against the float64 dense reference of ``reference.py`` under the tolerance
  rule (the checks of ``ring_cases.check``), plus the bytes that travelled:
  all-to-all records and ring records apart, the ring's K/V bytes from the
  group sizes.
  With ``case["links"]`` the cost model takes the given link figures (a fast link inside a
  node, a slow one between) and ``head_parallel="auto"`` must choose as ``case["chosen"]`` says,
  with the prediction and the runner-up's in each pass's first ring record.
* ``bitwise``: ``head_parallel=1``, ``RINGMPI_HEAD_PARALLEL=1`` (read when the context is
  built) and ``"auto"`` with one rank per node give bitwise the flat ring's outputs and gradients.
* ``errors``: unusable choices raise one ConfigError, the same on every rank.
* ``torch``: ``ringmpi.torch.ring_attention`` in a context of ``head_parallel=U``, with autograd.

``case["env"]`` is set in ``os.environ`` on every rank for the case only
(``RINGMPI_NODE_SIZE``, ``RINGMPI_HEAD_PARALLEL``), before the case builds its contexts.
"""

import contextlib
import json
import os
import sys

import numpy as np
from mpi4py import MPI

from case_driver import run_all
import ring_cases
from ring_cases import with_context
import ringmpi
from ringmpi import Layout
from ringmpi.parallel.head_parallel import ExchangeRecord, kv_heads_of
from ringmpi.parallel.topology import group_members, node_ids

BACKEND = ring_cases.BACKEND


@contextlib.contextmanager
def environment(extra):
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update({k: str(v) for k, v in extra.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def want_ring_bytes(comm, case, u, k, has_seg, itemsize, grad_itemsize, backward):
    """Bytes every rank's ring sends, summed over ranks: each of the U rings moves its groups' blocks."""
    size = comm.Get_size()
    groups = group_members(node_ids(comm), u)
    lay_kv = Layout(case["layout"], k.shape[1], size)
    batch, _, kv_heads, dim = k.shape
    fwd = bwd = 0
    for index in range(u):
        hkv = len(kv_heads_of(index, u, case["H"], kv_heads))
        for members in groups:
            rows = int(sum(lay_kv.counts()[m] for m in members))
            kv = 2 * batch * hkv * rows * dim * itemsize + 8 * rows * (1 + (batch if has_seg else 0))
            grad = 2 * batch * hkv * rows * dim * grad_itemsize
            fwd += (len(groups) - 1) * kv
            # (a lone group's dK/dV are finished where they are computed: no hop)
            bwd += (len(groups) - 1) * kv + (len(groups) * grad if len(groups) > 1 else 0)
    return [fwd, bwd if backward else 0]


def run_case(comm, case):
    """A case on ``comm``; with ``case["links"]`` (``[[latency, bandwidth] inside a node, [...]
    between nodes]``) on a duplicate whose link figures the cost model takes as given
    (``cost_measure.assume_links``), so that ``head_parallel="auto"`` chooses as on that machine."""
    if not case.get("links"):
        return _run_case(comm, case)
    from ringmpi.core.cost_model import Link
    from ringmpi.parallel.cost_measure import assume_links

    sub = comm.Dup()
    try:
        assume_links(sub, *(Link(*figures) for figures in case["links"]))
        return _run_case(sub, case)
    finally:
        sub.Free()


def _chosen_problem(case, fwd_stats, bwd_stats):
    """What is wrong with the choice auto stamped on each pass's first ring record, or None:
    one per pass, one of ``case["chosen"]``, the schedule that ran, its runner-up slower."""
    firsts = [r for st in (fwd_stats, bwd_stats) for r in st
              if not isinstance(r, ExchangeRecord) and r.predicted_s is not None]
    ran = {r.schedule for st in (fwd_stats, bwd_stats) for r in st if not isinstance(r, ExchangeRecord)}
    got = [(r.chosen, r.predicted_s, r.runner_up, r.runner_up_s) for r in firsts]
    if len(firsts) != (2 if case.get("backward") else 1) or \
            any(r.chosen not in case["chosen"] or not r.runner_up or r.runner_up_s < r.predicted_s for r in firsts):
        return f"auto's records {got}, expected one per pass choosing one of {case['chosen']}"
    if any(not r.chosen.startswith(f"head x {r.schedule}") for r in firsts) or len(ran) != 1:
        return f"auto chose {got} but the ring records name {sorted(ran)}"
    return None


def _run_case(comm, case):
    rank = comm.Get_rank()
    (q, k, v, do, seg_q, seg_kv, window), (lay_q, lay_kv), kw, local = ring_cases.shard_case(comm, case)
    to_backend, to_host = ring_cases.converters(case.get("bits", False))
    u = case["U"]  # None: the context's default, RINGMPI_HEAD_PARALLEL (case["env"])
    kw = with_context(kw, head_parallel=u, **({"dtype": "bfloat16"} if case.get("bits") else {}),
                      **({"schedule": case["schedule"]} if case.get("schedule") else {}))
    args = [to_backend(local[n]) for n in ("q", "k", "v")]
    fwd_stats, bwd_stats = [], []
    o, lse, _ = ringmpi.ring_attention(*args, **with_context(kw, stats=fwd_stats))
    results = {"o": to_host(o), "lse": to_host(lse)}
    returned = [o]
    if case.get("backward"):
        dq, dk, dv, _ = ringmpi.ring_attention_backward(to_backend(local["do"]), *args, (o, lse),
                                                        **with_context(kw, stats=bwd_stats))
        grads = (dq, dk, dv)
        results.update(zip(("dq", "dk", "dv"), (to_host(g) for g in grads)))
        returned += list(grads)
    if case.get("bits") and any(str(x.dtype) != "uint16" for x in returned):
        results["not_bits"] = [str(x.dtype) for x in returned]
    ring_sent = [comm.allreduce(sum(r.bytes_sent for r in st if not isinstance(r, ExchangeRecord)))
                 for st in (fwd_stats, bwd_stats)]
    exchanges = [sum(isinstance(r, ExchangeRecord) for r in st) for st in (fwd_stats, bwd_stats)]
    u_int = u if isinstance(u, int) else case.get("expect_U")
    u_pass = [u_int, u_int]  # the U each pass ran (forward, backward)
    if isinstance(u_int, list):  # auto on measured links: any of these, the one each pass ran
        # (each call chooses by its own predicted cost: the backward's may differ from the forward's)
        u_pass = [next((r.head_parallel for r in st if isinstance(r, ExchangeRecord)), 1)
                  for st in (fwd_stats, bwd_stats)]
        for name, ran_u in zip(("forward", "backward"), u_pass[:2 if case.get("backward") else 1]):
            if ran_u not in u_int:
                results["traffic"] = f"auto ran U={ran_u} in the {name}, expected one of {u_int}"
    if case.get("chosen"):
        problem = comm.allgather(_chosen_problem(case, fwd_stats, bwd_stats))
        if any(problem):
            results["traffic"] = next(p for p in problem if p)
        ran = {r.schedule for r in fwd_stats if not isinstance(r, ExchangeRecord)}
        u_pass = u_pass if ran == {"ring"} else [None, None]  # the byte counts below are the ring's
    ring_steps = sum(not isinstance(r, ExchangeRecord) for r in fwd_stats)
    if u_pass[0] is not None and ring_steps != comm.Get_size() // u_pass[0]:
        results["traffic"] = f"{ring_steps} forward ring steps, expected P/U = {comm.Get_size() // u_pass[0]}"
    if u_pass[0] is not None:
        dtype = ring_cases.dtype_of(case)
        want = [want_ring_bytes(comm, case, u_p, k, seg_kv is not None, dtype.itemsize,
                                8 if dtype == np.float64 else 4, case.get("backward"))[i]
                for i, u_p in enumerate(u_pass)]
        if ring_sent != want and "traffic" not in results:
            results["traffic"] = f"ring bytes sent (forward, backward) {ring_sent}, expected {want}"
        want_exchanges = [2 if u_pass[0] > 1 else 0, 2 if case.get("backward") and u_pass[1] > 1 else 0]
        if exchanges != want_exchanges:
            results["traffic"] = f"all-to-all records (forward, backward) {exchanges}, expected {want_exchanges}"
    gathered = comm.gather(results, root=0)
    if rank != 0:
        return None
    ok, msg = ring_cases.check(case, gathered, lay_q, lay_kv, q, k, v, do, seg_q, seg_kv, window)
    return ok, f"U={u}: {msg}"


def bitwise_case(comm, case):
    """U = 1 in every spelling is the flat ring, bitwise (outputs and gradients)."""
    _, _, kw, local = ring_cases.shard_case(comm, case)
    args = [local[n] for n in ("q", "k", "v")]

    def both(**extra):
        """Forward and backward in the case's context with ``extra`` (a context built here, so
        that it reads the environment of the moment for what ``extra`` leaves None)."""
        call = with_context(kw, **extra)
        o, lse, _ = ringmpi.ring_attention(*args, **call)
        dq, dk, dv, _ = ringmpi.ring_attention_backward(local["do"], *args, (o, lse), **call)
        return [o, lse, dq, dk, dv]

    flat = both()
    spellings = {"head_parallel=1": dict(head_parallel=1)}
    runs = {name: both(**extra) for name, extra in spellings.items()}
    with environment({"RINGMPI_HEAD_PARALLEL": "1"}):
        runs["RINGMPI_HEAD_PARALLEL=1"] = both(head_parallel=None)
    with environment({"RINGMPI_NODE_SIZE": "1"}):
        runs["auto, one rank per node"] = both(head_parallel="auto")
    bad = [name for name, got in runs.items()
           if not all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(flat, got))]
    bad = sorted(set(sum(comm.allgather(bad), [])))
    return not bad, ("not bitwise equal to the flat ring: " + ", ".join(bad)) if bad else \
        f"{len(runs)} spellings of U=1 bitwise equal to the flat ring"


def errors_case(comm, case):
    """Unusable choices: one ConfigError, the same on every rank, before any data moves."""
    from ringmpi.runtime.errors import ConfigError

    _, _, kw, local = ring_cases.shard_case(comm, case)
    args = [local[n] for n in ("q", "k", "v")]
    size, heads = comm.Get_size(), case["H"]
    attempts = [(dict(head_parallel=u), want, {}) for u, want in case["attempts"]]
    # head_parallel=None: the context, built under the environment, reads RINGMPI_HEAD_PARALLEL
    attempts.append((dict(head_parallel=None), "head_parallel must be a positive integer or 'auto', got 'two'",
                     {"RINGMPI_HEAD_PARALLEL": "two"}))
    attempts.append((dict(head_parallel="auto"), "RINGMPI_NODE_SIZE must be a positive integer",
                     {"RINGMPI_NODE_SIZE": "0"}))
    problems = []
    for extra, want, env in attempts:
        for call in ("forward", "backward"):
            got = None
            with environment(env):
                try:
                    if call == "forward":
                        ringmpi.ring_attention(*args, **with_context(kw, **extra))
                    else:
                        ringmpi.ring_attention_backward(local["do"], *args,
                                                        (local["q"], np.zeros((1, heads, args[0].shape[1]),
                                                                              np.float32)),
                                                        **with_context(kw, **extra))
                except ConfigError as exc:
                    got = str(exc)
            every = comm.allgather(got)
            if got is None or want not in got or len(set(every)) != 1:
                problems.append(f"{call} {env or extra}: wanted one ConfigError containing {want!r}, "
                                f"ranks got {every}")
    return not problems, "; ".join(problems) or f"{2 * len(attempts)} errors raised alike on {size} ranks"


def torch_case(comm, case):
    """``ringmpi.torch.ring_attention`` with ``head_parallel=U``: forward and autograd backward on CPU
    tensors against the float64 reference (``torch_cases.attn_case``)."""
    import torch
    import torch_cases
    import ringmpi.parallel.head_parallel as two_level

    calls = []
    real = {name: getattr(two_level, name) for name in ("forward", "backward")}

    def spy(name):
        def call(*args, **kwargs):
            calls.append(name)
            return real[name](*args, **kwargs)
        return call
    try:
        for name in real:
            setattr(two_level, name, spy(name))
        result = torch_cases.attn_case(comm, case, torch.device("cpu"))
    finally:
        for name, fn in real.items():
            setattr(two_level, name, fn)
    if result is None:
        return None
    ok, msg = result
    if calls != ["forward", "backward"]:
        return False, f"the head x ring schedule ran {calls}, expected forward then backward; {msg}"
    return ok, msg


def main():
    comm = MPI.COMM_WORLD
    with open(sys.argv[1]) as fh:
        cases = json.load(fh)
    kinds = {"bitwise": bitwise_case, "errors": errors_case, "torch": torch_case, "packed": ring_cases.packed_case}

    def call(case):
        with environment(case.get("env", {})):
            return kinds.get(case.get("kind"), run_case)(comm, case)
    run_all(comm, cases, call)


if __name__ == "__main__":
    main()
