"""Options stated once at every edge: every field of AttentionOptions reaches every public entry point
(a maths keyword of each call, flash-attn's convention, or a field of the ``context=`` RingContext it
takes for where and how it runs; a typed argument of the torch op; a flag of the commands that map it
one to one), unless the entry point says here why it cannot take it or does not use it."""

import inspect
from dataclasses import fields

import click
import pytest

import ringmpi
from ringmpi.context import RUN_FIELDS, RingContext
from ringmpi.options import AttentionOptions, option_edge, option_fields

FIELDS = {f.name: f.default for f in fields(AttentionOptions)}
RUN = set(RUN_FIELDS)  # the fields a call's context carries: never its keywords
MATHS = set(FIELDS) - RUN

# what an entry point does not take, and why (anything else missing fails); for a call, a field of
# its context listed here is one it does not use
NOT_TAKEN = {
    "ring_attention": {},
    "ring_attention_backward": {"return_max_logit": "the backward returns no max logit"},
    "decode_attention": {
        "dropout_p": "decode is inference: no dropout", "dropout_seed": "no dropout",
        "dropout_offsets": "no dropout", "head_parallel": "no ring: one Allreduce merges the shards",
        "timeout": "its one collective runs under the watchdog's default deadline",
        "check_finite": "a cache is checked when it is filled", "dtype": "the cache's dtype",
        "return_max_logit": "decode returns no max logit",
        "schedule": "no K/V move: the queries and partial results do"},
    "torch.ring_attention": {"dtype": "a tensor carries its dtype",
                             "return_max_logit": "the op returns o and lse"},
    "run": {"sinks": "--sinks-dataset names the input's dataset", "dtype": "the file's dtype",
            "dropout_offsets": "the job draws each pass's slice itself"},
    "bench": {"sinks": "--sinks draws random sinks", "dropout_seed": "--seed seeds inputs and dropout",
              "dropout_offsets": "synthetic inputs: the whole mask", "dtype": "--dtype is the inputs' dtype",
              "softmax_scale": "1/sqrt(D), as torch SDPA's column", "timeout": "RINGMPI_TIMEOUT",
              "check_finite": "synthetic inputs are finite", "return_max_logit": "not timed"},
}


def _calls():
    import ringmpi.torch as rt

    return {"ring_attention": ringmpi.ring_attention, "ring_attention_backward": ringmpi.ring_attention_backward,
            "decode_attention": ringmpi.decode_attention, "torch.ring_attention": rt.ring_attention}


def _commands():
    from ringmpi.bench.command import bench
    from ringmpi.cli.run import run

    return {"run": run, "bench": bench}


@pytest.mark.parametrize("name", ["ring_attention", "ring_attention_backward", "decode_attention",
                                  "torch.ring_attention"])
def test_every_field_is_a_keyword_or_the_context_of_every_public_call(name):
    pytest.importorskip("torch")
    params = inspect.signature(_calls()[name]).parameters
    assert RUN <= {f.name for f in fields(RingContext)}
    assert "context" in params and params["context"].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert params["context"].default is None, name
    assert not RUN & params.keys(), f"{name}: one way to pass each thing: {sorted(RUN & params.keys())} " \
        "are the context's"
    not_taken = set(NOT_TAKEN[name])
    missing = {f for f in MATHS if f not in params}
    assert missing == not_taken - RUN, f"{name}: give these a keyword (or a reason here): " \
        f"{sorted(missing - not_taken)}; not missing: {sorted(not_taken - RUN - missing)}"
    for f in MATHS & params.keys():
        assert params[f].kind is inspect.Parameter.KEYWORD_ONLY, (name, f)
        # the call's default (flash-attn's: window (-1, -1), softcap 0.0) is the field's default
        meant = getattr(AttentionOptions(**{f: params[f].default}), f)
        assert meant == FIELDS[f] or meant is FIELDS[f], (name, f, params[f].default)


def test_the_context_defaults_are_the_options_defaults(monkeypatch):
    monkeypatch.delenv("RINGMPI_HEAD_PARALLEL", raising=False)
    monkeypatch.delenv("RINGMPI_TIMEOUT", raising=False)
    ctx = RingContext()
    for f in RUN:
        assert getattr(ctx, f) == FIELDS[f] or getattr(ctx, f) is FIELDS[f], f


@pytest.mark.parametrize("name", ["run", "bench"])
def test_every_field_with_a_flag_is_a_flag_of_the_commands(name):
    command: click.Command = _commands()[name]
    dests = {p.name: p for p in command.params}

    def offered(f):  # the flag options.py states, under the field's name
        flag = option_edge(f)["flag"]
        return f in dests and flag is not None and flag.split("/")[0] in dests[f].opts

    missing = {f for f in FIELDS if not offered(f)}
    assert missing == set(NOT_TAKEN[name]), f"ringmpi {name}: missing {sorted(missing - set(NOT_TAKEN[name]))}, " \
        f"not missing: {sorted(set(NOT_TAKEN[name]) - missing)}"


def test_every_field_crosses_the_torch_op():
    """Each field but those the torch call does not take is one of the op's typed arguments
    (built from ``options.py``'s ``op`` kinds), and the op packs and unpacks it exactly."""
    pytest.importorskip("torch")
    import numpy as np
    import ringmpi.torch as rt

    carried = set(option_fields("op"))
    assert carried == set(FIELDS) - set(NOT_TAKEN["torch.ring_attention"])
    options = AttentionOptions(causal=True, window=(3, None), softmax_scale=0.25, softcap=2.0,
                               alibi_slopes=np.array([0.5, 0.25], np.float32), dropout_p=0.5,
                               dropout_seed=2 ** 64 - 1, dropout_offsets=(1, 2, 8), head_parallel="auto",
                               timeout=9.0, check_finite=True)
    scalars, per_head, present = rt._option_args(options), *rt._per_head_args(options)
    back = rt._options_of(scalars, per_head, present)
    for f in carried:
        mine, theirs = getattr(options, f), getattr(back, f)
        assert np.array_equal(mine, theirs) if f in ("sinks", "alibi_slopes") else mine == theirs, f
