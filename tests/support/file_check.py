"""A file job's output against the float64 dense reference: ``check_case`` reads the input and
output files of one ``ringmpi run`` and asserts what the output must hold."""

import h5py
import numpy as np

import reference
from ringmpi.core.masks import window_sides


def read_dataset(dset):
    """A dataset's values; bfloat16 per docs/file-format.md: uint16 patterns marked dtype="bfloat16"."""
    data = dset[()]
    if dset.attrs.get("dtype") == "bfloat16":
        assert data.dtype == np.uint16
        return data.view(reference.BFLOAT16)
    return data


def load_file(path):
    """``({name: values}, {attribute: value})`` of an HDF5 file."""
    with h5py.File(path, "r") as f:
        return {k: read_dataset(f[k]) for k in f}, dict(f.attrs)


def _opt(args, name, n=1):
    if name not in args:
        return None
    i = args.index(name)
    return args[i + 1:i + 1 + n]


def check_case(case, where, p):
    """``where/<id>.out.h5``, the output of ``ringmpi run where/<id>.in.h5 <case["run"]>`` on ``p``
    ranks: its attributes, dtypes and shapes, and every element within the tolerance rule of the
    float64 dense reference."""
    data, _ = load_file(where / f"{case['id']}.in.h5")
    out, attrs = load_file(where / f"{case['id']}.out.h5")
    rank4 = data["q"].ndim == 4
    lift = (lambda x: x) if rank4 else (lambda x: x[None])
    q, k, v = lift(data["q"]), lift(data["k"]), lift(data["v"])
    b = q.shape[0]
    seg_q = seg_kv = None
    if "segment_ids" in data:
        seg_q = seg_kv = np.broadcast_to(data["segment_ids"], (b, q.shape[1]))
    causal = "--causal" in case["run"]
    window = _opt(case["run"], "--window", 2)
    window = None if window is None else window_sides([int(w) for w in window])  # the flag's text
    scale = _opt(case["run"], "--scale")
    scale = float(scale[0]) if scale else 1.0 / np.sqrt(q.shape[3])
    layout = (_opt(case["run"], "--layout") or ["zigzag" if causal else "contiguous"])[0]
    assert attrs["world_size"] == p and attrs["layout"] == layout and bool(attrs["causal"]) == causal
    assert np.isclose(attrs["softmax_scale"], scale)
    dtype = q.dtype
    alibi = _opt(case["run"], "--alibi-slopes")
    alibi = None if alibi is None else np.array(alibi[0].split(","), dtype=np.float32)
    assert ("alibi_slopes" in attrs) == (alibi is not None)
    if alibi is not None:
        assert attrs["alibi_slopes"].dtype == np.float32 and np.array_equal(attrs["alibi_slopes"], alibi)
    vis = reference.visible(q.shape[1], k.shape[1], causal, window, seg_q, seg_kv)
    ref_o, ref_lse = reference.dense_forward(q, k, v, vis, scale, np.float64, alibi=alibi)
    naive_o, naive_lse = reference.dense_forward(q, k, v, vis, scale, dtype, alibi=alibi)
    assert out["o"].dtype == dtype and out["o"].shape == data["q"].shape[:-1] + data["v"].shape[-1:]  # D_v wide
    assert out["lse"].dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert out["lse"].shape == ((b,) if rank4 else ()) + (q.shape[2], q.shape[1])
    problems = []
    for name, ours, ref, naive in (("o", out["o"], ref_o, naive_o), ("lse", out["lse"], ref_lse, naive_lse)):
        ok, msg = reference.tolerance_check(name, lift(ours), ref, naive)
        problems += [] if ok else [msg]
    backward = "--backward" in case["run"]
    assert ("dq" in out) == backward
    if backward:
        do = lift(data["do"])
        refs = reference.dense_backward(do, q, k, v, vis, scale, np.float64, alibi=alibi)
        naives = reference.dense_backward(do, q, k, v, vis, scale, dtype, alibi=alibi)
        for name, ref, naive, like in zip(("dq", "dk", "dv"), refs, naives, ("q", "k", "v")):
            assert out[name].dtype == dtype and out[name].shape == data[like].shape
            ok, msg = reference.tolerance_check(name, lift(out[name]), ref, naive, gradient=True)
            problems += [] if ok else [msg]
    assert not problems, "; ".join(problems)
