"""RingContext and the public call shape (ringmpi.context): where and how a call runs is one
``context=`` object whose defaults come from the environment when it is built; the maths are the
calls' keywords in flash-attn's conventions (window sides -1 unbounded, softcap 0.0 off, a varlen
keyword one array or a (for_q, for_kv) pair); every public call takes each thing one way only.
In process, one rank (COMM_SELF)."""

import dataclasses
import inspect

import numpy as np
import pytest
from mpi4py import MPI

import ringmpi
from random_inputs import attention_inputs
from ringmpi.context import Attention, Gradients, RingContext, call_options, pair
from ringmpi.core.masks import window_of, window_sides
from ringmpi.options import AttentionOptions
from ringmpi.parallel.topology import head_parallel_setting
from ringmpi.runtime.errors import ConfigError

HEADS = 4


def _public_calls():
    calls = {"ringmpi.ring_attention": ringmpi.ring_attention,
             "ringmpi.ring_attention_backward": ringmpi.ring_attention_backward,
             "ringmpi.decode_attention": ringmpi.decode_attention}
    try:
        import ringmpi.torch as rt
    except ImportError:  # torch is optional: its calls are checked where it is installed
        return calls
    calls.update({"ringmpi.torch.ring_attention": rt.ring_attention,
                  "ringmpi.torch.scaled_dot_product_attention": rt.scaled_dot_product_attention})
    return calls


def _self_ring(**changes):
    return RingContext(MPI.COMM_SELF, backend="numpy", **changes)


# ------------------------------------------------------------------ the context and the environment
def test_defaults_come_from_the_environment_when_the_context_is_built(monkeypatch):
    monkeypatch.delenv("RINGMPI_HEAD_PARALLEL", raising=False)
    monkeypatch.delenv("RINGMPI_TIMEOUT", raising=False)
    plain = RingContext()
    assert (plain.head_parallel, plain.timeout) == (None, None)
    assert head_parallel_setting(plain.head_parallel) == 1  # the flat ring

    monkeypatch.setenv("RINGMPI_HEAD_PARALLEL", "2")
    monkeypatch.setenv("RINGMPI_TIMEOUT", "7.5")
    ctx = RingContext()
    assert head_parallel_setting(ctx.head_parallel) == 2 and ctx.timeout == 7.5
    assert call_options(ctx).timeout == 7.5 and head_parallel_setting(call_options(ctx).head_parallel) == 2
    assert (plain.head_parallel, plain.timeout) == (None, None), "read when built, not when used"
    # a value given wins; the environment is read nowhere else (the topology's setting no longer reads it)
    given = RingContext(head_parallel=1, timeout=3.0)
    assert (given.head_parallel, given.timeout) == (1, 3.0)
    assert head_parallel_setting(None) == 1
    monkeypatch.setenv("RINGMPI_HEAD_PARALLEL", "auto")
    monkeypatch.setenv("RINGMPI_TIMEOUT", "")
    auto = RingContext()
    assert head_parallel_setting(auto.head_parallel) == "auto" and auto.timeout is None


def test_of_takes_none_or_a_context_only():
    ctx = RingContext(MPI.COMM_SELF, layout="zigzag")
    assert RingContext.of(ctx) is ctx
    default = RingContext.of(None)
    assert isinstance(default, RingContext) and default == RingContext()
    assert (default.comm, default.layout, default.backend, default.stats) == (None, "contiguous", "auto", None)
    for wrong in (MPI.COMM_SELF, "zigzag", {"layout": "zigzag"}, AttentionOptions()):
        with pytest.raises(TypeError, match="context must be a ringmpi.RingContext, got " + type(wrong).__name__):
            RingContext.of(wrong)
    # and so does every public call
    q, k, v = attention_inputs(0, 1, 8, 2, 2, 4, do=False, dtype=np.float32)
    with pytest.raises(TypeError, match="context must be a ringmpi.RingContext"):
        ringmpi.ring_attention(q, k, v, context=MPI.COMM_SELF)


