"""The floating-point dtypes ringmpi computes with, and bfloat16 in particular.

The one place that knows float16, bfloat16, float32 and float64:

- ``bfloat16`` is ``ml_dtypes.bfloat16`` on NumPy and CuPy alike (CuPy >= 14
  allocates, views and transfers it; ``cupy.from_dlpack`` maps DLPack bf16 to
  it).  A ``uint16`` array holding bfloat16 bit patterns is accepted only when
  the caller says so with ``dtype="bfloat16"`` (:func:`view_declared`), never by
  guessing.
- 16-bit inputs compute and accumulate in float32, float64 in float64
  (:func:`compute_dtype`).
- :func:`float64_to_bfloat16` rounds once, to nearest even, from the float64
  value (``ml_dtypes``' own cast goes through float32 and can round twice).
- HDF5 has no bfloat16 type: a bfloat16 dataset is stored as its 16-bit
  patterns (``uint16``) with the attribute ``dtype = "bfloat16"``
  (:func:`hdf5_storage`, :func:`hdf5_logical_dtype`, :func:`from_hdf5_storage`).
"""

from __future__ import annotations

from typing import Optional

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
NAMES = ("float16", "bfloat16", "float32", "float64")
HDF5_DTYPE_ATTR = "dtype"


def resolve(name) -> np.dtype:
    """The NumPy dtype of a name (``"bfloat16"`` -> ``ml_dtypes.bfloat16``)."""
    if isinstance(name, str) and name.lower() in ("bfloat16", "bf16"):
        return BFLOAT16
    dt = np.dtype(name)
    if dt.name not in NAMES:
        raise TypeError(f"unsupported dtype {dt}; expected one of {', '.join(NAMES)}")
    return dt


def compute_dtype(dtype) -> np.dtype:
    """float64 for float64 inputs, float32 for float32, float16 and bfloat16 (names too)."""
    return np.dtype(np.float64) if resolve(dtype) == np.float64 else np.dtype(np.float32)


def is_16bit(dtype) -> bool:
    return np.dtype(dtype).name in ("float16", "bfloat16")


def declared_name(declared) -> Optional[str]:
    """The dtype name a caller's ``dtype=`` argument means, or None if it means none."""
    try:
        return resolve(declared).name
    except TypeError:
        return None


def view_declared(declared, *arrays):
    """``(arrays, bits)``: with ``declared == "bfloat16"`` every ``uint16`` array
    (NumPy or CuPy) viewed as bfloat16, no copy, and whether any was; anything
    else unchanged for the caller to judge.  uint16 is never read as bfloat16
    without the declaration."""
    if declared is None or declared_name(declared) != "bfloat16":
        return arrays, False
    is_bits = [str(getattr(x, "dtype", "")) == "uint16" for x in arrays]
    return tuple(x.view(BFLOAT16) if b else x for x, b in zip(arrays, is_bits)), any(is_bits)


def isfinite(x) -> np.ndarray:
    """Host boolean mask of finite elements of a NumPy array of any supported dtype."""
    x = np.asarray(x)
    return np.isfinite(x.astype(np.float32) if x.dtype == BFLOAT16 else x)


def float64_to_bfloat16(x) -> np.ndarray:
    """``x`` rounded once to the nearest bfloat16 (ties to even), on the host.

    float64 -> float32 with round-to-odd, then float32 -> bfloat16 to nearest
    even: round-to-odd to a format with at least two more bits than the target
    makes the second rounding exact (Boldo & Melquiond), so this equals one
    correct rounding of the float64 value.  NaN stays NaN, overflow gives inf.
    """
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        r = x.astype(np.float32)
        inexact = np.isfinite(r) & (r.astype(np.float64) != x)
        even = (r.view(np.uint32) & np.uint32(1)) == 0
        toward = np.where(x > r, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32)
        r = np.where(inexact & even, np.nextafter(r, toward), r).astype(np.float32)
    return r.astype(BFLOAT16)


def to_dtype(x, dtype) -> np.ndarray:
    """Host ``x`` cast to ``dtype``, rounding once for float64 -> bfloat16."""
    dtype = resolve(dtype)
    x = np.asarray(x)
    if dtype == BFLOAT16 and x.dtype != BFLOAT16:
        return float64_to_bfloat16(x)
    return x.astype(dtype)


# ---------------------------------------------------------------- HDF5 storage
def hdf5_storage(dtype) -> tuple:
    """``(storage dtype, attributes)`` of a dataset that holds ``dtype``."""
    dtype = resolve(dtype)
    if dtype == BFLOAT16:
        return np.dtype(np.uint16), {HDF5_DTYPE_ATTR: "bfloat16"}
    return dtype, {}


def hdf5_logical_dtype(dset) -> np.dtype:
    """The dtype a dataset holds: bfloat16 for ``uint16`` marked ``dtype="bfloat16"``, else its own."""
    mark = dset.attrs.get(HDF5_DTYPE_ATTR)
    if isinstance(mark, bytes):
        mark = mark.decode()
    if mark == "bfloat16" and dset.dtype == np.uint16:
        return BFLOAT16
    return dset.dtype


def to_hdf5_storage(data) -> np.ndarray:
    """The array to write for ``data`` (bfloat16 -> its uint16 bit patterns)."""
    data = np.asarray(data)
    return data.view(np.uint16) if data.dtype == BFLOAT16 else data


def from_hdf5_storage(data, logical) -> np.ndarray:
    """The inverse of :func:`to_hdf5_storage` for a dataset of dtype ``logical``."""
    data = np.asarray(data)
    return data.view(BFLOAT16) if np.dtype(logical) == BFLOAT16 and data.dtype == np.uint16 else data
