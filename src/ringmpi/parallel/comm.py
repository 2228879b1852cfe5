"""Which communicator a call runs on: the one place that resolves ``comm=None``.

Every public call takes ``comm=None`` and resolves it here (as heat's
``communication.py`` does): ``None`` is a library-owned duplicate of
``COMM_WORLD``, made once per process on first use, so ringmpi's messages never
mix with the application's; the communicator is never captured at import.
The commands (``ringmpi run``, ``make-data``) take their own duplicate,
:func:`dup_world`.  ``Dup`` is collective: it runs under the watchdog.
"""

from __future__ import annotations

from ..runtime.watchdog import phase

_DEFAULT_COMM = None


def dup_world():
    """A new duplicate of ``COMM_WORLD`` (collective over it, under the watchdog's deadline)."""
    from mpi4py import MPI

    with phase("duplicating COMM_WORLD (Comm.Dup)"):
        return MPI.COMM_WORLD.Dup()


def resolve_comm(comm=None):
    """``comm`` itself, or a library-owned duplicate of ``COMM_WORLD``."""
    global _DEFAULT_COMM
    if comm is not None:
        return comm
    if _DEFAULT_COMM is None:
        _DEFAULT_COMM = dup_world()
    return _DEFAULT_COMM
