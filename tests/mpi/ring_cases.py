"""Rank-side driver: run many ring-attention cases in one mpirun launch.

    mpirun -n P python tests/mpi/ring_cases.py CASES.json

Every rank builds the same global inputs from the case's seed, runs
``ring_attention`` (and the backward) on its own shard, and rank 0 gathers
the shards, compares them with the float64 dense reference of
``reference.py`` under the tolerance rule of docs/design.md, and prints one line per
case: ``CASE <json>``.  The backend comes from ``RINGMPI_TEST_BACKEND``
(default numpy).
"""

import os

import numpy as np
from mpi4py import MPI

from case_driver import agreed_error, run_file
import reference
from finite_differences import ring_fd_worst
from random_inputs import attention_inputs
import ringmpi
import ringmpi.core.dtypes
from ringmpi import Layout
from ringmpi.core import masks

BACKEND = os.environ.get("RINGMPI_TEST_BACKEND", "numpy")


def dtype_of(case):
    """The case's dtype; "bfloat16" is ml_dtypes.bfloat16."""
    name = case.get("dtype", "float32")
    return reference.BFLOAT16 if name == "bfloat16" else np.dtype(name)


def make_inputs(case):
    rng = np.random.default_rng(case.get("seed", 0))
    b, h, hkv, d = case["B"], case["H"], case["Hkv"], case["D"]
    n_q, n_kv = case["n_q"], case.get("n_kv", case["n_q"])
    dtype = dtype_of(case)
    q, k, v, do = attention_inputs(rng, b, n_q, h, hkv, d, n_kv=n_kv)
    q = q * case.get("q_scale", 1.0) + case.get("q_offset", 0.0)
    k = k * case.get("k_scale", 1.0)
    seg_q = seg_kv = None
    if case.get("segments"):
        # packed documents with boundaries at random places: documents cross shard boundaries
        nseg = case["segments"]
        cuts_q = np.sort(rng.choice(np.arange(1, n_q), size=min(nseg - 1, n_q - 1), replace=False)) if n_q > 1 else []
        seg_q = np.broadcast_to(np.searchsorted(cuts_q, np.arange(n_q), side="right"), (b, n_q)).copy()
        if n_kv == n_q:
            seg_kv = seg_q.copy()
        else:
            cuts_kv = np.sort(rng.choice(np.arange(1, n_kv), size=min(nseg - 1, n_kv - 1), replace=False)) if n_kv > 1 else []
            seg_kv = np.broadcast_to(np.searchsorted(cuts_kv, np.arange(n_kv), side="right"), (b, n_kv)).copy()
        if b > 1:  # a different packing per batch entry
            seg_q[1:] = (seg_q[1:] + 1) // 2
            seg_kv[1:] = (seg_kv[1:] + 1) // 2
    cast = lambda x: ringmpi.core.dtypes.to_dtype(x, dtype)  # noqa: E731  (bfloat16 rounded once)
    return cast(q), cast(k), cast(v), cast(do), seg_q, seg_kv


def ring_traffic(size, kv_bytes, grad_bytes, backward=True):
    """``[forward, backward]`` bytes one rank's ring sends: P - 1 K/V hops, then P dK/dV
    hops (none for a lone rank: its sums are finished where they are computed)."""
    return [(size - 1) * kv_bytes,
            ((size - 1) * kv_bytes + (size * grad_bytes if size > 1 else 0)) if backward else 0]


class Assignment:
    """Tokens placed on ranks by explicit positions (``ring_attention(positions=(pos_q, pos_kv))``):
    the tests' stand-in for a Layout, with its ``n``, ``indices``, ``shard`` and ``unshard``."""

    def __init__(self, parts):
        self.parts = [np.asarray(part, dtype=np.int64) for part in parts]
        self.n = sum(len(part) for part in self.parts)

    def indices(self, rank):
        return self.parts[rank]

    def shard(self, x, rank, axis=1):
        if hasattr(x, "index_select"):  # a torch tensor
            import torch
            return x.index_select(axis, torch.from_numpy(self.parts[rank]))
        return x.take(self.parts[rank], axis=axis)

    def unshard(self, shards, axis=1):
        shape = list(shards[0].shape)
        shape[axis] = self.n
        out = np.empty(shape, dtype=shards[0].dtype)
        for part, x in zip(self.parts, shards):
            sl = [slice(None)] * out.ndim
            sl[axis] = part
            out[tuple(sl)] = x
        return out


