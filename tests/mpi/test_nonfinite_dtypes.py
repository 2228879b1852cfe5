"""NaN/Inf semantics beyond the float32 cases of ``test_nonfinite.py``:

* a visible key whose weight underflows to exactly 0 still passes its NaN/Inf
  ``v`` row to every query that sees it (0 * NaN = NaN: the arithmetic over
  the visible keys), in float32, float16 and bfloat16;
* the q/k/v/do cases in float16 and bfloat16 (on the GPU these run the
  tensor-core kernels; ``tests/gpu/test_nonfinite_gpu.py`` runs the same list).

The checks are ``nonfinite_cases.py``'s: exactly the outputs that the float64
reference over visible keys makes non-finite are non-finite, the others match
it, and every output no bad value can reach equals a clean run's.
One mpirun launch at P = 3."""

import pytest

from test_nonfinite import B, D, HKV, H, N, nonfinite_results


def dtype_cases():
    out = []

    def add(dim=D, **case):
        out.append(dict(case, seed=len(out), B=B, N=N, H=H, Hkv=HKV, D=dim,
                        layout=("zigzag", "contiguous", "striped")[len(out) % 3]))

    for dtype in ("float32", "float16", "bfloat16"):
        for mask in ("causal", "window", "segments"):
            for value in ("nan", "inf"):
                add(id=f"underflow-{dtype}-{mask}-v-{value}", dtype=dtype, underflow=True, mask=mask,
                    tensor="v", value=value, at=[1, 2, 0, 5])
    for dtype in ("float16", "bfloat16"):
        for mask in ("causal", "window", "segments"):
            for tensor in ("q", "k", "v", "do"):
                head = 1 if tensor in ("q", "do") else 0
                for token in (2, N - 2):
                    add(id=f"{dtype}-{mask}-{tensor}-nan-t{token}", dtype=dtype, mask=mask, tensor=tensor,
                        value="nan" if token == 2 else "inf", at=[1, token, head, 5])
        # a head dim over 64: the tensor-core backward's 32-row query tiles
        add(id=f"{dtype}-causal-v-nan-d80", dtype=dtype, mask="causal", tensor="v", value="nan",
            at=[1, 2, 0, 70], dim=80)
    return out


CASES = dtype_cases()


def results(tmp_path_factory, backend="numpy"):
    return nonfinite_results(tmp_path_factory, f"dtypes-{backend}", 3, CASES, RINGMPI_TEST_BACKEND=backend)


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_nonfinite_dtype_case(tmp_path_factory, case):
    rc, found, err = results(tmp_path_factory)
    assert case["id"] in found, f"no result (mpirun exit {rc})\n{err[-3000:]}"
    ok, msg = found[case["id"]]
    assert ok, msg
