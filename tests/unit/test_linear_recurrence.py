"""The linear-attention pieces in one process: the tests' sequential reference (checked by
``torch.autograd.gradcheck``), the chunked runs of ``core/linear_recurrence.py`` against it,
forward and reverse, the state maps' composition and the shard segments."""

import numpy as np
import pytest
import torch

from linear_reference import recurrence
from random_inputs import linear_inputs
from ringmpi.core import linear_recurrence as lr
from ringmpi.core.state_maps import KINDS, StateMap, identity, pack, reset, then, transposed, unpack
from ringmpi.core.state_segments import Segment, empty_documents, segments


@pytest.mark.parametrize("per_key", [False, True])
@pytest.mark.parametrize("delta", [True, False])
def test_reference_passes_gradcheck(delta, per_key):
    rng = np.random.default_rng(3)
    x = linear_inputs(rng, 1, 7, 1, 2, 3, 2, per_key)
    args = [torch.tensor(x[n], requires_grad=True) for n in ("q", "k", "v", "g", "beta")]
    s0 = torch.tensor(rng.standard_normal((3, 2, 3, 2)), requires_grad=True)
    cu = [0, 3, 3, 7]  # two documents and an empty one

    def f(q, k, v, g, beta, s0):
        return recurrence(q, k, v, g, beta, 0.7, s0, cu_seqlens=cu, delta=delta)

    assert torch.autograd.gradcheck(f, (*args, s0))


def _head_major(a):
    return np.ascontiguousarray(np.moveaxis(a, 1, 2))


@pytest.mark.parametrize("per_key", [False, True])
@pytest.mark.parametrize("delta", [True, False])
@pytest.mark.parametrize("t", [1, 64, 150])
def test_chunked_run_against_the_recurrence(delta, t, per_key):
    """Forward, the run's map (M, each token's query as it sees the entering state) and every
    gradient, across chunk boundaries and a partial last chunk, in float64; a decay per token
    (gated delta rule, simple GLA) or per key (KDA, GLA)."""
    rng = np.random.default_rng(t)
    x = linear_inputs(rng, 2, t, 3, 3, 5, 4, per_key)
    s0 = rng.standard_normal((2, 3, 5, 4))
    scale = 0.6
    ref = {n: torch.tensor(a, requires_grad=True) for n, a in dict(x, s0=s0).items()}
    o_ref, f_ref = recurrence(*(ref[n] for n in ("q", "k", "v", "g", "beta")), scale, ref["s0"], delta=delta)
    do, dfinal = rng.standard_normal(o_ref.shape), rng.standard_normal(f_ref.shape)
    ((o_ref * torch.tensor(do)).sum() + (f_ref * torch.tensor(dfinal)).sum()).backward()

    pieces = lr.chunks(_head_major(x["q"]) * scale, _head_major(x["k"]), _head_major(x["v"]), _head_major(x["g"]),
                       _head_major(x["beta"]), delta)
    fwd = lr.run_forward(pieces, s0)
    err = lambda a, b: np.abs(a - b).max() / np.abs(b).max()  # noqa: E731
    assert err(np.moveaxis(fwd.o, 1, 2), o_ref.detach().numpy()) < 1e-12
    assert err(fwd.s_end, f_ref.detach().numpy()) < 1e-12
    from_zero = lr.run_forward(pieces, np.zeros_like(s0), track_map=True)
    m = from_zero.m if delta else (from_zero.m[..., :, None] if per_key else from_zero.m[..., None, None]) * np.eye(5)
    assert err(m @ s0 + from_zero.s_end, fwd.s_end) < 1e-12
    states = lr.entered(pieces, from_zero, s0)
    assert err(states, fwd.states) < 1e-12
    assert err(lr.outputs_of(pieces, states), fwd.o) < 1e-12
    np.testing.assert_array_equal(lr.outputs_of(pieces, states, lr.within(pieces)), lr.outputs_of(pieces, states))
    grads = lr.run_backward(pieces, fwd.states, _head_major(do), dfinal)
    # what the outputs ask of the entering state (the reverse recursion from a zero end gradient),
    # plus the map's transpose of the end state's gradient: the entering state's whole gradient
    seen = lr.seen_outputs(pieces, _head_major(do))
    c = lr.state_grads(pieces, seen, np.zeros_like(dfinal))[1]
    assert err(c + np.swapaxes(m, -1, -2) @ dfinal, grads.ds0) < 1e-12
    again = lr.run_backward(pieces, fwd.states, _head_major(do), dfinal, reverse=lr.state_grads(pieces, seen, dfinal))
    for name in ("dq", "dk", "dv", "dg", "ds0"):
        np.testing.assert_array_equal(getattr(again, name), getattr(grads, name))
    for ours, leaf in ((np.moveaxis(grads.dq, 1, 2) * scale, "q"), (np.moveaxis(grads.dk, 1, 2), "k"),
                       (np.moveaxis(grads.dv, 1, 2), "v"), (np.moveaxis(grads.dg, 1, 2), "g"), (grads.ds0, "s0")):
        assert err(ours, ref[leaf].grad.numpy()) < 1e-12, leaf
    if delta:
        assert err(np.moveaxis(grads.dbeta, 1, 2), ref["beta"].grad.numpy()) < 1e-12


