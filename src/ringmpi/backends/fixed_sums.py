"""The loop of the order-free sums (``invariant=True``): compiled, or NumPy.

:func:`add` adds float partial sums into int64 fixed point as
:func:`ringmpi.core.fixed_point.add_numpy` defines it, with the compiled loop
``ringmpi._ext._fixed`` (``_ext/fixed.c``: the same IEEE double operations, vectorised) where
it was built, else that NumPy function: the same integers either way.  ``RINGMPI_CPU_KERNEL=numpy``
asks for the NumPy loop, as it does for the tile pass.
"""

from __future__ import annotations

import os

from ..core.fixed_point import add_numpy


def _load():
    if os.environ.get("RINGMPI_CPU_KERNEL", "compiled") == "numpy":
        return None
    try:
        from .._ext import _fixed
    except ImportError:
        return None
    return _fixed


_FIXED = _load()


def implementation() -> str:
    """``"compiled"`` (``ringmpi._ext._fixed``) or ``"numpy"``: which loop :func:`add` runs."""
    return "numpy" if _FIXED is None else "compiled"


def vector_path():
    """The vector path the compiled loop runs (``"avx512"``, ``"avx2"``, ``"plain"``), or None
    where NumPy's loop runs."""
    return None if _FIXED is None else _FIXED.path()


def add(acc, x, rows=None, cols=None, index=None, bad=None, limbs: int = 1) -> None:
    """:func:`ringmpi.core.fixed_point.add_numpy`'s sums (its arguments), by the compiled loop
    when there is one."""
    if _FIXED is None:
        add_numpy(acc, x, rows, cols, index, bad, limbs)
    else:
        _FIXED.add(acc, x, rows, cols, index, bad, limbs)
