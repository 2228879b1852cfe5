"""Sinks, softcap, ALiBi and max logit on the GPU backend (single rank), against the float64 dense
reference of ``tests/support/reference.py`` under the tolerance rule.  Needs a CUDA GPU;
skipped, with the reason shown, where none is visible.

Covers the tensor-core (f16/bf16, D <= 128 backward) and SIMT kernels (f32,
f64, D = 200), with sinks, softcap, window, segments and GQA together.
"""

from __future__ import annotations

import numpy as np
import pytest

import reference
from ringmpi.backends import gpu_available
from ringmpi.runtime.device import gpu_unavailable_reason

pytestmark = pytest.mark.skipif(not gpu_available(), reason=f"no usable CUDA GPU: {gpu_unavailable_reason()}")


def _inputs(dtype, b, n, h, hkv, d, seed):
    import ringmpi.core.dtypes
    rng = np.random.default_rng(seed)
    cast = lambda x: ringmpi.core.dtypes.to_dtype(x, dtype)  # noqa: E731
    q, do = (cast(rng.standard_normal((b, n, h, d))) for _ in range(2))
    k = cast(rng.standard_normal((b, n, hkv, d)) * 3)
    v = cast(rng.standard_normal((b, n, hkv, d)))
    seg = np.broadcast_to(np.arange(n) // max(1, n // 3), (b, n)).copy()
    return q, k, v, do, seg, (rng.standard_normal(h) * 2).astype(np.float32)


KERNELS = [("float16", 64), ("bfloat16", 128), ("bfloat16", 200), ("float32", 59), ("float64", 64)]


@pytest.mark.parametrize("alibi", [False, True], ids=["no-alibi", "alibi"])
@pytest.mark.parametrize("dtype,d", KERNELS)
def test_sinks_softcap_max_logit(dtype, d, alibi):
    """Sinks, softcap and the max logit through all four kernels, with window, segments and GQA,
    forward and backward; with ALiBi (issue 25) the queries are the last 120 of the 150 tokens
    (N_q != N_kv: the offset counts)."""
    import cupy
    from mpi4py import MPI

    import ringmpi

    dt = reference.BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v, do, seg, sinks = _inputs(dt, 2, 150, 6, 2, d, seed=d + alibi)
    seg_q, slopes = seg, None
    if alibi:
        q, do, seg_q = q[:, 30:], do[:, 30:], seg[:, 30:]
        slopes = (2.0 ** (-8.0 * np.arange(1, 7) / 6)).astype(np.float32)
    window, softcap, scale = (40, 0), 5.0, 1 / np.sqrt(d)
    kw = dict(causal=True, window=window, softcap=softcap, sinks=cupy.asarray(sinks), segment_ids=(seg_q, seg),
              alibi_slopes=slopes, context=ringmpi.RingContext(MPI.COMM_SELF, backend="cupy"))
    up = [cupy.asarray(x) for x in (q, k, v)]
    o, lse, ml = ringmpi.ring_attention(*up, return_max_logit=True, **kw)
    dq, dk, dv, dsinks = ringmpi.ring_attention_backward(cupy.asarray(do), *up, (o, lse), **kw)
    vis = reference.visible(q.shape[1], k.shape[1], True, window, seg_q, seg)
    opts = dict(sinks=sinks, softcap=softcap, alibi=slopes)
    ref, naive = (reference.dense_forward(q, k, v, vis, scale, t, **opts) for t in (np.float64, dt))
    refg, naiveg = (reference.dense_backward(do, q, k, v, vis, scale, t, **opts) for t in (np.float64, dt))
    refm, naivem = (reference.dense_max_logit(q, k, vis, scale, t, softcap, slopes) for t in (np.float64, dt))
    checks = [("o", cupy.asnumpy(o), ref[0], naive[0], False), ("lse", cupy.asnumpy(lse), ref[1], naive[1], False),
              ("max_logit", np.asarray(ml), refm, naivem, False)]
    for i, (name, ours) in enumerate((("dq", dq), ("dk", dk), ("dv", dv), ("dsinks", dsinks))):
        checks.append((name, cupy.asnumpy(ours) if name != "dsinks" else np.asarray(ours), refg[i], naiveg[i], True))
    failures = [msg for name, ours, r, nv, grad in checks
                for ok, msg in [reference.tolerance_check(name, ours, r, nv, gradient=grad)] if not ok]
    assert not failures, "; ".join(failures)


def test_no_cap_is_bitwise_unchanged():
    """softcap=0.0 (off) and an absent option launch the same kernels with c = 0: same bits."""
    import cupy
    from mpi4py import MPI

    import ringmpi

    q, k, v, _, _, _ = _inputs(np.dtype("float16"), 1, 100, 4, 4, 64, seed=3)
    up = [cupy.asarray(x) for x in (q, k, v)]
    ring = ringmpi.RingContext(MPI.COMM_SELF, backend="cupy")
    a = ringmpi.ring_attention(*up, causal=True, context=ring)
    b = ringmpi.ring_attention(*up, causal=True, softcap=0.0, return_max_logit=True, context=ring)
    assert all(cupy.array_equal(x, y) for x, y in zip(a[:2], b[:2]))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_max_logit_of_nan_and_all_minus_inf_rows(dtype):
    """The NumPy test of tests/mpi/test_variants.py on CuPy: NaN propagates into the running
    maximum (as np.maximum), a row whose visible scores are all -inf keeps m = -inf."""
    import cupy

    from test_variants import nonfinite_max_logit_problems

    dt = reference.BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    problems = nonfinite_max_logit_problems("cupy", dt, cupy.asarray, cupy.asnumpy)
    assert not problems, "; ".join(problems)
