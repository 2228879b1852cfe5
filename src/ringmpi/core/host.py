"""Host (NumPy) copies of any backend's arrays: the one to-host rule."""

from __future__ import annotations

import sys

import numpy as np


def to_host(x) -> np.ndarray:
    """``x`` as a NumPy array: a CuPy array copied to the host (``.get()``), anything else as
    ``np.asarray`` sees it (no copy for a NumPy array)."""
    return x.get() if hasattr(x, "get") else np.asarray(x)


def array_module(x):
    """The array module ``x`` belongs to: ``cupy`` for a CuPy array (already imported, since
    the array exists: core/ never imports it), ``numpy`` for anything else."""
    if type(x).__module__.split(".")[0] == "cupy":
        return sys.modules["cupy"]
    return np
