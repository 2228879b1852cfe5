"""Rank-side driver: ring attention with a value head dim D_v different from D.

    mpirun -n P python tests/mpi/dv_cases.py CASES.json

A case is a ``ring_cases.py`` case with one more key, ``Dv``: ``v`` and ``do``
are ``(B, N, Hkv, Dv)`` and ``(B, N, H, Dv)``; ``q`` and ``k`` keep ``D``.  Every
rank builds the same global inputs from the case's seed, runs
``ring_attention`` and the backward on its shard, counts what travelled the
ring (K and V at their own sizes, dK and dV at theirs), and rank 0 compares
the gathered outputs with the float64 dense reference of ``reference.py``
under the tolerance rule (``ring_cases.check``).  ``kind: "errors"`` cases
check the shape errors of a mismatched ``v``/``o``/``do``; ``kind: "decode"`` cases
run ``decode_attention`` over a D_v-wide cache (given shards and a ``KVCache``);
``kind: "torch"`` cases compare ``ringmpi.torch`` with torch's SDPA.
"""


import numpy as np
from mpi4py import MPI

from case_driver import agreed_error, run_file
import reference
import ring_cases
import ringmpi
import ringmpi.core.dtypes
from ringmpi import Layout, RingContext


def make_inputs(case):
    """``ring_cases.make_inputs`` with ``v``, ``do`` drawn ``Dv`` wide (their own stream)."""
    q, k, _, _, seg_q, seg_kv = ring_cases.make_inputs(case)
    rng = np.random.default_rng([case.get("seed", 0), 17])
    b, h, hkv, dv = case["B"], case["H"], case["Hkv"], case["Dv"]
    n_q, n_kv = q.shape[1], k.shape[1]
    cast = lambda x: ringmpi.core.dtypes.to_dtype(x, q.dtype)  # noqa: E731
    v = cast(rng.standard_normal((b, n_kv, hkv, dv)))
    do = cast(rng.standard_normal((b, n_q, h, dv)))
    return q, k, v, do, seg_q, seg_kv


def run_case(comm, case):
    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, do, seg_q, seg_kv = make_inputs(case)
    lay_q, lay_kv = Layout(case["layout"], q.shape[1], size), Layout(case["layout"], k.shape[1], size)
    window = ring_cases.window_of(case)
    context = RingContext(comm, layout=case["layout"], backend=ring_cases.BACKEND)
    kw = dict(causal=case.get("causal", False), window=window, softmax_scale=case.get("scale"))
    if seg_q is not None:
        kw["segment_ids"] = (lay_q.shard(seg_q, rank), lay_kv.shard(seg_kv, rank))
    to_backend, to_host = ring_cases.converters()
    args = [to_backend(lay.shard(x, rank)) for lay, x in ((lay_q, q), (lay_kv, k), (lay_kv, v))]
    fwd_stats, bwd_stats = [], []
    o, lse, _ = ringmpi.ring_attention(*args, context=context.replace(stats=fwd_stats), **kw)
    dq, dk, dv, _ = ringmpi.ring_attention_backward(to_backend(lay_q.shard(do, rank)), *args, (o, lse),
                                                    context=context.replace(stats=bwd_stats), **kw)
    results = {name: to_host(x) for name, x in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv))}
    # K travels D wide and V D_v wide (P-1 hops), dK/dV likewise in the compute dtype (P hops)
    sent = [comm.allreduce(sum(r.bytes_sent for r in st)) for st in (fwd_stats, bwd_stats)]
    meta = 8 * k.shape[1] * (1 + (k.shape[0] if seg_kv is not None else 0))
    kv_bytes = (k.size + v.size) * q.dtype.itemsize + meta
    grad_bytes = (k.size + v.size) * (8 if q.dtype == np.float64 else 4)
    want = ring_cases.ring_traffic(size, kv_bytes, grad_bytes)
    if sent != want:
        results["traffic"] = f"ring bytes sent (forward, backward) {sent}, expected {want}"
    gathered = comm.gather(results, root=0)
    if rank != 0:
        return None
    return ring_cases.check(dict(case, backward=True), gathered, lay_q, lay_kv, q, k, v, do, seg_q, seg_kv,
                            window)


