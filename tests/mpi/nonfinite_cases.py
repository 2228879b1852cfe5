"""Rank-side driver for the non-finite tests: many cases in one mpirun launch.

    mpirun -n P python tests/mpi/nonfinite_cases.py CASES.json

Each case puts one NaN or +-Inf into ``q``, ``k``, ``v`` or ``do`` at one
global element, runs the ring forward and backward on it and on the same
inputs with that element replaced by a finite value, and rank 0 checks:

* exactly the outputs that a float64 dense computation over each query's
  visible keys alone makes non-finite are non-finite (``o``, ``lse``, ``dq``,
  ``dk``, ``dv``), and the finite ones are close to it;
* every query that sees no bad value (not in its own q/do row, not in the
  k/v row of a key visible to it) has ``o``, ``lse``, ``dq`` bitwise equal to
  the clean run's; every key seen by no such query has bitwise equal
  ``dk``, ``dv`` (on CuPy the gradients, summed with float atomics, to 1e-5).

``RINGMPI_TEST_BACKEND=cupy`` runs the cases on the GPU kernels.  Optional case
keys: ``dtype`` (float32 by default; float16/bfloat16 run the tensor-core
kernels on the GPU) and ``underflow``: the bad key's score is pushed ~500
below the others, so its weight is exactly 0 in float32 while it stays
visible: its NaN/Inf ``v`` row must still reach the queries that see it
(0 * NaN = NaN, as the arithmetic over visible keys says).

Prints one ``CASE <json>`` line per case.
"""

import json
import os
import sys
import traceback

import numpy as np
from mpi4py import MPI

import case_driver  # noqa: F401 (puts tests/support on the path)
import reference
from random_inputs import attention_inputs
import ringmpi
from ringmpi import Layout
from ringmpi.core.dtypes import BFLOAT16

BACKEND = os.environ.get("RINGMPI_TEST_BACKEND", "numpy")


def visible_matmul(a, b, vis):
    """sum_k a[i, k] b[k, :] over visible pairs only (a hidden pair adds nothing)."""
    return np.where(vis[:, :, None], a[:, :, None] * b[None, :, :], 0).sum(axis=1)


