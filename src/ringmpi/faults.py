"""Fault injection for tests: misbehave at named points when ``RINGMPI_FAULT`` asks.

Unset in normal use; then each point costs one environment lookup.  The
failure tests (tests/test_failures.py, tests/test_cli.py) use it to make a
rank raise, die or hang at a chosen ring step, or fail between writing its
outputs and closing the file.
"""

from __future__ import annotations

from typing import Optional

from .errors import RingmpiError


class InjectedFault(RingmpiError):
    """Raised by :func:`fault_point` when ``RINGMPI_FAULT`` asks for it (tests only)."""


def fault_point(where: str, rank: int, step: Optional[int] = None) -> None:
    """Testing aid: misbehave here when ``RINGMPI_FAULT`` asks for it.

    ``where`` is ``"fwd"``/``"bwd"`` with the ring ``step``, or a named point
    such as ``"write"`` (after a rank wrote its outputs, before the file is
    closed).  ``RINGMPI_FAULT`` is one of

    * ``write:<rank>`` - raise :class:`InjectedFault` at that point (``write``
      alone: on every rank);
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