def errors_case(comm, case):
    """Shapes that do not fit together: one ConfigError, the same on every rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, do, _, _ = make_inputs(case)
    lay = Layout(case["layout"], q.shape[1], size)
    to_backend, _ = ring_cases.converters()
    qs, ks, vs, dos = (to_backend(lay.shard(x, rank)) for x in (q, k, v, do))
    kw = dict(context=RingContext(comm, layout=case["layout"], backend=ring_cases.BACKEND))
    o, lse, _ = ringmpi.ring_attention(qs, ks, vs, **kw)
    attempts = {
        "v with other heads": (lambda: ringmpi.ring_attention(qs, ks, vs[:, :, :1], **kw),
                               "k and v must agree on (B, S_kv_local, H_kv)"),
        "do D wide": (lambda: ringmpi.ring_attention_backward(to_backend(lay.shard(q, rank)), qs, ks, vs, (o, lse),
                                                              **kw),
                      "do must have shape (B, S_q_local, H, D_v)"),
        "o D wide": (lambda: ringmpi.ring_attention_backward(dos, qs, ks, vs, (to_backend(lay.shard(q, rank)), lse),
                                                             **kw),
                     "o must have shape (B, S_q_local, H, D_v)"),
    }
    problems = []
    for what, (call, want) in attempts.items():
        problem = agreed_error(comm, call, want)
        if problem:
            problems.append(f"{what}: {problem}")
    return not problems, "; ".join(problems) or f"{len(attempts)} errors raised alike on {size} ranks"


def decode_case(comm, case):
    """decode_attention over a sharded cache with D_v-wide values: given shards, then a
    KVCache (``dim_v=``) grown by ``load_shard`` and ``append``; the same bits on every rank,
    against the float64 dense reference."""
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(case["seed"])
    b, h, hkv, d, dv, n, s_new = case["B"], case["H"], case["Hkv"], case["D"], case["Dv"], case["n"], case["s_new"]
    q = rng.standard_normal((b, s_new, h, d)).astype(np.float32)
    k = rng.standard_normal((b, n, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, n, hkv, dv)).astype(np.float32)
    lay = Layout(case["layout"], n, size)
    context = RingContext(comm, layout=case["layout"], backend=ring_cases.BACKEND)
    o_static, lse_static, _ = ringmpi.decode_attention(q, lay.shard(k, rank), lay.shard(v, rank), causal=True,
                                                       context=context)
    cache = ringmpi.KVCache(b, hkv, d, "float32", context=RingContext(comm, layout=case["layout"]), dim_v=dv,
                            chunk=3)
    n0 = n - s_new
    lay0 = Layout(case["layout"], n0, size)
    cache.load_shard(lay0.shard(k[:, :n0], rank), lay0.shard(v[:, :n0], rank), n0)
    cache.append(k[:, n0:], v[:, n0:])
    o_cache, lse_cache, _ = ringmpi.decode_attention(q, **cache.views(), causal=True,
                                                     context=cache.ring_context(backend=ring_cases.BACKEND))
    gathered = comm.gather([np.asarray(x) for x in (o_static, lse_static, o_cache, lse_cache)], root=0)
    if rank != 0:
        return None
    vis = reference.visible(s_new, n, True)
    ref_o, ref_lse = reference.dense_forward(q, k, v, vis, 1 / np.sqrt(d), np.float64)
    naive_o, naive_lse = reference.dense_forward(q, k, v, vis, 1 / np.sqrt(d), np.float32)
    ok, msgs = True, []
    if not all(all(np.array_equal(a, b) for a, b in zip(g, gathered[0])) for g in gathered):
        ok, msgs = False, ["ranks got different bits"]
    for label, o, lse in (("static", *gathered[0][:2]), ("kvcache", *gathered[0][2:])):
        for name, ours, ref, naive in (("o", o, ref_o, naive_o), ("lse", lse, ref_lse, naive_lse)):
            good, msg = reference.tolerance_check(f"{label} {name}", ours, ref, naive)
            ok &= good
            msgs.append(msg)
    return ok, "; ".join(msgs)


def torch_case(comm, case):
    """ringmpi.torch with D_v-wide values against torch's own SDPA on the gathered sequence:
    o and the autograd gradients, float64 SDPA the reference and float32 SDPA the naive
    error; the SDPA-shaped wrapper gives the same ``o``."""
    import torch
    import torch.nn.functional as F

    import ringmpi.torch as rt

    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, do, _, _ = make_inputs(case)
    lay_q, lay_kv = Layout(case["layout"], q.shape[1], size), Layout(case["layout"], k.shape[1], size)
    causal = case.get("causal", False)
    local = [torch.from_numpy(lay.shard(x, rank)).requires_grad_(True)
             for lay, x in ((lay_q, q), (lay_kv, k), (lay_kv, v))]
    context = RingContext(comm, layout=case["layout"])
    o = rt.ring_attention(*local, causal=causal, context=context).o
    o.backward(torch.from_numpy(lay_q.shard(do, rank)))
    o_sdpa = rt.scaled_dot_product_attention(*(t.detach().transpose(1, 2) for t in local), is_causal=causal,
                                             context=context).transpose(1, 2)
    mine = [o.detach().numpy(), o_sdpa.numpy()] + [t.grad.numpy() for t in local]
    gathered = comm.gather(mine, root=0)
    if rank != 0:
        return None
    lays = (lay_q, lay_q, lay_q, lay_kv, lay_kv)
    ours = [lay.unshard([g[i] for g in gathered], axis=1) for i, lay in enumerate(lays)]
    group = q.shape[2] // k.shape[2]

    def sdpa(dtype):
        args = [torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).to(dtype).requires_grad_(True)
                for x in (q, k, v)]
        kk, vv = (t.repeat_interleave(group, dim=1) for t in args[1:])
        out = F.scaled_dot_product_attention(args[0], kk, vv, is_causal=causal)
        out.backward(torch.from_numpy(np.ascontiguousarray(do.transpose(0, 2, 1, 3))).to(dtype))
        back = lambda t: t.detach().double().numpy().transpose(0, 2, 1, 3)  # noqa: E731
        return [back(out), back(out)] + [back(t.grad) for t in args]

    ref, naive = sdpa(torch.float64), sdpa(torch.float32)
    ok, msgs = np.array_equal(ours[0], ours[1]), []
    if not ok:
        msgs.append("the SDPA-shaped wrapper gave another o")
    for i, name in enumerate(("o", "o (sdpa-shaped)", "dq", "dk", "dv")):
        good, msg = reference.tolerance_check(name, ours[i], ref[i], naive[i], gradient=i >= 2)
        ok &= good
        msgs.append(msg)
    return ok, "; ".join(msgs)


def main():
    run_file(MPI.COMM_WORLD, {"errors": errors_case, "decode": decode_case, "torch": torch_case}, run_case)


if __name__ == "__main__":
    main()