def _random_map(rng, kind, shape=(2, 3, 4, 5)):
    rows, heads, kd, _ = shape
    m = {"identity": lambda: rng.integers(0, 2, (rows, heads)).astype(float),
         "scalar": lambda: rng.uniform(0, 1, (rows, heads)),
         "diagonal": lambda: rng.uniform(0, 1, (rows, heads, kd)),
         "dense": lambda: rng.standard_normal((rows, heads, kd, kd))}[kind]()
    return StateMap(kind, m, rng.standard_normal(shape))


@pytest.mark.parametrize("kind", KINDS)
def test_state_maps_compose_in_order(kind):
    rng = np.random.default_rng(5)
    a, b, c = (_random_map(rng, kind) for _ in range(3))
    s = rng.standard_normal(a.u.shape)
    ab = then(a, b)
    assert np.allclose(ab.apply(s) + ab.u, b.apply(a.apply(s) + a.u) + b.u)
    left, right = then(then(a, b), c), then(a, then(b, c))  # associative: any scan's grouping
    assert np.allclose(left.m, right.m) and np.allclose(left.u, right.u)
    back = unpack(kind, pack(ab), ab.u.shape)
    assert np.array_equal(back.m, ab.m) and np.array_equal(back.u, ab.u)
    none = identity(kind, 2, 3, 4, 5, np.float64)
    assert np.allclose(then(none, a).apply(s), a.apply(s)) and np.allclose(then(a, none).u, a.u)
    assert np.array_equal(reset(kind, a.u).apply(s), np.zeros_like(s))
    d = rng.standard_normal(s.shape)  # <M s, d> = <s, M^T d>
    assert np.isclose(np.sum(a.apply(s) * d), np.sum(s * transposed(a, a.u).apply(d)))


def test_segments_cut_a_shard_at_documents():
    bounds = [0, 9, 9, 60, 190, 260]
    assert segments(0, 60, bounds) == [Segment(0, 9, 0, True, True), Segment(9, 60, 2, True, True)]
    assert segments(100, 200, bounds) == [Segment(0, 90, 3, False, True), Segment(90, 100, 4, True, False)]
    assert segments(120, 150, bounds) == [Segment(0, 30, 3, False, False)]
    assert segments(70, 70, bounds) == []
    assert empty_documents(bounds) == [1]


