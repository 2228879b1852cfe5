#!/usr/bin/env bash
# ringmpi under a local Open MPI (workstation, container, CI): root allowed,
# oversubscription allowed (more ranks than cores), shared-memory transport
# without the ptrace single-copy path that containers often forbid.
#
#   jobs/local.sh -n 4 run IN.h5 -o OUT.h5 --causal --backward
#   jobs/local.sh -n 2 make-data IN.h5 --n 32768 --heads 8 --dim 64 --with-do
#   jobs/local.sh -n 1 verify IN.h5 OUT.h5
#
# Everything after "-n P" is a ringmpi command line.  Edit nothing; set
# RINGMPI_VENV for another virtual environment (default: .venv of this
# checkout) and MPIRUN for another launcher (default: mpirun).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${RINGMPI_VENV:-$here/.venv}
nprocs=4
if [ "${1:-}" = "-n" ] || [ "${1:-}" = "--np" ]; then
    [ $# -ge 2 ] || { echo "usage: $0 [-n P] COMMAND [ARGS...]" >&2; exit 2; }
    nprocs=$2
    shift 2
fi
[ $# -ge 1 ] || { echo "usage: $0 [-n P] COMMAND [ARGS...]   (COMMAND: run, make-data, verify, info, bench)" >&2; exit 2; }
[ -x "$venv/bin/ringmpi" ] || { echo "$0: no ringmpi in $venv: run scripts/setup.sh first" >&2; exit 2; }

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_btl=self,vader,tcp
export OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
# ranks may outnumber cores here: yield instead of spinning while waiting
export OMPI_MCA_mpi_yield_when_idle=1
# one BLAS/OpenMP thread per rank: parallelism comes from ranks
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
export PYTHONUNBUFFERED=1

exec "${MPIRUN:-mpirun}" -n "$nprocs" "$venv/bin/ringmpi" "$@"
