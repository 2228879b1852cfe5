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
