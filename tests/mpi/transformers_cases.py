"""Rank-side driver: Hugging Face models with ``attn_implementation="ringmpi"`` in one mpirun launch.

    mpirun -n P python tests/mpi/transformers_cases.py CASES.json

Every rank builds the same tiny random-weight model from a config made here
(no hub downloads) and the same global batch; rank 0 also runs the same
weights with HF's own attention (``sdpa``, or ``eager`` where HF's sdpa
refuses softcap or sinks) on the whole batch in one process.  Then each rank
runs ``model(**ringmpi.transformers.shard_batch(batch, ...))``, and the
README's recipe: backward of this rank's share of the global mean loss,
every parameter's gradient summed over the ranks.  Rank 0 prints one
``CASE <json>`` line per case.

Case kinds:

``compare``  logits (gathered), HF's ``out.loss`` (summed over ranks) and every
             parameter gradient against HF on one process: float64 <= 1e-10 and
             float32 <= 1e-4 relative (max error / max magnitude per tensor);
             bfloat16 under docs/design.md's gradient rule against a float64 HF run,
             with a bfloat16 HF run as the naive error.  ``qwen3-next-packed``: three
             documents in one row, the reference each document run on its own (HF's Gated
             DeltaNet layer would carry its state from one into the next).
``dropout``  attention dropout in training mode: logits and gradients at P ranks equal
             a one-rank ringmpi run (COMM_SELF) for one seed, and differ for
             another step.
``errors``   one ConfigError on every rank: position_ids that do not match the
             layout, no shard context, a shard given to HF's own attention, dropout
             without a seed, padded rows (B > 1) through Qwen3-Next's Gated DeltaNet.
``invariant`` ``shard_batch(..., context=RingContext(..., invariant=True))``: every attention call's
             ``o`` and the gradients of its ``q, k, v`` (gathered over the ranks) are bitwise what
             ``ringmpi.torch.ring_attention`` with ``invariant=True`` gives on one rank for the same
             ``q, k, v`` and upstream gradient.  The rest of the model is torch's, whose bits
             may move with P, so each layer is checked on the inputs it got.
"""

import contextlib

import numpy as np
import torch
from mpi4py import MPI

from case_driver import agreed_error, run_file
from linear_reference import float64_delta_rule
import reference
import ringmpi
import ringmpi.transformers as rmt
import transformers
from ringmpi import RingContext

# Qwen3-Next's Gated DeltaNet computes its decay from ``A_log.float()`` in any dtype, so A_log's gradient
# is float32 arithmetic (each rank's share rounded to float32, then summed): float32's rounding, ~6e-8
# relative per operation (measured 1.2e-7 at P = 2, 6.5e-8 at P = 3), bounds it, not float64's
FLOAT32_DECAY = 1e-6
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.2,
             attention_dropout=0.0, tie_word_embeddings=False)


def config_for(model: str):
    """(config, HF's reference attention) of one tiny model family."""
    if model in ("llama", "packed", "packed-rows", "left-padding", "dropout"):
        return transformers.LlamaConfig(**SMALL), "sdpa"
    if model == "packed-dynamic":  # dynamic NTK rotary: frequencies from the longest document's length (issue 54)
        return transformers.LlamaConfig(**dict(SMALL, max_position_embeddings=16), rope_parameters=dict(
            rope_type="dynamic", factor=2.0, rope_theta=10000.0)), "sdpa"
    if model == "qwen2":
        return transformers.Qwen2Config(**SMALL, attention_bias=True), "sdpa"
    if model == "mistral":
        return transformers.MistralConfig(**SMALL, sliding_window=13), "sdpa"
    if model == "gemma2":
        return transformers.Gemma2Config(**dict(SMALL, tie_word_embeddings=True), query_pre_attn_scalar=5,
                                         attn_logit_softcapping=1.5, final_logit_softcapping=3.0,
                                         sliding_window=11, layer_types=["sliding_attention", "full_attention"],
                                         pad_token_id=0), "eager"
    if model == "gpt-oss":  # the experts' loop: torch's grouped_mm has no float64
        return transformers.GptOssConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=9,
                                         layer_types=["sliding_attention", "full_attention"],
                                         experts_implementation="eager"), "eager"
    if model == "mixtral-padded":  # router load-balancing loss on: computed from every rank's tokens (issue 54)
        return transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2,
                                          output_router_logits=True, router_aux_loss_coef=0.5,
                                          experts_implementation="eager"), "eager"
    if model in ("qwen3-next", "qwen3-next-packed"):  # the hybrid: Gated DeltaNet layers (the scan) between
        # attention layers (the ring); -packed: three documents in one row
        return transformers.Qwen3NextConfig(**dict(SMALL, num_hidden_layers=4), layer_types=[
            "linear_attention", "full_attention", "linear_attention", "full_attention"], linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            experts_implementation="eager"), "eager"
    raise ValueError(model)