def test_a_context_is_frozen_and_replaced():
    ctx = RingContext(MPI.COMM_SELF, timeout=5.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.timeout = 1.0
    other = ctx.replace(layout="striped", stats=[])
    assert (other.comm, other.layout, other.timeout, other.stats) == (MPI.COMM_SELF, "striped", 5.0, [])
    assert (ctx.layout, ctx.stats) == ("contiguous", None)
    assert other.replace(stats=None) == other.replace(stats=[1])  # the record is no part of the settings
    assert ctx.replace(invariant=True) != ctx


# ------------------------------------------------------------------ flash-attn's conventions
def test_pair_is_one_array_for_both_or_a_tuple_as_is():
    seg, seg_kv = np.zeros((2, 5), np.int32), np.ones((2, 7), np.int32)
    both = pair(seg, "segment_ids")
    assert isinstance(both, tuple) and len(both) == 2 and both[0] is seg and both[1] is seg
    given = (seg, seg_kv)
    assert pair(given, "segment_ids") is given
    assert pair((seg, None), "positions") == (seg, None)
    assert pair(None, "positions") == (None, None)
    with pytest.raises(TypeError, match="positions must be one array or a tuple .for_q, for_kv., got a tuple of 3"):
        pair((seg, seg, seg), "positions")
    with pytest.raises(TypeError, match="segment_ids .* a tuple of 1"):
        pair((seg,), "segment_ids")


def test_window_sides_minus_one_is_unbounded():
    assert window_sides((-1, -1)) is None
    assert window_sides((3, -1)) == (3, None) and window_sides((-1, 0)) == (None, 0)
    assert window_sides((5, 2)) == (5, 2)
    assert window_of(None) == (-1, -1) and window_of((3, None)) == (3, -1) and window_of((None, 0)) == (-1, 0)
    for window in ((-1, -1), (3, -1), (-1, 0), (5, 2)):
        assert window_of(window_sides(window)) == window
    ctx = RingContext()
    assert call_options(ctx, window=(-1, -1)).window is None
    assert call_options(ctx, window=(-1, -1)).digest() == call_options(ctx).digest()
    assert call_options(ctx, window=(3, -1)).window == (3, None)
    assert call_options(ctx, window=np.array([3, -1])).window == (3, None)
    # anything else is left for the options' check to name
    for bad in ((-2, 0), (3,), (1.5, 0), "wide"):
        problem = call_options(ctx, window=bad).problem(HEADS)
        assert problem == f"window must be (left, right), each an int >= 0 or -1 (unbounded), got {bad!r}", bad


def test_a_bad_window_is_a_config_error_of_the_call():
    q, k, v = attention_inputs(1, 1, 8, 2, 2, 4, do=False, dtype=np.float32)
    with pytest.raises(ConfigError, match=r"window must be \(left, right\), each an int >= 0 or -1 \(unbounded\), "
                                          r"got \(-2, 0\)"):
        ringmpi.ring_attention(q, k, v, window=(-2, 0), context=_self_ring())


def test_window_minus_one_gives_the_unwindowed_bits():
    q, k, v = attention_inputs(2, 1, 24, 2, 2, 8, do=False, dtype=np.float32)
    ctx = _self_ring()
    plain = ringmpi.ring_attention(q, k, v, causal=True, context=ctx)
    off = ringmpi.ring_attention(q, k, v, causal=True, window=(-1, -1), context=ctx)
    left = ringmpi.ring_attention(q, k, v, causal=True, window=(3, -1), context=ctx)
    assert plain.o.tobytes() == off.o.tobytes() and plain.lse.tobytes() == off.lse.tobytes()
    assert plain.o.tobytes() != left.o.tobytes()
    # (3, -1) with causal: each query sees itself and the 3 keys before it, as (3, 0)
    bounded = ringmpi.ring_attention(q, k, v, causal=True, window=(3, 0), context=ctx)
    assert left.o.tobytes() == bounded.o.tobytes()


def test_softcap_zero_is_off():
    assert AttentionOptions(softcap=0.0).softcap is None
    assert AttentionOptions(softcap=0.0).digest() == AttentionOptions().digest()
    assert AttentionOptions(softcap=0.0).score_spec(HEADS) == AttentionOptions().score_spec(HEADS)
    assert AttentionOptions(softcap=2.0).digest() != AttentionOptions().digest()
    assert call_options(RingContext(), softcap=0.0).digest() == AttentionOptions().digest()
    assert AttentionOptions(softcap=-1.0).problem(HEADS) == "softcap must be finite and >= 0 (0.0: off), got -1.0"

    q, k, v, do = attention_inputs(3, 1, 16, 2, 2, 8, dtype=np.float32)
    ctx = _self_ring()
    plain = ringmpi.ring_attention(q, k, v, causal=True, context=ctx)
    off = ringmpi.ring_attention(q, k, v, causal=True, softcap=0.0, context=ctx)
    capped = ringmpi.ring_attention(q, k, v, causal=True, softcap=0.5, context=ctx)
    assert plain.o.tobytes() == off.o.tobytes() and plain.lse.tobytes() == off.lse.tobytes()
    assert plain.o.tobytes() != capped.o.tobytes()
    grads = ringmpi.ring_attention_backward(do, q, k, v, plain, causal=True, context=ctx)
    grads_off = ringmpi.ring_attention_backward(do, q, k, v, off, causal=True, softcap=0.0, context=ctx)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(grads[:3], grads_off[:3]))
    with pytest.raises(ConfigError, match=r"softcap must be finite and >= 0 \(0\.0: off\), got -1\.0"):
        ringmpi.ring_attention(q, k, v, softcap=-1.0, context=ctx)


