"""ringmpi.transformers under real mpirun: tiny random-weight HF models against HF's own attention.

One launch per world size (P = 1, 2, 3; N = 61, not divisible by P) runs every
case of ``transformers_cases.py``: Llama (GQA), Qwen2, Mistral (sliding window),
Gemma 2 (softcap, non-default scale, alternating windows), gpt-oss (sinks, MoE),
Mixtral with its router load-balancing loss over a left-padded batch, dynamic-NTK
rotary over packed documents on the contiguous and balanced layouts (issue 54),
Qwen3-Next (Gated DeltaNet layers on ringmpi's scan, attention on the ring;
contiguous and zigzag), a packed row of three documents, two rows of different packs on the balanced
layout (flattened into one row) and a left-padded batch, in float64, float32
and (Llama, gpt-oss) bfloat16; attention dropout equal across P;
``shard_batch`` with ``RingContext(invariant=True)``'s attention calls bitwise one rank's (Llama,
Gemma 2, packed); the errors.
"""

import subprocess
import sys

import pytest

from mpi_util import CaseLaunches, mpirun_env

pytest.importorskip("torch", reason="ringmpi.transformers needs PyTorch")
pytest.importorskip("transformers", reason="ringmpi.transformers needs transformers (the 'transformers' extra)")

MODELS = ("llama", "qwen2", "mistral", "gemma2", "gpt-oss", "packed", "left-padding")
WORLD_SIZES = (1, 2, 3)


def cases_for(p):
    cases = []

    def add(name, **kw):
        case = dict(id=f"P{p}-{name}", n=61, seed=10 + len(cases))
        case.update(kw)
        cases.append(case)

    for model in MODELS:
        for dtype in ("float64", "float32"):
            add(f"{model}-{dtype}", model=model, dtype=dtype, B=2 if model == "left-padding" else 1)
    for model in ("llama", "gpt-oss"):
        add(f"{model}-bfloat16", model=model, dtype="bfloat16")
    add("mixtral-padded-float64", model="mixtral-padded", dtype="float64", B=2)  # router loss over padding
    for layout in ("contiguous", "zigzag"):  # the hybrid: Gated DeltaNet on the scan, attention on the ring (issue 51)
        add(f"qwen3-next-{layout}-float64", model="qwen3-next", dtype="float64", layout=layout)
    for layout in ("zigzag", "balanced"):  # packed documents: each its own state (cu_seqlens), as run one by one
        add(f"qwen3-next-packed-{layout}-float64", model="qwen3-next-packed", dtype="float64", layout=layout)
    for layout in ("contiguous", "balanced"):  # dynamic NTK over packed documents (explicit positions)
        add(f"packed-dynamic-{layout}-float64", model="packed-dynamic", dtype="float64", layout=layout)
    if p == 3:  # packed rows flattened into one, on the balanced layout, K/V routed (issue 42)
        add("packed-rows-balanced-float64", model="packed-rows", dtype="float64", B=2, layout="balanced")
    for model in ("llama", "gemma2", "packed"):  # N = 384: whole 64-token tiles on 1, 2 and 3 contiguous shards
        add(f"invariant-{model}", kind="invariant", model=model, dtype="float32", n=384, layout="contiguous")
    add("dropout", kind="dropout", model="dropout")
    add("errors", kind="errors", model="llama")
    return cases


TRANSFORMERS = CaseLaunches("transformers_cases.py", WORLD_SIZES, cases_for, timeout=400)
results = TRANSFORMERS.fixture()


@pytest.mark.mpi
@pytest.mark.parametrize("p,case", TRANSFORMERS.params())
def test_transformers_case(results, p, case):
    ok, msg = results(p)[case["id"]]
    assert ok, msg


def test_import_without_transformers_says_what_to_install(tmp_path):
    """Without transformers, importing ringmpi.transformers names the extra to install."""
    (tmp_path / "transformers.py").write_text("raise ImportError('no transformers here')\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "try:\n    import ringmpi.transformers\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         env=mpirun_env(), check=True).stdout
    assert "pip install 'ringmpi[transformers]'" in out


def test_dropout_seeds_differ_per_layer_and_step():
    import ringmpi.transformers as rmt

    seeds = {rmt.dropout_seed(7, step, layer) for step in range(3) for layer in range(4)}
    assert len(seeds) == 12 and all(0 <= s < 2 ** 64 for s in seeds)
    assert rmt.dropout_seed(7, 1, 2) == rmt.dropout_seed(7, 1, 2) != rmt.dropout_seed(8, 1, 2)
