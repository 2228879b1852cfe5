"""Rank-side driver: every decoder-only causal LM of the installed transformers, sharded, against one process.

    mpirun -n P python tests/mpi/transformers_sweep_cases.py CASES.json [RESULTS.json]

A case is one architecture (``hf_architectures.decoder_types()``, plus variants
with length-dependent rotary embeddings) as a tiny float64 config with random
weights, router losses on where the config has them.  One rank (they take turns) runs it on
the whole sequence with the architecture's eager attention (the reference: logits, ``out.loss``
with labels, every parameter's gradient of that loss); then every rank runs
``model(**shard_batch(batch, context=RingContext(comm, layout=...)))`` with ``attn_implementation="ringmpi"``
for the contiguous, zigzag and balanced layouts: logits gathered, ``out.loss`` and
every gradient summed over the ranks.  Each layout must be **exact** (DESIGN.md's
rule in float64: max error <= 1e-6 for logits and loss, <= 1e-5 for gradients) or
**refused**: one ConfigError, the same on every rank, raised before the model's
first module runs.  An architecture whose tiny config does not build, or whose
model fails on one process, is **not buildable** (it is reported, not failed).
Anything else (a wrong answer, another exception, a refusal after compute began)
fails its case.  Rank 0 prints one ``CASE`` line per architecture, and writes every
record to RESULTS.json when given (``scripts/transformers_table.py`` makes the
README's table from it).
"""

import itertools
import json
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from case_driver import run_all  # first: it puts tests/support on the path
import hf_architectures as archs
from linear_reference import float64_delta_rule, float64_gated_norms
from transformers_cases import float64_softmax
import ringmpi.transformers as rmt
from ringmpi import RingContext
from ringmpi.runtime.errors import ConfigError

LAYOUTS = ("contiguous", "zigzag", "balanced")
N = 20
LOGIT_TOL, GRAD_TOL = 1e-6, 1e-5  # DESIGN.md's floors; float64's own error is ~1e-16
ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.5, router_z_loss_coef=0.1, z_loss_coefficient=0.1)


class FirstModule:
    """Counts forwards of the model's leaf modules: a refusal must come before the first."""

    def __init__(self, model):
        self.calls = 0
        self.handles = [m.register_forward_pre_hook(self.hook) for m in model.modules()
                        if not list(m.children())]

    def hook(self, module, args):
        self.calls += 1

    def remove(self):
        for h in self.handles:
            h.remove()


def router_settings(cfg):
    """The router-loss fields this config has, turned on."""
    return {k: v for k, v in ROUTER.items() if hasattr(cfg, k)}


def build(case, attn_implementation):
    """The tiny model, float64, in eval mode: ``attn_implementation="ringmpi"`` as a user builds it."""
    extra = dict(case.get("config", {}))
    cfg = archs.tiny_config(case["type"], **extra)
    extra.update(router_settings(cfg))
    _, model = archs.build(case["type"], attn_implementation, seed=7, **extra)
    return model.eval()  # no dropout: one process and P ranks draw differently


def batch_for():
    rng = np.random.default_rng(3)
    ids = torch.from_numpy(rng.integers(3, 60, size=(1, N)))
    return {"input_ids": ids, "labels": ids.clone()}


