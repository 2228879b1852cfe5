"""Rank-side driver: many sharded linear-attention cases, every world size, in one mpirun launch.

    mpirun -n 7 python tests/mpi/linear_cases.py CASES.json

A case runs on the first ``P`` ranks (its ``P``; one sub-communicator per size, made up front),
largest ``P`` first, so a rank that no case needs any more only waits, asleep, for the end.

Every rank builds the same global inputs from the case's seed and passes its contiguous shard
(``lengths``: every rank's token count, uneven and empty shards included) to
``ringmpi.gated_delta_rule`` / ``simple_gla`` and their backwards (or the torch wrappers of
``ringmpi.torch_linear``).  Rank 0 gathers the shards and compares, in float64, outputs, final
state and every gradient with the sequential recurrence of ``tests/support/linear_reference.py``
(relative to each tensor's largest entry, <= 1e-10); in float32, outputs, final state and every
gradient with transformers' ``torch_chunk_gated_delta_rule`` (KDA: ``chunk_kimi_delta_attention``)
and its autograd (RMS-relative <= 1e-5).  A case's inputs and
references depend on its name only, so rank 0 computes each reference once for every ``P``.  Every rank must return
the same final state and initial-state gradient.  ``conv`` cases check ``causal_conv1d`` (halo,
documents, backward) against torch's ``conv1d`` per document, ``relayout`` cases every pair of
layouts bitwise (and the torch wrapper's gradient), ``hf-layer`` cases a real Qwen3-Next Gated
DeltaNet layer sharded (its convolution and rule replaced by ringmpi's) against the layer on
the whole sequence; ``error`` cases expect one ConfigError on
every rank.
"""

import functools
import json
import sys
import time

import numpy as np
from mpi4py import MPI

from case_driver import agreed_error, run_all  # first: it puts tests/support on the path
import ringmpi
from ringmpi import RingContext
from random_inputs import linear_inputs

EXACT = 1e-10   # float64: relative to the tensor's largest entry
DELTA = ("gdn", "kda")     # the delta rule: beta
PER_KEY = ("kda", "gla-key")  # a decay per key: g (B, T, HV, K)
CALLS = {"gdn": "gated_delta_rule", "kda": "kda", "gla": "simple_gla", "linear": "simple_gla", "gla-key": "gla"}
RMS_32 = 1e-5   # float32 against transformers' chunked reference, RMS-relative
FLOAT32_DECAY = 1e-6  # a float64 Qwen3-Next layer, whose decay g is computed in float32


def inputs(case):
    """The global inputs of a case (float64), the same on every rank."""
    rng = np.random.default_rng(case["seed"])
    b, n, h, hv, kd, vd = (case[x] for x in ("B", "N", "H", "HV", "K", "V"))
    x = linear_inputs(rng, b, n, h, hv, kd, vd, per_key=case["kind"] in PER_KEY, delta=case["kind"] in DELTA,
                      g=(0.0, 0.4))
    if case["kind"] == "linear":
        x["g"] = None
    rows = b if case.get("cu") is None else len(case["cu"]) - 1
    x["s0"] = rng.standard_normal((rows, hv, kd, vd)) if case.get("init") else None
    x["do"] = rng.standard_normal((b, n, hv, vd))
    x["dfinal"] = rng.standard_normal((rows, hv, kd, vd)) if case.get("final") else None
    return x


def shard(x, lengths, rank):
    lo = sum(lengths[:rank])
    return None if x is None else np.ascontiguousarray(x[:, lo:lo + lengths[rank]])


def run_numpy(comm, case, x, dtype):
    cast = (lambda a: None if a is None else a.astype(dtype))
    lengths, rank = case["lengths"], comm.Get_rank()
    mine = {name: cast(shard(x[name], lengths, rank)) for name in ("q", "k", "v", "g", "beta", "do")}
    common = dict(scale=case.get("scale"), initial_state=cast(x["s0"]), cu_seqlens=case.get("cu"),
                  context=RingContext(comm))
    forward, backward = (getattr(ringmpi, CALLS[case["kind"]] + s) for s in ("", "_backward"))
    inputs = ("q", "k", "v", "g", "beta") if case["kind"] in DELTA else ("q", "k", "v", "g")
    o, final = forward(*(mine[n] for n in inputs), output_final_state=bool(case.get("final")), **common)
    grads = backward(mine["do"], *(mine[n] for n in inputs), dfinal_state=cast(x["dfinal"]), **common)
    if case["kind"] not in DELTA:
        grads = grads[:4] + (None,) + grads[4:]
    return o, final, grads


