"""The public call on the GPU: ``ring_attention`` and its backward on CuPy arrays.

Single rank in process, forward and backward against ``reference.py`` under
docs/design.md's rule, over every mask (full, causal, window, segments) and GQA,
with the head dims a parameter: ``D_v = D`` in bfloat16 at D = 64, 128, 256 (then
also the ``uint16`` + ``dtype="bfloat16"`` path, bit for bit), and the value head
dims ``D_v != D`` in every dtype: the MLA pair D = 192, D_v = 128 (its own kernel
instantiations) and a pair in one head-dim bucket (D = 100, D_v = 110: the
D == D_v kernels with D_v at run time).  An unsupported pair is refused with a
ConfigError before any compute.  Skipped, with the reason shown, where no GPU is visible.
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
HEAD_DIMS = ([("bfloat16", d, d) for d in (64, 128, 256)]  # D_v = D
             + [(dtype, d, d_v) for d, d_v in ((192, 128), (100, 110)) for dtype in DTYPES])  # D_v != D


def _dtype(name):
    return reference.BFLOAT16 if name == "bfloat16" else np.dtype(name)


@pytest.mark.parametrize("dtype,d,d_v", HEAD_DIMS, ids=[f"{t}-D{d}-Dv{dv}" for t, d, dv in HEAD_DIMS])
@pytest.mark.parametrize("mask", list(MASKS))
def test_public_call_cupy(mask, dtype, d, d_v):
    import cupy as cp
    from mpi4py import MPI

    import ringmpi

    dt = _dtype(dtype)
    b, n, h, hkv = 2, 200, 4, 2
    q, k, v, do = attention_inputs(0, b, n, h, hkv, d, dv=d_v, dtype=dt)
    kw = dict(MASKS[mask])
    seg = None
    if kw.pop("segments", False):
        seg = (np.arange(n) // 37)[None].repeat(b, 0)
        kw.update(segment_ids=seg)
    ring = ringmpi.RingContext(MPI.COMM_SELF, backend="cupy")
    args = [cp.asarray(x) for x in (q, k, v)]
    assert all(a.dtype == dt for a in args)
    o, lse, _ = ringmpi.ring_attention(*args, **kw, context=ring)
    dq, dk, dv, _ = ringmpi.ring_attention_backward(cp.asarray(do), *args, (o, lse), **kw, context=ring)
    assert o.shape == (b, n, h, d_v) and dv.shape == v.shape and dk.shape == k.shape
    assert o.dtype == dt and all(g.dtype == dt for g in (dq, dk, dv))
    assert lse.dtype == (np.float64 if dtype == "float64" else np.float32)
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

    if dtype == "bfloat16":  # the same bits as uint16, declared: uint16 results, bit for bit the same
        bits = [a.view(cp.uint16) for a in args]
        o_bits, lse_bits, _ = ringmpi.ring_attention(*bits, **kw, context=ring.replace(dtype="bfloat16"))
        assert o_bits.dtype == np.uint16
        assert cp.array_equal(o_bits, o.view(cp.uint16)) and cp.array_equal(lse_bits, lse)


def test_unsupported_value_dim_is_refused():
    import cupy as cp
    from mpi4py import MPI

    import ringmpi
    from ringmpi.runtime.errors import ConfigError

    q, k, v = (cp.asarray(x) for x in attention_inputs(1, 1, 8, 2, 2, 24, dv=40, do=False, dtype=np.float32))
    ring = ringmpi.RingContext(MPI.COMM_SELF, backend="cupy")
    with pytest.raises(ConfigError, match="D=24 with value head dim D_v=40"):
        ringmpi.ring_attention(q, k, v, context=ring)
    with pytest.raises(ConfigError, match="D=24 with value head dim D_v=40"):
        ringmpi.decode_attention(q[:, :1], k, v, causal=True, context=ring)
