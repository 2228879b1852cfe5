"""Resuming a file job: which passes a partial output file holds, and whether it fits.

``ringmpi run`` writes its outputs into a temporary file ``.<out>.partial``
(see :class:`ringmpi.filejob.hdf5.AtomicOutput`).  Two root attributes of that file
make it resumable:

``ringmpi_job``
    JSON of a :class:`JobRecord`: ringmpi version, world size, every option
    that changes the numbers, a fingerprint of the input file, and the list
    of passes (batch entries x kv-head groups).
``ringmpi_passes_done``
    ``(n_passes,) uint8``: 1 for each pass whose outputs were written and
    flushed.  Updated in place (same size, no new metadata) and flushed
    after each pass, so a job killed at any moment leaves a file whose
    marked passes are complete.

``ringmpi run --resume`` compares the stored record with the current one
(:func:`differences`), reuses the stored pass plan, and skips marked passes.
Results do not depend on the world size, so a different one is accepted
(bitwise identical output needs the same one).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

import numpy as np

from .hdf5 import flush_file

JOB_ATTR = "ringmpi_job"
DONE_ATTR = "ringmpi_passes_done"


def input_fingerprint(path: str, spec) -> dict:
    """A cheap identity of the input file: size, modification time, shapes and dtype."""
    st = os.stat(path)
    return {"size": int(st.st_size), "mtime_ns": int(st.st_mtime_ns), "dtype": spec.dtype,
            "shapes": {k: list(v) for k, v in sorted(spec.shapes.items())}}


@dataclass
class JobRecord:
    """What a file job was asked to do, stored in its partial output.

    ``options`` holds every setting that changes the results (layout, mask,
    scale, backward, backend, heads per pass); ``passes`` is the pass plan as
    ``[b0, b1, g0, g1]`` lists.
    """

    version: str
    world_size: int
    options: dict
    input: dict
    passes: List[List[int]]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "JobRecord":
        return cls(**json.loads(text))


def differences(stored: JobRecord, current: JobRecord) -> List[str]:
    """What differs between a partial file's job and this one, in words (empty: resumable).

    The world size may differ (results do not depend on it); the pass plan is
    taken from the stored record, so it is not compared.
    """
    found = []
    if stored.version != current.version:
        found.append(f"ringmpi version {stored.version} -> {current.version}")
    for key in sorted(set(stored.options) | set(current.options)):
        a, b = stored.options.get(key), current.options.get(key)
        if a != b:
            found.append(f"option {key}: {a!r} -> {b!r}")
    for key in sorted(set(stored.input) | set(current.input)):
        a, b = stored.input.get(key), current.input.get(key)
        if a != b:
            found.append(f"input {key}: {a!r} -> {b!r}")
    return found


def start(fout, record: JobRecord, comm) -> None:
    """Record a new job in a freshly created output file (collective over ``comm``)."""
    fout.attrs[JOB_ATTR] = record.to_json()
    fout.attrs[DONE_ATTR] = np.zeros(len(record.passes), dtype=np.uint8)
    flush_file(fout, comm)


def mark_done(fout, index: int, comm) -> None:
    """Mark pass ``index`` complete, after its outputs were written (collective over ``comm``).

    The outputs are flushed first, then the mark is written in place and
    flushed, so a mark on disk always means the data is on disk.
    """
    flush_file(fout, comm)
    done = np.array(fout.attrs[DONE_ATTR], dtype=np.uint8)
    done[index] = 1
    fout.attrs.modify(DONE_ATTR, done)
    flush_file(fout, comm)


def read_partial(path: str) -> Tuple[Optional[JobRecord], Optional[np.ndarray], Optional[str]]:
    """``(record, done, None)`` from a partial output file, or ``(None, None, problem)``.

    Serial and read-only (rank 0 checks before the collective open).
    """
    import h5py

    try:
        with h5py.File(path, "r", locking=False) as f:
            if JOB_ATTR not in f.attrs or DONE_ATTR not in f.attrs:
                return None, None, f"{path}: not a resumable ringmpi partial output (no job record)"
            record = JobRecord.from_json(str(f.attrs[JOB_ATTR]))
            done = np.array(f.attrs[DONE_ATTR], dtype=np.uint8)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return None, None, f"{path}: cannot read the partial output to resume ({exc})"
    if len(done) != len(record.passes):
        return None, None, f"{path}: damaged job record ({len(done)} marks for {len(record.passes)} passes)"
    return record, done, None


def check_resume(path: str, current: JobRecord):
    """Rank 0: ``(stored record, done marks, problem)`` for ``--resume``.

    No partial file: ``(None, None, None)``, start afresh.  A partial file of a
    different job (input, options, version): a problem naming every difference.
    """
    if not os.path.exists(path):
        return None, None, None
    stored, done, problem = read_partial(path)
    if problem:
        return None, None, problem
    diff = differences(stored, current)
    if diff:
        return None, None, (f"--resume: the partial output {path} belongs to a different job: "
                            + "; ".join(diff) + " (run without --resume to start again)")
    return stored, done, None
