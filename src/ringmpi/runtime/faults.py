"""Fault injection for tests: misbehave at named points when ``RINGMPI_FAULT`` asks.

Unset in normal use; then each point costs one environment lookup.  The
failure tests (tests/mpi/test_failures.py, tests/mpi/test_cli.py) use it to make a
rank raise, die or hang at a chosen ring step, or fail between writing its
outputs and closing the file.
"""

from __future__ import annotations

from typing import Optional

from .errors import RingmpiError


class InjectedFault(RingmpiError):
    """Raised by :func:`fault_point` when ``RINGMPI_FAULT`` asks for it (tests only)."""


_REACHED: dict = {}  # times each named point was reached (the sleep fault's nth)


def fault_point(where: str, rank: int, step: Optional[int] = None) -> None:
    """Testing aid: misbehave here when ``RINGMPI_FAULT`` asks for it.

    ``where`` is ``"fwd"``/``"bwd"`` with the ring ``step``, or a named point
    such as ``"write"`` (after a rank wrote its outputs, before the file is
    closed).  ``RINGMPI_FAULT`` is one of

    * ``write:<rank>`` - raise :class:`InjectedFault` at that point (``write``
      alone: on every rank);
    * ``sleep:<where>:<rank>:<seconds>[:<nth>]`` - the ``nth`` time (default 1)
      that rank reaches ``where`` (``create``: before the file job creates its
      output; ``finite``: before the file job's ranks share their finiteness
      checks; ``plan``: before a call's agreement on shapes; ``fwd``/``bwd``:
      ring step 1 of a pass), say so on stderr and sleep, while the other ranks
      wait in what follows (a test cuts a link meanwhile);
    * ``<action>:<rank>:<step>[:fwd|bwd|pass]`` at a ring step (both ring phases when
      omitted; with ``pass``: at the start of that pass of ``ringmpi run``),
      with action ``raise`` (raise :class:`InjectedFault`), ``exit``
      (``os._exit(3)``: a rank that dies without a word) or ``hang`` (stop
      sending and sleep forever: a stuck rank).

    Unset in normal use; then this costs one environment lookup.
    """
    import os

    want = os.environ.get("RINGMPI_FAULT", "")
    if not want:
        return
    action, *fields = want.split(":")
    if action == "sleep":
        if len(fields) >= 3 and fields[0] == where and int(fields[1]) == rank and step in (None, 1):
            _REACHED[where] = _REACHED.get(where, 0) + 1
            if _REACHED[where] == (int(fields[3]) if len(fields) > 3 else 1):
                import sys
                import time

                print(f"[rank {rank}] ringmpi fault: sleeping {fields[2]} s at '{where}' (RINGMPI_FAULT={want})",
                      file=sys.stderr, flush=True)
                time.sleep(float(fields[2]))
        return
    if step is None:
        if action == where and (not fields or int(fields[0]) == rank):
            raise InjectedFault(f"injected fault at '{where}' on rank {rank} (RINGMPI_FAULT={want})")
        return
    if action not in ("raise", "exit", "hang") or len(fields) < 2:
        return
    if int(fields[0]) != rank or int(fields[1]) != step or (fields[2] != where if len(fields) > 2 else where == "pass"):
        return
    if action == "raise":
        raise InjectedFault(f"injected fault on rank {rank} at {where} ring step {step} (RINGMPI_FAULT={want})")
    if action == "exit":
        os._exit(3)
    import time

    while True:  # a stuck rank: the others' ring waits must pass their deadline
        time.sleep(3600)