def reference(model, batch):
    """One process, eager attention: logits, out.loss, gradients of out.loss."""
    model.zero_grad(set_to_none=True)
    # HF's float32 islands, float64 in the reference (the gated norms in ours too: the same modules)
    with float64_softmax(), float64_delta_rule(), float64_gated_norms():
        out = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
        out.loss.backward()
    grads = {n: p.grad.double().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().double().numpy(), float(out.loss.detach()), grads


def sharded(comm, model, batch, layout):
    """ringmpi on comm: gathered logits, out.loss and gradients summed over the ranks."""
    model.zero_grad(set_to_none=True)
    shard = rmt.shard_batch(batch, context=RingContext(comm, layout=layout), step=0)
    with float64_gated_norms():
        out = model(**shard)
        out.loss.backward()
    params = list(model.named_parameters())
    flat = np.concatenate([np.zeros(p.numel()) if p.grad is None else p.grad.double().numpy().ravel()
                           for _, p in params] + [[float(out.loss.detach())]])
    comm.Allreduce(MPI.IN_PLACE, flat)  # every gradient and the loss summed over the ranks, in one call
    grads, at = {}, 0
    for name, p in params:
        grads[name] = flat[at:at + p.numel()].reshape(p.shape)
        at += p.numel()
    ring = shard[rmt.CONTEXT_KEY].ring  # its layout: the Layout object (the balanced one's documents)
    logits = rmt.gather(out.logits, context=ring).double().numpy().reshape(1, N, -1)
    return logits, float(flat[-1]), grads


def compare(ours, ref):
    """(worst error over logits, loss and gradients against its bound, description)."""
    # HF's out.loss is float32 (its loss upcasts the logits to float32): its own rounding, ~1e-7 relative,
    # is the plain computation's error of the rule
    errs = {"logits": (np.abs(ours[0] - ref[0]).max(), LOGIT_TOL),
            "loss": (abs(ours[1] - ref[1]), LOGIT_TOL + 2e-6 * abs(ref[1]))}
    for name, g in ours[2].items():
        want = ref[2].get(name, np.zeros_like(g))
        errs[f"grad {name}"] = (np.abs(g - want).max(), GRAD_TOL)
    worst = max(errs, key=lambda k: errs[k][0] / errs[k][1])
    return errs[worst][0] / errs[worst][1], f"worst {worst} {errs[worst][0]:.1e} (limit {errs[worst][1]:g})"


def one_layout(comm, model, batch, layout, ref, ref_rank):
    """(status, detail) of one layout: "exact", "refused", or a failure."""
    first = FirstModule(model)
    try:
        ours = sharded(comm, model, batch, layout)
        problem = None
    except ConfigError as exc:
        ours, problem = None, f"ConfigError: {exc}"
    except Exception as exc:  # noqa: BLE001 - what reached the user is the finding
        ours, problem = None, f"{type(exc).__name__}: {exc}"
    finally:
        first.remove()
    every = comm.allgather((problem, first.calls if problem else 0))
    if any(p for p, _ in every):
        msgs = {p for p, _ in every}
        if len(msgs) != 1 or not problem.startswith("ConfigError"):
            return "FAIL", f"not one ConfigError on every rank: {sorted(str(m) for m in msgs)}"
        late = max(c for _, c in every)  # a refusal of ringmpi's attention itself: before any ring transfer
        return ("refused at its first attention" if late else "refused"), problem[len("ConfigError: "):]
    result = None
    if ref is not None:  # the rank that ran the reference
        ratio, detail = compare(ours, ref)
        result = ("exact" if ratio <= 1 else "WRONG"), detail
    return comm.bcast(result, root=ref_rank)


def sweep_case(comm, case):
    start = time.perf_counter()
    try:
        return _sweep_case(comm, case)
    finally:
        if RECORDS and RECORDS[-1]["id"] == case["id"]:
            RECORDS[-1]["seconds"] = round(time.perf_counter() - start, 2)


def _sweep_case(comm, case):
    rank = comm.Get_rank()
    record = {"id": case["id"], "type": case["type"]}
    built = model = ref = None
    try:
        model = build(case, rmt.NAME)
    except Exception as exc:  # noqa: BLE001 - transformers refusing "ringmpi", or a config that is not tiny
        try:
            archs.build(case["type"], "eager", **case.get("config", {}))
        except Exception as plain:  # noqa: BLE001 - a config that does not build tiny is reported, not failed
            built = f"{type(plain).__name__}: {str(plain).splitlines()[0][:200] if str(plain) else ''}"
        else:  # a refusal before any compute
            why = str(exc).splitlines()[0][:300] if str(exc) else ""
            record.update(status="refused", detail=f"transformers refuses attn_implementation='ringmpi' at "
                                                   f"from_config: {type(exc).__name__}: {why}")
            return finish(comm, record)
    ref_rank = next(COUNT) % comm.Get_size()  # the references take turns among the ranks
    if model is not None and rank == ref_rank:
        try:  # the same weights with the architecture's eager attention, on one process
            plain = build(case, "eager")
            plain.load_state_dict(model.state_dict())
            ref = reference(plain, batch_for())
        except Exception as exc:  # noqa: BLE001
            built = f"one process: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    every = comm.allgather(built)
    if any(every):
        record.update(status="not buildable", detail=next(b for b in every if b))
        return finish(comm, record)
    batch = batch_for()
    layouts = {}
    for layout in LAYOUTS:
        layouts[layout] = one_layout(comm, model, batch, layout, ref, ref_rank)
    record["layouts"] = layouts
    statuses = {s for s, _ in layouts.values()}
    if statuses == {"exact"}:
        record.update(status="exact", detail="; ".join(f"{k}: {d}" for k, (_, d) in layouts.items()))
    elif len(statuses) == 1 and statuses < {"refused", "refused at its first attention"} and len(
            {d for _, d in layouts.values()}) == 1:
        record.update(status=statuses.pop(), detail=layouts["contiguous"][1])
    else:
        record.update(status="FAIL", detail="; ".join(f"{k}: {s} {d}" for k, (s, d) in layouts.items()))
    return finish(comm, record)


def finish(comm, record):
    if comm.Get_rank() != 0:
        return None
    RECORDS.append(record)
    ok = record["status"] in STATUSES
    return ok, json.dumps({k: record[k] for k in ("type", "status", "detail")})


RECORDS = []
COUNT = itertools.count()
STATUSES = ("exact", "refused", "refused at its first attention", "not buildable")  # the passing ones


def main():
    rmt.register()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    with open(sys.argv[1]) as fh:
        cases = json.load(fh)
    run_all(comm, cases, lambda case: sweep_case(comm, case))
    if comm.Get_rank() == 0 and len(sys.argv) > 2:
        with open(sys.argv[2], "w") as fh:
            json.dump(RECORDS, fh, indent=1)


if __name__ == "__main__":
    main()
