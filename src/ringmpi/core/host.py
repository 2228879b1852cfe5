"""An array of any backend as a host NumPy array: the one to-host conversion of ringmpi."""

from __future__ import annotations

import numpy as np


def to_host(x) -> np.ndarray:
    """``x`` as a host NumPy array: a CuPy array (anything with ``.get()``) copied to the host,
    anything else through ``np.asarray`` (no copy when it already is one)."""
    return x.get() if hasattr(x, "get") else np.asarray(x)
