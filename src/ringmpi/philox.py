"""Philox 4x32-10, the counter-based generator of Salmon et al. (SC11, Random123).

A pure function of a 128-bit counter and a 64-bit key: the same (counter,
key) gives the same four 32-bit words on every machine, in any order, so a
random decision can be tied to *what* it is about (a query/key pair) instead
of *where* it is computed.  Vectorised over NumPy arrays of ``uint32``; the
CUDA twin is ``kernels/philox.cuh`` (same rounds, same constants).

Checked against the Random123 known-answer vectors (``tests/test_philox.py``).
"""

from __future__ import annotations

import numpy as np

ROUNDS = 10
MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
WEYL = (0x9E3779B9, 0xBB67AE85)  # key schedule: golden ratio, sqrt(3) - 1
_LOW = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


def _mulhilo(multiplier: int, x: np.ndarray):
    """``(hi, lo)`` uint32 words of the 64-bit product ``multiplier * x``."""
    prod = np.uint64(multiplier) * x.astype(np.uint64)
    return (prod >> _SHIFT).astype(np.uint32), (prod & _LOW).astype(np.uint32)


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = ROUNDS):
    """Philox 4x32 with ``rounds`` rounds, elementwise over broadcast arrays.

    ``c0..c3``: the counter words, ``k0, k1``: the key words (Python ints or
    integer arrays, each in ``[0, 2^32)``).  Returns the four output words as
    ``uint32`` arrays of the broadcast shape.
    """
    c = [np.asarray(x, dtype=np.uint64).astype(np.uint32) for x in np.broadcast_arrays(c0, c1, c2, c3)]
    key = [np.uint32(int(k0)), np.uint32(int(k1))]
    for r in range(rounds):
        if r:  # the key is bumped between rounds
            key = [np.uint32((int(key[0]) + WEYL[0]) & 0xFFFFFFFF),
                   np.uint32((int(key[1]) + WEYL[1]) & 0xFFFFFFFF)]
        hi0, lo0 = _mulhilo(MULTIPLIERS[0], c[0])
        hi1, lo1 = _mulhilo(MULTIPLIERS[1], c[2])
        c = [hi1 ^ c[1] ^ key[0], lo1, hi0 ^ c[3] ^ key[1], lo0]
    return tuple(c)