def build(case, impl, dtype, dropout=0.0):
    cfg, ref_impl = config_for(case["model"])
    cfg.attention_dropout = dropout
    torch.manual_seed(case["seed"])
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=ref_impl if impl == "ref" else impl)
    model = model.to(torch.float64)
    if case["model"] == "gpt-oss":  # sinks well away from zero, so that a wrong gradient shows
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    if case["model"] in ("qwen3-next", "qwen3-next-packed"):  # decays well inside (0, 1), as the layer test's
        with torch.no_grad():
            for layer in model.model.layers:
                if hasattr(layer, "linear_attn"):
                    layer.linear_attn.A_log.copy_(torch.linspace(-2.0, 0.5, 4, dtype=torch.float64))
    return model.to(DTYPES[dtype])


def make_batch(case):
    """The global batch: input_ids (B, N), labels, and per model family position_ids/attention_mask."""
    rng = np.random.default_rng(case["seed"])
    b, n = case.get("B", 1), case["n"]
    ids = torch.from_numpy(rng.integers(1, 64, size=(b, n)))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if case["model"] in ("packed", "packed-dynamic", "qwen3-next-packed"):  # three documents in one row:
        # position_ids restart
        cuts = [0, n // 3, n // 3 + n // 2, n]
        batch["position_ids"] = torch.cat([torch.arange(cuts[i + 1] - cuts[i]) for i in range(3)])[None]
    if case["model"] == "packed-rows":  # a different pack per row (one long document in row 0)
        rows = [[0, n - 9, n - 8, n], [0, 7, 8, 30, n]]
        batch["position_ids"] = torch.stack([torch.cat([torch.arange(c[i + 1] - c[i]) for i in range(len(c) - 1)])
                                             for c in rows[:b]])
    if case["model"] in ("left-padding", "mixtral-padded"):
        mask = torch.ones(b, n, dtype=torch.int64)
        mask[1, :9] = 0
        batch["attention_mask"] = mask
        batch["labels"] = ids.masked_fill(mask == 0, rmt.IGNORE_INDEX)
    return batch


def shifted(batch):
    """What shard_batch predicts: the globally shifted labels (padding predicts nothing)."""
    full = rmt.shard_batch(batch, context=RingContext(MPI.COMM_SELF, layout="contiguous"), step=0)
    return full["shift_labels"], full["num_items_in_batch"]


def mean_loss(logits, labels, count):
    """This rank's share of the global mean cross-entropy, in the logits' dtype."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum",
                                             ignore_index=rmt.IGNORE_INDEX) / count


@contextlib.contextmanager
def float64_softmax():
    """HF's eager attention takes its softmax in float32 whatever the input dtype (Gemma 2:
    ``softmax(..., dtype=torch.float32)``); a float64 reference must keep float64."""
    real = torch.nn.functional.softmax

    def softmax(x, dim=None, _stacklevel=3, dtype=None):
        return real(x, dim=dim, dtype=torch.float64 if x.dtype == torch.float64 else dtype)
    torch.nn.functional.softmax = softmax
    try:
        yield
    finally:
        torch.nn.functional.softmax = real


def keep_float64_norms():
    """Gemma 2's RMSNorm computes in float32 whatever the dtype (``x.float()``); in float64 runs
    (ours and HF's alike) it keeps float64, so that the comparison sees the attention, not that."""
    from transformers.models.gemma2 import modeling_gemma2 as gemma2
    real = gemma2.Gemma2RMSNorm.forward

    def forward(self, x):
        if x.dtype != torch.float64:
            return real(self, x)
        return self._norm(x) * (1.0 + self.weight)
    gemma2.Gemma2RMSNorm.forward = forward


def keep_float64_qwen3_next():
    """Qwen3-Next's RMSNorms (plain and gated) compute in float32 whatever the dtype; in float64 runs
    (ours and HF's alike) they keep float64, as Gemma 2's do."""
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next
    norm, gated = qwen3_next.Qwen3NextRMSNorm.forward, qwen3_next.Qwen3NextRMSNormGated.forward

    def norm_forward(self, x):
        return norm(self, x) if x.dtype != torch.float64 else self._norm(x) * (1.0 + self.weight)

    def gated_forward(self, x, gate):
        if x.dtype != torch.float64:
            return gated(self, x, gate)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)) * (
            torch.nn.functional.silu(gate))
    qwen3_next.Qwen3NextRMSNorm.forward = norm_forward
    qwen3_next.Qwen3NextRMSNormGated.forward = gated_forward


