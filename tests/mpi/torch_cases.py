"""Rank-side driver: run many ``ringmpi.torch`` cases in one mpirun launch.

    mpirun -n P python tests/mpi/torch_cases.py CASES.json

Every rank builds the same global inputs from the case's seed (``ring_cases.make_inputs``),
calls ``ringmpi.torch`` on its own shard, and rank 0 prints one line per case:
``CASE <json>``.  Tensors live on ``RINGMPI_TEST_DEVICE`` (``cpu`` or ``cuda``).

Case kinds:

``attn``      forward, LSE and gradients of ``sum(o * do)`` against a float64 dense
              torch autograd computation on the gathered sequence, under docs/design.md's
              tolerance rule (the "naive" error is the same dense computation in the
              input dtype).
``sdpa``      ``scaled_dot_product_attention`` (B, H, S, D) against
              ``torch.nn.functional.scaled_dot_product_attention``, forward and gradients.
``gradcheck`` ``torch.autograd.gradcheck`` (float64) of the global function
              ``(q, k, v) -> o`` built from the ring call on every rank.
``autograd``  gradients only where required, nothing kept under ``no_grad``, a
              non-differentiable LSE, double backward raises.
``shares``    the tensors handed to and returned by the backend share memory with
              the caller's (no hidden copies).
``errors``    a bad argument on one rank gives the same ConfigError on every rank.
``compile``   ``torch.compile(fullgraph=True)`` of a 2-layer model: one custom-op node per
              layer, compiled output and gradients equal eager's.
"""

import contextlib
import json
import math
import os
import sys

import numpy as np
import torch
from mpi4py import MPI

from case_driver import run_all
import reference
from ring_cases import make_inputs, placements
import ringmpi.torch as rt
from ringmpi import ConfigError, Layout, RingContext

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16,
          "float32": torch.float32, "float64": torch.float64}


