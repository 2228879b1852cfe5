"""The block-op interface of ringmpi.backends, checked on every backend that can run here.

One body per backend: the documented names exist, each backend satisfies the
``typing.Protocol`` s of ringmpi.backends.interface (members and call
signatures), the messages behave as
the schedule expects, forward_block/backward_block return their tile counts
and agree with a float64 dense reference (docs/design.md's tolerance rule).
CuPy is skipped, with the reason shown, where no GPU is visible.
"""

import inspect

import numpy as np
import pytest

from random_inputs import attention_inputs
from reference import dense_backward, dense_forward, tolerance_check, visible
from ringmpi.backends import INTERFACE, MESSAGE_INTERFACE, Backend, Message, get_backend, gpu_available
from ringmpi.core.masks import BlockMask, ScoreSpec

BACKENDS = [
    "numpy",
    pytest.param("cupy", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU visible to CuPy")]),
]


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _problem(seed, b=2, n=70, h=4, hkv=2, d=16):
    return tuple(x.astype(np.float32) for x in attention_inputs(seed, b, n, h, hkv, d))


@pytest.fixture(params=BACKENDS)
def be(request):
    return get_backend(request.param)


def test_every_documented_name_exists(be):
    for name in INTERFACE:
        assert hasattr(be, name), name
    msg = be.message(64)
    for name in MESSAGE_INTERFACE:
        assert callable(getattr(msg, name)), name
    assert be.compute_dtype(np.float64) == np.float64 and be.compute_dtype(np.float16) == np.float32


def protocol_problems(obj, protocol) -> list:
    """How ``obj`` fails ``protocol``: a member it lacks, or a method that cannot be called as the
    protocol declares it (the protocol's parameters by name and in order; any more need defaults)."""
    problems = []
    for name in [n for n in protocol.__annotations__] + [n for n, v in vars(protocol).items()
                                                          if callable(v) and not n.startswith("_")]:
        if not hasattr(obj, name):
            problems.append(f"no {name}")
            continue
        declared = getattr(protocol, name, None)
        if not callable(declared):
            continue
        if not callable(getattr(obj, name)):
            problems.append(f"{name} is not callable")
            continue
        want = list(inspect.signature(declared).parameters.values())[1:]  # without self
        have = list(inspect.signature(getattr(obj, name)).parameters.values())
        names = [p.name for p in have[:len(want)]]
        extra = [p.name for p in have[len(want):] if p.default is inspect.Parameter.empty
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if names != [p.name for p in want] or extra:
            problems.append(f"{name}{inspect.signature(getattr(obj, name))} does not take "
                            f"{name}{inspect.signature(declared)} (without self)")
    return problems


def test_the_backend_satisfies_the_protocols(be):
    """Both backends are :class:`~ringmpi.backends.interface.Backend` s, their messages
    :class:`~ringmpi.backends.interface.Message` s: every member, every call signature."""
    assert isinstance(be, Backend) and protocol_problems(be, Backend) == []
    msg = be.message(64)
    assert isinstance(msg, Message) and protocol_problems(msg, Message) == []
    assert INTERFACE[:3] == ("name", "xp", "MODIFIERS") and "backward_block" in INTERFACE
    assert MESSAGE_INTERFACE == ("mpi_buffer", "view", "arrived", "ready_to_send")


def test_the_protocol_check_finds_what_a_backend_gets_wrong():
    """The check above fails on a backend that lacks a member or whose block op takes other arguments."""
    from ringmpi.backends.numpy_backend import NumpyBackend

    class Missing(NumpyBackend):
        annotate = None

    class Reordered(NumpyBackend):
        def forward_block(self, qh, kh, vh, m, o_acc, l, scale, mask, tick=None, resident=None):
            raise AssertionError("never called")

    class Demanding(NumpyBackend):
        def finalize(self, o_acc, m, l, out_dtype, stream):
            raise AssertionError("never called")

    assert protocol_problems(NumpyBackend(), Backend) == []
    assert protocol_problems(Missing(), Backend) == ["annotate is not callable"]
    assert [p.split("(")[0] for p in protocol_problems(Reordered(), Backend)] == ["forward_block"]
    assert [p.split("(")[0] for p in protocol_problems(Demanding(), Backend)] == ["finalize"]
    assert protocol_problems(object(), Message) == [f"no {n}" for n in MESSAGE_INTERFACE]


def test_message_views_share_the_mpi_buffer(be):
    msg = be.message(32)
    view = msg.view(0, (8,), np.float32)
    view[...] = be.xp.arange(8, dtype=np.float32)
    msg.ready_to_send(dirty=True)
    assert np.array_equal(np.asarray(_host(msg.mpi_buffer())).view(np.float32), np.arange(8, dtype=np.float32))


def _block_pass(be, q, k, v, spec, seg=None, split=3):
    """Forward over K/V split into ``split`` blocks, as a ring would deliver them."""
    xp = be.xp
    qh = be.to_heads(be.asarray(q), np.float32)
    o_acc = xp.zeros(qh.shape, np.float32)
    m = xp.full(qh.shape[:3], -np.inf, dtype=np.float32)
    l = xp.zeros(qh.shape[:3], np.float32)
    n = k.shape[1]
    cuts = np.linspace(0, n, split + 1).astype(int)
    counts = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        mask = BlockMask(spec, np.arange(q.shape[1]), np.arange(lo, hi), seg,
                         None if seg is None else seg[:, lo:hi])
        kh = be.to_heads(be.asarray(k[:, lo:hi]), np.float32)
        vh = be.to_heads(be.asarray(v[:, lo:hi]), np.float32)
        counts.append(be.forward_block(qh, kh, vh, o_acc, m, l, 1 / 4, mask, tick=lambda: None))
    o, lse = be.finalize(o_acc, m, l, np.float32)
    return _host(o), _host(lse), counts


@pytest.mark.parametrize("causal, use_seg", [(False, False), (True, False), (True, True)])
def test_forward_block_matches_the_dense_reference_and_counts_tiles(be, causal, use_seg):
    q, k, v, _ = _problem(0)
    seg = np.sort(np.random.default_rng(1).integers(0, 3, q.shape[:2]), axis=1) if use_seg else None
    spec = ScoreSpec(causal=causal)
    o, lse, counts = _block_pass(be, q, k, v, spec, seg)
    vis = visible(70, 70, causal, None, seg, seg)
    o64, lse64 = dense_forward(q, k, v, vis, 1 / 4, np.float64)
    o32, lse32 = dense_forward(q, k, v, vis, 1 / 4, np.float32)
    for name, ours, ref, naive in (("o", o, o64, o32), ("lse", lse, lse64, lse32)):
        ok, msg = tolerance_check(name, ours, ref, naive)
        assert ok, msg
    for computed, skipped in counts:
        assert isinstance(computed, int) and isinstance(skipped, int) and computed + skipped > 0
    if not causal:
        assert all(skipped == 0 for _, skipped in counts)
    else:  # the last key block lies partly in the future of the first queries
        assert counts[0][0] > 0


def test_a_block_entirely_in_the_future_is_skipped(be):
    q, k, v, do = _problem(2, n=40)
    qh = be.to_heads(be.asarray(q[:, :10]), np.float32)
    kh = be.to_heads(be.asarray(k[:, 20:]), np.float32)
    vh = be.to_heads(be.asarray(v[:, 20:]), np.float32)
    o_acc = be.xp.zeros(qh.shape, np.float32)
    m = be.xp.full(qh.shape[:3], -np.inf, dtype=np.float32)
    l = be.xp.zeros(qh.shape[:3], np.float32)
    mask = BlockMask(ScoreSpec(causal=True), np.arange(10), np.arange(20, 40))
    computed, skipped = be.forward_block(qh, kh, vh, o_acc, m, l, 0.25, mask)
    assert computed == 0 and skipped > 0
    assert not _host(l).any()
    doh, lse, dvec = qh.copy(), be.xp.zeros(qh.shape[:3], np.float32), be.xp.zeros(qh.shape[:3], np.float32)
    dq, dk, dv = be.xp.zeros_like(qh), be.xp.zeros_like(kh), be.xp.zeros_like(vh)
    computed, skipped = be.backward_block(qh, doh, lse, dvec, kh, vh, dq, dk, dv, 0.25, mask)
    assert computed == 0 and skipped > 0 and not _host(dk).any()
    empty = be.to_heads(be.asarray(k[:, :0]), np.float32)
    assert be.forward_block(qh, empty, empty, o_acc, m, l, 0.25,
                            BlockMask(ScoreSpec(), np.arange(10), np.arange(0))) == (0, 0)


def test_backward_block_matches_the_dense_reference(be):
    q, k, v, do = _problem(3)
    spec = ScoreSpec(causal=True)
    o, lse, _ = _block_pass(be, q, k, v, spec)
    xp = be.xp
    qh, doh = be.to_heads(be.asarray(q), np.float32), be.to_heads(be.asarray(do), np.float32)
    dvec = be.row_dot(doh, be.to_heads(be.asarray(o), np.float32))
    assert np.allclose(_host(dvec), (_host(doh) * _host(be.to_heads(be.asarray(o), np.float32))).sum(-1),
                       rtol=1e-5, atol=1e-5)
    lse_d = be.asarray(lse)
    dq = xp.zeros_like(qh)
    kh, vh = be.to_heads(be.asarray(k), np.float32), be.to_heads(be.asarray(v), np.float32)
    dk, dv = xp.zeros_like(kh), xp.zeros_like(vh)
    mask = BlockMask(spec, np.arange(70), np.arange(70))
    computed, skipped = be.backward_block(qh, doh, lse_d, dvec, kh, vh, dq, dk, dv, 1 / 4, mask)
    assert computed > 0
    dq *= np.float32(1 / 4)
    dk *= np.float32(1 / 4)
    vis = visible(70, 70, True)
    ref = dense_backward(do, q, k, v, vis, 1 / 4, np.float64)
    naive = dense_backward(do, q, k, v, vis, 1 / 4, np.float32)
    for name, ours, r, nv in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, naive):
        ok, msg = tolerance_check(name, _host(be.from_heads(ours, np.float32)), r, nv, gradient=True)
        assert ok, msg
