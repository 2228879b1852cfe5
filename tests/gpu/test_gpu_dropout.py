"""Dropout on the GPU: the CUDA keep mask equals the NumPy one bit for bit.

Block level (one rank): with ``q = 0`` every weight is 1 and ``v`` the
identity, so the forward's ``o_acc[i, j]`` is exactly weight ``(i, j)``'s
dropout factor: the kernels' mask (Philox in ``kernels/rules.h``) must equal
``Dropout.keep`` (``ringmpi/core/philox.py``) everywhere, for every kernel kind, at
positions past 2^32.  Then forward and backward with dropout against the NumPy
backend, and the ring cases of ``tests/mpi/dropout_cases.py`` on the CuPy backend.
Skipped, visibly, without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpi_util import mpirun_env, run_cases
from ringmpi.backends import gpu_available
from ringmpi.backends.numpy_backend import NumpyBackend
from ringmpi.core.dropout import Dropout
from ringmpi.core.masks import BlockMask, ScoreSpec

pytestmark = pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU visible to CuPy")

KINDS = ("float16", "bfloat16", "float32", "float64")


def _dtype(name):
    from ringmpi.core.dtypes import BFLOAT16
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def _mask(p, seed, heads, sq, skv, causal=False, high=0):
    rng = np.random.default_rng(seed)
    q_pos = np.sort(rng.choice(4 * sq, sq, replace=False)) + high
    kv_pos = np.sort(rng.choice(4 * skv, skv, replace=False)) + high
    spec = ScoreSpec(causal=causal, dropout=Dropout(p=p, seed=seed, heads=heads))
    return BlockMask(spec, q_pos.astype(np.int64), kv_pos.astype(np.int64))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dim", (64, 96))
def test_keep_mask_bitwise(kind, dim):
    import cupy
    from ringmpi.backends.cupy_backend import CupyBackend

    be = CupyBackend.instance()
    dt = _dtype(kind)
    ct = np.float64 if kind == "float64" else np.float32
    batch, heads, kv_heads, sq, skv = 2, 3, 1, 70, dim  # v = identity: D = S_kv
    mask = _mask(0.35, (1 << 40) + 17, heads, sq, skv, high=(1 << 33) + 5)
    q = cupy.zeros((batch, heads, sq, dim), dtype=ct)
    k = cupy.asarray(np.random.default_rng(1).standard_normal((batch, kv_heads, skv, dim)).astype(dt))
    v = cupy.asarray(np.broadcast_to(np.eye(skv, dim), (batch, kv_heads, skv, dim)).astype(dt))
    o = cupy.zeros((batch, heads, sq, dim), dtype=ct)
    m = cupy.full((batch, heads, sq), -np.inf, dtype=ct)
    l = cupy.zeros((batch, heads, sq), dtype=ct)
    be.forward_block(q, k, v, o, m, l, 1.0, mask)
    got = cupy.asnumpy(o)
    d = mask.spec.dropout
    for b in range(batch):
        for h in range(heads):
            keep = d.keep(b, h, mask.q_pos, mask.kv_pos)
            np.testing.assert_array_equal(got[b, h] != 0, keep, err_msg=f"{kind} D={dim} b={b} h={h}")
            if kind in ("float32", "float64"):  # the factor itself, exactly
                np.testing.assert_array_equal(got[b, h], np.where(keep, d.rescale(ct), 0))
    np.testing.assert_array_equal(cupy.asnumpy(l), skv)  # l counts every weight, kept or not


@pytest.mark.parametrize("kind, tol", [("float64", 1e-10), ("float32", 2e-4), ("float16", 2e-2)])
def test_forward_backward_match_numpy(kind, tol):
    import cupy
    from ringmpi.backends.cupy_backend import CupyBackend

    gpu, cpu = CupyBackend.instance(), NumpyBackend()
    dt = _dtype(kind)
    ct = np.dtype(np.float64 if kind == "float64" else np.float32)
    rng = np.random.default_rng(3)
    batch, heads, kv_heads, sq, skv, dim = 2, 4, 2, 77, 90, 40
    mask = _mask(0.3, 99, heads, sq, skv, causal=True)
    q = rng.standard_normal((batch, heads, sq, dim)).astype(dt).astype(ct)
    k = rng.standard_normal((batch, kv_heads, skv, dim)).astype(dt)
    v = rng.standard_normal((batch, kv_heads, skv, dim)).astype(dt)
    do = rng.standard_normal((batch, heads, sq, dim)).astype(dt).astype(ct)
    results = []
    for be, xp in ((cpu, np), (gpu, cupy)):
        o = xp.zeros((batch, heads, sq, dim), dtype=ct)
        m = xp.full((batch, heads, sq), -np.inf, dtype=ct)
        l = xp.zeros((batch, heads, sq), dtype=ct)
        args = [xp.asarray(x) for x in (q, k, v)]
        be.forward_block(*args, o, m, l, 0.2, mask)
        out, lse = be.finalize(o, m, l, ct)
        doh = xp.asarray(do)
        dvec = be.row_dot(doh, xp.ascontiguousarray(out.transpose(0, 2, 1, 3)))
        dq, dk, dv = (xp.zeros(x.shape, dtype=ct) for x in (q, k, v))
        be.backward_block(args[0], doh, lse, dvec, args[1], args[2], dq, dk, dv, 0.2, mask)
        results.append([np.asarray(x.get() if hasattr(x, "get") else x, dtype=np.float64)
                        for x in (out, lse, dq, dk, dv)])
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), *results):
        assert np.max(np.abs(a - b)) <= tol * max(1.0, np.max(np.abs(a))), f"{kind} {name}"


@pytest.mark.mpi
def test_ring_dropout_cases_on_cupy(tmp_path_factory):
    from test_dropout import cases_for

    tmp = tmp_path_factory.mktemp("gpu_dropout")
    cases = [c for c in cases_for(2) if "-inv-" not in c["id"] and c.get("kind") != "torch"]
    results = run_cases(2, cases, tmp, timeout=300, env=mpirun_env(RINGMPI_TEST_BACKEND="cupy"),
                        driver="dropout_cases.py")
    failed = {k: msg for k, (ok, msg) in results.items() if not ok}
    assert not failed, failed