@pytest.mark.parametrize("m", [1, 5, 64])
def test_unit_lower_inverse(m):
    """The chunks' UT system is solved by an inverse made of doubling blocks: it is the inverse,
    at any size (the last block of a size that is not a power of two is short)."""
    rng = np.random.default_rng(m)
    t = np.tril(rng.uniform(-0.5, 0.5, (3, m, m)), -1) + np.eye(m)
    inv = lr.unit_lower_inverse(t)
    assert np.array_equal(inv, np.tril(inv))
    np.testing.assert_allclose(inv, np.linalg.inv(t), rtol=0, atol=1e-12 * np.abs(np.linalg.inv(t)).max())
    np.testing.assert_allclose(inv @ t, np.broadcast_to(np.eye(m), t.shape), rtol=0, atol=1e-12)


class _Foreign(np.ndarray):
    """A stand-in for a device array type (its module reads as ``cupy``): NumPy computes it, but
    any operation that mixes in a plain NumPy array fails, as CuPy does."""

    @staticmethod
    def _plain(x):
        if type(x) is np.ndarray:
            raise TypeError("a NumPy array was mixed into the device path")
        if isinstance(x, (list, tuple)):
            return type(x)(_Foreign._plain(a) for a in x)
        return x.view(np.ndarray) if isinstance(x, _Foreign) else x

    @staticmethod
    def _wrapped(r):
        if isinstance(r, tuple):
            return tuple(_Foreign._wrapped(a) for a in r)
        return r.view(_Foreign) if type(r) is np.ndarray else r

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if "out" in kwargs:
            kwargs["out"] = self._plain(kwargs["out"])
        return self._wrapped(getattr(ufunc, method)(*self._plain(inputs), **kwargs))

    def __array_function__(self, func, types, args, kwargs):
        return self._wrapped(func(*self._plain(args), **{n: self._plain(a) for n, a in kwargs.items()}))

    def __setitem__(self, key, value):
        self.view(np.ndarray)[key] = self._plain(value)


_Foreign.__module__ = "cupy"


class _ForeignModule:
    """``cupy`` for :func:`ringmpi.core.host.array_module`: NumPy whose new arrays are :class:`_Foreign`."""

    def __getattr__(self, name):
        attr = getattr(np, name)
        if not callable(attr) or isinstance(attr, type):
            return attr
        return lambda *a, **kw: _Foreign._wrapped(attr(*_Foreign._plain(a),
                                                       **{n: _Foreign._plain(v) for n, v in kw.items()}))


@pytest.mark.parametrize("per_key", [False, True])
@pytest.mark.parametrize("delta", [True, False])
def test_chunked_run_keeps_the_inputs_array_type(monkeypatch, delta, per_key):
    """Every array the chunked runs make comes from the inputs' module: with a foreign array type
    (which refuses plain NumPy operands, as CuPy does) every result keeps that type and the same
    values as on NumPy."""
    monkeypatch.setitem(__import__("sys").modules, "cupy", _ForeignModule())
    rng = np.random.default_rng(5)
    x = {n: _head_major(a) for n, a in linear_inputs(rng, 1, 150, 2, 2, 4, 3, per_key).items()}
    s0, ds_end = rng.standard_normal((1, 2, 4, 3)), rng.standard_normal((1, 2, 4, 3))
    do = rng.standard_normal((1, 2, 150, 3))

    def run(cast):
        pieces = lr.chunks(*(cast(x[n]) for n in ("q", "k", "v", "g", "beta")), delta)
        fwd = lr.run_forward(pieces, cast(s0), track_map=True)
        grads = lr.run_backward(pieces, fwd.states, cast(do), cast(ds_end))
        return [fwd.o, fwd.s_end, fwd.m, fwd.states_m, grads.dq, grads.dk, grads.dv, grads.dg, grads.ds0] + (
            [grads.dbeta] if delta else [])

    plain, foreign = run(lambda a: a), run(lambda a: a.view(_Foreign))
    for i, (p, f) in enumerate(zip(plain, foreign)):
        assert type(f) is _Foreign, f"result {i} is {type(f).__name__}"
        np.testing.assert_array_equal(f.view(np.ndarray), p)
