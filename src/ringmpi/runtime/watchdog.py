"""A deadline over every blocking phase: a phase that outlives it ends the whole job.

The ring's waits poll and raise :class:`~ringmpi.runtime.errors.RingTimeout` past
their deadline; a collective call (an HDF5 open, create, write or close, a
planning agreement, the decode merge) cannot be polled: a rank blocked in it
waits for as long as a peer is gone.  Such calls run inside a phase::

    with watchdog.phase("HDF5 create out.h5"):
        ...

One daemon thread per process watches the phases in progress.  When one
outlives its deadline it prints, on that rank, ``[rank r] ringmpi: <phase>
did not finish within T s (host h) ...`` and calls ``MPI_Abort``, which
ends every rank of the job, as a hung ring wait does.  The thread needs the
GIL, which mpi4py releases while it waits in MPI, and h5py while it reads or
writes a dataset, but not while it opens, flushes or closes a file: callers
therefore enter those behind a barrier (:func:`sync`), where a lost peer is
seen with the GIL free.  Should a peer vanish inside such a call after all,
``faulthandler`` (a C thread, no GIL) dumps every thread's stack and ends the
process ``ABORT_GRACE_S`` after the deadline, which ends the job too.

The deadline of a phase is its ``timeout`` argument, else :func:`set_default`
(``ringmpi run --timeout``), else ``RINGMPI_TIMEOUT``; none of these means no
deadline (and no thread).  :func:`deadline` is that rule, the one of ringmpi: the
ring's waits take theirs from it too (a call's ``timeout``, else the same default).
"""

from __future__ import annotations

import faulthandler
import itertools
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Dict, Optional, Tuple

from . import env
from .abort import abort_job

_default: Optional[float] = None
_lock = threading.Condition()
_phases: Dict[int, Tuple[str, float, float]] = {}  # id -> (name, deadline, timeout)
_ids = itertools.count()
_thread: Optional[threading.Thread] = None
_on_abort: Dict[int, Callable[[], None]] = {}  # id -> cleanup run before the abort
ABORT_GRACE_S = 5.0  # after MPI_Abort, end this process anyway


def set_default(timeout: Optional[float]) -> None:
    """The deadline of phases that name none (seconds; None: ``RINGMPI_TIMEOUT``)."""
    global _default
    _default = timeout


def deadline(timeout: Optional[float] = None) -> Optional[float]:
    """``timeout``, else :func:`set_default`'s, else ``RINGMPI_TIMEOUT``, else None."""
    if timeout is not None:
        return timeout
    if _default is not None:
        return _default
    return env.timeout()


@contextmanager
def phase(name: str, timeout: Optional[float] = None):
    """Run the body under the deadline (see the module docstring); no deadline: no cost."""
    limit = deadline(timeout)
    if limit is None:
        yield
        return
    key = next(_ids)
    with _lock:
        _phases[key] = (name, time.monotonic() + limit, limit)
        _start()
        _arm_backstop()
        _lock.notify()
    try:
        yield
    finally:
        with _lock:
            del _phases[key]
            _arm_backstop()


def on_abort(cleanup: Callable[[], None]) -> int:
    """Run ``cleanup()`` on this rank before the watchdog aborts the job (e.g. remove a temporary
    file); returns a key for :func:`cancel_on_abort`."""
    key = next(_ids)
    _on_abort[key] = cleanup
    return key


def cancel_on_abort(key: Optional[int]) -> None:
    _on_abort.pop(key, None)


def sync(comm) -> None:
    """A barrier on ``comm`` when a deadline is set: run just before a collective HDF5 call
    that keeps the GIL, so a rank that never comes is waited for where the watchdog can see it."""
    if deadline() is not None:
        comm.Barrier()


def _arm_backstop() -> None:
    """faulthandler's timer at the earliest deadline + ABORT_GRACE_S (cancelled when none)."""
    if not _phases:
        faulthandler.cancel_dump_traceback_later()
        return
    due = min(d for _, d, _ in _phases.values())
    try:  # the process's own stderr, even where sys.stderr is redirected (it needs a file descriptor)
        faulthandler.dump_traceback_later(max(due - time.monotonic(), 0.0) + ABORT_GRACE_S, exit=True,
                                          file=sys.__stderr__)
    except (AttributeError, ValueError, OSError):  # no stderr with a descriptor: no backstop
        pass


def _start() -> None:
    global _thread
    if _thread is None or not _thread.is_alive():
        _thread = threading.Thread(target=_watch, name="ringmpi-watchdog", daemon=True)
        _thread.start()


def _watch() -> None:
    while True:
        with _lock:
            while not _phases:
                _lock.wait()
            name, due, limit = min(_phases.values(), key=lambda p: p[1])
            left = due - time.monotonic()
            if left > 0:
                _lock.wait(left)
                continue
        _expire(name, limit)
        return


def _expire(name: str, limit: float) -> None:
    import socket

    timer = threading.Timer(ABORT_GRACE_S, os._exit, args=(1,))
    timer.daemon = True
    timer.start()  # should MPI_Abort itself block (the launcher unreachable)
    for cleanup in list(_on_abort.values()):
        try:
            cleanup()
        except Exception:
            pass
    abort_job(f"ringmpi: {name} did not finish within {limit:g} s (host {socket.gethostname()}); "
              f"a peer rank may have died or its link may be down: aborting the job")
