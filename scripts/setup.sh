#!/usr/bin/env bash
# Idempotent setup for a Debian/Ubuntu machine (or a cluster with its own MPI):
#   1. system Open MPI + parallel HDF5 from the distribution (only when missing;
#      skipped when MPICC / HDF5_DIR point at an existing installation),
#   2. .venv with mpi4py using that MPI (mpi4py's binary wheel when it provably loads
#      the libmpi that MPICC links, else built from source against it) and h5py built
#      against the parallel HDF5 (checked: h5py.get_config().mpi must be true),
#   3. ringmpi installed editable: what the main job needs (NumPy, click, ml_dtypes,
#      the compiled tile pass), plus the extras RINGMPI_EXTRAS names.
# Takes seconds when everything is already there; says how long each step took.
#
#   scripts/setup.sh                       # the main job (scripts/main.sh)
#   RINGMPI_EXTRAS=test scripts/setup.sh   # and the test stack (scripts/test.sh)
#   RINGMPI_EXTRAS=test,gpu scripts/setup.sh
#   RINGMPI_MPI4PY=source scripts/setup.sh # always build mpi4py from source
#   RINGMPI_TORCH_SPEC='torch==2.13.0' (default) chooses the torch build the tests get
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
venv=${RINGMPI_VENV:-$here/.venv}
extras=${RINGMPI_EXTRAS:-}
say() { printf '[setup] %s\n' "$*" >&2; }
step_start=$SECONDS
took() { say "$* ($((SECONDS - step_start)) s)"; step_start=$SECONDS; }  # the step that just ended
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# ---- 1. system MPI and parallel HDF5 ------------------------------------
need_pkgs=()
if [ -z "${MPICC:-}" ]; then
    command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1 \
        || need_pkgs+=(openmpi-bin libopenmpi-dev)
fi
if [ -z "${HDF5_DIR:-}" ]; then
    [ -d /usr/lib/x86_64-linux-gnu/hdf5/openmpi ] || [ -d "/usr/lib/$(uname -m)-linux-gnu/hdf5/openmpi" ] \
        || need_pkgs+=(libhdf5-openmpi-dev)
fi
command -v pkg-config >/dev/null 2>&1 || need_pkgs+=(pkg-config)
# the multi-node tests' cluster of network namespaces (root only): ip and tc
if [ "$(id -u)" = 0 ]; then command -v tc >/dev/null 2>&1 || need_pkgs+=(iproute2); fi
command -v gcc >/dev/null 2>&1 || need_pkgs+=(build-essential)
py=${PYTHON:-python3}
if ! command -v "$py" >/dev/null 2>&1; then
    need_pkgs+=(python3 python3-venv python3-dev)
else
    "$py" -c 'import ensurepip, venv' >/dev/null 2>&1 || need_pkgs+=(python3-venv)
    "$py" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
        || need_pkgs+=(python3-dev)
