"""Real-world HDF5 inputs: any byte order, float16/32/64, contiguous or chunked,
compressed with gzip, lzf, shuffle and fletcher32.
Outputs are native-endian in the input's precision and match the float64
reference; a dataset that is not floating point gets exit 2 and one message.

All good inputs run in one mpirun launch at P = 3 (``run_files.py``); the
filtered ones again at P = 1 and 2, so shards cut chunks in other places.
The LZF inputs hold chunks that LZF compressed and chunks it left raw (filter
mask bit set), the case HDF5 1.10's collective filtered read gets wrong."""

import json
import sys

import h5py
import numpy as np
import pytest

import reference
from cli_util import ringmpi
from mpi_util import DRIVERS, mpirun
from random_inputs import attention_inputs

N, B, H, HKV, D = 37, 2, 4, 2, 8
CHUNKS = (1, 8, 2, 8)  # q/do chunks hold 2 of the 4 heads: shards and passes cut across chunks

VARIANTS = {
    "big-endian-f4": dict(dtype=">f4"),
    "big-endian-f8": dict(dtype=">f8"),
    "little-endian-f2-chunked": dict(dtype="<f2", chunks=CHUNKS),
    "big-endian-f2-gzip-shuffle-fletcher32": dict(dtype=">f2", chunks=CHUNKS, compression="gzip",
                                                  shuffle=True, fletcher32=True),
    "f4-gzip": dict(dtype="<f4", chunks=CHUNKS, compression="gzip", compression_opts=9),
    "big-endian-f4-chunked-3d": dict(dtype=">f4", chunks=(8, 2, 8), three_d=True),
    "f4-lzf": dict(dtype="<f4", chunks=CHUNKS, compression="lzf", compressible_rows=16),
    "big-endian-f4-lzf-shuffle": dict(dtype=">f4", chunks=CHUNKS, compression="lzf", shuffle=True,
                                      compressible_rows=16),
    "f4-gzip-shuffle-fletcher32": dict(dtype="<f4", chunks=CHUNKS, compression="gzip", shuffle=True,
                                       fletcher32=True),
}
FILTERED = sorted(name for name, variant in VARIANTS.items() if "compression" in variant)


def write_variant(path, variant):
    data = dict(zip(("q", "k", "v", "do"), attention_inputs(11, B, N, H, HKV, D)))
    opts = {k: v for k, v in variant.items() if k not in ("dtype", "three_d", "compressible_rows")}
    with h5py.File(path, "w") as f:
        for name, x in data.items():
            x = x[0] if variant.get("three_d") else x
            if variant.get("compressible_rows"):  # a few repeated values: LZF shrinks those chunks
                x[:, :variant["compressible_rows"]] = np.round(x[:, :variant["compressible_rows"]])
            chunks = opts.get("chunks")
            if chunks is not None and name in ("k", "v"):
                chunks = tuple(min(c, s) for c, s in zip(chunks, x.shape))
            f.create_dataset(name, data=x.astype(variant["dtype"]), **dict(opts, chunks=chunks))


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    where = tmp_path_factory.mktemp("hdf5_inputs")
    cases = [dict(id=name, run=["--causal", "--backward", "--heads-per-pass", "2"]) for name in VARIANTS]
    for name, variant in VARIANTS.items():
        write_variant(where / f"{name}.in.h5", variant)
    spec = where / "cases.json"
    spec.write_text(json.dumps(cases))
    rc, out, err, _ = mpirun(3, [sys.executable, DRIVERS / "run_files.py", spec, where], 240)
    assert rc == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    return where


