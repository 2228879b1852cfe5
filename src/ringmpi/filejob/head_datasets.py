"""Per-head data of a file job: the sinks it reads, the max logits and dsinks it writes.

``ringmpi run --sinks-dataset NAME`` reads ``NAME`` (``(H,)`` float32/float64,
finite) whole on every rank; each pass uses the sinks of its heads.  The
outputs ``max_logit (H,)`` (with ``--max-logit``) and ``dsinks (H,)`` (with
``--backward``) are reduced over the batch, so a job split into batch passes
keeps one row per batch entry in ``max_logit_partial``/``dsinks_partial``
``(B, H)`` (a pass writes its value in its first batch row and the identity,
``-inf`` or ``0``, in the others: rewriting a pass after ``--resume`` gives
the same file) and :func:`finish` reduces them into the final datasets and
removes the partials.  These arrays are the same on every rank, and every
rank makes the same HDF5 calls with the same data: under the ``mpio`` driver
a dataset touched by one rank only can leave that rank's metadata cache out of
step with the others (a reopened file after ``--resume`` then hangs at the
next collective flush).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..runtime.errors import agree
from ..options import sinks_problem
from .hdf5 import flush_file

PARTIAL = "_partial"


def read_sinks(fin, name: str, heads: int, comm) -> np.ndarray:
    """The ``(H,)`` sinks dataset ``name`` (every rank reads it); ConfigError (exit 2) on every
    rank when it is missing or not ``(H,)`` finite float32/float64."""
    problem, sinks = None, None
    if name not in fin:
        problem = f"--sinks-dataset {name!r}: no such dataset in the input file"
    else:
        dset = fin[name]
        if dset.dtype.kind != "f" or dset.dtype.itemsize not in (4, 8):
            problem = f"--sinks-dataset {name!r}: dtype {dset.dtype}, expected float32 or float64"
        elif dset.shape != (heads,):
            problem = f"--sinks-dataset {name!r}: shape {dset.shape}, expected (H,) = ({heads},)"
        else:
            sinks = np.ascontiguousarray(dset[()], dtype=dset.dtype.newbyteorder("="))
            problem = sinks_problem(sinks, heads)
            if problem:
                problem = f"--sinks-dataset {name!r}: {problem}"
    agree(comm, problem)
    return sinks


def create(fout, spec, sinks: Optional[np.ndarray], max_logit: bool, dsinks: bool) -> None:
    """Create the per-head datasets and write ``sinks`` (collective)."""
    heads, batch = spec.heads, spec.batch
    ct = np.float64 if spec.dtype == "float64" else np.float32
    if sinks is not None:
        fout.create_dataset("sinks", shape=(heads,), dtype=sinks.dtype)
    for name, wanted, dtype in (("max_logit", max_logit, ct),
                                ("dsinks", dsinks, None if sinks is None else sinks.dtype)):
        if wanted:
            fout.create_dataset(name, shape=(heads,), dtype=dtype)
            fout.create_dataset(name + PARTIAL, shape=(batch, heads), dtype=dtype)
    if sinks is not None:
        fout["sinks"][...] = sinks


def write_pass(fout, p, group: int, max_logit=None, dsinks=None) -> None:
    """Write one pass's ``max_logit``/``dsinks`` (its heads, reduced over its batch entries;
    collective, the same values on every rank)."""
    h0, h1 = p.g0 * group, p.g1 * group
    for name, value, identity in (("max_logit", max_logit, -np.inf), ("dsinks", dsinks, 0.0)):
        if value is None:
            continue
        dset = fout[name + PARTIAL]
        rows = np.full((p.b1 - p.b0, h1 - h0), identity, dtype=dset.dtype)
        rows[0] = np.asarray(value)
        dset[p.b0:p.b1, h0:h1] = rows


def finish(fout, comm) -> None:
    """Reduce the partial datasets into ``max_logit``/``dsinks``, then remove the partials
    (collective over ``comm``; the flushes under the watchdog, as every collective flush)."""
    todo = [(name, reduce) for name, reduce in (("max_logit", np.max), ("dsinks", np.sum))
            if name + PARTIAL in fout]
    if todo:
        flush_file(fout, comm)
    for name, reduce in todo:
        fout[name][...] = reduce(fout[name + PARTIAL][()], axis=0)
        flush_file(fout, comm)
        del fout[name + PARTIAL]