def device_for(comm):
    if os.environ.get("RINGMPI_TEST_DEVICE", "cpu") == "cuda":
        return torch.device("cuda", comm.Get_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def host64(t):
    """A float64 NumPy copy of a tensor of any dtype/device."""
    return t.detach().to("cpu", torch.float64).numpy()


# ------------------------------------------------------------ dense references
def visibility(case, seg_q, seg_kv):
    window = None if case.get("window") is None else tuple(case["window"])
    n_q, n_kv = case["n_q"], case.get("n_kv", case["n_q"])
    return torch.from_numpy(reference.visible(n_q, n_kv, case.get("causal", False), window, seg_q, seg_kv))


def dense(q, k, v, vis, scale):
    """o (B, N_q, H, D), lse (B, H, N_q) of plain dense attention in q's dtype, differentiable.

    ``vis (B or 1, N_q, N_kv)`` bool; rows that see nothing give o = 0 and lse = -inf."""
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    vis = vis[:, None]
    seen = vis.any(-1, keepdim=True)
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(torch.where(seen, s, torch.zeros((), dtype=s.dtype)), dim=-1) * seen
    return (p @ vh).transpose(1, 2), lse


def dense_grads(q, k, v, do, vis, scale, dtype):
    """(o, lse, dq, dk, dv) of :func:`dense` computed in ``dtype``, as float64 NumPy arrays."""
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    o, lse = dense(*leaves, vis, scale)
    grads = torch.autograd.grad((o * do.to(dtype)).sum(), leaves)
    return [host64(x) for x in (o, lse) + tuple(grads)]


# ------------------------------------------------------------ helpers
def global_inputs(case):
    """q, k, v, do as float64 CPU tensors and segment ids as NumPy arrays (or None)."""
    q, k, v, do, seg_q, seg_kv = make_inputs(dict(case, dtype="float64"))
    return tuple(torch.from_numpy(x) for x in (q, k, v, do)) + (seg_q, seg_kv)


def positions_of(lay_q, lay_kv, rank, device):
    """The call's ``positions`` (a tuple for q and kv) for explicit placements, else nothing."""
    if isinstance(lay_q, Layout):
        return {}
    return dict(positions=tuple(torch.from_numpy(lay.indices(rank)).to(device) for lay in (lay_q, lay_kv)))


def local(comm, case, dtype, device, requires_grad=True):
    """This rank's shards: (q, k, v, do) tensors and the ring keywords (``context`` among them)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, do, seg_q, seg_kv = global_inputs(case)
    lay_q, lay_kv = placements(case, q.shape[1], k.shape[1], size, seg_q)
    iq, ikv = torch.from_numpy(lay_q.indices(rank)), torch.from_numpy(lay_kv.indices(rank))
    shards = [x.index_select(1, idx).to(device, dtype) for x, idx in ((q, iq), (k, ikv), (v, ikv), (do, iq))]
    if case.get("noncontiguous"):  # made as (B, H, S, D), handed over as a transposed view
        shards[:3] = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in shards[:3]]
    for x in shards[:3]:
        x.requires_grad_(requires_grad)
    balanced = getattr(lay_q, "kind", None) == "balanced"  # passed as the Layout object itself
    ring = RingContext(comm, layout=lay_q if balanced else case["layout"])
    if case.get("head_parallel") is not None:
        ring = ring.replace(head_parallel=case["head_parallel"])
    kw = dict(causal=case.get("causal", False), softmax_scale=case.get("scale"), context=ring)
    if case.get("window") is not None:
        kw["window"] = tuple(case["window"])
    kw.update(positions_of(lay_q, lay_kv, rank, device))
    if seg_q is not None:  # as tensors on the device: the wrapper takes them anywhere
        kw["segment_ids"] = (torch.from_numpy(lay_q.shard(seg_q, rank)).to(device),
                             torch.from_numpy(lay_kv.shard(seg_kv, rank)).to(device))
    return shards, kw, (lay_q, lay_kv)


def tolerance(messages, name, ours, ref, naive, gradient):
    ok, msg = reference.tolerance_check(name, ours, ref, naive, gradient=gradient)
    messages.append(msg)
    return ok


# ------------------------------------------------------------ cases
def attn_case(comm, case, device):
    dtype = DTYPES[case.get("dtype", "float32")]
    (q, k, v, do), kw, (lay_q, lay_kv) = local(comm, case, dtype, device)
    stream = torch.cuda.Stream(device) if case.get("stream") and device.type == "cuda" else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        if stream is not None:
            # a fresh stream whose queued work (a long GEMM) produces q: a call that
            # does not run on torch's current stream reads q before it is written
            big = torch.randn(4096, 4096, device=device)
            q = (q + 0 * (big @ big).sum()).detach().requires_grad_(True)
        stats = [] if case.get("expect_schedule") else None
        kw["context"] = kw["context"].replace(stats=stats)
        o, lse, _ = rt.ring_attention(q, k, v, **kw)
        (o * do).sum().backward()
        mine = [host64(x) for x in (o, lse, q.grad, k.grad, v.grad)]
    ran = None if stats is None else {r.schedule for r in stats}
    want = case.get("expect_schedule")
    if stats is not None and (ran != {want} if want != "auto" else  # auto: per pass its choice (issue 53)
                              not ran or not ran <= {"ring", "routed", "allgather"}
                              or not any(r.predicted_s for r in stats)):
        problems = [f"rank {comm.Get_rank()} ran {sorted({r.schedule for r in stats})}"]
    else:
        problems = []
    want_lse = torch.float64 if dtype == torch.float64 else torch.float32
    problems += [f"{n} {x.dtype} on {x.device}" for n, x, dt in
                (("o", o, dtype), ("lse", lse, want_lse), ("dq", q.grad, dtype), ("dk", k.grad, dtype),
                 ("dv", v.grad, dtype)) if x.dtype != dt or x.device != device]
    gathered = comm.gather(mine, root=0)
    problems = sum(comm.allgather(problems), [])
    if comm.Get_rank() != 0:
        return None
    gq, gk, gv, gdo, seg_q, seg_kv = global_inputs(case)
    vis = visibility(case, seg_q, seg_kv)
    scale = case.get("scale") or 1.0 / math.sqrt(gq.shape[3])
    rounded = [x.to(dtype) for x in (gq, gk, gv, gdo)]  # the inputs the ring saw
    ref = dense_grads(*rounded, vis, scale, torch.float64)
    naive = dense_grads(*rounded, vis, scale, dtype)
    messages = [f"wrong dtype/device: {problems}"] if problems else []
    ok = not problems
    for i, (name, lay, axis) in enumerate((("o", lay_q, 1), ("lse", lay_q, 2), ("dq", lay_q, 1),
                                           ("dk", lay_kv, 1), ("dv", lay_kv, 1))):
        ours = lay.unshard([g[i] for g in gathered], axis=axis)
        ok &= tolerance(messages, name, ours, ref[i], naive[i], gradient=i >= 2)
    return ok, "; ".join(messages)


def sdpa_case(comm, case, device):
    (q, k, v, do), kw, (lay_q, lay_kv) = local(comm, dict(case, dtype="float64"), torch.float64, device)
    heads = lambda x: x.detach().transpose(1, 2).requires_grad_(True)  # noqa: E731
    qh, kh, vh = heads(q), heads(k), heads(v)
    causal, scale = kw.pop("causal"), kw.pop("softmax_scale")
    o = rt.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale, **kw)
    (o * do.transpose(1, 2)).sum().backward()
    mine = [host64(x) for x in (o.transpose(1, 2), qh.grad.transpose(1, 2), kh.grad.transpose(1, 2),
                                vh.grad.transpose(1, 2))]
    gathered = comm.gather(mine, root=0)
    if comm.Get_rank() != 0:
        return None
    gq, gk, gv, gdo, _, _ = global_inputs(case)
    leaves = [x.transpose(1, 2).clone().requires_grad_(True) for x in (gq, gk, gv)]
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=case.get("causal", False),
                                                           enable_gqa=True)
    (ref * gdo.transpose(1, 2)).sum().backward()
    refs = [host64(x.transpose(1, 2)) for x in (ref, leaves[0].grad, leaves[1].grad, leaves[2].grad)]
    ok, messages = True, []
    for i, (name, lay) in enumerate((("o", lay_q), ("dq", lay_q), ("dk", lay_kv), ("dv", lay_kv))):
        err = reference.max_err(lay.unshard([g[i] for g in gathered], axis=1), refs[i])
        ok &= err <= 1e-12
        messages.append(f"{name}: err {err:.3g} vs torch SDPA (bound 1e-12)")
    return ok, "; ".join(messages)


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum of ``x`` over the ranks; backward: the gradient as is
    (every rank evaluates the same loss of the replicated result)."""

    @staticmethod
    def forward(ctx, x, comm):
        buf = x.detach().cpu().numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, buf)
        return torch.from_numpy(buf).to(x.device)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Replicated(torch.autograd.Function):
    """Forward: ``x`` as is (the same on every rank); backward: the gradient summed over ranks."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        buf = g.detach().cpu().numpy().copy()
        ctx.comm.Allreduce(MPI.IN_PLACE, buf)
        return torch.from_numpy(buf).to(g.device), None


def gradcheck_case(comm, case, device):
    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, _, seg_q, seg_kv = global_inputs(case)
    lay_q, lay_kv = Layout(case["layout"], q.shape[1], size), Layout(case["layout"], k.shape[1], size)
    iq, ikv = (torch.from_numpy(lay.indices(rank)).to(device) for lay in (lay_q, lay_kv))
    kw = dict(causal=case.get("causal", False), context=RingContext(comm, layout=case["layout"]))
    if seg_q is not None:
        kw["segment_ids"] = (lay_q.shard(seg_q, rank), lay_kv.shard(seg_kv, rank))

    def global_attention(qg, kg, vg):
        ql, kl, vl = (_Replicated.apply(x, comm).index_select(1, idx)
                      for x, idx in ((qg, iq), (kg, ikv), (vg, ikv)))
        ol = rt.ring_attention(ql, kl, vl, **kw).o
        scattered = torch.zeros(ol.shape[0], qg.shape[1], *ol.shape[2:], dtype=ol.dtype, device=device)
        return _SumOverRanks.apply(scattered.index_copy(1, iq, ol), comm)

    inputs = tuple(x.to(device).requires_grad_(True) for x in (q, k, v))
    ok = torch.autograd.gradcheck(global_attention, inputs, eps=1e-6, atol=1e-7, rtol=1e-5,
                                  raise_exception=False)
    return ok, f"torch.autograd.gradcheck (float64, {sum(x.numel() for x in inputs)} inputs): {ok}"


def autograd_case(comm, case, device):
    (q, k, v, do), kw, _ = local(comm, case, torch.float32, device)
    failures = []

    def expect(cond, what):
        if not cond:
            failures.append(what)

    with torch.no_grad():
        o, _, _ = rt.ring_attention(q, k, v, **kw)
    expect(o.grad_fn is None and not o.requires_grad, "no_grad forward built a graph")
    o, _, _ = rt.ring_attention(q.detach(), k.detach(), v.detach(), **kw)
    expect(o.grad_fn is None, "a forward without inputs requiring grad built a graph")
    o, lse, _ = rt.ring_attention(q, k, v, **kw)
    expect(o.grad_fn is not None and not lse.requires_grad, "o not differentiable or lse differentiable")
    full = torch.autograd.grad((o * do).sum(), (q, k, v))
    k_only = k.detach().requires_grad_(True)
    o, _, _ = rt.ring_attention(q.detach(), k_only, v.detach(), **kw)
    (o * do).sum().backward()
    expect(k_only.grad is not None and torch.equal(k_only.grad, full[1]), "k-only gradient differs")
    o, _, _ = rt.ring_attention(q, k, v, **kw)
    (dq,) = torch.autograd.grad((o * do).sum(), (q,), create_graph=True)
    try:
        dq.sum().backward()
        failures.append("double backward did not raise")
    except RuntimeError as exc:
        expect("cannot be differentiated twice" in str(exc), f"double backward raised an unclear error: {exc}")
    failures = comm.gather(failures, root=0)
    if comm.Get_rank() != 0:
        return None
    bad = [f"rank {r}: {f}" for r, fs in enumerate(failures) for f in fs]
    return not bad, "; ".join(bad) or "grad only where required, nothing kept under no_grad, double backward raises"


def _pointer(a):
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


def shares_case(comm, case, device):
    """The arrays the backend reads and writes are the caller's tensors' memory (the op's calls of
    :func:`ringmpi.attention.forward` and :func:`ringmpi.attention.backward`, spied on)."""
    dtype = DTYPES[case.get("dtype", "float32")]
    (q, k, v, do), kw, _ = local(comm, case, dtype, device)
    seen = {}
    real_fwd, real_bwd = rt.ring_forward, rt.ring_backward  # the library calls the op makes

    def spy(name, real):
        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            seen[name] = (args, out)
            return out
        return call

    rt.ring_forward = spy("fwd", real_fwd)
    rt.ring_backward = spy("bwd", real_bwd)
    try:
        o, lse, _ = rt.ring_attention(q, k, v, **kw)
        grads = torch.autograd.grad(o, (q, k, v), do)
    finally:
        rt.ring_forward, rt.ring_backward = real_fwd, real_bwd
    (fq, fk, fv), (fo, flse, _) = seen["fwd"]
    (bdo, bq, bk, bv, bo, blse), bgrads = seen["bwd"]
    pairs = [("q in", q, fq), ("k in", k, fk), ("v in", v, fv), ("o out", o, fo), ("lse out", lse, flse),
             ("do in", do, bdo), ("o saved", o, bo), ("lse saved", lse, blse)]
    pairs += [(f"d{n} out", g, a) for n, g, a in zip("qkv", grads, bgrads)]
    empty = q.numel() == 0 or k.numel() == 0
    bad = [n for n, t, a in pairs if t.numel() and t.data_ptr() != _pointer(a)]
    bad = comm.gather(bad, root=0)
    if comm.Get_rank() != 0:
        return None
    failing = {f"rank {r}": b for r, b in enumerate(bad) if b}
    return not failing, (f"copies found: {failing}" if failing else
                         f"inputs, outputs, saved tensors and gradients share memory with the backend's arrays"
                         f"{' (empty shard on some rank)' if empty else ''}")


def errors_case(comm, case, device):
    (q, k, v, _), kw, _ = local(comm, case, torch.float32, device)
    results, ring = [], kw["context"]
    attempts = [("a NumPy q on rank 1", dict(q=q.detach().cpu().numpy() if comm.Get_rank() == 1 else q)),
                ("a backend that does not fit the device",
                 dict(context=ring.replace(backend="numpy" if device.type == "cuda" else "cupy"))),
                ("a window the op's int arguments cannot hold, on rank 1",  # AttentionOptions names it
                 dict(window=(1.5, 0) if comm.Get_rank() == 1 else (-1, -1))),
                ("head_parallel=2.5 on every rank", dict(context=ring.replace(head_parallel=2.5)))]
    for what, change in attempts:
        args = dict(q=q, k=k, v=v, **kw)
        args.update(change)
        try:
            rt.ring_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
            results.append(f"{what}: no error")
        except ConfigError as exc:
            results.append(f"{what}: ConfigError: {exc}")
    gathered = comm.gather(results, root=0)
    if comm.Get_rank() != 0:
        return None
    same = all(g == gathered[0] for g in gathered)
    raised = all(": ConfigError: " in r for r in gathered[0])
    return same and raised, f"identical on every rank: {same}; " + "; ".join(gathered[0])


def compile_case(comm, case, device):
    """torch.compile(fullgraph=True) of a 2-layer model with RingSelfAttention (one with sinks,
    one with ALiBi; with ``positions``, explicit positions as tensor arguments): each layer's ring
    call is one node of the graph (the custom op, traced through its fake implementation), and the
    compiled forward and gradients equal eager's."""
    rank, size = comm.Get_rank(), comm.Get_size()
    n, dim = case["n_q"], 16
    lay, _ = placements(case, n, n, size)
    positions = None if isinstance(lay, Layout) else torch.from_numpy(lay.indices(rank))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float32)
    ring = RingContext(comm, layout=case["layout"])

    class PlacedSelfAttention(rt.RingSelfAttention):
        """RingSelfAttention whose ring call also takes ALiBi slopes and explicit positions
        (ring_attention's keywords that the module does not take)."""

        def __init__(self, *args, alibi_slopes=None, **kw):
            super().__init__(*args, **kw)
            self.alibi_slopes = alibi_slopes

        def forward(self, x):
            b, s, _ = x.shape
            q = self.q_proj(x).view(b, s, self.heads, self.head_dim)
            k, v = self.kv_proj(x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
            o, _, _ = rt.ring_attention(q, k, v, causal=self.causal, window=self.window, softcap=self.softcap,
                                        sinks=self.sinks, alibi_slopes=self.alibi_slopes, positions=positions,
                                        context=self.context)
            return self.out_proj(o.reshape(b, s, self.heads * self.head_dim))

    class TwoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(
                PlacedSelfAttention(dim, 4, 2, sinks=i == 1, causal=True, context=ring,
                                    alibi_slopes=slopes if i == 0 else None)
                for i in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)
            return x

    torch.manual_seed(case["seed"])
    eager = TwoLayers().to(device, torch.float64)
    compiled_model = TwoLayers().to(device, torch.float64)
    compiled_model.load_state_dict(eager.state_dict())
    x = torch.randn(1, n, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(case["seed"]))
    x = lay.shard(x, rank).to(device)
    ring_nodes = []

    def backend(gm, example_inputs):
        ops = (torch.ops.ringmpi.ring_attention, torch.ops.ringmpi.ring_attention.default)
        ring_nodes.append(sum(n.op == "call_function" and n.target in ops for n in gm.graph.nodes))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(compiled_model, backend=backend, fullgraph=True)
    outs = []
    for model in (eager, compiled):
        y = model(x)
        (y * y).sum().backward()
        outs.append([y.detach()] + [p.grad for p in (eager if model is eager else compiled_model).parameters()])
    errs = [float((a - b).abs().max() / b.abs().max().clamp(min=1e-300)) for a, b in zip(outs[1], outs[0])]
    worst = comm.allreduce(max(errs), op=MPI.MAX)
    ok = worst <= 1e-12 and ring_nodes == [2]
    return ok, f"ring nodes per graph {ring_nodes}; compiled vs eager output and {len(errs) - 1} gradients: {worst:.2e}"


KINDS = {"attn": attn_case, "sdpa": sdpa_case, "gradcheck": gradcheck_case,
         "autograd": autograd_case, "shares": shares_case, "errors": errors_case, "compile": compile_case}


def main():
    comm = MPI.COMM_WORLD
    device = device_for(comm)
    with open(sys.argv[1]) as fh:
        cases = json.load(fh)
    run_all(comm, cases, lambda case: KINDS[case.get("kind", "attn")](comm, case, device))


if __name__ == "__main__":
    main()