def split_tokens(rng, order, size):
    """``order`` cut into ``size`` non-empty pieces at random places."""
    cuts = np.sort(rng.choice(np.arange(1, len(order)), size=size - 1, replace=False))
    return np.split(order, cuts)


def _documents(seg, size):
    """Whole documents of ``seg (N,)`` on ranks: largest first onto the least-loaded rank."""
    docs = [np.flatnonzero(seg == s) for s in np.unique(seg)]
    parts = [[] for _ in range(size)]
    for doc in sorted(docs, key=len, reverse=True):
        min(parts, key=lambda part: sum(map(len, part))).append(doc)
    return [np.concatenate(part) if part else np.zeros(0, np.int64) for part in parts]


def placements(case, n_q, n_kv, size, seg_q=None):
    """``(lay_q, lay_kv)``: the case's layout, or with ``positions`` an :class:`Assignment`:
    ``"permutation"`` (a random permutation cut at random places, per sequence) or
    ``"documents"`` (batch entry 0's documents whole on ranks, in a rank order of their own) or
    ``"balanced"`` (the balanced Layout of batch entry 0's documents, passed as the layout)."""
    kind = case.get("positions")
    if kind is None:
        return Layout(case["layout"], n_q, size), Layout(case["layout"], n_kv, size)
    if kind == "balanced":  # the balanced Layout of batch entry 0's documents (issue 42)
        cut = np.flatnonzero(np.diff(seg_q[0]) != 0) + 1
        docs = np.diff(np.concatenate([[0], cut, [n_q]])).tolist()
        lay = Layout("balanced", n_q, size, documents=docs, causal=case.get("causal", False),
                     window=window_of(case))
        return lay, lay
    rng = np.random.default_rng(case.get("seed", 0) + 5)
    if kind == "documents":
        parts = _documents(seg_q[0], size)
        lay = Assignment([parts[r] for r in rng.permutation(size)])
        return lay, lay
    return (Assignment(split_tokens(rng, rng.permutation(n_q), size)),
            Assignment(split_tokens(rng, rng.permutation(n_kv), size)))


def position_kw(lay_q, lay_kv, rank):
    """The call's ``positions=(pos_q, pos_kv)`` for explicit placements, else nothing."""
    if not isinstance(lay_q, Assignment):
        return {}
    return dict(positions=(lay_q.indices(rank), lay_kv.indices(rank)))


def window_of(case):
    """The case's window (None an unbounded side) as the calls take it: flash-attn's
    ``(left, right)``, -1 an unbounded side (``(-1, -1)`` without one)."""
    return masks.window_of(case.get("window"))


def with_context(kw, **changes):
    """The call's keywords ``kw`` with its ``context`` changed (``RingContext.replace``): e.g. the
    ``stats`` list of one call."""
    return dict(kw, context=kw["context"].replace(**changes))


def shard_case(comm, case):
    """One case's global inputs and this rank's part of them:
    ``(q, k, v, do, seg_q, seg_kv, window), (lay_q, lay_kv), kw, local`` with ``kw``
    the call's keywords (segment ids sharded; ``context``: the case's communicator, layout and
    backend) and ``local`` this rank's q, k, v, do."""
    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, do, seg_q, seg_kv = make_inputs(case)
    lay_q, lay_kv = placements(case, q.shape[1], k.shape[1], size, seg_q)
    window = window_of(case)
    kw = dict(causal=case.get("causal", False), window=window, softmax_scale=case.get("scale"),
              context=ringmpi.RingContext(comm=comm, layout=case["layout"], backend=BACKEND),
              **position_kw(lay_q, lay_kv, rank))
    if seg_q is not None:
        kw.update(segment_ids=(lay_q.shard(seg_q, rank), lay_kv.shard(seg_kv, rank)))
    local = dict(q=lay_q.shard(q, rank), k=lay_kv.shard(k, rank), v=lay_kv.shard(v, rank),
                 do=lay_q.shard(do, rank))
    return (q, k, v, do, seg_q, seg_kv, window), (lay_q, lay_kv), kw, local


