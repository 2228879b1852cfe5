"""The launch plans of :mod:`ringmpi.kernels` on a real GPU.

* More than 65535 (batch, head) rows: the grid's (y, z) split covers every row.
* The small-shared-memory kernels the planner picks on compute capability
  8.6/8.9 (SIMT forward for f16/bf16 at D > 192, 8-key float64 tiles at
  D > 128) run on any sm_80+ GPU by planning against 8.6's limit; the plans of
  7.0 and 7.5 (SIMT kernels for every dtype, smaller key tiles) by planning
  against their capability and limits (compiled for the real device: the
  bfloat16 bit rounding of sm_70/75 itself runs only on such a GPU).

Judged against the float64 dense reference with the library's tolerance rule,
as tests/gpu/test_gpu_backend.py does.  Skipped, with the reason, without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from ringmpi import kernels as K
from ringmpi.backends import gpu_available
from ringmpi.core.masks import ScoreSpec
from ringmpi.core.dense_reference import tolerance
from test_gpu_backend import NO_GPU, check, max_err, naive, reference64, round_to, run_backend, visibility

SMEM_CC86 = 101376

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason=NO_GPU)]


def _judge(case, d, dtype, label):
    spec, q, k, v, do, q_pos, kv_pos, seg_q, seg_kv = case
    scale = 1.0 / np.sqrt(d)
    vis = visibility(spec, q_pos, kv_pos, seg_q, seg_kv, q.shape[0])
    ref = reference64(spec, q, k, v, do, seg_q, seg_kv, scale)
    base = naive(q, k, v, do, vis, scale, dtype)
    got = run_backend(case, d, dtype)
    for i, name in enumerate(("o", "lse", "dq", "dk", "dv")):
        err, bound = max_err(got[i], ref[i]), tolerance(max_err(base[i], ref[i]), gradient=i >= 2)
        assert err <= bound, f"{name}: max err {err:.3e} > bound {bound:.3e} ({label})"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_more_batch_heads_than_grid_y(dtype):
    batch, heads, kv_heads, s, d = 2, 33_000, 33_000, 5, 8   # 66000 rows both ways
    rng = np.random.default_rng(3)
    q, do = (round_to(rng.standard_normal((batch, s, heads, d)), dtype) for _ in range(2))
    k, v = (round_to(rng.standard_normal((batch, s, kv_heads, d)), dtype) for _ in range(2))
    pos = np.arange(s, dtype=np.int64)
    kind = K.F32 if dtype == "float32" else K.BF16
    assert K.forward_kernel(kind, d).grid(batch, heads, kv_heads, s, s)[2] == 2
    _judge((ScoreSpec(causal=True), q, k, v, do, pos, pos, None, None), d, dtype, f"B*H=66000 {dtype}")


# (compute capability, opt-in shared memory per block) whose plans run on a bigger GPU
PLANNED_FOR = {"8.6": (86, SMEM_CC86), "7.5": (75, 65536), "7.0": (70, 98304)}


@pytest.mark.parametrize("dtype,d,cc", [(t, d, cc) for t in ("float16", "bfloat16", "float32", "float64")
                                        for d in (160, 256) for cc in PLANNED_FOR])
def test_kernels_chosen_for_smaller_gpus(monkeypatch, dtype, d, cc):
    from ringmpi.backends import cupy_backend

    arch, limit = PLANNED_FOR[cc]
    real_cc, real_limit = cupy_backend.compute_capability(0), cupy_backend.smem_optin_limit(0)
    if real_cc < K.TENSOR_CORE_CC and arch >= K.TENSOR_CORE_CC or real_limit < limit:
        pytest.skip(f"this GPU (compute capability {real_cc}, {real_limit} B per block) cannot run {cc}'s plan")
    kind = {"float16": K.F16, "bfloat16": K.BF16, "float32": K.F32, "float64": K.F64}[dtype]
    if (cc, kind) == ("7.5", K.F64) and d > 192:
        pytest.skip("no float64 kernel for D > 192 fits 7.5 (tests/unit/test_launch_planning.py checks the refusal)")
    monkeypatch.setattr(cupy_backend, "smem_optin_limit", lambda device_id: limit)
    monkeypatch.setattr(cupy_backend, "compute_capability", lambda device_id: arch)
    fwd, bwd = K.forward_kernel(kind, d, limit, cc=arch), K.backward_kernel(kind, d, limit, cc=arch)
    assert fwd.smem <= limit and bwd.smem <= limit
    assert not (fwd.tensor_cores or bwd.tensor_cores) or arch >= K.TENSOR_CORE_CC
    check("plain", d, dtype)
    check("causal", d, dtype)