def run_reference(case, dtype):
    """HF's own attention on one process: logits, HF's out.loss, gradients of the mean loss."""
    batch = make_batch(case)
    labels, count = shifted(batch)
    model = build(case, "ref", dtype)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with float64_softmax(), float64_delta_rule():
        if case["model"] == "qwen3-next-packed":  # each document on its own (HF's Gated DeltaNet would carry
            # its state across them): the logits side by side, the loss over all of them
            starts = [0] + [i for i in range(1, batch["position_ids"].shape[1]) if batch["position_ids"][0, i] == 0]
            ends = starts[1:] + [batch["position_ids"].shape[1]]
            logits = torch.cat([model(input_ids=batch["input_ids"][:, a:z], use_cache=False).logits
                                for a, z in zip(starts, ends)], dim=1)
            loss = mean_loss(logits, labels, count)
            loss.backward()
            loss = loss.item()
        else:
            out = model(**inputs, labels=labels, shift_labels=labels, use_cache=False)
            logits, loss = out.logits, out.loss.item()
            mean_loss(logits, labels, count).backward()
    grads = {name: p.grad.double().numpy().copy() for name, p in model.named_parameters()}
    return logits.detach().double().numpy(), loss, grads


def run_ringmpi(comm, case, dtype, layout="zigzag", dropout=0.0, seed=None, step=0, train=False):
    """ringmpi on comm: gathered logits, out.loss summed over ranks, gradients summed over ranks."""
    batch = make_batch(case)
    model = build(case, "ringmpi", dtype, dropout)
    model.train(train)
    layout = case.get("layout", layout)
    shard = rmt.shard_batch(batch, context=RingContext(comm, layout=layout), dropout_seed=seed, step=step)
    with float64_softmax():  # as the reference's: Qwen3-Next's router takes its softmax in float32 too
        out = model(**shard)
    mean_loss(out.logits, shard["shift_labels"], shard["num_items_in_batch"]).backward()
    grads = {}
    for name, p in model.named_parameters():  # the README recipe: sum every gradient over the ranks
        g = p.grad.double().numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, g)
        grads[name] = g
    if layout == "balanced":  # one flattened row (1, B * N) placed by the balanced Layout
        logits = rmt.gather(out.logits, context=shard[rmt.CONTEXT_KEY].ring)
        logits = logits.reshape(*batch["input_ids"].shape, -1).double().numpy()
    else:
        logits = rmt.gather(out.logits, context=RingContext(comm, layout=layout)).double().numpy()
    return logits, comm.allreduce(out.loss.item()), grads


def rel(ours, ref, real=None):
    if real is not None:
        ours, ref = ours[real], ref[real]
    scale = np.abs(ref).max()
    err = np.abs(ours - ref).max()
    return err / scale if scale > 0 else err