def run_case(comm, case):
    rank, size = comm.Get_rank(), comm.Get_size()
    (q, k, v, do, seg_q, seg_kv, window), (lay_q, lay_kv), kw, local = shard_case(comm, case)
    to_backend, to_host = converters(case.get("bits", False))
    if case.get("bits"):  # bfloat16 passed as uint16 bit patterns, declared with dtype=
        kw["context"] = kw["context"].replace(dtype="bfloat16")
    args = [to_backend(local[n]) for n in ("q", "k", "v")]
    fwd_stats, bwd_stats = [], []
    o, lse, _ = ringmpi.ring_attention(*args, **with_context(kw, stats=fwd_stats))
    results = {"o": to_host(o), "lse": to_host(lse)}
    repeat = case.get("repeat", 1)
    for _ in range(repeat - 1):
        o2, lse2, _ = ringmpi.ring_attention(*args, **kw)
        if not (np.array_equal(to_host(o2), results["o"]) and np.array_equal(to_host(lse2), results["lse"])):
            results["not_bitwise"] = True
    if case.get("backward"):
        dq, dk, dv, _ = ringmpi.ring_attention_backward(to_backend(local["do"]), *args, (o, lse),
                                                        **with_context(kw, stats=bwd_stats))
        results.update(dq=to_host(dq), dk=to_host(dk), dv=to_host(dv))
        returned = (o, dq, dk, dv)
    else:
        returned = (o,)
    if case.get("bits") and any(str(x.dtype) != "uint16" for x in returned):
        results["not_bits"] = [str(x.dtype) for x in returned]
        for _ in range(repeat - 1):
            again = ringmpi.ring_attention_backward(to_backend(local["do"]), *args, (o, lse), **kw)
            if not all(np.array_equal(to_host(a), results[n]) for a, n in zip(again, ("dq", "dk", "dv"))):
                results["not_bitwise"] = True
    # what travelled: K/V in the input dtype (P-1 hops each), dK/dV in the compute dtype (P hops)
    sent = [comm.allreduce(sum(r.bytes_sent for r in st)) for st in (fwd_stats, bwd_stats)]
    # each K/V message also carries its block's int64 positions (and segment ids when given)
    kv_bytes = 2 * k.size * q.dtype.itemsize + 8 * k.shape[1] * (1 + (k.shape[0] if seg_kv is not None else 0))
    grad_bytes = 2 * k.size * (8 if q.dtype == np.float64 else 4)
    want = ring_traffic(size, kv_bytes, grad_bytes, case.get("backward"))
    if sent != want:
        results["traffic"] = f"ring bytes sent (forward, backward) {sent}, expected {want}"
    gathered = comm.gather(results, root=0)
    if rank != 0:
        return None
    return check(case, gathered, lay_q, lay_kv, q, k, v, do, seg_q, seg_kv, window)


def converters(bits=False):
    """(to backend, to host); with ``bits`` bfloat16 arrays travel as uint16 bit
    patterns and every uint16 result must come back that way."""
    if BACKEND == "cupy":
        import cupy
        up, down = cupy.asarray, cupy.asnumpy
    else:
        up, down = (lambda x: x), (lambda x: np.asarray(x))
    if not bits:
        return up, down

    def to_backend(x):
        assert x.dtype == reference.BFLOAT16
        return up(x.view(np.uint16))

    def to_host(x):
        x = down(x)
        return x.view(reference.BFLOAT16) if x.dtype == np.uint16 else x
    return to_backend, to_host


