"""The log-sum-exp merge of decode partials, without MPI.

Merging the partials of two key sets must equal attention over their union,
and ``merge(a, b)`` must be the same bits as ``merge(b, a)`` (what makes the
Allreduce give the same bits on every rank).
"""

import numpy as np
import pytest

from ringmpi.decode import merge_partials

D = 5


def partial(rng, scores, values, dtype):
    """Packed rows [o, lse, flag, sig, -sig] of softmax attention over given scores (rows, keys)."""
    rows = np.zeros((scores.shape[0], D + 4), dtype=dtype)
    for i, s in enumerate(scores):
        if np.isneginf(s).all():
            rows[i, D] = -np.inf
            continue
        w = np.exp(s - s.max())
        rows[i, :D] = (w @ values) / w.sum()
        rows[i, D] = s.max() + np.log(w.sum())
    rows[:, D + 1] = rng.integers(0, 2, len(rows))
    rows[:, D + 2] = rng.integers(0, 100, len(rows))
    rows[:, D + 3] = -rows[:, D + 2]
    return rows


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_is_attention_over_the_union_and_symmetric(dtype):
    rng = np.random.default_rng(0)
    n, ka, kb = 40, 7, 9
    sa, sb = rng.standard_normal((n, ka)) * 5, rng.standard_normal((n, kb)) * 5
    sa[:5] = -np.inf  # rows that saw nothing in one part, in both, or in neither
    sb[3:8] = -np.inf
    sa[20:22] += 80.0  # far-apart maxima
    va, vb = rng.standard_normal((ka, D)), rng.standard_normal((kb, D))
    a, b = partial(rng, sa, va, dtype), partial(rng, sb, vb, dtype)
    ab, ba = b.copy(), a.copy()
    merge_partials(a, ab)
    merge_partials(b, ba)
    assert ab.tobytes() == ba.tobytes()
    union = partial(rng, np.concatenate([sa, sb], axis=1), np.concatenate([va, vb]), np.float64)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    seen = ~np.isneginf(union[:, D])
    assert np.array_equal(np.isneginf(ab[:, D]), ~seen)
    assert np.all(ab[~seen, :D] == 0)
    np.testing.assert_allclose(ab[seen, :D + 1], union[seen, :D + 1], rtol=tol, atol=tol)
    np.testing.assert_array_equal(ab[:, D + 1:], np.maximum(a[:, D + 1:], b[:, D + 1:]))
