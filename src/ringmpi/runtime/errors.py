"""Error types, and agreement on errors across ranks.

Configuration problems are checked on every rank and agreed with one
collective, so every rank raises the same :class:`ConfigError` before any
compute; no rank is left waiting in the ring for a peer that gave up.
"""

from __future__ import annotations

from typing import Optional

from .abort import abort_job
from .watchdog import phase


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
    with phase("the ranks' agreement on the configuration (allgather)"):
        problems = comm.allgather(problem)
    _raise_first(problems)


def _raise_first(problems) -> None:
    failing = [(r, p) for r, p in enumerate(problems) if p is not None]
    if not failing:
        return
    rank, message = failing[0]
    if len(failing) < len(problems) or len({p for _, p in failing}) > 1:
        message = f"rank {rank}: {message}"
        if len(failing) > 1:
            message += f" (and {len(failing) - 1} more rank(s) failed their checks)"
    raise ConfigError(message)


def agree_shards(comm, problem: Optional[str], signature, length: int, what: str) -> tuple:
    """:func:`agree`, and in the same allgather every rank's shard length (returned, in rank order)
    and the call's ``signature`` (any comparable value: shapes, dtype, options), which every rank
    must pass alike; else one ConfigError naming ``what`` disagrees.  For calls on contiguous
    shards (the linear-attention layers, their convolution, a change of layout)."""
    with phase("the ranks' agreement on the call and their shards (allgather)"):
        every = comm.allgather((problem, signature, length))
    _raise_first([p for p, _, _ in every])
    if any(s != every[0][1] for _, s, _ in every):
        raise ConfigError(f"ranks disagree on the call ({what})")
    return tuple(int(t) for _, _, t in every)


class abort_on_error:
    """Context manager: any exception inside ends the whole MPI job.

    ``with ringmpi.abort_on_error(): ...`` prints the exception with this
    rank's ``[rank r]`` prefix, flushes, and calls ``MPI_Abort`` so that the
    other ranks do not wait forever for this one.  A :class:`ConfigError`
    (raised identically on every rank after :func:`agree`) is re-raised
    unchanged unless ``abort_config=True``: every rank sees it and can exit
    cleanly with status 2.
    """

    def __init__(self, abort_config: bool = False):
        self.abort_config = abort_config

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None or issubclass(exc_type, (SystemExit, GeneratorExit)):
            return False
        if issubclass(exc_type, ConfigError) and not self.abort_config:
            return False
        import traceback

        if issubclass(exc_type, KeyboardInterrupt):
            abort_job("interrupted", 130)
        detail = "".join(traceback.format_exception(exc_type, exc, tb))
        abort_job(f"ringmpi: {exc_type.__name__}: {exc}\n{detail}", 1)
        return False