def check(case, gathered, lay_q, lay_kv, q, k, v, do, seg_q, seg_kv, window):
    messages, ok = [], True
    if gathered[0].get("traffic"):
        ok = False
        messages.append(gathered[0]["traffic"])
    if any(g.get("not_bits") for g in gathered):
        ok = False
        messages.append(f"uint16 inputs gave {gathered[0].get('not_bits')}, not uint16 outputs")
    if any(g.get("not_bitwise") for g in gathered):
        ok = False
        messages.append("repeated runs differ bitwise")
    dtype = q.dtype
    scale = case.get("scale") or 1.0 / np.sqrt(q.shape[3])
    vis = reference.visible(q.shape[1], k.shape[1], case.get("causal", False), window, seg_q, seg_kv)
    ref_o, ref_lse = reference.dense_forward(q, k, v, vis, scale, np.float64)
    extreme = case.get("q_scale", 1.0) * case.get("k_scale", 1.0) >= 1e4
    naive = reference.dense_forward_both_orders if extreme else reference.dense_forward
    naive_o, naive_lse = naive(q, k, v, vis, scale, dtype)
    o = lay_q.unshard([g["o"] for g in gathered], axis=1)
    lse = lay_q.unshard([g["lse"] for g in gathered], axis=2)
    want_lse_dtype = np.float64 if dtype == np.float64 else np.float32
    if o.dtype != dtype or lse.dtype != want_lse_dtype:
        ok = False
        messages.append(f"dtypes o {o.dtype} lse {lse.dtype}")
    for name, ours, ref, naive, grad in (("o", o, ref_o, naive_o, False), ("lse", lse, ref_lse, naive_lse, False)):
        good, msg = reference.tolerance_check(name, ours, ref, naive, gradient=grad)
        ok &= good
        messages.append(msg)
    if case.get("backward"):
        refs = reference.dense_backward(do, q, k, v, vis, scale, np.float64)
        naives = reference.dense_backward(do, q, k, v, vis, scale, dtype)
        for i, name in enumerate(("dq", "dk", "dv")):
            lay = lay_q if name == "dq" else lay_kv
            ours = lay.unshard([g[name] for g in gathered], axis=1)
            good, msg = reference.tolerance_check(name, ours, refs[i], naives[i], gradient=True)
            ok &= good and ours.dtype == dtype
            messages.append(msg)
    return ok, "; ".join(messages)


def fd_case(comm, case):
    """Finite-difference check of the ring backward against the ring forward (float64)."""
    size = comm.Get_size()
    case = dict(case, dtype="float64")
    q, k, v, do, _, _ = make_inputs(case)
    lay_q, lay_kv = Layout(case["layout"], q.shape[1], size), Layout(case["layout"], k.shape[1], size)
    kw = dict(causal=case.get("causal", False),
              context=ringmpi.RingContext(comm=comm, layout=case["layout"], backend=BACKEND))
    worst = ring_fd_worst(comm, lay_q, lay_kv, q, k, v, do, kw, converters(), np.random.default_rng(123),
                          probes=4, eps=1e-6)
    return worst < 1e-6, f"finite-difference worst relative error {worst:.3g}"


def bf16_errors_case(comm, case):
    """bfloat16 input errors: one ConfigError, the same on every rank, before any compute."""
    rank, size = comm.Get_rank(), comm.Get_size()
    case = dict(case, dtype="bfloat16")
    q, k, v, _, _, _ = make_inputs(case)
    lay = Layout(case["layout"], q.shape[1], size)
    q_bad = q.copy()
    q_bad[0, case["nan_at"], 1, 2] = np.nan  # a bfloat16 NaN on whichever rank owns that token
    shards = lambda *xs: [lay.shard(x, rank) for x in xs]  # noqa: E731
    to_backend, _ = converters()
    bits = lambda x: to_backend(x.view(np.uint16))  # noqa: E731
    f32 = lambda x: to_backend(x.astype(np.float32))  # noqa: E731
    attempts = {
        "uint16 without dtype=": ([bits(x) for x in shards(q, k, v)], {},
                                  "q has unsupported dtype uint16"),
        "float32 declared bfloat16": ([f32(x) for x in shards(q, k, v)], {"dtype": "bfloat16"},
                                      "q has dtype float32 but dtype='bfloat16' was given"),
        "bfloat16 NaN": ([to_backend(x) for x in shards(q_bad, k, v)], {"check_finite": True},
                         f"q has a non-finite value (nan) at global index [0, {case['nan_at']}, 1, 2]"),
    }
    problems = []
    for what, (args, extra, want) in attempts.items():
        problem = agreed_error(comm, lambda: ringmpi.ring_attention(*args, context=ringmpi.RingContext(
            comm=comm, layout=case["layout"], backend=BACKEND, **extra)), want)
        if problem:
            problems.append(f"{what}: {problem}")
    return not problems, "; ".join(problems) or f"{len(attempts)} errors raised alike on {size} ranks"