fi
if [ ${#need_pkgs[@]} -gt 0 ]; then
    command -v apt-get >/dev/null 2>&1 || die "missing ${need_pkgs[*]} and no apt-get; set MPICC and HDF5_DIR to your installation"
    [ "$(id -u)" = 0 ] || die "missing ${need_pkgs[*]}: run as root, or install them, or set MPICC/HDF5_DIR"
    say "installing ${need_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
    took "installed ${need_pkgs[*]}"
fi
export MPICC=${MPICC:-$(command -v mpicc)}
if [ -z "${HDF5_DIR:-}" ]; then
    HDF5_DIR=/usr/lib/$(uname -m)-linux-gnu/hdf5/openmpi
fi
export HDF5_DIR
[ -f "$HDF5_DIR/include/H5pubconf.h" ] || [ -f "$HDF5_DIR/include/hdf5.h" ] \
    || die "no HDF5 headers under HDF5_DIR=$HDF5_DIR"

# ---- 2. virtual environment with MPI-built mpi4py and h5py --------------
if [ ! -x "$venv/bin/python" ]; then
    say "creating $venv"
    "$py" -m venv "$venv"
fi
vpy=$venv/bin/python
pipq() { "$vpy" -m pip install -q --disable-pip-version-check "$@"; }

have() { "$vpy" - "$@" <<'PY' 2>/dev/null
import sys
ok = True
for mod in sys.argv[1:]:
    try:
        __import__(mod)
    except Exception:
        ok = False
sys.exit(0 if ok else 1)
PY
}

# the libmpi that MPICC links, and the one the installed mpi4py loads (real paths)
mpicc_libmpi() {
    local dirs d
    dirs=$("$MPICC" --showme:libdirs 2>/dev/null || "$MPICC" -show 2>/dev/null | tr ' ' '\n' | sed -n 's/^-L//p')
    for d in $dirs; do [ -e "$d/libmpi.so" ] && { readlink -f "$d/libmpi.so"; return; }; done
}
loaded_libmpi() { "$vpy" - <<'PY' 2>/dev/null
import os
from mpi4py import MPI  # noqa: F401 (loads libmpi)
print(next(os.path.realpath(line.split()[-1]) for line in open("/proc/self/maps") if "/libmpi.so" in line))
PY
}
if ! have mpi4py; then
    want_libmpi=$(mpicc_libmpi || true)
    if [ "${RINGMPI_MPI4PY:-wheel}" = wheel ] && [ -n "$want_libmpi" ] \
            && pipq --only-binary=mpi4py 'mpi4py>=4.1' 2>/dev/null \
            && [ "$(loaded_libmpi)" = "$want_libmpi" ]; then
        took "mpi4py: binary wheel, loading $want_libmpi (the libmpi of $MPICC)"
    else
        "$vpy" -m pip uninstall -y -q mpi4py 2>/dev/null || true
        say "building mpi4py against $MPICC"
        pipq --upgrade pip setuptools wheel
        pipq --no-binary=mpi4py --no-cache-dir 'mpi4py>=4.0'
        took "built mpi4py from source"
    fi
fi
if ! "$vpy" -c 'import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)' 2>/dev/null; then
    say "building h5py against parallel HDF5 in $HDF5_DIR"
    pipq --upgrade 'setuptools>=61' packaging 'Cython>=3' pkgconfig numpy
    "$vpy" -m pip uninstall -y -q h5py 2>/dev/null || true
    CC=mpicc HDF5_MPI=ON HDF5_DIR="$HDF5_DIR" \
        "$vpy" -m pip install -q --disable-pip-version-check --no-binary=h5py \
        --no-build-isolation --no-cache-dir 'h5py>=3.10'
    took "built h5py against $HDF5_DIR"
fi
"$vpy" -c 'import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)' \
    || die "h5py in $venv is not built with MPI (h5py.get_config().mpi is False)"

# ---- 3. the project, editable -----------------------------------------
# torch (the PyTorch interop and its tests): pin the build before the extras ask for
# "torch>=2.1", so that pip does not pick a newer, much larger build
case ",$extras," in
    *,test,*|*,torch,*|*,bench,*|*,transformers,*)
        if ! have torch; then
            say "installing ${RINGMPI_TORCH_SPEC:-torch==2.13.0}"
            pipq "${RINGMPI_TORCH_SPEC:-torch==2.13.0}"
            took "installed torch"
        fi ;;
esac
stamp=$venv/.ringmpi-installed
# the extension is rebuilt when its source or build script changes; extras installed before
# (the stamp's) are kept, so scripts/main.sh after scripts/test.sh installs nothing
digest=$(cat pyproject.toml setup.py src/ringmpi/_ext/fused.c | sha1sum | cut -c1-12)
read -r had_digest had_extras < "$stamp" 2>/dev/null || true
sorted_extras() { printf '%s\n' ${*//,/ } | sort -u | paste -sd, -; }
all_extras=$(sorted_extras "$extras" "${had_extras:-}")
if [ "${had_digest:-}" != "$digest" ] || [ "$all_extras" != "$(sorted_extras "${had_extras:-}")" ] || ! have ringmpi; then
    say "installing ringmpi (editable${all_extras:+, extras: $all_extras})"
    target=.${all_extras:+[$all_extras]}
    pipq --no-build-isolation -e "$target" 2>/dev/null || pipq -e "$target"
    echo "$digest $all_extras" > "$stamp"
    took "installed ringmpi"
fi
# the extras (transformers) must not have replaced the pinned torch build
case ",$extras," in
    *,test,*|*,torch,*|*,bench,*|*,transformers,*)
        want_torch=${RINGMPI_TORCH_SPEC:-torch==2.13.0}
        got_torch=$("$vpy" -c 'import torch; print(torch.__version__.split("+")[0])')
        case "$want_torch" in
            torch==*) [ "$got_torch" = "${want_torch#torch==}" ] \
                || die "torch $got_torch installed, $want_torch wanted (an extra replaced it)" ;;
        esac ;;
esac
say "ready: $venv (mpi4py $("$vpy" -c 'import mpi4py; print(mpi4py.__version__)'), h5py $("$vpy" -c 'import h5py; print(h5py.__version__)') parallel)"