def run_torch(comm, case, x):
    import torch

    """The autograd wrappers: the loss sum(o * do) on every rank plus sum(final * dfinal) on rank 0
    only (a replicated output's gradient is summed over ranks); the initial state's gradient is
    this rank's share, summed here."""
    import ringmpi.torch_linear as tl
    lengths, rank = case["lengths"], comm.Get_rank()
    leaf = {n: (None if shard(x[n], lengths, rank) is None else torch.tensor(shard(x[n], lengths, rank),
                                                                             requires_grad=True))
            for n in ("q", "k", "v", "g", "beta")}
    s0 = None if x["s0"] is None else torch.tensor(x["s0"], requires_grad=True)
    common = dict(scale=case.get("scale"), initial_state=s0, cu_seqlens=case.get("cu"), context=RingContext(comm),
                  output_final_state=bool(case.get("final")))
    if case["kind"] in DELTA:
        o, final = tl.gated_delta_rule(*(leaf[n] for n in ("q", "k", "v", "g", "beta")), **common)
    else:
        o, final = tl.simple_gla(*(leaf[n] for n in ("q", "k", "v", "g")), **common)
    loss = (o * torch.tensor(shard(x["do"], lengths, rank))).sum()
    if final is not None and rank == 0:
        loss = loss + (final * torch.tensor(x["dfinal"])).sum()
    loss.backward()
    dinit = None if s0 is None else s0.grad.numpy().copy()
    if dinit is not None:
        comm.Allreduce(MPI.IN_PLACE, dinit, op=MPI.SUM)
    grads = tuple(None if leaf[n] is None else leaf[n].grad.numpy() for n in ("q", "k", "v", "g", "beta"))
    return o.detach().numpy(), None if final is None else final.detach().numpy(), grads + (dinit,)


@functools.lru_cache(maxsize=None)
def reference(name):
    """The reference of a case (float64 recurrence, or transformers' in float32), once per name."""
    case = CASES_BY_NAME[name]
    x = inputs(case)
    return reference32(case, x) if case.get("dtype") == "float32" else reference64(case, x)


def reference64(case, x):
    import torch
    from linear_reference import recurrence

    t = {n: None if x[n] is None else torch.tensor(x[n], requires_grad=True)
         for n in ("q", "k", "v", "g", "beta", "s0")}
    g = t["g"] if t["g"] is not None else torch.zeros(x["v"].shape[:3], dtype=torch.float64)
    scale = case.get("scale") or case["K"] ** -0.5
    o, final = recurrence(t["q"], t["k"], t["v"], g, t["beta"], scale, t["s0"], case.get("cu"),
                          delta=case["kind"] in DELTA)
    loss = (o * torch.tensor(x["do"])).sum()
    if x["dfinal"] is not None:
        loss = loss + (final * torch.tensor(x["dfinal"])).sum()
    loss.backward()
    grads = tuple(None if t[n] is None else t[n].grad.numpy() for n in ("q", "k", "v", "g", "beta", "s0"))
    return o.detach().numpy(), final.detach().numpy(), grads


def reference32(case, x):
    """transformers' chunked gated delta rule in float32: outputs, final state, and the gradients
    its autograd gives."""
    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    t = {n: torch.tensor(x[n], dtype=torch.float32, requires_grad=True) for n in ("q", "k", "v", "g", "beta", "s0")}
    chunked = chunk_kimi_delta_attention if case["kind"] == "kda" else torch_chunk_gated_delta_rule
    o, final = chunked(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["s0"], output_final_state=True)
    ((o * torch.tensor(x["do"], dtype=torch.float32)).sum()
     + (final * torch.tensor(x["dfinal"], dtype=torch.float32)).sum()).backward()
    grads = tuple(t[n].grad.numpy() for n in ("q", "k", "v", "g", "beta", "s0"))
    return o.detach().numpy(), final.detach().numpy(), grads


def relative(ours, ref):
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-300)) if ref.size else 0.0


def rms_relative(ours, ref):
    return float(np.sqrt(np.mean((ours.astype(np.float64) - ref) ** 2) / np.mean(ref.astype(np.float64) ** 2)))


def same_on_every_rank(comm, a):
    every = comm.gather(None if a is None else a.tobytes(), root=0)
    return comm.Get_rank() != 0 or len(set(every)) == 1