def positions_errors_case(comm, case):
    """Bad positions: one ConfigError, the same on every rank, before any compute."""
    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, do, _, _ = make_inputs(case)
    lay = Layout(case["layout"], q.shape[1], size)
    args = [converters()[0](lay.shard(x, rank)) for x in (q, k, v)]
    mine = lay.indices(rank)
    n = q.shape[1]
    swapped = mine.copy()
    if size > 1 and rank == 1:
        swapped[0] = lay.indices(0)[0]  # rank 0's first position twice, rank 1's first nowhere
    attempts = {
        "out of range": (np.where(mine == n - 1, n, mine), "positions_q must lie in [0, N = "),
        "negative": (mine - (rank == 0), "positions_q must lie in [0, N = "),
        "repeated on a rank": (np.where(mine == mine[-1], mine[0], mine), "more than once"),
        "float": (mine.astype(np.float64), "positions_q must be integers"),
        "wrong length": (mine[:-1], "positions_q must have shape (S_local,)"),
    }
    if size > 1:
        attempts["held twice, one missing"] = (swapped, "are not a permutation of 0 .. ")
        attempts["given on one rank only"] = (mine if rank == 0 else None, "on every rank or on none")
    problems = []
    ctx = ringmpi.RingContext(comm=comm, backend=BACKEND)
    for what, (pos, want) in attempts.items():
        lse0 = np.zeros((q.shape[0], q.shape[2], len(mine)), np.float32)
        for call, fn in (("forward", lambda: ringmpi.ring_attention(
                *args, causal=True, positions=pos, context=ctx)),
                ("backward", lambda: ringmpi.ring_attention_backward(
                    args[0], *args, (args[0], lse0), causal=True, positions=pos, context=ctx))):
            problem = agreed_error(comm, fn, want)
            if problem:
                problems.append(f"{what} ({call}): {problem}")
    return not problems, "; ".join(problems) or f"{2 * len(attempts)} errors raised alike on {size} ranks"


def allgather_memory_case(comm, case):
    """The all-gather schedule allocates no more than it declares (issue 53): each rank's traced
    peak (``tracemalloc``: NumPy's allocations) over one forward and one backward call, against
    the cost model's ``resident_memory`` of the call, the memory ``schedule="auto"`` checks."""
    import tracemalloc

    from ringmpi.core.cost_model import Shape, resident_memory

    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, do, _, _ = make_inputs(case)
    lay = Layout("contiguous", q.shape[1], size)
    q, k, v, do = (lay.shard(x, rank) for x in (q, k, v, do))
    ctx = ringmpi.RingContext(comm=comm, schedule="allgather", backend=BACKEND)
    shape = Shape(n_q=case["n_q"], n_kv=case["n_q"], batch=case["B"], heads=case["H"], kv_heads=case["Hkv"],
                  dim=case["D"], dim_v=case["D"], itemsize=q.dtype.itemsize, grad_itemsize=4)
    stats, peaks = [], []
    for backward in (False, True):
        tracemalloc.start()
        if backward:
            ringmpi.ring_attention_backward(do, q, k, v, (o, lse), context=ctx.replace(stats=stats))
        else:
            o, lse, _ = ringmpi.ring_attention(q, k, v, context=ctx.replace(stats=stats))
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    declared = [resident_memory(shape, size, "allgather", b) for b in (False, True)]
    over = [f"rank {rank} {name}: traced {got / 2**20:.1f} MiB > declared {want / 2**20:.1f} MiB"
            for name, got, want in zip(("forward", "backward"), peaks, declared) if got > want]
    if {r.schedule for r in stats} != {"allgather"}:
        over.append(f"rank {rank}: ran {sorted({r.schedule for r in stats})}, not the all-gather")
    over = sum(comm.allgather(over), [])
    mib = " / ".join(f"{p / 2**20:.1f} of {d / 2**20:.1f}" for p, d in zip(peaks, declared))
    return (not over, "; ".join(over) or f"rank 0 traced / declared MiB (forward, backward): {mib}") \
        if rank == 0 else None


def packed_case(comm, case):
    """Packed documents: ``packed_cases.packed_case`` (imported here: it builds on this module)."""
    import packed_cases
    return packed_cases.packed_case(comm, case)


def main():
    run_file(MPI.COMM_WORLD, {"fd": fd_case, "bf16_errors": bf16_errors_case,
                              "positions_errors": positions_errors_case, "packed": packed_case,
                              "allgather_memory": allgather_memory_case}, run_case)


if __name__ == "__main__":
    main()
