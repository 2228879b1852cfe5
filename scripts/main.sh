#!/usr/bin/env bash
# The main command: attention over the bundled sample file on 4 local ranks, then a check
# against a float64 dense reference.
#
#   scripts/main.sh
#
# Sets up what the main job needs (scripts/setup.sh, idempotent: MPI, parallel HDF5, mpi4py,
# h5py, NumPy, click, ml_dtypes, the compiled pass; the tests' stack is scripts/test.sh's), runs
#   ringmpi run data/sample.h5 -o out/sample_out.h5 --causal --backward --overwrite
# under mpirun (jobs/local.sh), verifies the result, and prints where it is.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
scripts/setup.sh
venv=${RINGMPI_VENV:-$here/.venv}
mkdir -p out
jobs/local.sh -n "${RINGMPI_NPROCS:-4}" run data/sample.h5 -o out/sample_out.h5 --causal --backward --overwrite
"$venv/bin/ringmpi" verify data/sample.h5 out/sample_out.h5
echo "output: $here/out/sample_out.h5 (datasets o, lse, dq, dk, dv; see docs/file-format.md)"
