"""Error types, and agreement on errors across ranks.

Configuration problems are checked on every rank and agreed with one
collective, so every rank raises the same :class:`ConfigError` before any
compute; no rank is left waiting in the ring for a peer that gave up.
"""

from __future__ import annotations

from typing import Optional


class RingmpiError(RuntimeError):
    """Base class of ringmpi's own errors."""


class ConfigError(RingmpiError, ValueError):
    """Bad input or configuration, found before any compute (exit status 2)."""

    exit_code = 2


class RingTimeout(RingmpiError):
    """A ring transfer did not complete before its deadline."""


def agree(comm, problem: Optional[str]) -> None:
    """Raise the same :class:`ConfigError` on every rank if any rank has a problem.

    ``problem`` is this rank's message or None.  Collective over ``comm``.
    The message raised is the lowest failing rank's; when ranks disagree, the
    count of failing ranks is added.
    """
    problems = comm.allgather(problem)
    failing = [(r, p) for r, p in enumerate(problems) if p is not None]
    if not failing:
        return
    rank, message = failing[0]
    if len(failing) < len(problems) or len({p for _, p in failing}) > 1:
        message = f"rank {rank}: {message}"
        if len(failing) > 1:
            message += f" (and {len(failing) - 1} more rank(s) failed their checks)"
    raise ConfigError(message)
