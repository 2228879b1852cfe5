"""Ending the whole MPI job from one rank: print this rank's message, flush, ``MPI_Abort``.

The lowest piece of ringmpi's error handling: :class:`~ringmpi.runtime.errors.abort_on_error`
(an exception on one rank) and the watchdog (a phase past its deadline) both end a job here.
It never initialises MPI: without MPI the process alone exits.
"""

from __future__ import annotations


def rank_prefix() -> str:
    """``[rank r] `` when MPI is initialised, else empty (never initialises MPI)."""
    try:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            return f"[rank {MPI.COMM_WORLD.Get_rank()}] "
    except Exception:
        pass
    return ""


def abort_job(message: str, code: int = 1) -> None:
    """Print ``message`` for this rank, flush, and end the whole MPI job now."""
    import sys

    prefix = rank_prefix()
    text = "\n".join(prefix + line for line in message.rstrip().splitlines())
    print(text, file=sys.stderr, flush=True)
    sys.stdout.flush()
    if prefix:
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(code)
    import os
    os._exit(code)
