"""Settings read from the environment, checked where they are read."""

from __future__ import annotations

import os
from typing import Optional


def positive_int(name: str, default: Optional[int] = None) -> Optional[int]:
    """The environment variable ``name`` as a positive int; ``default`` when it is unset
    or empty; ``ValueError`` naming the variable when it is anything else."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {text!r}")
    return value


# The run settings: each variable is read here and nowhere else (the defaults of ringmpi.RingContext,
# of the watchdog and of the file job).
HEAD_PARALLEL = "RINGMPI_HEAD_PARALLEL"
TIMEOUT = "RINGMPI_TIMEOUT"
PASS_BYTES = "RINGMPI_PASS_BYTES"
IO_PIECE_BYTES = "RINGMPI_IO_PIECE_BYTES"
MEMORY_BUDGET = "RINGMPI_MEMORY_BUDGET"
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def head_parallel() -> Optional[str]:
    """``RINGMPI_HEAD_PARALLEL`` as given (``U`` or ``auto``, checked where it is used), or None."""
    return os.environ.get(HEAD_PARALLEL) or None


def timeout() -> Optional[float]:
    """``RINGMPI_TIMEOUT`` in seconds, or None when unset or empty."""
    value = os.environ.get(TIMEOUT)
    return float(value) if value else None


def pass_bytes(default: int) -> int:
    """``RINGMPI_PASS_BYTES``: the file job's bytes per pass, else ``default``."""
    return int(os.environ.get(PASS_BYTES) or default)


def io_piece_bytes(default: int) -> int:
    """``RINGMPI_IO_PIECE_BYTES``: the largest transfer of one collective HDF5 call, else ``default``."""
    value = os.environ.get(IO_PIECE_BYTES)
    return max(1, int(value)) if value else default


def parse_bytes(text: str, name: str = MEMORY_BUDGET) -> int:
    """``"8G"`` -> 8 * 2^30; a plain integer is bytes.  ValueError naming ``name`` when not a
    positive size."""
    body = text.strip().upper().rstrip("B")
    scale = _UNITS.get(body[-1:], 1)
    if scale != 1:
        body = body[:-1]
    try:
        value = int(float(body) * scale)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be a positive size in bytes (e.g. 8G), got {text!r}")
    return value


def memory_budget() -> Optional[int]:
    """``RINGMPI_MEMORY_BUDGET`` in bytes (a suffix K, M, G or T multiplies by 2^10 .. 2^40),
    or None when unset or empty."""
    text = os.environ.get(MEMORY_BUDGET)
    return parse_bytes(text) if text else None
