"""ringmpi.torch under real mpirun: autograd, dtypes, zero copy, and the training example.

One launch per world size runs every case (``torch_cases.py``); each case is
its own pytest item.  The CUDA launch runs the same cases on CUDA tensors (plus
one on a fresh torch stream) and is skipped, with the reason shown, where no
GPU is visible.  The training example runs as a user would launch it, at
P = 1 (float64 and float32) and P = 2, 3.
"""

import subprocess
import sys

import numpy as np
import pytest

import reference
from mpi_util import CaseLaunches, ROOT, mpirun, mpirun_env
from training import train_example

pytest.importorskip("torch", reason="ringmpi.torch needs PyTorch (the 'torch' extra)")


def cases_for(p, cuda=False):
    cases = []
    tag = f"P{p}{'-cuda' if cuda else ''}"

    def add(name, **kw):
        case = dict(id=f"{tag}-{name}", B=1, H=4, Hkv=2, D=16, layout="zigzag", causal=True,
                    seed=100 * p + len(cases))
        case.update(kw)
        cases.append(case)

    for dtype in ("float32", "bfloat16"):
        add(f"{dtype}-contiguous-gqa", dtype=dtype, n_q=97, layout="contiguous")
        add(f"{dtype}-zigzag-mha", dtype=dtype, n_q=97, Hkv=4)
        add(f"{dtype}-striped-full-mqa", dtype=dtype, n_q=50, layout="striped", causal=False, Hkv=1)
        add(f"{dtype}-window", dtype=dtype, n_q=97, window=[16, 0])
        add(f"{dtype}-segments", dtype=dtype, n_q=97, segments=4, B=2)
        add(f"{dtype}-kv-longer", dtype=dtype, n_q=40, n_kv=97, layout="contiguous")
    add("float32-rows-see-nothing", n_q=97, n_kv=40)
    add("float32-n-below-p", n_q=2, D=5)
    add("float32-noncontiguous", n_q=97, D=24, noncontiguous=True)
    add("float32-scale", n_q=50, scale=0.3, causal=False)
    add("float16-zigzag", dtype="float16", n_q=97)
    add("float64-window-segments", dtype="float64", n_q=64, window=[8, 8], causal=False, segments=3)
    add("sdpa", kind="sdpa", n_q=97)
    add("gradcheck", kind="gradcheck", n_q=7, n_kv=8, H=2, Hkv=1, D=3, segments=2)
    add("autograd", kind="autograd", n_q=50)
    add("shares-float32", kind="shares", n_q=50)
    add("shares-bfloat16", kind="shares", dtype="bfloat16", n_q=50)
    add("errors", kind="errors", n_q=20)
    if p == 3:  # explicit positions (issue 27): a permutation, whole documents per rank
        add("float32-positions-permutation", n_q=97, n_kv=80, positions="permutation", window=[20, 5])
        add("float64-positions-documents", dtype="float64", n_q=90, segments=5, B=2, positions="documents")
        add("bfloat16-positions-permutation", dtype="bfloat16", n_q=64, positions="permutation")
        # a balanced Layout (issue 42) travels into the op as its positions, the schedule auto's by default
        add("float32-balanced-routed", n_q=97, segments=6, positions="balanced", window=[30, 0],
            expect_schedule="auto")
    if p == 2 and not cuda:
        add("compile", kind="compile", n_q=37, positions="permutation")  # ALiBi, sinks, explicit positions
    if cuda:
        add("float32-torch-stream", n_q=97, stream=True)
    return cases


TORCH = CaseLaunches("torch_cases.py", [(2, False), (3, False), (2, True)], lambda launch: cases_for(*launch),
                     timeout=300, env=lambda launch: mpirun_env(RINGMPI_TEST_DEVICE="cuda" if launch[1] else "cpu"))
results = TORCH.fixture()


def cuda_skip_reason():
    """None when CUDA tensors can run here, else why not."""
    from ringmpi.backends import gpu_available
    if not gpu_available():
        return "no CUDA GPU visible to CuPy"
    import torch
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} cannot use the GPU (a CPU build?)"
    return None


@pytest.mark.mpi
@pytest.mark.parametrize("launch,case", TORCH.params())
def test_torch_case(results, launch, case):
    if launch[1]:
        reason = cuda_skip_reason()
        if reason:
            pytest.skip(reason)
    ok, msg = results(launch)[case["id"]]
    assert ok, msg


def test_import_ringmpi_does_not_import_torch():
    code = "import sys, ringmpi; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env=mpirun_env())



@pytest.mark.mpi
@pytest.mark.parametrize("p,flags", [(2, []), (3, ["--sinks"])], ids=["P2", "P3-sinks"])
def test_training_example_matches_one_rank(tmp_path, p, flags):
    """jobs/train_context_parallel.py (the README's gradient recipe: every parameter's gradient
    summed over the ranks): after 5 Adam steps, the P > 1 losses, parameters and last summed
    gradients (Adam alone would hide a gradient off by a constant factor) are as close to a
    float64 P = 1 run as a float32 P = 1 run is (docs/design.md's gradient rule: 3x its error + 1e-5);
    301 tokens make uneven zigzag shards.  With ``--sinks`` the model learns a sink per head,
    whose gradient must be each rank's own share like every other parameter's (issue 27)."""
    runs = {(size, dtype): train_example(tmp_path, size, dtype, *flags)
            for size, dtype in ((1, "float64"), (1, "float32"), (p, "float32"))}
    ref, one, many = runs[1, "float64"], runs[1, "float32"], runs[p, "float32"]
    assert sorted(many) == sorted(ref) and len(ref) > 10
    assert any(n.endswith("sinks") for n in ref) == bool(flags)
    for name in ref:
        ok, msg = reference.tolerance_check(name, many[name], ref[name], one[name], gradient=True)
        assert ok, msg
    assert many["losses"][-1] < many["losses"][0] - 0.1, f"the loss did not go down: {many['losses']}"


@pytest.mark.mpi
def test_data_x_context_parallel_example_matches_one_rank(tmp_path):
    """jobs/train_data_context_parallel.py: 4 ranks as 2 DDP replicas (gloo, started from MPI)
    x 2 ring ranks give the losses and parameters of one rank over the same global batch
    (float64, 3 Adam steps, 203 tokens: uneven zigzag shards)."""
    argv = ["--seq-len", 203, "--steps", 3, "--batch", 2, "--dim", 16, "--layers", 1, "--dtype", "float64"]
    runs = {}
    for p, cp in ((1, 1), (4, 2)):
        out = tmp_path / f"p{p}.npz"
        rc, stdout, stderr, _ = mpirun(p, [sys.executable, ROOT / "jobs" / "train_data_context_parallel.py", *argv,
                                           "--cp", cp, "--save", out], timeout=420)
        assert rc == 0 and "step   2  loss" in stdout, f"P={p}: exit {rc}\n{stdout[-2000:]}\n{stderr[-3000:]}"
        with np.load(out) as data:
            runs[p] = dict(data)
    one, four = runs[1], runs[4]
    assert sorted(one) == sorted(four) and len(one) > 5
    np.testing.assert_allclose(four["losses"], one["losses"], rtol=1e-10)
    for name in one:
        scale = np.abs(one[name]).max()
        assert np.abs(four[name] - one[name]).max() <= 1e-8 * scale, name
