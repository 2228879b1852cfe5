"""The file job's options and output attributes (in-process, no MPI): every bad option is the
ConfigError ``ringmpi run`` prints, and what the job writes as root attributes reads back equal."""

from dataclasses import replace

import h5py
import numpy as np
import pytest

from ringmpi.runtime.errors import ConfigError
from ringmpi.filejob import JobOptions, OutputAttributes
from test_passes import spec


@pytest.mark.parametrize("options,message", [
    (dict(window=(2, -2)), "--window sides must be >= 0 (or -1 for unbounded), got 2 -2"),
    (dict(timeout=0.0), "--timeout must be positive, got 0.0"),
    (dict(softmax_scale=float("nan")), "--scale must be a positive finite number, got nan"),
    (dict(softcap=-1.0), "--softcap: softcap must be finite and >= 0 (0.0: off)"),
    (dict(dropout_p=0.5), "--seed"),
])
def test_bad_options_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        JobOptions.of_flags(**options).check()


def test_alibi_slopes_are_checked_against_the_input_heads():
    options = JobOptions.of_flags(alibi_slopes=np.array([0.5, 0.25], dtype=np.float32))
    options.check()  # before the input is read: no head count yet
    options.check(2)
    with pytest.raises(ConfigError, match=r"--alibi-slopes: alibi_slopes must have shape \(H,\) = \(4,\)"):
        options.check(4)
    with pytest.raises(ConfigError, match="--alibi-slopes: alibi_slopes must be finite"):
        JobOptions.of_flags(alibi_slopes=np.array([0.5, np.inf], dtype=np.float32)).check(2)


@pytest.mark.parametrize("flags", [
    dict(),
    dict(causal=True, window=(3, None), layout="striped", backward=True, softmax_scale=0.25, heads_per_pass=4,
         sinks_dataset="sinks", softcap=30.0, return_max_logit=True, dropout_p=0.125, dropout_seed=2 ** 64 - 1,
         alibi_slopes=np.array([1 / 3] + [2.0 ** -i for i in range(1, 8)], dtype=np.float32)),
])
def test_output_attributes_read_back_what_was_written(tmp_path, flags):
    options = JobOptions.of_flags(**flags)
    options.check()
    s = spec()
    written = OutputAttributes.of_job(options, s, "in.h5", 3, "numpy")
    with h5py.File(tmp_path / "out.h5", "w") as f:
        written.write(f)
    with h5py.File(tmp_path / "out.h5", "r") as f:
        back = OutputAttributes.read(f, "out.h5")
        assert f.attrs["window"].dtype == np.int64 and ("dropout_seed" in f.attrs) == ("dropout_p" in flags)
        assert ("alibi_slopes" in f.attrs) == ("alibi_slopes" in flags)
    mine, theirs = written.attention, back.attention
    assert replace(back, attention=None) == replace(written, attention=None)
    assert replace(theirs, alibi_slopes=None) == replace(mine, alibi_slopes=None)
    assert (mine.alibi_slopes is None) == (theirs.alibi_slopes is None)
    if "alibi_slopes" in flags:
        assert theirs.alibi_slopes.dtype == np.float32
        assert np.array_equal(theirs.alibi_slopes, np.array(flags["alibi_slopes"], dtype=np.float32))
    mask = back.score_spec(s)
    window = flags.get("window")
    assert (mask.causal, mask.window, mask.softcap) == (
        flags.get("causal", False), None if window is None else (3, None), flags.get("softcap"))
    assert theirs.softmax_scale == (0.25 if "softmax_scale" in flags else 1 / np.sqrt(s.dim))
    assert theirs.return_max_logit == flags.get("return_max_logit", False)


def test_attributes_missing_from_a_foreign_file_are_named(tmp_path):
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f.attrs["causal"] = True
    with h5py.File(tmp_path / "other.h5", "r") as f:
        with pytest.raises(ConfigError, match="attribute 'softmax_scale' missing: not written by ringmpi run"):
            OutputAttributes.read(f, "other.h5")