# ------------------------------------------------------------------ what the calls return
def test_the_calls_return_named_tuples_of_fixed_length():
    q, k, v, do = attention_inputs(4, 1, 16, 2, 2, 8, dtype=np.float32)
    ctx = _self_ring()
    out = ringmpi.ring_attention(q, k, v, causal=True, context=ctx)
    assert type(out) is Attention and len(out) == 3 and out.max_logit is None
    o, lse, _ = out
    assert o is out.o and lse is out.lse and o.shape == q.shape and lse.shape == (1, 2, 16)
    with_max = ringmpi.ring_attention(q, k, v, causal=True, return_max_logit=True, context=ctx)
    assert with_max.max_logit is not None and with_max.o.tobytes() == out.o.tobytes()
    grads = ringmpi.ring_attention_backward(do, q, k, v, out, causal=True, context=ctx)
    assert type(grads) is Gradients and len(grads) == 4 and grads.dsinks is None
    # the forward's result or its (o, lse): the same gradients
    again = ringmpi.ring_attention_backward(do, q, k, v, (o, lse), causal=True, context=ctx)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(grads[:3], again[:3]))
    sinks = np.zeros(2, np.float32)
    out_s = ringmpi.ring_attention(q, k, v, causal=True, sinks=sinks, context=ctx)
    assert ringmpi.ring_attention_backward(do, q, k, v, out_s, causal=True, sinks=sinks, context=ctx).dsinks.shape == (2,)
    assert ringmpi.Attention is Attention and ringmpi.Gradients is Gradients and ringmpi.RingContext is RingContext


# ------------------------------------------------------------------ one way to pass each thing
@pytest.mark.parametrize("name", ["ringmpi.ring_attention", "ringmpi.ring_attention_backward",
                                  "ringmpi.decode_attention", "ringmpi.torch.ring_attention",
                                  "ringmpi.torch.scaled_dot_product_attention"])
def test_every_public_call_is_short_and_takes_each_thing_once(name):
    calls = _public_calls()
    if name not in calls:
        pytest.skip("torch is not installed")
    params = inspect.signature(calls[name]).parameters
    assert len(params) <= 16, f"{name} has {len(params)} parameters: {list(params)}"
    assert "options" not in params and "comm" not in params, name
    # nor anything that goes by another name or in a catch-all
    assert not {"segment_ids_q", "segment_ids_kv", "positions_q", "positions_kv", "return_lse"} & params.keys(), name
    assert all(p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params.values()), name
    run = {f.name for f in dataclasses.fields(RingContext)}
    assert not run & params.keys(), f"{name}: {sorted(run & params.keys())} are the context's"
    assert params["context"].kind is inspect.Parameter.KEYWORD_ONLY and params["context"].default is None


def test_the_old_keywords_are_refused():
    q, k, v = attention_inputs(5, 1, 8, 2, 2, 4, do=False, dtype=np.float32)
    for old in (dict(comm=MPI.COMM_SELF), dict(options=AttentionOptions()), dict(backend="numpy"),
                dict(segment_ids_q=np.zeros((1, 8), np.int32))):
        with pytest.raises(TypeError, match="unexpected keyword argument '" + next(iter(old)) + "'"):
            ringmpi.ring_attention(q, k, v, **old)
    assert not hasattr(ringmpi, "AttentionOptions") and "AttentionOptions" not in ringmpi.__all__