def dense_visible(q, k, v, do, vis, scale):
    """float64 o, lse, dq, dk, dv where every sum runs over visible pairs only."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    b_, n, h_, d = q.shape
    group = h_ // k.shape[2]
    o, dq = np.zeros_like(q), np.zeros_like(q)
    lse = np.zeros((b_, h_, n))
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    with np.errstate(all="ignore"):
        for b in range(b_):
            vb = vis[min(b, len(vis) - 1)]
            for h in range(h_):
                kh = h // group
                qq, kk, vv, dd = q[b, :, h], k[b, :, kh], v[b, :, kh], do[b, :, h]
                s = np.where(vb, (qq @ kk.T) * scale, -np.inf)
                m = s.max(axis=1)
                shift = np.where(np.isneginf(m), 0, m)
                p = np.where(vb, np.exp(s - shift[:, None]), 0)
                l = p.sum(axis=1)
                seen = l != 0
                o[b, :, h] = np.where(seen[:, None], visible_matmul(p, vv, vb) / np.where(seen, l, 1)[:, None], 0)
                lse[b, h] = np.where(seen, shift + np.log(np.where(seen, l, 1)), -np.inf)
                dvec = (dd * o[b, :, h]).sum(axis=1)
                lse_use = np.where(np.isneginf(lse[b, h]), np.inf, lse[b, h])
                pp = np.where(vb, np.exp(s - lse_use[:, None]), 0)
                ds = np.where(vb, pp * (dd @ vv.T - dvec[:, None]), 0)
                dq[b, :, h] = visible_matmul(ds, kk, vb) * scale
                dk[b, :, kh] += visible_matmul(ds.T, qq, vb.T) * scale
                dv[b, :, kh] += visible_matmul(pp.T, dd, vb.T)
    return o, lse, dq, dk, dv


def make_inputs(case):
    rng = np.random.default_rng(case["seed"])
    b, n, h, hkv, d = case["B"], case["N"], case["H"], case["Hkv"], case["D"]
    q, k, v, do = attention_inputs(rng, b, n, h, hkv, d)
    seg = None
    if case["mask"] == "segments":
        seg = np.stack([np.searchsorted(np.sort(rng.choice(np.arange(1, n), 3, replace=False)),
                                        np.arange(n), side="right") for _ in range(b)])
    if case.get("underflow"):
        b_, token, _, _ = case["at"]
        q[b_, :, :, 0] = 40.0                  # every query of batch b_ ...
        k[b_, token, :, 0] = -40.0             # ... scores this key ~ -566: weight exp(-566 - max) = 0
    return [x.astype(DTYPES[case.get("dtype", "float32")]) for x in (q, k, v, do)], seg


DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": BFLOAT16}
# finite outputs against the float64 reference over the same (rounded) inputs
CLOSE = {"float32": dict(rtol=2e-3, atol=2e-4), "float16": dict(rtol=2e-2, atol=2e-2),
         "bfloat16": dict(rtol=8e-2, atol=8e-2)}


def run(comm, case, tensors, seg, lay):
    rank = comm.Get_rank()
    q, k, v, do = (lay.shard(x, rank) for x in tensors)
    mask = dict(causal=case["mask"] in ("causal", "segments"),
                window=(3, 1) if case["mask"] == "window" else (-1, -1))
    if seg is not None:
        mask.update(segment_ids=lay.shard(seg, rank))
    kw = dict(context=ringmpi.RingContext(comm=comm, layout=case["layout"], backend=BACKEND), **mask)
    o, lse, _ = ringmpi.ring_attention(q, k, v, **kw)
    grads = ringmpi.ring_attention_backward(do, q, k, v, (o, lse), **kw)[:3]
    host = (lambda x: x.get()) if BACKEND == "cupy" else np.asarray
    if case.get("dtype", "float32") != "float32":  # compare 16-bit outputs as float32 (exact)
        host = (lambda get: lambda x: np.asarray(get(x), dtype=np.float32))(host)
    mine = [host(x) for x in (o, lse) + tuple(grads)]
    every = comm.gather(mine, root=0)
    if rank != 0:
        return None
    axes = (1, 2, 1, 1, 1)
    return [lay.unshard([e[i] for e in every], axis=axes[i]) for i in range(5)]


def check(case, bad_out, clean_out, tensors, seg, touched_q, touched_kv):
    q, k, v, do = tensors
    n = q.shape[1]
    vis = reference.visible(n, n, case["mask"] in ("causal", "segments"),
                            (3, 1) if case["mask"] == "window" else None, seg, seg)
    refs = dense_visible(q, k, v, do, vis, 1.0 / np.sqrt(q.shape[3]))
    problems = []
    names = ("o", "lse", "dq", "dk", "dv")
    for name, ours, ref in zip(names, bad_out, refs):
        bad_ours, bad_ref = ~np.isfinite(ours), ~np.isfinite(ref)
        if (bad_ours != bad_ref).any():
            where = np.argwhere(bad_ours != bad_ref)[:4].tolist()
            problems.append(f"{name}: non-finite at {np.argwhere(bad_ours).tolist()[:6]}, "
                            f"reference at {np.argwhere(bad_ref).tolist()[:6]} (differ at {where})")
            continue
        fin = ~bad_ref
        close = dict(CLOSE[case.get("dtype", "float32")])
        if case.get("dtype", "float32") != "float32" and fin.any():  # 16-bit: error relative to the largest value
            close["atol"] *= max(1.0, float(np.abs(ref[fin]).max()))
        if not np.allclose(ours[fin], ref[fin], **close):
            problems.append(f"{name}: finite values off by {np.abs(ours[fin] - ref[fin]).max():.3g}")
    # untouched outputs: bitwise equal to the clean run
    per_q = {"o": (touched_q, lambda x: x.transpose(0, 2, 1, 3)), "lse": (touched_q, lambda x: x),
             "dq": (touched_q, lambda x: x.transpose(0, 2, 1, 3)),
             "dk": (touched_kv, lambda x: x.transpose(0, 2, 1, 3)),
             "dv": (touched_kv, lambda x: x.transpose(0, 2, 1, 3))}
    for name, ours, clean in zip(names, bad_out, clean_out):
        touched, heads_first = per_q[name]
        a, c = heads_first(ours), heads_first(clean)
        keep = ~touched
        if BACKEND == "cupy" and name in ("dq", "dk", "dv"):  # float atomics: the order of the sum varies
            same = np.allclose(a[keep], c[keep], rtol=1e-5, atol=1e-6)
        else:
            same = a[keep].tobytes() == c[keep].tobytes()
        if not same:
            problems.append(f"{name}: an output no bad value can reach differs from the clean run")
    return not problems, "; ".join(problems) or "ok"


def touched_sets(case, tensors, seg):
    """(B, H, N) queries that see a bad value; (B, H_kv, N) keys seen by such a query."""
    q, k, v, do = tensors
    n, h, hkv = q.shape[1], q.shape[2], k.shape[2]
    group = h // hkv
    vis = reference.visible(n, n, case["mask"] in ("causal", "segments"),
                            (3, 1) if case["mask"] == "window" else None, seg, seg)
    vis = np.broadcast_to(vis, (q.shape[0], n, n))
    bad_row = lambda x: ~np.isfinite(x).all(axis=-1)  # noqa: E731
    bq, bdo = bad_row(q).transpose(0, 2, 1), bad_row(do).transpose(0, 2, 1)   # (B, H, N)
    bkv = (bad_row(k) | bad_row(v)).transpose(0, 2, 1)                          # (B, Hkv, N)
    bkv_h = np.repeat(bkv, group, axis=1)                                       # (B, H, N)
    sees_bad = (vis[:, None] & bkv_h[:, :, None, :]).any(axis=-1)               # (B, H, N)
    touched_q = bq | bdo | sees_bad
    seen_by = (vis[:, None] & touched_q[:, :, :, None]).any(axis=2)             # (B, H, N keys)
    touched_kv = seen_by.reshape(q.shape[0], hkv, group, n).any(axis=2)
    return touched_q, touched_kv


def main():
    cases = json.load(open(sys.argv[1]))
    comm = MPI.COMM_WORLD.Dup()
    for case in cases:
        try:
            tensors, seg = make_inputs(case)
            which = "qkvd".index(case["tensor"][0]) if case["tensor"] != "do" else 3
            bad = [x.copy() for x in tensors]
            bad[which][tuple(case["at"])] = float(case["value"])
            clean = [x.copy() for x in tensors]
            clean[which][tuple(case["at"])] = 0.37
            lay = Layout(case["layout"], case["N"], comm.Get_size())
            bad_out = run(comm, case, bad, seg, lay)
            clean_out = run(comm, case, clean, seg, lay)
            if comm.Get_rank() == 0:
                ok, msg = check(case, bad_out, clean_out, bad, seg, *touched_sets(case, bad, seg))
        except Exception:
            ok, msg = False, traceback.format_exc()
        if comm.Get_rank() == 0:
            print("CASE " + json.dumps({"id": case["id"], "ok": bool(ok), "msg": msg}), flush=True)


if __name__ == "__main__":
    main()
