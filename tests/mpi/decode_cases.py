"""Rank-side driver: run many decode_attention / KVCache cases in one mpirun launch.

    mpirun -n P python tests/mpi/decode_cases.py CASES.json

Every rank builds the same global cache and new tokens from the case's seed.
``static`` cases shard a given cache by a layout; ``cache`` cases grow a
:class:`ringmpi.KVCache` over several appends and check every step; ``error``
cases expect the same ConfigError on every rank.  Rank 0 gathers every rank's
result, checks that all ranks got the same bits, compares with a float64 dense
reference on the gathered cache (docs/design.md's tolerance rule) and prints
``CASE <json>`` per case.
"""

import json
import sys

import ml_dtypes
import numpy as np
from mpi4py import MPI

from case_driver import run_all
import reference
from ring_cases import Assignment, split_tokens, window_of
import ringmpi
import ringmpi.kvcache
from ringmpi import Layout, RingContext


def dtype_of(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def decode_reference(q, k, v, lengths, causal, window, sinks, scale, dtype):
    """Dense decode in ``dtype``: entry b's new token t sits at lengths[b] - S_new + t."""
    b_, s_new, h, d = q.shape
    o = np.zeros(q.shape, dtype=dtype)
    lse = np.full((b_, h, s_new), -np.inf, dtype=dtype)
    for b in range(b_):
        n = int(lengths[b])
        if n > 0:
            vis = reference.visible(s_new, n, causal, None if window is None else tuple(window))
            o[b:b + 1], lse[b:b + 1] = reference.dense_forward(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n],
                                                               vis, scale, dtype)
    if sinks is not None:
        sk = np.asarray(sinks, dtype=dtype)[None, :, None]
        with np.errstate(invalid="ignore"):
            total = np.logaddexp(lse, sk).astype(dtype)
            factor = np.exp(lse - total).astype(dtype)
        o = (o * factor.transpose(0, 2, 1)[..., None]).astype(dtype)
        lse = total
    return o, lse


def check(case, gathered, q, k, v, lengths, sinks, label=""):
    """Rank 0: same bits everywhere, dtypes, tolerance against the float64 reference."""
    root = case.get("root")
    results = [g for g in gathered if g is not None]
    ok, msgs = True, []
    if any(len(g) != 3 or g[2] is not None for g in results):  # Attention(o, lse, None) on every rank
        return False, f"{label}a rank returned {[type(g).__name__ for g in results]}"
    if root is not None:
        others = [g for r, g in enumerate(gathered) if r != root]
        if any(tuple(g) != (None, None, None) for g in others):
            return False, f"{label}non-root ranks returned a result"
        results = [gathered[root]]
    o, lse, _ = results[0]
    for r, (o_r, lse_r, _) in enumerate(results[1:], 1):
        if o_r.tobytes() != o.tobytes() or lse_r.tobytes() != lse.tobytes():
            ok = False
            msgs.append(f"rank {r} differs bitwise from rank 0")
    dtype = q.dtype
    want_lse = np.float64 if dtype == np.float64 else np.float32
    if o.dtype != dtype or lse.dtype != want_lse or o.shape != q.shape:
        ok = False
        msgs.append(f"o {o.dtype} {o.shape} lse {lse.dtype}")
    scale = case.get("scale") or 1.0 / np.sqrt(q.shape[3])
    window = case.get("window")
    causal = case.get("causal", True)
    ref = decode_reference(q, k, v, lengths, causal, window, sinks, scale, np.float64)
    naive = decode_reference(q, k, v, lengths, causal, window, sinks, scale, dtype)
    for name, ours, r64, nv in (("o", o, ref[0], naive[0]), ("lse", lse, ref[1], naive[1])):
        good, msg = reference.tolerance_check(name, ours, r64, nv)
        ok &= good
        msgs.append(msg)
    return ok, label + "; ".join(msgs)


def make(case, rng, shape):
    return rng.standard_normal(shape).astype(dtype_of(case.get("dtype", "float32")))


def kwargs(case):
    return dict(causal=case.get("causal", True), window=window_of(case), softmax_scale=case.get("scale"),
                root=case.get("root"))


