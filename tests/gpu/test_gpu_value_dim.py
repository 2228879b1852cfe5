"""A value head dim D_v != D on the GPU through the public API (issue 13, part 3).

Single rank in process, every dtype, full/causal/window/segments, GQA:
the MLA pair D = 192, D_v = 128 (its own kernel instantiations), a pair in
one head-dim bucket (D = 100, D_v = 110: the D == D_v kernels with D_v at run
time), forward and backward against ``reference.py`` under docs/design.md's rule;
an unsupported pair is refused with a ConfigError before any compute.
Skipped, with the reason shown, where no GPU is visible.
"""

from __future__ import annotations

import numpy as np
import pytest

import reference
from random_inputs import attention_inputs
from ringmpi.backends import gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU visible to CuPy")]
MASKS = {"full": dict(), "causal": dict(causal=True), "window": dict(causal=True, window=(16, 0)),
         "segments": dict(segments=True)}
DTYPES = ("float16", "bfloat16", "float32", "float64")


def _dtype(name):
    return reference.BFLOAT16 if name == "bfloat16" else np.dtype(name)


@pytest.mark.parametrize("d,d_v", [(192, 128), (100, 110)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", list(MASKS))
def test_value_dim_cupy(mask, dtype, d, d_v):
    import cupy as cp
    from mpi4py import MPI

    import ringmpi
    from ringmpi.core.dtypes import to_dtype

    dt = _dtype(dtype)
    b, n, h, hkv = 2, 150, 4, 2
    q, k, v, do = (to_dtype(x, dt) for x in attention_inputs(5, b, n, h, hkv, d, dv=d_v))
    kw = dict(MASKS[mask])
    seg = None
    if kw.pop("segments", False):
        seg = (np.arange(n) // 37)[None].repeat(b, 0)
        kw.update(segment_ids=seg)
    ring = ringmpi.RingContext(MPI.COMM_SELF, backend="cupy")
    args = [cp.asarray(x) for x in (q, k, v)]
    o, lse, _ = ringmpi.ring_attention(*args, **kw, context=ring)
    dq, dk, dv, _ = ringmpi.ring_attention_backward(cp.asarray(do), *args, (o, lse), **kw, context=ring)
    assert o.shape == (b, n, h, d_v) and dv.shape == v.shape and dk.shape == k.shape
    vis = reference.visible(n, n, kw.get("causal", False), kw.get("window"), seg, seg)
    scale = 1 / np.sqrt(d)
    ref = reference.dense_forward(q, k, v, vis, scale, np.float64) + reference.dense_backward(
        do, q, k, v, vis, scale, np.float64)
    naive = reference.dense_forward(q, k, v, vis, scale, dt) + reference.dense_backward(
        do, q, k, v, vis, scale, dt)
    problems = []
    for i, (name, ours) in enumerate(zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv))):
        ok, msg = reference.tolerance_check(name, cp.asnumpy(ours), ref[i], naive[i], gradient=i >= 2)
        problems += [] if ok else [msg]
    assert not problems, "; ".join(problems)


def test_unsupported_pair_is_refused():
    import cupy as cp
    from mpi4py import MPI

    import ringmpi
    from ringmpi.runtime.errors import ConfigError

    rng = np.random.default_rng(1)
    q, k = (cp.asarray(rng.standard_normal((1, 8, 2, 24)).astype(np.float32)) for _ in range(2))
    v = cp.asarray(rng.standard_normal((1, 8, 2, 40)).astype(np.float32))
    ring = ringmpi.RingContext(MPI.COMM_SELF, backend="cupy")
    with pytest.raises(ConfigError, match="D=24 with value head dim D_v=40"):
        ringmpi.ring_attention(q, k, v, context=ring)
    with pytest.raises(ConfigError, match="D=24 with value head dim D_v=40"):
        ringmpi.decode_attention(q[:, :1], k, v, causal=True, context=ring)