def compare_case(comm, case):
    dtype = case["dtype"]
    ours = run_ringmpi(comm, case, dtype)
    if comm.Get_rank() != 0:
        return None
    batch = make_batch(case)
    real = None if "attention_mask" not in batch else batch["attention_mask"].numpy().astype(bool)
    if dtype == "bfloat16":
        return bf16_check(case, ours, real)
    ref = run_reference(case, dtype)
    tol = {"float64": 1e-10, "float32": 1e-4}[dtype]
    errs = {"logits": rel(ours[0], ref[0], real)}
    errs.update({f"grad {n}": rel(ours[2][n], ref[2][n]) for n in ref[2]})
    loss_err = abs(ours[1] - ref[1]) / abs(ref[1])  # HF's out.loss is float32 (logits.float()) in any dtype
    limits = {name: max(tol, FLOAT32_DECAY) if name.endswith("A_log") else tol for name in errs}
    worst = max(errs, key=lambda name: errs[name] / limits[name])
    ok = all(errs[name] <= limits[name] for name in errs) and loss_err <= 1e-5 and sorted(ours[2]) == sorted(ref[2])
    return ok, (f"logits and {len(errs) - 1} gradients, worst {worst}: {errs[worst]:.2e} relative "
                f"(limit {limits[worst]:g}); "
                f"logits {errs['logits']:.2e}; out.loss summed over ranks {ours[1]:.7f} vs HF {ref[1]:.7f}")


def bf16_check(case, ours, real):
    """docs/design.md's gradient rule: error vs float64 <= 3x HF's own bfloat16 error + 1e-5."""
    ref, naive = run_reference(case, "float64"), run_reference(case, "bfloat16")
    problems, names = [], ["logits"] + sorted(ref[2])
    for name in names:
        a, r, nv = ((ours[0], ref[0], naive[0]) if name == "logits"
                    else (ours[2][name], ref[2][name], naive[2][name]))
        if real is not None and name == "logits":
            a, r, nv = a[real], r[real], nv[real]
        good, msg = reference.tolerance_check(name, a, r, nv, gradient=True)
        if not good:
            problems.append(msg)
    return not problems, "; ".join(problems) or f"{len(names)} tensors within 3x HF bfloat16's error + 1e-5"


def dropout_case(comm, case):
    """Attention dropout: the same masks for every P (one seed), new ones for another step."""
    args = dict(dtype="float64", dropout=0.25, seed=1234, train=True)
    ours = run_ringmpi(comm, case, step=5, **args)
    if comm.Get_rank() != 0:
        return None
    one = run_ringmpi(MPI.COMM_SELF, case, step=5, **args)
    other_step = run_ringmpi(MPI.COMM_SELF, case, step=6, **args)
    plain = run_ringmpi(MPI.COMM_SELF, case, dtype="float64")
    errs = {"logits": rel(ours[0], one[0])}
    errs.update({f"grad {n}": rel(ours[2][n], one[2][n]) for n in one[2]})
    worst = max(errs, key=errs.get)
    moved = {"no dropout": rel(one[0], plain[0]), "step 6": rel(one[0], other_step[0])}
    ok = errs[worst] <= 1e-10 and min(moved.values()) > 1e-3
    return ok, (f"P={comm.Get_size()} vs one rank: worst {worst} {errs[worst]:.2e}; "
                f"logits differ from no dropout by {moved['no dropout']:.2e}, from step 6 by {moved['step 6']:.2e}")


