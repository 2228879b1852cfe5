"""The ``ringmpi`` command in tests: where it is, one process of it under a deadline, an input
file to give it, and what a failed write leaves behind."""

import shutil

import h5py

from mpi_util import ROOT, mpirun_env, run_deadline
from random_inputs import attention_inputs

RINGMPI = str(ROOT / ".venv" / "bin" / "ringmpi") if (ROOT / ".venv" / "bin" / "ringmpi").exists() \
    else shutil.which("ringmpi")


def ringmpi(args, timeout=60, env=None):
    """One process, no mpirun (P = 1): (returncode, stdout, stderr)."""
    rc, out, err, _ = run_deadline([RINGMPI] + [str(a) for a in args], timeout, env=env or mpirun_env())
    return rc, out, err


def write_input(path, n=20, h=4, hkv=2, d=8, b=1, dtype="float32", do=True, **override):
    """An input file of ``ringmpi run``: random q, k, v (and do), each replaced by ``override``'s
    array of that name, or left out where that is None."""
    data = dict(zip(("q", "k", "v", "do"), attention_inputs(1, b, n, h, hkv, d, do=do)))
    data = {k: v.astype(dtype) for k, v in data.items()}
    data.update(override)
    with h5py.File(path, "w") as f:
        for name, value in data.items():
            if value is not None:
                f[name] = value
    return path


def leftovers(directory):
    """The temporary files an interrupted or refused write left in ``directory``."""
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)

