#!/usr/bin/env bash
# Idempotent setup for a Debian/Ubuntu machine (or a cluster with its own MPI):
#   1. system Open MPI + parallel HDF5 from the distribution (only when missing;
#      skipped when MPICC / HDF5_DIR point at an existing installation),
#   2. .venv with mpi4py using that MPI (mpi4py's binary wheel when it provably loads
#      the library file that MPICC links, else built from source with MPICC) and h5py
#      compiled with MPICC against the parallel HDF5 (checked: h5py.get_config().mpi),
#   3. ringmpi installed editable: what the main job needs (NumPy, click, ml_dtypes,
#      the compiled tile pass), plus the extras RINGMPI_EXTRAS names.
# The MPI is identified by asking its library (a program built by MPICC); at the end the set-up
# fails unless mpi4py, h5py and ringmpi, imported in one process, map that one MPI library.
# Takes seconds when everything is already there; says how long each step took.
#
#   scripts/setup.sh                       # the main job (scripts/main.sh)
#   RINGMPI_EXTRAS=test scripts/setup.sh   # and the test stack (scripts/test.sh)
#   RINGMPI_EXTRAS=test,gpu scripts/setup.sh
#   RINGMPI_MPI4PY=source scripts/setup.sh # always build mpi4py from source
#   RINGMPI_TORCH_SPEC='torch==2.13.0' (default) chooses the torch build the tests get
#   MPICC=/path/to/mpicc HDF5_DIR=/path/to/parallel/hdf5 RINGMPI_VENV=.venv-mine scripts/setup.sh
#       # another MPI (a module-loaded one, MPICH beside Open MPI): mpi4py and h5py built for it,
#       # and checked at the end to load its library and no other
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

# The MPI that MPICC builds against, asked of the library itself (not of its directory or of one
# implementation's wrapper flags): a tiny program compiled by MPICC prints the file that defines
# MPI_Get_library_version and the first line of what it returns (callable before MPI_Init).
probe_dir=$(mktemp -d)
trap 'rm -rf "$probe_dir"' EXIT
cat > "$probe_dir/probe.c" <<'C'
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <mpi.h>
int main(void) {
    static char version[MPI_MAX_LIBRARY_VERSION_STRING + 1];
    int length = 0;
    Dl_info info;
    void *defined = dlsym(RTLD_NEXT, "MPI_Get_library_version");  /* NULL: linked statically */
    MPI_Get_library_version(version, &length);
    version[strcspn(version, "\n")] = '\0';
    printf("%s\n%s\n", defined && dladdr(defined, &info) && info.dli_fname ? info.dli_fname : "static", version);
    return 0;
}
C
"$MPICC" -o "$probe_dir/probe" "$probe_dir/probe.c" -ldl >"$probe_dir/log" 2>&1 \
    || die "$MPICC cannot build an MPI program: $(tail -5 "$probe_dir/log")"
{ read -r mpi_file; read -r mpi_version_raw; } < <("$probe_dir/probe") || die "a program built by $MPICC does not run"
mpi_version=$(printf '%s' "$mpi_version_raw" | tr -d '\000' | tr -s ' \t' '  ' | sed 's/^ //; s/ $//')
[ "$mpi_file" = static ] || mpi_file=$(readlink -f "$mpi_file")
say "MPI of $MPICC: $mpi_version ($mpi_file)"
checker=$here/src/ringmpi/runtime/mpi_library.py   # stdlib + mpi4py: runs before ringmpi is installed
# 0 when mpi4py and the named modules load MPICC's library and no other; the report in $probe_dir/stack
stack_is_mpicc() {
    local expect=(--version "$mpi_version") rc=0
    [ "$mpi_file" = static ] || expect+=(--library "$mpi_file")
    "$vpy" "$checker" "${expect[@]}" "$@" >"$probe_dir/stack" 2>&1 || rc=$?
    [ "$rc" -le 128 ] || echo "the check crashed with signal $((rc - 128)) while importing mpi4py $*" >>"$probe_dir/stack"
    return "$rc"
}
# mpi4py's binary wheel looks for libmpi first in the environment's lib/ (before the linker's
# paths), in every process this venv's Python runs: a link there to MPICC's library selects it
wheel_link=$venv/lib/libmpi.so
if ! have mpi4py || ! stack_is_mpicc; then
    "$vpy" -m pip uninstall -y -q mpi4py 2>/dev/null || true
    rm -f "$wheel_link"
    if [ "${RINGMPI_MPI4PY:-wheel}" = wheel ] && [ "$mpi_file" != static ] \
            && ln -s "$mpi_file" "$wheel_link" \
            && pipq --only-binary=mpi4py 'mpi4py>=4.1' 2>/dev/null && stack_is_mpicc; then
        took "mpi4py: binary wheel, loading $mpi_file (linked from $wheel_link)"
    else
        [ ! -L "$wheel_link" ] || say "mpi4py's binary wheel does not load $mpi_file: building it from source"
        "$vpy" -m pip uninstall -y -q mpi4py 2>/dev/null || true
        rm -f "$wheel_link"
        say "building mpi4py against $MPICC"
        pipq --upgrade pip setuptools wheel
        MPICC="$MPICC" pipq --no-binary=mpi4py --no-cache-dir 'mpi4py>=4.0'
        stack_is_mpicc || die "mpi4py built by $MPICC does not load $mpi_file only:
$(cat "$probe_dir/stack")"
        took "built mpi4py from source with $MPICC"
    fi
fi
if ! "$vpy" -c 'import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)' 2>/dev/null \
        || ! stack_is_mpicc h5py; then
    say "building h5py with $MPICC against parallel HDF5 in $HDF5_DIR"
    pipq --upgrade 'setuptools>=61' packaging 'Cython>=3' pkgconfig numpy
    "$vpy" -m pip uninstall -y -q h5py 2>/dev/null || true
    CC="$MPICC" HDF5_MPI=ON HDF5_DIR="$HDF5_DIR" \
        "$vpy" -m pip install -q --disable-pip-version-check --no-binary=h5py \
        --no-build-isolation --no-cache-dir 'h5py>=3.10'
    stack_is_mpicc h5py || die "h5py built with $MPICC against $HDF5_DIR does not load $mpi_file only
(is HDF5_DIR a parallel HDF5 built with another MPI?):
$(cat "$probe_dir/stack")"
    took "built h5py with $MPICC against $HDF5_DIR"
fi
"$vpy" -c 'import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)' \
    || die "h5py in $venv is not built with MPI (h5py.get_config().mpi is False)"
if [ -n "${RINGMPI_SETUP_MPI_ONLY:-}" ]; then  # the minutes-long part alone (the MPICH test's background build)
    stack_is_mpicc h5py || die "mpi4py and h5py in $venv are not one MPI library, $mpi_file:
$(cat "$probe_dir/stack")"
    say "MPI stack ready: $venv (RINGMPI_SETUP_MPI_ONLY: ringmpi not installed)"
    exit 0
fi

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
# the extension is rebuilt when its source or build script changes (fixed_split.py: _fixed's -D
# defines); extras installed before (the stamp's) are kept, so scripts/main.sh after scripts/test.sh
# installs nothing
digest=$(cat pyproject.toml setup.py src/ringmpi/_ext/*.c src/ringmpi/_ext/*.h src/ringmpi/core/fixed_split.py src/ringmpi/kernels/rules.h src/ringmpi/core/philox.py src/ringmpi/core/masks.py | sha1sum | cut -c1-12)
read -r had_digest had_extras 2>/dev/null < "$stamp" || true
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
# one MPI in the whole stack: mpi4py, h5py (its parallel HDF5) and ringmpi, in one process
stack_is_mpicc h5py ringmpi ringmpi.cli || die "the venv $venv mixes MPI libraries, or not $MPICC's ($mpi_file):
$(cat "$probe_dir/stack")
HDF5_DIR=$HDF5_DIR must be a parallel HDF5 built with the same MPI as MPICC=$MPICC"
took "one MPI library in mpi4py, h5py and ringmpi: $mpi_file"
say "ready: $venv (mpi4py $("$vpy" -c 'import mpi4py; print(mpi4py.__version__)'), h5py $("$vpy" -c 'import h5py; print(h5py.__version__)') parallel)"