def static_case(comm, case):
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(case["seed"])
    b, n, s, h, hkv, d = (case[x] for x in ("B", "N", "S", "H", "Hkv", "D"))
    q, k, v = make(case, rng, (b, s, h, d)), make(case, rng, (b, n, hkv, d)), make(case, rng, (b, n, hkv, d))
    sinks = rng.standard_normal(h).astype(np.float32) * 2 if case.get("sinks") else None
    lengths = np.asarray(case["lengths"]) if case.get("lengths") is not None else None
    lay = Layout(case["layout"], n, size)
    kw = kwargs(case)
    if case.get("positions"):  # explicit cache positions: a random assignment, ascending on each rank
        lay = Assignment(np.sort(part) for part in split_tokens(np.random.default_rng(case["seed"] + 5),
                                                          np.random.default_rng(case["seed"] + 6).permutation(n), size))
        kw["positions"] = lay.indices(rank)
    if case.get("root") is not None and rank != case["root"]:
        q_in = None
    else:
        q_in = q
    context = RingContext(comm, layout=case["layout"], backend="numpy")
    res = ringmpi.decode_attention(q_in, lay.shard(k, rank), lay.shard(v, rank), sinks=sinks,
                                   cache_lengths=lengths, **kw,
                                   context=context.replace(layout=lay) if case.get("layout_obj") else context)
    again = ringmpi.decode_attention(q_in, lay.shard(k, rank), lay.shard(v, rank), sinks=sinks,
                                     cache_lengths=lengths, context=context, **kw)
    repeat_same = all((x is None and y is None) or x.tobytes() == y.tobytes() for x, y in zip(res, again))
    gathered = comm.gather(res, root=0)
    same = comm.gather(repeat_same, root=0)
    if rank != 0:
        return None
    ok, msg = check(case, gathered, q, k, v, np.full(b, n) if lengths is None else lengths, sinks)
    if not all(same):
        ok, msg = False, "repeated call differs bitwise; " + msg
    return ok, msg


def cache_case(comm, case):
    """Grow a KVCache: optional prefill shard, then several appends, each step checked."""
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(case["seed"])
    b, h, hkv, d = (case[x] for x in ("B", "H", "Hkv", "D"))
    cache = ringmpi.KVCache(b, hkv, d, case.get("dtype", "float32"), context=RingContext(comm, layout=case["layout"]),
                            capacity=case.get("capacity", 0), chunk=case.get("chunk", 4))
    total = case["prefill"] + sum(case["steps"]) + 1
    k_all, v_all = np.zeros((b, total, hkv, d), dtype=cache.dtype), np.zeros((b, total, hkv, d), dtype=cache.dtype)
    lengths = np.zeros(b, dtype=np.int64)
    n0 = case["prefill"]
    if n0:
        lengths[:] = case.get("prefill_lengths") or n0
        k_all[:, :n0], v_all[:, :n0] = make(case, rng, (b, n0, hkv, d)), make(case, rng, (b, n0, hkv, d))
        for x in (k_all, v_all):  # right padding beyond an entry's length is never seen
            for e in range(b):
                x[e, lengths[e]:n0] = 1e4
        lay = Layout(case["layout"], n0, size)
        cache.load_shard(lay.shard(k_all[:, :n0], rank), lay.shard(v_all[:, :n0], rank), n0, lengths)
    sinks = rng.standard_normal(h).astype(np.float32) if case.get("sinks") else None
    kw = kwargs(case)
    oks, msgs = [], []
    for step, s_new in enumerate(case["steps"]):
        k_new, v_new = make(case, rng, (b, s_new, hkv, d)), make(case, rng, (b, s_new, hkv, d))
        q = make(case, rng, (b, s_new, h, d))
        for e in range(b):
            k_all[e, lengths[e]:lengths[e] + s_new] = k_new[e]
            v_all[e, lengths[e]:lengths[e] + s_new] = v_new[e]
        lengths += s_new
        cache.append(k_new, v_new)
        views = cache.views()
        if not (np.shares_memory(views["k_cache"], cache._k) or cache.local_rows == 0):
            oks.append(False)
            msgs.append(f"step {step}: the cache view is a copy")
        res = ringmpi.decode_attention(q, sinks=sinks, **views, **kw, context=cache.ring_context(backend="numpy"))
        gathered = comm.gather(res, root=0)
        if rank == 0:
            if not np.array_equal(cache.lengths, lengths):
                oks.append(False)
                msgs.append(f"step {step}: lengths {cache.lengths} != {lengths}")
            ok, msg = check(case, gathered, q, k_all, v_all, lengths, sinks, label=f"step {step}: ")
            oks.append(ok)
            if not ok or step == len(case["steps"]) - 1:
                msgs.append(msg)
    rows = comm.gather((cache.local_rows, cache.capacity), root=0)
    owned = comm.gather(cache.placement.indices(rank), root=0)
    if rank != 0:
        return None
    n = int(lengths.max())
    fresh = ringmpi.kvcache.CachePlacement(case["layout"], case["prefill"], n, size)
    if any(not np.array_equal(o, fresh.indices(r)) for r, o in enumerate(owned)) or \
            not np.array_equal(np.sort(np.concatenate(owned)), np.arange(n)):
        oks.append(False)
        msgs.append(f"slots held {[o.tolist() for o in owned]} are not the placement's partition of {n}")
    chunk, cap0 = case.get("chunk", 4), case.get("capacity", 0)
    if sum(r for r, _ in rows) != n or any(c < r or (c > cap0 and c - r >= chunk) for r, c in rows):
        oks.append(False)
        msgs.append(f"rows/capacity per rank {rows} for {n} slots")
    if case.get("expect_rows") is not None and [r for r, _ in rows] != case["expect_rows"]:
        oks.append(False)
        msgs.append(f"rows per rank {[r for r, _ in rows]}, expected {case['expect_rows']}")
    return all(oks), "; ".join(msgs)