def run_case(comm, case):
    x = inputs(case)
    dtype = np.dtype(case.get("dtype", "float64"))
    o, final, grads = run_torch(comm, case, x) if case.get("torch") else run_numpy(comm, case, x, dtype)
    replicated_ok = same_on_every_rank(comm, final) & same_on_every_rank(comm, grads[5])
    shards = comm.gather((o, grads[:5]), root=0)
    if comm.Get_rank() != 0:
        return True, ""
    whole = lambda parts: None if parts[0] is None else np.concatenate(parts, axis=1)  # noqa: E731
    o = whole([s[0] for s in shards])
    got = [whole([s[1][i] for s in shards]) for i in range(5)] + [grads[5]]
    msgs = [] if replicated_ok else ["ranks returned different final states or initial-state gradients"]
    if o.dtype != dtype or o.shape != x["v"].shape:
        msgs.append(f"o is {o.dtype} {o.shape}")
    o_ref, final_ref, ref_grads = reference(case["name"])
    if dtype == np.float32:
        errs = {"o": rms_relative(o, o_ref), "final": rms_relative(final, final_ref)}
        errs.update({name: rms_relative(ours, ref) for name, ours, ref in
                     zip(("dq", "dk", "dv", "dg", "dbeta", "dinit"), got, ref_grads)})
        bound = RMS_32
    else:
        errs = {"o": relative(o, o_ref)}
        if case.get("final"):
            errs["final"] = relative(final, final_ref)
        for name, ours, ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dinit"), got, ref_grads):
            if (ours is None) != (ref is None):
                msgs.append(f"{name}: got {'None' if ours is None else 'an array'}, reference the other")
            elif ours is not None:
                errs[name] = relative(ours, ref)
        bound = EXACT
    msgs += [f"{name} error {err:.3g} > {bound:g}" for name, err in errs.items() if not err <= bound]
    return not msgs, "; ".join(msgs) or " ".join(f"{n}={e:.1e}" for n, e in errs.items())


def conv_reference(x, w, b, dy, bounds, activation):
    """torch's conv1d on each document alone: ``(y, dx, dw, db)`` in float64."""
    import torch
    import torch.nn.functional as F

    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    width, parts = w.shape[1], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:
            y = F.conv1d(xt[:, lo:hi].transpose(1, 2), wt[:, None, :], bt, padding=width - 1, groups=w.shape[0])
            parts.append(y[..., :hi - lo].transpose(1, 2))
    y = torch.cat(parts, dim=1)
    y = F.silu(y) if activation else y
    (y * torch.tensor(dy)).sum().backward()
    return y.detach().numpy(), xt.grad.numpy(), wt.grad.numpy(), bt.grad.numpy()


def run_conv(comm, case):
    rng = np.random.default_rng(case["seed"])
    b, n, d, width = case["B"], case["N"], case["D"], case["W"]
    x, w, bias, dy = (rng.standard_normal(s) for s in ((b, n, d), (d, width), (d,), (b, n, d)))
    lengths, rank = case["lengths"], comm.Get_rank()
    act, cu = case.get("activation"), case.get("cu")
    if case.get("torch"):
        import torch
        import ringmpi.torch_linear as tl

        xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (shard(x, lengths, rank), w, bias))
        y = tl.causal_conv1d(xt, wt, bt, activation=act, cu_seqlens=cu, context=RingContext(comm))
        (y * torch.tensor(shard(dy, lengths, rank))).sum().backward()
        y, dx, dw, db = y.detach().numpy(), xt.grad.numpy(), wt.grad.numpy().copy(), bt.grad.numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, dw, op=MPI.SUM)  # the replicated parameters' shares
        comm.Allreduce(MPI.IN_PLACE, db, op=MPI.SUM)
    else:
        context = RingContext(comm)
        y = ringmpi.causal_conv1d(shard(x, lengths, rank), w, bias, activation=act, cu_seqlens=cu, context=context)
        dx, dw, db = ringmpi.causal_conv1d_backward(shard(dy, lengths, rank), shard(x, lengths, rank), w, bias,
                                                    activation=act, cu_seqlens=cu, context=context)
    same = same_on_every_rank(comm, dw) & same_on_every_rank(comm, db)
    shards = comm.gather((y, dx), root=0)
    if rank != 0:
        return True, ""
    ref = conv_reference(x, w, bias, dy, cu or [0, n], act)
    ours = (np.concatenate([s[0] for s in shards], axis=1), np.concatenate([s[1] for s in shards], axis=1), dw, db)
    errs = {name: relative(o, r) for name, o, r in zip(("y", "dx", "dw", "db"), ours, ref)}
    msgs = [] if same else ["ranks returned different parameter gradients"]
    msgs += [f"{name} error {e:.3g} > {EXACT:g}" for name, e in errs.items() if not e <= EXACT]
    return not msgs, "; ".join(msgs) or " ".join(f"{n}={e:.1e}" for n, e in errs.items())


