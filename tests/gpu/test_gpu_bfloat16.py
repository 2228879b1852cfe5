"""bfloat16 on the GPU through the public API: ``ml_dtypes.bfloat16`` CuPy arrays.

Single rank in process (every mask, forward and backward, and the ``uint16`` +
``dtype="bfloat16"`` path are cases of ``test_gpu_public_call.py``; here an
undeclared ``uint16`` refused and a bfloat16 NaN found by ``check_finite``), then the
bfloat16 ring cases of ``test_ring_mpi.py`` on 2 and 3 ranks sharing one GPU,
CUDA-aware and staged.  Judged by docs/design.md's rule against ``reference.py``.
Skipped, with the reason shown, where no GPU is visible.
"""

from __future__ import annotations

import numpy as np
import pytest

import reference
from mpi_util import mpirun_env, run_cases
from random_inputs import attention_inputs
from ringmpi.backends import gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU visible to CuPy")]
BF16 = reference.BFLOAT16


def test_uint16_needs_declaration_and_nan_is_named():
    import cupy as cp
    from mpi4py import MPI

    import ringmpi
    from ringmpi.runtime.errors import ConfigError

    q, k, v = attention_inputs(0, 2, 50, 4, 2, 64, do=False, dtype=BF16)
    args = [cp.asarray(x) for x in (q, k, v)]
    with pytest.raises(ConfigError, match="unsupported dtype uint16"):
        ringmpi.ring_attention(*(a.view(cp.uint16) for a in args),
                               context=ringmpi.RingContext(MPI.COMM_SELF, backend="cupy"))
    args[0][1, 17, 3, 5] = cp.asarray(np.array(np.nan, dtype=BF16))
    with pytest.raises(ConfigError, match=r"q has a non-finite value \(nan\) at global index \[1, 17, 3, 5\]"):
        ringmpi.ring_attention(*args, context=ringmpi.RingContext(MPI.COMM_SELF, backend="cupy", check_finite=True))


def _bf16_ring_cases(p):
    import test_ring_mpi

    return [c for c in test_ring_mpi.cases_for(p) if c.get("dtype") == "bfloat16" and c.get("kind") is None]


@pytest.mark.mpi
@pytest.mark.parametrize("cuda_aware", ["off", "on"])
@pytest.mark.parametrize("p", [2, 3])
def test_bfloat16_ring_multi_rank_one_gpu(tmp_path, p, cuda_aware):
    """Every layout and mask, forward and backward, ranks sharing the GPU;
    K/V travel as bfloat16 (CUDA-aware: device buffers; off: staged)."""
    if cuda_aware == "on":
        from mpi4py import MPI

        from ringmpi.runtime.device import cuda_aware_mpi
        if not cuda_aware_mpi(MPI.COMM_SELF)[0]:
            pytest.skip("this MPI is not CUDA-aware")
    cases = _bf16_ring_cases(p)
    results = run_cases(p, cases, tmp_path, timeout=240,
                        env=mpirun_env(RINGMPI_TEST_BACKEND="cupy", RINGMPI_CUDA_AWARE=cuda_aware))
    bad = [f"{c['id']}: {results[c['id']][1]}" for c in cases if not results[c["id"]][0]]
    assert not bad, "\n".join(bad)


def test_float64_to_bfloat16_on_gpu_rounds_once():
    """The convert kernel rounds float64 straight to bfloat16, like
    ringmpi.core.dtypes.float64_to_bfloat16; via float32 these would differ."""
    import cupy as cp

    from ringmpi.backends.cupy_backend import CupyBackend
    from ringmpi.core.dtypes import float64_to_bfloat16

    rng = np.random.default_rng(9)
    halfway = (rng.integers(1 << 7, 1 << 8, 4096) * 2 + 1) / 2.0 ** 8 * 2.0 ** rng.integers(-60, 60, 4096)
    x = np.concatenate([halfway * (1 + 2.0 ** -40), halfway * (1 - 2.0 ** -40), rng.standard_normal(4096),
                        [np.inf, -np.inf, 1e300, -1e-300, 0.0]])
    be = CupyBackend.instance()
    as_heads = lambda a: cp.asarray(a.reshape(1, -1, 1, 1))  # noqa: E731  (B, S, H, D) -> to_heads
    got = cp.asnumpy(be.to_heads(as_heads(x), "bfloat16")).ravel()
    assert got.dtype == BF16
    assert np.array_equal(got.view(np.uint16), float64_to_bfloat16(x).view(np.uint16))


@pytest.mark.parametrize("d", [64, 192])  # MMA backward (D <= 128) and SIMT backward
@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_cupy_backend_rounds_q_and_do_like_numpy(kv, d):
    """With 16-bit K/V the CuPy kernels use qh/doh rounded to that dtype (the
    interface contract), so float32 qh gives exactly what its rounded copy gives."""
    import cupy as cp

    from ringmpi.backends.cupy_backend import CupyBackend
    from ringmpi.core.dtypes import resolve
    from ringmpi.core.masks import BlockMask, ScoreSpec

    kvt = resolve(kv)
    be = CupyBackend.instance()
    rng = np.random.default_rng(4)
    b, h, sq, skv = 1, 2, 70, 90
    qh = rng.standard_normal((b, h, sq, d)).astype(np.float32)
    doh = rng.standard_normal((b, h, sq, d)).astype(np.float32)
    kh, vh = (cp.asarray(rng.standard_normal((b, h, skv, d)).astype(kvt)) for _ in range(2))
    mask = BlockMask(ScoreSpec(causal=True, offset=skv - sq), np.arange(sq), np.arange(skv), None, None)
    lse = cp.asarray(rng.standard_normal((b, h, sq)).astype(np.float32) + 5)
    dvec = cp.asarray(rng.standard_normal((b, h, sq)).astype(np.float32))

    def run(q, do):
        q, do = cp.asarray(q), cp.asarray(do)
        o, m, l = cp.zeros_like(q), cp.full(q.shape[:3], -np.inf, np.float32), cp.zeros(q.shape[:3], np.float32)
        be.forward_block(q, kh, vh, o, m, l, 0.125, mask)
        dq = cp.zeros_like(q)
        dk, dv = cp.zeros(kh.shape, np.float32), cp.zeros(kh.shape, np.float32)
        be.backward_block(q, do, lse, dvec, kh, vh, dq, dk, dv, 0.125, mask)
        be.synchronize()
        return [cp.asnumpy(x) for x in (o, m, l, dq, dk, dv)]

    rounded = [x.astype(kvt).astype(np.float32) for x in (qh, doh)]
    for name, a, c in zip(("o", "m", "l", "dq", "dk", "dv"), run(qh, doh), run(*rounded)):
        assert np.array_equal(a, c), name
