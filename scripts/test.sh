#!/usr/bin/env bash
# Set everything up with the test stack (idempotent, see scripts/setup.sh) and run the test suite.
# Multi-rank tests start real mpirun, oversubscribed, each under a deadline.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
RINGMPI_EXTRAS=${RINGMPI_EXTRAS:-test} bash scripts/setup.sh
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
exec "${RINGMPI_VENV:-.venv}/bin/python" -m pytest -q "$@"
