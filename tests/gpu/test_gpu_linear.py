"""The linear-attention layers on the device: gated_delta_rule, kda and simple_gla (forward and
backward) with CuPy inputs, and ``ringmpi.torch_linear`` with CUDA tensors, at P = 1, against the
same calls on NumPy.  The arrays must stay CuPy (CUDA tensors) throughout, and every result must
be within the rule of docs/design.md: at most 3x the error of the float32 NumPy run (both against
the float64 NumPy run) + 1e-5 of the reference's scale.  Needs a CUDA GPU; skipped, with the
reason shown, elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

import ringmpi
from random_inputs import linear_inputs
from ringmpi.backends import gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU visible to CuPy")]

B, T, H, HV, K, V = 1, 150, 2, 4, 16, 8  # T: two full chunks and a partial one

LAYERS = {  # name: (forward, backward, delta, per-key decay)
    "gated_delta_rule": (ringmpi.gated_delta_rule, ringmpi.gated_delta_rule_backward, True, False),
    "kda": (ringmpi.kda, ringmpi.kda_backward, True, True),
    "simple_gla": (ringmpi.simple_gla, ringmpi.simple_gla_backward, False, False),
}


def _inputs(delta: bool, per_key: bool, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    x = linear_inputs(rng, B, T, H, HV, K, V, per_key=per_key, delta=delta, g=(0.01, 0.1), beta=(0.1, 0.9))
    if not delta:
        del x["beta"]
    x["initial_state"] = 0.1 * rng.standard_normal((B, HV, K, V))
    x["do"] = rng.standard_normal((B, T, HV, V))
    x["dfinal_state"] = rng.standard_normal((B, HV, K, V))
    return x


def _run(name: str, x: dict) -> list:
    """``[o, final, *grads]`` of one layer on ``x``'s arrays (NumPy or CuPy, as given)."""
    forward, backward, delta, _ = LAYERS[name]
    args = (x["q"], x["k"], x["v"], x["g"]) + ((x["beta"],) if delta else ())
    o, final = forward(*args, initial_state=x["initial_state"], output_final_state=True)
    grads = backward(x["do"], *args, initial_state=x["initial_state"], dfinal_state=x["dfinal_state"])
    return [o, final, *grads]


def _check(got, ref, one, what):
    err, err32 = np.abs(got - ref).max(), np.abs(one - ref).max()
    assert err <= 3 * err32 + 1e-5 * max(1.0, np.abs(ref).max()), f"{what}: {err} against float32 NumPy's {err32}"


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_cupy_inputs_match_numpy(name):
    cupy = pytest.importorskip("cupy")
    x64 = _inputs(*LAYERS[name][2:])
    x32 = {n: a.astype(np.float32) for n, a in x64.items()}
    ref, one = _run(name, x64), _run(name, x32)
    got = _run(name, {n: cupy.asarray(a) for n, a in x32.items()})
    assert len(got) == len(ref)
    for i, (g, r, o) in enumerate(zip(got, ref, one)):
        assert isinstance(g, cupy.ndarray), f"{name} result {i} left the device: {type(g).__name__}"
        assert g.dtype == np.float32
        _check(cupy.asnumpy(g), r, o, f"{name} result {i}")


@pytest.mark.parametrize("name", ["gated_delta_rule", "simple_gla"])
def test_torch_linear_on_cuda_matches_cpu(name):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} cannot use the GPU")
    from ringmpi import torch_linear

    delta = LAYERS[name][2]
    x64 = _inputs(delta, False, seed=1)
    names = ["q", "k", "v", "g"] + (["beta"] if delta else []) + ["initial_state"]

    def run(dtype, device):
        leaves = {n: torch.tensor(x64[n], dtype=dtype, device=device, requires_grad=True) for n in names}
        args = [leaves[n] for n in names[:-1]]
        fn = torch_linear.gated_delta_rule if delta else torch_linear.simple_gla
        o, final = fn(*args, initial_state=leaves["initial_state"], output_final_state=True)
        loss = (o * torch.tensor(x64["do"], dtype=dtype, device=device)).sum() + (
            final * torch.tensor(x64["dfinal_state"], dtype=dtype, device=device)).sum()
        loss.backward()
        outs = [o, final] + [leaves[n].grad for n in names]
        assert all(t.device.type == torch.device(device).type for t in outs)
        return [t.detach().cpu().double().numpy() for t in outs]

    ref, one, got = run(torch.float64, "cpu"), run(torch.float32, "cpu"), run(torch.float32, "cuda")
    for i, (g, r, o) in enumerate(zip(got, ref, one)):
        _check(g, r, o, f"torch_linear.{name} result {i}")