def invariant_case(comm, case):
    """The attention calls of an ``invariant=True`` model at P ranks against one rank's, bit for bit."""
    calls = []

    def capture(module, query, key, value, attention_mask, **kw):
        # q, k, v cut from the model's graph: their gradients are this attention call's own
        query, key, value = (x.detach().requires_grad_() for x in (query, key, value))
        o, none = rmt.attention_forward(module, query, key, value, attention_mask, **kw)
        seen = dict(module=module, kw=kw, q=query, k=key, v=value, o=o.detach().clone())
        o.register_hook(lambda g: seen.update(do=g.detach().clone()))
        calls.append(seen)
        return o, none

    transformers.AttentionInterface.register("ringmpi-capture", capture)
    batch = make_batch(case)
    model = build(case, "ringmpi-capture", case["dtype"])
    ring = RingContext(comm, layout=case["layout"], invariant=True)
    shard = rmt.shard_batch(batch, context=ring, step=0)
    out = model(**shard)
    mean_loss(out.logits, shard["shift_labels"], shard["num_items_in_batch"]).backward()

    def gathered(x, axis):
        """``x`` of this rank's tokens (sequence along ``axis``) as the whole sequence."""
        return rmt.gather(x, context=ring, axis=axis).numpy()

    one = rmt.shard_batch(batch, context=RingContext(MPI.COMM_SELF, layout="contiguous", invariant=True),
                          step=0)[rmt.CONTEXT_KEY]
    problems = []
    for i, seen in enumerate(calls):
        got = dict(o=gathered(seen["o"], 1), do=gathered(seen["do"], 1))
        got.update({f"d{n}": gathered(seen[n].grad, 2) for n in "qkv"})
        q, k, v = (gathered(seen[n], 2) for n in "qkv")
        if comm.Get_rank():
            continue
        q, k, v = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
        kw = {name: x for name, x in seen["kw"].items() if name not in ("position_ids", rmt.CONTEXT_KEY)}
        o, _ = rmt.attention_forward(seen["module"], q, k, v, None, ringmpi_context=one, **kw)
        o.backward(torch.from_numpy(got["do"]))
        want = dict(o=o, dq=q.grad, dk=k.grad, dv=v.grad)
        for name, w in want.items():
            w = w.detach().numpy()
            if not np.array_equal(w, got[name]):
                diff = np.abs(w.astype(np.float64) - got[name]).max()
                problems.append(f"call {i} {name}: {int((w != got[name]).sum())} of {w.size} differ (max {diff:.1e})")
    if comm.Get_rank():
        return None
    return not problems and len(calls) > 0, "; ".join(problems) or (
        f"{len(calls)} attention calls: o, dq, dk, dv at P={comm.Get_size()} bitwise one rank's")


def errors_case(comm, case):
    """Mistakes the adapter must catch, with one ConfigError on every rank."""
    model = build(case, "ringmpi", "float64")
    batch = make_batch(case)
    size = comm.Get_size()
    problems = []

    def attempt(what, call, want):
        problem = agreed_error(comm, call, want)
        if problem:
            problems.append(f"{what}: {problem}")

    if size > 1:  # RoPE positions that are not the layout's (what HF makes without shard_batch's)
        shard = rmt.shard_batch(batch, context=RingContext(comm, layout="zigzag"), step=0)
        shard["position_ids"] = torch.arange(shard["input_ids"].shape[1])[None]
        attempt("local position_ids", lambda: model(**shard), "position_ids do not match the zigzag layout")
        shard = rmt.shard_batch(batch, context=RingContext(comm, layout="zigzag"), step=0)
        shard[rmt.CONTEXT_KEY].layout = ringmpi.Layout("contiguous", case["n"], size)
        shard[rmt.CONTEXT_KEY].positions = shard[rmt.CONTEXT_KEY].layout.indices(comm.Get_rank())
        shard[rmt.CONTEXT_KEY].ring = shard[rmt.CONTEXT_KEY].ring.replace(layout=shard[rmt.CONTEXT_KEY].layout)
        attempt("zigzag shards, contiguous attention", lambda: model(**shard), "do not match the contiguous")
    attempt("no shard context", lambda: model(input_ids=batch["input_ids"]), "needs the sharded batch")
    zigzag = RingContext(comm, layout="zigzag")  # shard_batch's default layout
    sdpa = build(dict(case, model="llama"), "sdpa", "float64")
    attempt("a shard for HF's own attention", lambda: sdpa(**rmt.shard_batch(batch, context=zigzag, step=0)),
            "but its attention is 'sdpa'")
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    attempt("dropout without a seed", lambda: model(**rmt.shard_batch(batch, context=zigzag, step=0)),
            "needs shard_batch(..., dropout_seed=SEED)")
    hybrid = build(dict(case, model="qwen3-next"), "ringmpi", "float64")
    padded = make_batch(dict(case, model="left-padding", B=2))  # documents in several rows: no cu_seqlens
    attempt("padded rows through Gated DeltaNet",
            lambda: hybrid(**rmt.shard_batch(padded, context=zigzag, step=0)), "Qwen3NextGatedDeltaNet")
    return not problems, "; ".join(problems) or "errors raised alike on every rank"


def main():
    rmt.register()
    keep_float64_norms()
    keep_float64_qwen3_next()
    torch.set_num_threads(1)
    run_file(MPI.COMM_WORLD, {"dropout": dropout_case, "errors": errors_case, "invariant": invariant_case},
             compare_case)


if __name__ == "__main__":
    main()
