"""gated_delta_rule, kda, simple_gla, gla over real mpirun against the sequential recurrence
(float64, 1e-10) and transformers' chunked gated delta rule and KDA (float32, 1e-5 RMS), with
causal_conv1d and relayout: ``linear_cases.py``.

One launch of 7 ranks runs every case at every world size P = 1, 2, 3, 4, 7 (sub-communicators);
each case is its own pytest item.  Shards are uneven, one is empty from P = 3 on, and documents
(``cu_seqlens`` in global positions) cross rank boundaries, one spans several ranks (P >= 4), one
ends exactly at a shard's end (P >= 3), one is empty.
"""

import zlib

import numpy as np
import pytest

from mpi_util import CaseLaunches

WORLD_SIZES = (1, 2, 3, 4, 7)
DOCUMENT_END = 60  # a document boundary that ends shard 0 from P = 3 on


def split(n, p, seed, empty, first=None):
    """Uneven shard lengths summing to n; with ``empty`` and p >= 3, shard p // 2 holds nothing;
    ``first``: shard 0's length."""
    if first is not None:
        return [first] + split(n - first, p - 1, seed, empty)
    weights = np.random.default_rng(seed + p).uniform(0.3, 1.7, p)
    if empty and p >= 3:
        weights[p // 2] = 0
    cuts = np.floor(np.cumsum(weights) / weights.sum() * n).astype(int)
    cuts[-1] = n
    return np.diff(np.concatenate([[0], cuts])).tolist()


def cases_for(p):
    cases = []

    def add(name, kind, n, empty=True, **kw):
        seed = zlib.crc32(name.encode())  # the same inputs at every P: rank 0 computes each reference once
        case = dict(id=f"P{p}-{name}", name=name, P=p, kind=kind, B=1, N=n, H=2, HV=4, K=8, V=6, seed=seed)
        case.update(kw)
        docs = "cu" in kw
        case["lengths"] = split(n, p, seed, empty, first=DOCUMENT_END if docs and p >= 3 else None)
        cases.append(case)

    add("gdn-f64", "gdn", 200, B=2, init=True, final=True)
    add("gdn-f64-plain", "gdn", 130, empty=False, H=3, HV=3, K=5, V=7, scale=0.4)
    # documents: a short one, an empty one, one from shard 0's end over several ranks, the rest
    docs = [0, 9, 9, DOCUMENT_END, 190, 260]
    add("gdn-f64-docs", "gdn", 260, init=True, final=True, cu=docs)
    add("gla-f64-docs", "gla", 260, init=True, final=True, cu=docs)
    add("kda-f64-docs", "kda", 260, init=True, final=True, cu=docs)
    add("gla-key-f64", "gla-key", 150, B=2, init=True, final=True)
    add("linear-f64", "linear", 150, B=2, final=True)
    if p <= 3:  # the torch wrappers' own rule (summed final-state gradient, initial-state share)
        add("gdn-torch-docs", "gdn", 260, init=True, final=True, torch=True, cu=docs)
        add("gla-torch", "gla", 120, B=2, init=True, final=True, torch=True)
    add("gdn-f32-transformers", "gdn", 180, B=2, K=16, V=16, dtype="float32", init=True, final=True)
    add("kda-f32-transformers", "kda", 140, B=1, H=3, HV=3, K=16, V=8, dtype="float32", init=True, final=True)
    if p in (1, 3):
        add("kda-torch", "kda", 100, init=True, final=True, torch=True, H=3, HV=3)
    conv_lengths = [3, 1, 0, 2] + split(40 - 6, p - 4, 7, True) if p > 4 else split(40, p, 7, True)
    for name, kw in (("conv", {}), ("conv-silu-docs", dict(activation="silu", cu=[0, 2, 2, 5, 30, 40])),
                     ("conv-torch-docs", dict(activation="silu", cu=[0, 2, 2, 5, 30, 40], torch=True))):
        if p <= 3 or not kw.get("torch"):
            cases.append(dict(id=f"P{p}-{name}", P=p, kind="conv", B=2, N=40, D=5, W=4, seed=zlib.crc32(name.encode()),
                              lengths=conv_lengths, **kw))
    if p in (2, 3):  # a real Qwen3-Next Gated DeltaNet layer; at P = 3 a shard shorter than the halo
        for dtype in ("float64", "float32"):
            cases.append(dict(id=f"P{p}-hf-qwen3next-layer-{dtype}", P=p, kind="hf-layer", dtype=dtype, B=2, N=70,
                              seed=11, lengths=[30, 40] if p == 2 else [33, 2, 35]))
    cases.append(dict(id=f"P{p}-relayout", P=p, kind="relayout", N=45, seed=3, documents=[20, 3, 22]))
    for what, expect in (("heads_one_rank", "must be a multiple of"), ("dtype_one_rank", "must share one dtype"),
                         ("cu_length", "cu_seqlens ends at"), ("conv_width_one_rank", "ranks disagree"),
                         ("relayout_rows_one_rank", "must hold this rank's")):
        if p == 1 and what == "conv_width_one_rank":
            continue
        cases.append(dict(id=f"P{p}-error-{what}", P=p, kind="error", what=what, expect=expect))
    return cases


LAUNCHES = CaseLaunches("linear_cases.py", [max(WORLD_SIZES)],
                        lambda _: [c for p in WORLD_SIZES for c in cases_for(p)], timeout=300)
results = LAUNCHES.fixture()


@pytest.mark.parametrize("launch,case", LAUNCHES.params())
def test_linear_attention(results, launch, case):
    ok, msg = results(launch)[case["id"]]
    assert ok, msg
