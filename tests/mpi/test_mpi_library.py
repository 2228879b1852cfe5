"""Which MPI library the stack loaded (issue 52), on this suite's own venv: set-up's check passes on
it, and ``ringmpi info`` names the library file that mpi4py and h5py each loaded."""

import subprocess
import sys

import pytest

from cli_util import RINGMPI
from mpi_util import ROOT, mpirun

CHECK = [sys.executable, str(ROOT / "src" / "ringmpi" / "runtime" / "mpi_library.py")]


def one_library():
    """The one MPI library file this venv's check reports (it must pass)."""
    done = subprocess.run(CHECK + ["h5py", "ringmpi", "ringmpi.cli"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    mapped = [line.split()[3] for line in done.stdout.splitlines() if line.startswith("mapped MPI library:")]
    assert len(mapped) == 1, done.stdout
    return mapped[0]


def test_setup_check_passes_and_names_one_library():
    library = one_library()
    done = subprocess.run(CHECK + ["--library", library, "h5py"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and f"h5py: {library}" in done.stdout, done.stdout + done.stderr


def test_setup_check_fails_on_another_library():
    done = subprocess.run(CHECK + ["--library", "/nonexistent/libmpi.so", "h5py"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "MISMATCH: expected only /nonexistent/libmpi.so" in done.stdout, done.stdout


@pytest.mark.mpi
def test_info_names_the_library_files():
    library = one_library()
    rc, out, err, _ = mpirun(2, [RINGMPI, "info"], 60)
    assert rc == 0, err[-3000:]
    assert f"MPI library files: mpi4py loaded {library}, h5py loaded {library}" in out, out
    assert "MPI: Open MPI (Open MPI v" in out or "MPI: MPICH (" in out, out
    assert "WARNING" not in out, out