@pytest.fixture(scope="module", params=[1, 2])
def filtered_outputs(request, tmp_path_factory):
    """The filtered variants run at P = 1 and P = 2 (one launch each)."""
    where = tmp_path_factory.mktemp(f"hdf5_filtered_p{request.param}")
    cases = [dict(id=name, run=["--causal", "--backward", "--heads-per-pass", "2"]) for name in FILTERED]
    for name in FILTERED:
        write_variant(where / f"{name}.in.h5", VARIANTS[name])
    spec = where / "cases.json"
    spec.write_text(json.dumps(cases))
    rc, out, err, _ = mpirun(request.param, [sys.executable, DRIVERS / "run_files.py", spec, where], 240)
    assert rc == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    return where


@pytest.mark.mpi
@pytest.mark.parametrize("name", FILTERED)
def test_filtered_variant_matches_reference_at_p1_p2(filtered_outputs, name):
    test_input_variant_matches_reference(filtered_outputs, name)


@pytest.mark.parametrize("name", sorted(n for n in FILTERED if VARIANTS[n]["compression"] == "lzf"))
def test_lzf_inputs_mix_compressed_and_raw_chunks(tmp_path, name):
    """Chunks LZF could not shrink are stored raw (mask bit set); both kinds must be read."""
    write_variant(tmp_path / "in.h5", VARIANTS[name])
    with h5py.File(tmp_path / "in.h5", "r") as f:
        masks = {f["q"].id.get_chunk_info(i).filter_mask for i in range(f["q"].id.get_num_chunks())}
    assert 0 in masks and len(masks) > 1, masks


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_input_variant_matches_reference(outputs, name):
    variant = VARIANTS[name]
    with h5py.File(outputs / f"{name}.in.h5", "r") as f:
        stored = f["q"].dtype
        data = {k: f[k][()] for k in f}
        if "compression" in variant:
            assert f["q"].compression == variant["compression"] and f["q"].chunks is not None
    native = stored.newbyteorder("=")
    lift = (lambda x: x[None]) if variant.get("three_d") else (lambda x: x)
    q, k, v, do = (lift(data[n].astype(native)) for n in ("q", "k", "v", "do"))
    with h5py.File(outputs / f"{name}.out.h5", "r") as f:
        out = {k: f[k][()] for k in f}
    for key in ("o", "dq", "dk", "dv"):
        assert out[key].dtype == native and out[key].dtype.isnative, (key, out[key].dtype)
    assert out["lse"].dtype == (np.float64 if native == np.float64 else np.float32)
    vis = reference.visible(N, N, causal=True)
    scale = 1.0 / np.sqrt(D)
    problems = []
    for key, ours, ref, naive in zip(("o", "lse"), (out["o"], out["lse"]),
                                     reference.dense_forward(q, k, v, vis, scale, np.float64),
                                     reference.dense_forward(q, k, v, vis, scale, native)):
        ok, msg = reference.tolerance_check(key, lift(ours), ref, naive)
        problems += [] if ok else [msg]
    refs = reference.dense_backward(do, q, k, v, vis, scale, np.float64)
    naives = reference.dense_backward(do, q, k, v, vis, scale, native)
    for key, ref, naive in zip(("dq", "dk", "dv"), refs, naives):
        ok, msg = reference.tolerance_check(key, lift(out[key]), ref, naive, gradient=True)
        problems += [] if ok else [msg]
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("dtype,shown", [("int32", "int32"), (">i8", ">i8"), ("complex64", "complex64")])
def test_not_floating_point_is_refused(tmp_path, dtype, shown):
    src = tmp_path / "in.h5"
    rng = np.random.default_rng(0)
    with h5py.File(src, "w") as f:
        f["q"] = (rng.standard_normal((10, 2, 4)) * 10).astype(dtype)
        f["k"] = f["v"] = rng.standard_normal((10, 2, 4)).astype("f4")
    rc, _, err = ringmpi(["run", src, "-o", tmp_path / "out.h5"])
    assert rc == 2 and err.count("ringmpi: error:") == 1, err
    assert f"dataset 'q' has unsupported dtype {shown}; expected floating point" in err, err
    assert "Traceback" not in err and not (tmp_path / "out.h5").exists()