def error_case(comm, case):
    """Bad input: the same ConfigError on every rank, nobody hangs."""
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(case["seed"])
    b, n, s, h, hkv, d = 1, 7, 1, 2, 1, 4
    q, k, v = (rng.standard_normal(x).astype(np.float32) for x in ((b, s, h, d), (b, n, hkv, d), (b, n, hkv, d)))
    lay = Layout("contiguous", n, size)
    kl, vl = lay.shard(k, rank), lay.shard(v, rank)
    kw = dict(causal=True, context=RingContext(comm, layout="contiguous", backend="numpy"))
    what = case["what"]
    if what == "softcap":
        kw["softcap"] = -1.0
    elif what == "softcap_one_rank" and rank == size - 1:
        kw["softcap"] = 30.0
    elif what == "dtype_one_rank" and rank == size - 1:
        kl = kl.astype(np.float64)
    elif what == "q_differs" and rank == size - 1:
        q = q + 1
    elif what == "lengths":
        kw["cache_lengths"] = [n + 1]
    elif what == "positions_repeated":  # rank 0's first position on every rank
        kw["positions"] = np.concatenate([[0], lay.indices(rank)[1:]]) if rank else lay.indices(rank)
        if size == 1:
            kw["positions"] = np.array([0, 0, 2, 3, 4, 5, 6])
    elif what == "positions_range":
        kw["positions"] = lay.indices(rank) + 1
    try:
        ringmpi.decode_attention(q, kl, vl, **kw)
        mine = "no error"
    except ringmpi.ConfigError as exc:
        mine = f"ConfigError: {exc}"
    every = comm.gather(mine, root=0)
    if rank != 0:
        return None
    ok = len(set(every)) == 1 and every[0].startswith("ConfigError") and case["expect"] in every[0]
    return ok, " | ".join(sorted(set(every)))


def main():
    comm = MPI.COMM_WORLD
    with open(sys.argv[1]) as fh:
        cases = json.load(fh)
    run = {"static": static_case, "cache": cache_case, "error": error_case}
    run_all(comm, cases, lambda case: run[case["kind"]](comm, case))


if __name__ == "__main__":
    main()
