"""Which communicator a call runs on: the one place that resolves ``comm=None``.

Every public call takes ``comm=None`` and resolves it here (as heat's
``communication.py`` does): ``None`` is a library-owned duplicate of
``COMM_WORLD``, made once per process on first use, so ringmpi's messages never
mix with the application's; the communicator is never captured at import.
"""

from __future__ import annotations

_DEFAULT_COMM = None


def resolve_comm(comm=None):
    """``comm`` itself, or a library-owned duplicate of ``COMM_WORLD``."""
    global _DEFAULT_COMM
    if comm is not None:
        return comm
    if _DEFAULT_COMM is None:
        from mpi4py import MPI
        _DEFAULT_COMM = MPI.COMM_WORLD.Dup()
    return _DEFAULT_COMM
