"""NaN/Inf semantics of the CUDA kernels: the cases of ``tests/mpi/test_nonfinite.py``
on the CuPy backend (float32: the SIMT kernels), one mpirun launch at P = 3;
the cases of ``tests/mpi/test_nonfinite_dtypes.py`` (float16/bfloat16: the
tensor-core kernels; a visible key whose weight underflows to 0 with a NaN/Inf
``v`` row, which must still reach its queries), a second launch.
Needs a CUDA GPU; skipped, with the reason shown, where none is visible."""

from __future__ import annotations

import pytest

from ringmpi.backends import gpu_available
from test_nonfinite import CASES, nonfinite_results
from test_nonfinite_dtypes import CASES as DTYPE_CASES, results as dtype_results

pytestmark = pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU visible to CuPy")


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_nonfinite_case_on_gpu(tmp_path_factory, case):
    rc, found, err = nonfinite_results(tmp_path_factory, "cupy", 3, CASES, RINGMPI_TEST_BACKEND="cupy")
    assert case["id"] in found, f"no result (mpirun exit {rc})\n{err[-3000:]}"
    ok, msg = found[case["id"]]
    assert ok, msg


@pytest.mark.parametrize("case", DTYPE_CASES, ids=[c["id"] for c in DTYPE_CASES])
def test_nonfinite_dtype_case_on_gpu(tmp_path_factory, case):
    rc, found, err = dtype_results(tmp_path_factory, backend="cupy")
    assert case["id"] in found, f"no result (mpirun exit {rc})\n{err[-3000:]}"
    ok, msg = found[case["id"]]
    assert ok, msg
