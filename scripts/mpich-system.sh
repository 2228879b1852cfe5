#!/usr/bin/env bash
# Install the distribution's MPICH and its parallel HDF5 beside the system Open MPI
# (Debian/Ubuntu, root, only what is missing), for the suite's MPICH stack test, and keep
# Open MPI the default: installing mpich registers the `mpi` (mpicc...) and `mpirun`
# alternatives, so every MPI-related alternative is pinned (manual mode) to what it names
# now before apt runs, and checked afterwards; one that moved anyway is set back.
#
#   bash scripts/mpich-system.sh     # prints MPICC=... HDF5_DIR=... MPIRUN=... on success
set -euo pipefail
say() { printf '[mpich-system] %s\n' "$*" >&2; }
die() { printf '[mpich-system] ERROR: %s\n' "$*" >&2; exit 1; }

arch=$(uname -m)-linux-gnu
mpicc=/usr/bin/mpicc.mpich
mpirun=/usr/bin/mpirun.mpich
hdf5=/usr/lib/$arch/hdf5/mpich
alts=(mpi mpirun "mpi-$arch" h5pcc hdf5.pc)

have_all() { [ -x "$mpicc" ] && [ -x "$mpirun" ] && [ -f "$hdf5/include/hdf5.h" ]; }

if ! have_all; then
    command -v apt-get >/dev/null 2>&1 || die "no MPICH at $mpicc / $hdf5 and no apt-get"
    [ "$(id -u)" = 0 ] || die "no MPICH at $mpicc / $hdf5: install mpich libhdf5-mpich-dev (needs root)"
    declare -A before=()
    for a in "${alts[@]}"; do
        t=$(readlink "/etc/alternatives/$a" 2>/dev/null) || continue
        before[$a]=$t
        update-alternatives --set "$a" "$t" >/dev/null 2>&1 || true   # manual mode: apt keeps it
    done
    say "installing mpich libhdf5-mpich-dev"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends mpich libhdf5-mpich-dev >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq --no-install-recommends mpich libhdf5-mpich-dev >/dev/null; }
    for a in "${!before[@]}"; do
        now=$(readlink "/etc/alternatives/$a" 2>/dev/null || true)
        if [ "$now" != "${before[$a]}" ]; then
            say "apt switched alternative $a to $now: setting it back to ${before[$a]}"
            update-alternatives --set "$a" "${before[$a]}" >/dev/null
        fi
    done
    have_all || die "mpich installed but $mpicc, $mpirun or $hdf5/include/hdf5.h is missing"
fi
# the defaults must not have become MPICH (the rest of the suite and scripts/main.sh use them)
for tool in mpirun mpicc; do
    p=$(command -v "$tool" 2>/dev/null) || continue
    case "$(readlink -f "$p")" in
        *mpich*|*hydra*) die "$tool now resolves to $(readlink -f "$p") (MPICH); set it back with update-alternatives" ;;
    esac
done
echo "MPICC=$mpicc HDF5_DIR=$hdf5 MPIRUN=$mpirun"
