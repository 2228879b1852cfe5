"""Philox 4x32-10 against the Random123 known-answer vectors (kat_vectors).

These make the dropout reference non-circular: the dense reference draws its
keep matrix from ringmpi.core.philox, which is checked here against published values.
"""

import numpy as np
import pytest

from ringmpi.core.philox import philox4x32

# counter (4 words), key (2 words) -> output (4 words), Random123 tests/kat_vectors
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KAT)
def test_known_answers(counter, key, expected):
    out = philox4x32(*counter, *key)
    assert tuple(int(w) for w in out) == expected
    assert all(w.dtype == np.uint32 for w in out)


def test_vectorised_equals_scalar():
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2 ** 32, size=(4, 37), dtype=np.uint64)
    out = philox4x32(*words, 0x12345678, 0x9ABCDEF0)
    for n in range(37):
        one = philox4x32(*(int(w[n]) for w in words), 0x12345678, 0x9ABCDEF0)
        assert tuple(int(o[n]) for o in out) == tuple(int(x) for x in one)


def test_broadcasting_and_distinct_outputs():
    i = np.arange(64)[:, None]
    j = np.arange(64)[None, :]
    w0 = philox4x32(j, i, 0, 0, 1, 2)[0]
    assert w0.shape == (64, 64)
    assert len(np.unique(w0)) == 64 * 64  # a 2^32 range: collisions here would be a bug