def run_relayout(comm, case):
    from ringmpi import Layout

    n, size, rank = case["N"], comm.Get_size(), comm.Get_rank()
    x = np.random.default_rng(case["seed"]).standard_normal((2, n, 3)).astype(np.float32)
    kinds = [Layout("contiguous", n, size), Layout("zigzag", n, size), Layout("striped", n, size),
             Layout("balanced", n, size, documents=case["documents"], causal=True)]
    context = RingContext(comm)
    wrong = [(a, b) for a in kinds for b in kinds
             if not np.array_equal(ringmpi.relayout(a.shard(x, rank), a, b, context=context), b.shard(x, rank))]
    import torch
    import ringmpi.torch_linear as tl

    a, b = kinds[0], kinds[1]
    xt = torch.tensor(a.shard(x, rank), requires_grad=True)
    (tl.relayout(xt, a, b, context=context) * torch.tensor(b.shard(x, rank))).sum().backward()
    grad_ok = np.array_equal(xt.grad.numpy(), a.shard(x, rank))  # the gradient comes back to the source layout
    bad = comm.gather((wrong, grad_ok), root=0)
    if rank != 0:
        return True, ""
    wrong = [pair for w, _ in bad for pair in w]
    msgs = [f"{a.kind} -> {b.kind} differs" for a, b in wrong[:4]]
    msgs += [] if all(g for _, g in bad) else ["torch relayout's gradient did not come back to the source layout"]
    return not msgs, "; ".join(msgs)


def qwen3_next_layer(dtype):
    """A Gated DeltaNet layer of a tiny Qwen3-Next made from a config (random weights, seeded)."""
    import torch
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = Qwen3NextConfig(hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"],
                             linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                             linear_value_head_dim=6, linear_conv_kernel_dim=4, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    layer = Qwen3NextGatedDeltaNet(config, 0).to(dtype)
    with torch.no_grad():  # A_log's random start: decays well inside (0, 1)
        layer.A_log.copy_(torch.linspace(-2.0, 0.5, 4, dtype=dtype))
    return layer


def sharded_gated_deltanet(layer, hidden, comm):
    """The layer's forward on this rank's contiguous shard, with ringmpi's sharded convolution and
    gated delta rule in place of its own (what a hybrid model's integration does)."""
    import torch
    import torch.nn.functional as F
    import ringmpi.torch_linear as tl
    from transformers.models.qwen3_next.modeling_qwen3_next import l2norm

    q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(hidden), layer.in_proj_ba(hidden))
    mixed = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (q, k, v)], dim=-1)
    mixed = tl.causal_conv1d(mixed, layer.conv1d.weight[:, 0, :], layer.conv1d.bias, activation=layer.activation,
                             context=RingContext(comm))
    q, k, v = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    q, k = (l2norm(x.reshape(x.shape[0], x.shape[1], -1, layer.head_k_dim), dim=-1, eps=1e-6) for x in (q, k))
    v = v.reshape(v.shape[0], v.shape[1], -1, layer.head_v_dim)
    g = (-layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)).to(hidden.dtype)  # as the layer does
    o, _ = tl.gated_delta_rule(q, k, v, g, b.sigmoid(), context=RingContext(comm))
    o = layer.norm(o.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(o.reshape(hidden.shape[0], hidden.shape[1], -1))


def float64_chunk_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, **_):
    """transformers' chunked rule replaced by the sequential recurrence in float64 (its own computes in
    float32), so the float64 layer is a float64 reference."""
    from linear_reference import recurrence
    from transformers.models.qwen3_next.modeling_qwen3_next import l2norm

    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query, dim=-1, eps=1e-6), l2norm(key, dim=-1, eps=1e-6)
    o, final = recurrence(query, key, value, g.to(query.dtype), beta, query.shape[-1] ** -0.5, initial_state)
    return o, final if output_final_state else None


