"""``ringmpi run --dropout P --seed S``: the file job draws the library's mask,
whatever the world size, layout or pass plan; bad values exit 2."""

import h5py
import numpy as np
import pytest

import reference
from cli_util import RINGMPI, ringmpi, write_input
from mpi_util import mpirun

P, SEED = 0.25, 12345


@pytest.mark.mpi
def test_run_with_dropout_matches_reference(tmp_path):
    src = write_input(tmp_path / "in.h5", n=23, h=4, hkv=2, d=6, b=2, dtype="float64")
    runs = {
        "p1": (1, ["--layout", "contiguous"]),
        "p3-striped-passes": (3, ["--layout", "striped", "--heads-per-pass", "2"]),
    }
    outs = {}
    for name, (nprocs, extra) in runs.items():
        out = tmp_path / f"{name}.h5"
        rc, stdout, err, _ = mpirun(nprocs, [RINGMPI, "run", src, "-o", out, "--causal", "--backward",
                                             "--dropout", P, "--seed", SEED] + extra, timeout=120)
        assert rc == 0, err[-3000:]
        with h5py.File(out, "r") as f:
            outs[name] = {k: f[k][...] for k in ("o", "lse", "dq", "dk", "dv")}
            assert f.attrs["dropout_p"] == P and int(f.attrs["dropout_seed"]) == SEED
    with h5py.File(src, "r") as f:
        q, k, v, do = (f[n][...] for n in ("q", "k", "v", "do"))
    vis = reference.visible(q.shape[1], k.shape[1], causal=True)
    drop = reference.dropout_factors(SEED, P, q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    scale = 1 / np.sqrt(q.shape[3])
    want = dict(zip(("o", "lse"), reference.dense_forward(q, k, v, vis, scale, np.float64, drop=drop)))
    want.update(zip(("dq", "dk", "dv"), reference.dense_backward(do, q, k, v, vis, scale, np.float64, drop=drop)))
    for name, got in outs.items():
        for key, x in got.items():
            np.testing.assert_allclose(x, want[key], rtol=1e-10, atol=1e-12, err_msg=f"{name} {key}")


@pytest.mark.parametrize("args, message", [
    (["--dropout", "1.0", "--seed", "1"], "--dropout must be in [0, 1)"),
    (["--dropout", "0.5"], "needs --seed"),
])
def test_bad_dropout_exits_2(tmp_path, args, message):
    src = write_input(tmp_path / "in.h5")
    rc, out, err = ringmpi(["run", src, "-o", tmp_path / "out.h5"] + args)
    assert rc == 2 and message in err, err
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.mpi
def test_bench_with_dropout(tmp_path):
    rc, out, err, _ = mpirun(2, [RINGMPI, "bench", "--n", "96", "--heads", "2", "--dim", "8", "--repeat", "1",
                                 "--warmup", "0", "--backend", "numpy", "--backward", "--dropout", "0.2"],
                             timeout=120)
    assert rc == 0, err[-3000:]
    assert "dropout 0.2" in out.splitlines()[0]


@pytest.mark.mpi
def test_verify_applies_the_recorded_dropout(tmp_path):
    src = write_input(tmp_path / "in.h5", n=30, h=2, hkv=1, d=8, b=2, dtype="float32")
    out = tmp_path / "out.h5"
    rc, _, err, _ = mpirun(2, [RINGMPI, "run", src, "-o", out, "--causal", "--backward",
                               "--dropout", "0.4", "--seed", "9"], timeout=120)
    assert rc == 0, err[-3000:]
    rc, stdout, err = ringmpi(["verify", src, out])
    assert rc == 0 and "dropout 0.4 seed 9" in stdout, stdout + err
    with h5py.File(out, "r+") as f:  # a different seed's output must fail verification
        f.attrs["dropout_seed"] = np.uint64(10)
    rc, stdout, err = ringmpi(["verify", src, out])
    assert rc == 1, stdout + err
