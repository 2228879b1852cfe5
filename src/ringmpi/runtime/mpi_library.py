"""Which MPI library this process runs on, by name (``ringmpi info`` and the bench's record)."""

from __future__ import annotations


def mpi_library() -> str:
    """The MPI library's name and version: the first line of ``MPI_Get_library_version`` (Open MPI
    pads the string with NULs)."""
    from mpi4py import MPI

    return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
