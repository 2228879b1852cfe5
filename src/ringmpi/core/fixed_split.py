"""The split of a float partial into int64 words (``invariant=True``): its constants, stated once.

Three loops convert a partial ``y`` (already scaled onto the grid, :mod:`ringmpi.core.fixed_point`)
to integers, and must give the same integers: ``fixed_point.add_numpy`` (NumPy), ``_ext/fixed.c``
(the compiled CPU loop) and ``kernels/invariant.cu`` (``fixed_add``, the GPU's).  One word:
``trunc(y)`` for ``|y| < 2^(TOP + 1)``; two words (float64 sums): ``hi = trunc(y 2^-LIMB_BITS)``,
``lo = trunc(y - hi 2^LIMB_BITS)`` for ``|y| < 2^(TOP + LIMB_BITS + 1)``.  A value at or beyond
the limit (or NaN) adds nothing and flags its row.

The C and CUDA sources write none of these numbers: ``setup.py`` passes :func:`c_defines` to the
C compiler, ``ringmpi.kernels.compile_options`` passes :func:`cuda_defines` to NVRTC (``-D``
defines; both sources ``#error`` without them).  No NumPy here: ``setup.py`` loads this file by
its path, before the package's dependencies are installed.
"""

from __future__ import annotations

import struct

TOP = 61          # one int64 word: partials and sums below 2^61 (the limit 2^62 leaves 2^63 a factor 2)
LIMB_BITS = 30    # two words: y = hi 2^30 + lo, |lo| < 2^30 (an int32 too: _ext/fixed.c's AVX2 path)
LIMB = 2.0 ** LIMB_BITS


def top(limbs: int) -> int:
    """The grid's top exponent: sums stay below ``2^top(limbs)``."""
    return TOP + LIMB_BITS * (limbs - 1)


def limit(limbs: int) -> float:
    """``2^(top(limbs) + 1)``: a value on the grid is split only when its magnitude is below this."""
    return 2.0 ** (top(limbs) + 1)


def constants() -> dict:
    """The split's constants as the C and CUDA sources name them, as floats (all powers of two:
    exact doubles)."""
    return {"FIXED_LIMIT_1": limit(1), "FIXED_LIMIT_2": limit(2), "FIXED_LIMB": LIMB, "FIXED_LIMB_INV": 1.0 / LIMB}


def c_literal(x: float) -> str:
    """``x`` as a C99 hexadecimal floating literal (``0x1.0000000000000p+62``): exact."""
    return float.hex(float(x))


def cuda_literal(x: float) -> str:
    """``x`` as a CUDA double from its IEEE bits (``__longlong_as_double(0x43d0000000000000LL)``):
    exact, and NVRTC's C++14 has no hexadecimal floating literals."""
    return f"__longlong_as_double({struct.unpack('<Q', struct.pack('<d', float(x)))[0]:#x}LL)"


def c_defines() -> dict:
    """``_ext/fixed.c``'s ``-D`` defines: :func:`constants` as C literals, and ``FIXED_LIMB_BITS``."""
    return {"FIXED_LIMB_BITS": str(LIMB_BITS), **{k: c_literal(v) for k, v in constants().items()}}


def cuda_defines() -> dict:
    """``kernels/invariant.cu``'s ``-D`` defines: :func:`constants` as CUDA doubles."""
    return {k: cuda_literal(v) for k, v in constants().items()}