def run_hf_layer(comm, case):
    """A real Qwen3-Next Gated DeltaNet layer, sharded: output, input gradient and every parameter's
    gradient (this rank's share, summed over ranks) against the whole sequence on one process."""
    import torch
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    dtype = torch.float64 if case["dtype"] == "float64" else torch.float32
    layer = qwen3_next_layer(dtype)
    rng = np.random.default_rng(case["seed"])
    b, n = case["B"], case["N"]
    hidden, dout = (torch.tensor(rng.standard_normal((b, n, 32)), dtype=dtype) for _ in range(2))
    lengths, rank = case["lengths"], comm.Get_rank()
    lo, hi = sum(lengths[:rank]), sum(lengths[:rank + 1])
    mine = hidden[:, lo:hi].clone().requires_grad_(True)
    out = sharded_gated_deltanet(layer, mine, comm)
    (out * dout[:, lo:hi]).sum().backward()
    grads = {name: p.grad.detach().numpy().copy() for name, p in layer.named_parameters() if p.grad is not None}
    for g in grads.values():
        comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
    shards = comm.gather((out.detach().numpy(), mine.grad.numpy()), root=0)
    if rank != 0:
        return True, ""
    layer.zero_grad()
    whole = hidden.clone().requires_grad_(True)
    saved = qwen3_next.torch_chunk_gated_delta_rule
    if dtype == torch.float64:
        qwen3_next.torch_chunk_gated_delta_rule = float64_chunk_rule
    try:
        ref = layer(whole)
    finally:
        qwen3_next.torch_chunk_gated_delta_rule = saved
    (ref * dout).sum().backward()
    pairs = [("out", np.concatenate([s[0] for s in shards], axis=1), ref.detach().numpy()),
             ("dhidden", np.concatenate([s[1] for s in shards], axis=1), whole.grad.numpy())]
    pairs += [("d" + name, grads[name], p.grad.numpy()) for name, p in layer.named_parameters()]
    # the layer computes its decay g in float32 even in a float64 model (A_log.float(), a.float()), and a
    # shard's projections round differently from the whole's, so a float32 rounding of g may differ: the
    # float64 layer is exact to that island's rounding, not to 1e-10 (the rule itself is, cases above)
    measure, bound = (relative, FLOAT32_DECAY) if dtype == torch.float64 else (rms_relative, RMS_32)
    errs = {name: measure(ours, ref) for name, ours, ref in pairs}
    msgs = [f"{name} error {e:.3g} > {bound:g}" for name, e in errs.items() if not e <= bound]
    return not msgs, "; ".join(msgs) or " ".join(f"{n}={e:.1e}" for n, e in errs.items())


def run_error(comm, case):
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(0)
    n = 4
    q = rng.standard_normal((1, n, 2, 4))
    v = rng.standard_normal((1, n, 2, 3))
    g, beta = np.zeros((1, n, 2)), np.ones((1, n, 2))
    what = case["what"]
    if what == "heads_one_rank" and rank == size - 1:
        v = rng.standard_normal((1, n, 3, 3))
    cu = [0, 3, size * n + 1] if what == "cu_length" else None
    if what == "dtype_one_rank" and rank == 0:
        q = q.astype(np.float32)
    if what == "conv_width_one_rank":
        w = np.ones((3, 4 if rank < size - 1 else 3))
        call = lambda: ringmpi.causal_conv1d(np.ones((1, n, 3)), w, context=RingContext(comm))  # noqa: E731
    elif what == "relayout_rows_one_rank":
        layout = ringmpi.Layout("contiguous", size * n, size)
        rows = n + (rank == size - 1)
        call = lambda: ringmpi.relayout(np.ones((1, rows)), layout, layout, context=RingContext(comm))  # noqa: E731
    else:
        call = lambda: ringmpi.gated_delta_rule(q, q, v, g, beta, cu_seqlens=cu,  # noqa: E731
                                                context=RingContext(comm))
    problem = agreed_error(comm, call, case["expect"])
    return problem is None, problem or ""


CASES_BY_NAME = {}


def main():
    world = MPI.COMM_WORLD
    with open(sys.argv[1]) as fh:
        cases = json.load(fh)
    CASES_BY_NAME.update({c["name"]: c for c in cases if "name" in c})
    sizes = sorted({c["P"] for c in cases}, reverse=True)
    subs = {p: world.Split(0 if world.Get_rank() < p else MPI.UNDEFINED, world.Get_rank()) for p in sizes}
    kinds = {"error": run_error, "conv": run_conv, "relayout": run_relayout, "hf-layer": run_hf_layer}
    for p in sizes:
        if subs[p] != MPI.COMM_NULL:
            run_all(subs[p], [c for c in cases if c["P"] == p],
                    lambda case, comm=subs[p]: kinds.get(case["kind"], run_case)(comm, case))
    done = world.Ibarrier()  # ranks no case needs sleep here instead of spinning in MPI
    while not done.Test():
        time.sleep(0.01)


if __name__ == "__main__":
    main()
