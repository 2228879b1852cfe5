"""AttentionOptions (issue 25): its rules, the agreement digest, the mask spec it implies and the
file-attributes round trip; the ALiBi modifier's own pieces.  In process, no MPI launch."""

import numpy as np
import pytest

from ringmpi.core.modifiers import Alibi
from ringmpi.filejob.attributes import attention_attrs, attention_of_attrs
from ringmpi.options import AttentionOptions


def test_rules_name_the_bad_option():
    heads = 4
    assert AttentionOptions().problem(heads) is None
    bad = {
        "window must be (left, right), each an int >= 0 or -1 (unbounded)": dict(window=(1, -2)),
        "softcap must be finite and >= 0 (0.0: off)": dict(softcap=-1.0),
        "sinks must have shape (H,) = (4,)": dict(sinks=np.zeros(3, np.float32)),
        "alibi_slopes must be float32": dict(alibi_slopes=np.zeros(heads, np.float64)),
        "alibi_slopes must have shape": dict(alibi_slopes=np.zeros((heads, 1), np.float32)),
        "alibi_slopes must be finite": dict(alibi_slopes=np.array([0, np.nan, 0, 0], np.float32)),
        "dropout_p > 0 needs a dropout_seed": dict(dropout_p=0.1),
        "dropout_offsets must be": dict(dropout_p=0.1, dropout_seed=1, dropout_offsets=(0, 2, 4)),
        "softmax_scale must be a finite number": dict(softmax_scale=float("inf")),
        "timeout must be a number of seconds > 0": dict(timeout=0),
        "schedule must be one of 'auto', 'ring', 'routed', 'allgather'": dict(schedule="ringed"),
    }
    for want, kw in bad.items():
        problem = AttentionOptions(**kw).problem(heads)
        assert problem is not None and want in problem, (kw, problem)
    # flash-attn's conventions: softcap 0.0 is off and a window side of -1 unbounded, held as the
    # options not given (the same digest and spec)
    for off in (dict(softcap=0.0), dict(window=(-1, -1)), dict(softcap=0, window=[-1, -1])):
        assert AttentionOptions(**off).problem(heads) is None, off
        assert (AttentionOptions(**off).softcap, AttentionOptions(**off).window) == (None, None), off
        assert AttentionOptions(**off).digest() == AttentionOptions().digest(), off
    assert AttentionOptions(window=(-1, 3)).window == (None, 3)
    assert AttentionOptions(window=(-1, 3)).digest() == AttentionOptions(window=(None, 3)).digest()
    assert AttentionOptions(window=(-1, 3)).digest() != AttentionOptions().digest()
    assert "is not one of" in AttentionOptions(dtype="int8").dtype_problem()
    assert AttentionOptions(dtype="bf16").dtype_problem() is None


def test_digest_sees_what_ranks_must_share():
    base = AttentionOptions(causal=True, window=(4, 0), softcap=2.0, sinks=np.ones(2, np.float32))
    same = AttentionOptions(causal=True, window=[4.0, 0], softcap=2, sinks=np.ones(2, np.float64))
    assert base.digest() == same.digest()
    for changed in (dict(causal=False), dict(window=(5, 0)), dict(softcap=3.0), dict(softmax_scale=0.5),
                    dict(sinks=np.zeros(2, np.float32)), dict(alibi_slopes=np.ones(2, np.float32)),
                    dict(check_finite=True), dict(schedule="routed")):
        kw = dict(causal=True, window=(4, 0), softcap=2.0, sinks=np.ones(2, np.float32))
        kw.update(changed)
        assert AttentionOptions(**kw).digest() != base.digest(), changed
    # sinks and ALiBi slopes of the same values are told apart
    assert (AttentionOptions(sinks=np.ones(2, np.float32)).digest()
            != AttentionOptions(alibi_slopes=np.ones(2, np.float32)).digest())
    assert base.digest(np.arange(3)) != base.digest(np.arange(4))


def test_schedule_default_is_auto_only_on_a_balanced_layout():
    """(issue 42) The default keeps every existing call on the ring, bit for bit."""
    assert AttentionOptions().kv_schedule(balanced=False) == "ring"
    assert AttentionOptions().kv_schedule(balanced=True) == "auto"
    for given in ("auto", "ring", "routed", "allgather"):
        assert AttentionOptions(schedule=given).kv_schedule(balanced=True) == given
        assert AttentionOptions(schedule=given).kv_schedule(balanced=False) == given
    assert AttentionOptions().digest() == AttentionOptions(schedule=None).digest()


