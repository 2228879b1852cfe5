"""The file job's options and output attributes (in-process, no MPI): every bad option is the
ConfigError ``ringmpi run`` prints, and what the job writes as root attributes reads back equal."""

import h5py
import numpy as np
import pytest

from ringmpi.errors import ConfigError
from ringmpi.filejob import JobOptions, OutputAttributes
from test_passes import spec


@pytest.mark.parametrize("options,message", [
    (dict(window=(2, -2)), "--window sides must be >= 0 (or -1 for unbounded), got 2 -2"),
    (dict(timeout=0.0), "--timeout must be positive, got 0.0"),
    (dict(scale=float("nan")), "--scale must be a positive finite number, got nan"),
    (dict(softcap=-1.0), "--softcap: softcap must be finite and > 0"),
    (dict(dropout_p=0.5), "--seed"),
])
def test_bad_options_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        JobOptions(**options).check()


@pytest.mark.parametrize("options", [
    JobOptions(),
    JobOptions(causal=True, window=(3, -1), layout="striped", backward=True, scale=0.25, heads_per_pass=4,
               sinks_dataset="sinks", softcap=30.0, max_logit=True, dropout_p=0.125, dropout_seed=2 ** 64 - 1),
])
def test_output_attributes_read_back_what_was_written(tmp_path, options):
    options.check()
    s = spec()
    written = OutputAttributes.of_job(options, s, "in.h5", 3, "numpy")
    with h5py.File(tmp_path / "out.h5", "w") as f:
        written.write(f)
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert OutputAttributes.read(f, "out.h5") == written
        assert f.attrs["window"].dtype == np.int64 and ("dropout_seed" in f.attrs) == (options.dropout_p > 0)
    mask = written.mask_spec(s)
    assert (mask.causal, mask.window, mask.softcap) == (options.causal, options.ring_window, options.softcap)
    assert written.softmax_scale == (0.25 if options.scale else 1 / np.sqrt(s.dim))


def test_attributes_missing_from_a_foreign_file_are_named(tmp_path):
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f.attrs["causal"] = True
    with h5py.File(tmp_path / "other.h5", "r") as f:
        with pytest.raises(ConfigError, match="attribute 'softmax_scale' missing: not written by ringmpi run"):
            OutputAttributes.read(f, "other.h5")
