"""Philox 4x32-10, the counter-based generator of Salmon et al. (SC11, Random123).

A pure function of a 128-bit counter and a 64-bit key: the same (counter,
key) gives the same four 32-bit words on every machine, in any order, so a
random decision can be tied to *what* it is about (a query/key pair) instead
of *where* it is computed.  Vectorised over NumPy arrays of ``uint32``; the
compiled twin is ``philox4x32_10_word0`` in ``kernels/rules.h`` (built by NVRTC and by the C
compiler), which writes none of the constants: :func:`cuda_defines` gives them to both as ``-D``
defines (``ringmpi.kernels.DROPOUT_DEFINES``; ``setup.py`` reads the literals below from this
file's source).

Checked against the Random123 known-answer vectors (``tests/unit/test_philox.py``).
"""

from __future__ import annotations

import numpy as np

ROUNDS = 10
MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
WEYL = (0x9E3779B9, 0xBB67AE85)  # key schedule: golden ratio, sqrt(3) - 1
_LOW = np.uint64(0xFFFFFFFF)


def constants() -> dict:
    """The generator's constants as ``kernels/rules.h`` names them: ``PHILOX_ROUNDS``, the round
    multipliers ``PHILOX_M0``, ``PHILOX_M1`` and the key schedule's ``PHILOX_W0``, ``PHILOX_W1``."""
    return {"PHILOX_ROUNDS": ROUNDS, "PHILOX_M0": MULTIPLIERS[0], "PHILOX_M1": MULTIPLIERS[1],
            "PHILOX_W0": WEYL[0], "PHILOX_W1": WEYL[1]}


def cuda_defines() -> dict:
    """:func:`constants` as C and CUDA literals (the words as unsigned hexadecimal), for ``-D``."""
    return {name: (str(value) if name == "PHILOX_ROUNDS" else f"0x{value:08X}u")
            for name, value in constants().items()}
_SHIFT = np.uint64(32)


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = ROUNDS):
    """Philox 4x32 with ``rounds`` rounds, elementwise over broadcast arrays.

    ``c0..c3``: the counter words, ``k0, k1``: the key words (Python ints or
    integer arrays, each in ``[0, 2^32)``).  Returns the four output words as
    ``uint32`` arrays of the broadcast shape.

    Words are held in uint64 (the 64-bit product of two 32-bit words is exact
    there), so a round is two multiplies, shifts, masks and xors in place.
    """
    c = [np.array(x, dtype=np.uint64) & _LOW for x in np.broadcast_arrays(c0, c1, c2, c3)]
    key = [int(k0) & 0xFFFFFFFF, int(k1) & 0xFFFFFFFF]
    m0, m1 = np.uint64(MULTIPLIERS[0]), np.uint64(MULTIPLIERS[1])
    for r in range(rounds):
        if r:  # the key is bumped between rounds
            key = [(key[0] + WEYL[0]) & 0xFFFFFFFF, (key[1] + WEYL[1]) & 0xFFFFFFFF]
        prod0 = c[0] * m0  # becomes (hi0 ^ c3 ^ k1) and lo0
        prod1 = c[2] * m1
        new0 = prod1 >> _SHIFT
        new0 ^= c[1]
        new0 ^= np.uint64(key[0])
        prod1 &= _LOW
        new2 = prod0 >> _SHIFT
        new2 ^= c[3]
        new2 ^= np.uint64(key[1])
        prod0 &= _LOW
        c = [new0, prod1, new2, prod0]
    return tuple(x.astype(np.uint32) for x in c)