def test_mask_spec_and_scale():
    opts = AttentionOptions(causal=True, window=(3, None), softcap=2.5, dropout_p=0.5, dropout_seed=9,
                            dropout_offsets=(1, 2, 8), alibi_slopes=np.array([0.5, 0.25], np.float32),
                            return_max_logit=True)
    spec = opts.score_spec(2, offset=5)
    assert spec.causal and spec.window == (3, None) and spec.offset == 5 and spec.softcap == 2.5
    assert spec.exact_max and spec.modifiers == (Alibi((0.5, 0.25)),)
    assert (spec.dropout.p, spec.dropout.seed, spec.dropout.heads) == (0.5, 9, 8)
    assert (spec.dropout.batch_offset, spec.dropout.head_offset) == (1, 2)
    part = spec.for_heads(1, 1)
    assert part.modifiers == (Alibi((0.25,)),) and part.dropout.head_offset == 3
    assert AttentionOptions().score_spec(4).dropout is None and AttentionOptions().score_spec(4).modifiers == ()
    assert AttentionOptions().scale(16) == 0.25 and AttentionOptions(softmax_scale=0.7).scale(16) == 0.7


def test_file_attributes_round_trip():
    for opts in (AttentionOptions(), AttentionOptions(causal=True, window=(7, None), softcap=3.0),
                 AttentionOptions(window=(None, 2), softmax_scale=0.3, dropout_p=0.25, dropout_seed=2 ** 63 + 5)):
        attrs = attention_attrs(opts, dim=16)
        back = attention_of_attrs(attrs)
        assert attention_attrs(back, dim=16).keys() == attrs.keys()
        for key, value in attrs.items():
            assert np.array_equal(attention_attrs(back, dim=16)[key], value), key
        assert back.score_spec(4) == opts.score_spec(4)
        assert back.scale(16) == opts.scale(16)
    assert attention_attrs(AttentionOptions(), dim=16)["window"].dtype == np.int64


def test_options_reach_a_call_one_way_only():
    """A call's options are its maths keywords joined with its context's run fields (no options
    object to pass besides): each field comes from exactly one of the two."""
    from ringmpi.context import RingContext, call_options

    ctx = RingContext(schedule="routed", head_parallel=2, timeout=9.0, check_finite=True, dtype="float32",
                      invariant=True, dropout_offsets=(1, 2, 8))
    opts = call_options(ctx, causal=True, window=(3, -1), softcap=0.0, dropout_p=0.5, dropout_seed=4)
    assert opts == AttentionOptions(causal=True, window=(3, None), dropout_p=0.5, dropout_seed=4, schedule="routed",
                                    head_parallel=2, timeout=9.0, check_finite=True, dtype="float32",
                                    invariant=True, dropout_offsets=(1, 2, 8))
    with pytest.raises(TypeError, match="schedule"):  # a run field is the context's, never a keyword too
        call_options(ctx, schedule="ring")
    with pytest.raises(TypeError, match="causal"):  # and the maths are never the context's
        RingContext(causal=True)


def test_alibi_terms():
    assert Alibi.problem(None, 3) is None and Alibi.problem(np.zeros(3, np.float32), 3) is None
    alibi = Alibi.of(np.array([0.5, 0.125], np.float32))
    terms = alibi.terms(np.array([0, 4]), np.array([1, 2, 9]), offset=3, dtype=np.float32)
    assert terms(0).tolist() == [[-1.0, -0.5, -3.0], [-3.0, -2.5, -1.0]]  # -0.5 * |i + 3 - j|
    assert terms(1).tolist() == [[-0.25, -0.125, -0.75], [-0.75, -0.625, -0.25]]
    assert alibi.for_heads(slice(1, 2)).slopes == (0.125,)
    assert alibi.kernel_values().dtype == np.float32


def test_for_heads_slices_the_per_head_arrays():
    sinks, slopes = np.arange(4, dtype=np.float32), np.array([0.5, 0.25, 0.125, 0.0625], dtype=np.float32)
    part = AttentionOptions(causal=True, sinks=sinks, alibi_slopes=slopes, dropout_offsets=(0, 0, 4)).for_heads(1, 2)
    assert np.array_equal(part.sinks, sinks[1:3]) and np.array_equal(part.alibi_slopes, slopes[1:3])
    assert part.causal and part.dropout_offsets == (0, 0, 4)
    assert AttentionOptions().for_heads(1, 2) == AttentionOptions()
