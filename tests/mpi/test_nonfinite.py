"""NaN and Inf inputs: a masked key never reaches a query, a query that sees a
non-finite value never gets a silent finite answer, every other output is
bitwise a clean run's (NumPy backend; ``tests/gpu`` runs the same cases on CuPy).

All cases share one mpirun launch at P = 3 (``nonfinite_cases.py``)."""

import json
import sys

import numpy as np
import pytest

from mpi_util import DRIVERS, case_records, launch_cache, mpirun, mpirun_env

N, B, H, HKV, D = 23, 2, 4, 2, 8


def cases():
    out = []
    for mask in ("causal", "window", "segments"):
        for tensor in ("q", "k", "v", "do"):
            for value in ("nan", "inf", "-inf"):
                # token 2: visible to many queries (causal) / masked for most; token N-2: masked for most
                for token in (2, N - 2):
                    head = 1 if tensor in ("q", "do") else 0
                    out.append(dict(id=f"{mask}-{tensor}-{value}-t{token}", mask=mask, tensor=tensor, value=value,
                                    at=[1, token, head, 5], seed=len(out), B=B, N=N, H=H, Hkv=HKV, D=D,
                                    layout=("zigzag", "contiguous", "striped")[len(out) % 3]))
    return out


CASES = cases()
# one tile per block at P = 3; many small tiles per block (state turning NaN mid-block) at P = 4
LAUNCHES = {"tiles-default-P3": (3, {}), "tiles-3x2-P4": (4, {"RINGMPI_TILE_Q": 3, "RINGMPI_TILE_KV": 2})}


def _launch(key, tmp_path_factory, p, cases, **env):
    path = tmp_path_factory.mktemp("nonfinite") / "cases.json"
    path.write_text(json.dumps(cases))
    rc, out, err, _ = mpirun(p, [sys.executable, DRIVERS / "nonfinite_cases.py", path], 300, env=mpirun_env(**env))
    return rc, {id_: (rec["ok"], rec["msg"]) for id_, rec in case_records(out).items()}, err


_launches = launch_cache(_launch)  # shared with test_nonfinite_dtypes and the GPU's test_nonfinite_gpu


def nonfinite_results(tmp_path_factory, key, p, cases, **env):
    """``(mpirun exit code, {id: (ok, msg)}, stderr)`` of ``cases`` in one launch of
    ``nonfinite_cases.py`` on ``p`` ranks, run the first time ``key`` is asked for."""
    return _launches(key, tmp_path_factory, p, cases, **env)


def results(tmp_path_factory, launch):
    p, env = LAUNCHES[launch]
    return nonfinite_results(tmp_path_factory, launch, p, CASES, **env)


@pytest.mark.mpi
@pytest.mark.parametrize("launch", sorted(LAUNCHES))
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_nonfinite_case(tmp_path_factory, launch, case):
    rc, found, err = results(tmp_path_factory, launch)
    assert case["id"] in found, f"no result (mpirun exit {rc})\n{err[-3000:]}"
    ok, msg = found[case["id"]]
    assert ok, msg


def test_finalize_never_hides_a_nan_sum():
    """A row whose running sum became NaN is reported as NaN, not as 'saw no key'."""
    from ringmpi.backends.numpy_backend import NumpyBackend

    o_acc = np.zeros((1, 1, 3, 2), np.float32)
    m = np.array([[[0.0, np.nan, -np.inf]]], np.float32)
    l = np.array([[[2.0, np.nan, 0.0]]], np.float32)
    o, lse = NumpyBackend.finalize(o_acc, m, l, np.float32)
    assert np.isfinite(o[0, 0]).all() and np.isnan(o[0, 1]).all() and (o[0, 2] == 0).all()
    assert np.isfinite(lse[0, 0, 0]) and np.isnan(lse[0, 0, 1]) and lse[0, 0, 2] == -np.inf


def test_careful_copies_keep_the_layout_blas_sees():
    """The careful path's clean copies have the operand's strides and its offset in a 64-byte
    line, so BLAS takes the same kernel on them as on the clean run's views (OpenBLAS's
    AVX-512 gemv orders a row's sum by the leading dimension: a compact copy of a strided
    ``q`` or ``do`` tile changed the last bits of rows no bad value reaches)."""
    from ringmpi.backends.numpy_backend import clean_copy

    rng = np.random.default_rng(0)
    heads = rng.standard_normal((1, 7, 4, 8)).astype(np.float32)
    for x in (heads[0, 1:6, 2], heads[0, :, 1].T, heads[0, 3:4, 0], heads[0, 2:5, 3, 1:]):
        bad = np.zeros(x.shape[0], bool)
        bad[x.shape[0] // 2] = True
        copy = clean_copy(x, bad)
        assert copy.strides == x.strides and copy.ctypes.data % 64 == x.ctypes.data % 64
        assert not np.shares_memory(copy, heads)
        assert (copy[bad] == 0).all() and (copy[~bad] == x[~bad]).all()
        vec = rng.standard_normal(x.shape[1]).astype(np.float32)
        mat = rng.standard_normal((x.shape[1], 1)).astype(np.float32)
        keep = ~bad
        assert (copy @ vec)[keep].tobytes() == (x @ vec)[keep].tobytes()
        assert (copy @ mat)[keep].tobytes() == (x @ mat)[keep].tobytes()
