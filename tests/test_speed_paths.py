"""The NumPy backend's speed paths change no bit of any result (issue 15).

* ``resident``: what a block op derives from the resident operands (rounded
  ``q``/``do``, their NaN/Inf scans, scratch) is made on the first block of a
  call and reused; every block of a call must give bitwise what a block op
  without ``resident`` gives, with and without non-finite values.
"""

import numpy as np
import pytest

from ringmpi.backends.numpy_backend import NumpyBackend
from ringmpi.masks import BlockMask, MaskSpec

B, N, H, HKV, D = 2, 37, 4, 2, 8
SPLITS = (0, 11, 25, 37)  # three visiting blocks of uneven length


def _inputs(seed, bad=None):
    rng = np.random.default_rng(seed)
    q, do = rng.standard_normal((2, B, N, H, D)).astype(np.float32)
    k, v = rng.standard_normal((2, B, N, HKV, D)).astype(np.float32)
    arrays = dict(q=q, k=k, v=v, do=do)
    if bad is not None:
        name, value, token = bad
        arrays[name][1, token, 1 if name in ("q", "do") else 0, 3] = value
    return arrays


def _blocks(be, k, v, spec):
    for lo, hi in zip(SPLITS[:-1], SPLITS[1:]):
        yield (be.to_heads(k[:, lo:hi], np.float32), be.to_heads(v[:, lo:hi], np.float32),
               BlockMask(spec, np.arange(N), np.arange(lo, hi)))


def _forward(be, x, spec, resident):
    qh = be.to_heads(x["q"], np.float32)
    o_acc, m, l = np.zeros(qh.shape, np.float32), np.full(qh.shape[:3], -np.inf, np.float32), np.zeros(qh.shape[:3], np.float32)
    with np.errstate(all="ignore"):
        for kh, vh, mask in _blocks(be, x["k"], x["v"], spec):
            be.forward_block(qh, kh, vh, o_acc, m, l, 0.3, mask, resident=resident)
    return o_acc, m, l


def _backward(be, x, spec, resident):
    qh, doh = be.to_heads(x["q"], np.float32), be.to_heads(x["do"], np.float32)
    o_acc, m, l = _forward(be, x, spec, None)
    with np.errstate(all="ignore"):
        o, lse = be.finalize(o_acc, m, l, np.float32)
        dvec = be.row_dot(doh, be.to_heads(o, np.float32))
    dq = np.zeros_like(qh)
    grads = []
    with np.errstate(all="ignore"):
        for kh, vh, mask in _blocks(be, x["k"], x["v"], spec):
            dk, dv = np.zeros_like(kh), np.zeros_like(vh)
            be.backward_block(qh, doh, lse, dvec, kh, vh, dq, dk, dv, 0.3, mask, resident=resident)
            grads += [dk, dv]
    return [dq] + grads


@pytest.mark.parametrize("bad", [None, ("q", np.nan, 5), ("k", np.inf, 20), ("v", np.nan, 30), ("do", -np.inf, 9)])
@pytest.mark.parametrize("tiles", [(512, 512), (5, 4)])
def test_resident_state_is_bitwise_the_per_block_computation(monkeypatch, bad, tiles):
    import ringmpi.backends.numpy_backend as nb

    monkeypatch.setattr(nb, "TILE_Q", tiles[0])
    monkeypatch.setattr(nb, "TILE_KV", tiles[1])
    be = NumpyBackend()
    x = _inputs(1, bad)
    spec = MaskSpec(causal=True)
    resident = {}
    for got, want in zip(_forward(be, x, spec, resident), _forward(be, x, spec, None)):
        np.testing.assert_array_equal(got, want)
    assert resident, "the forward kept nothing across blocks"
    resident = {}
    for got, want in zip(_backward(be, x, spec, resident), _backward(be, x, spec, None)):
        np.testing.assert_array_equal(got, want)
    assert resident, "the backward kept nothing across blocks"
