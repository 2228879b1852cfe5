"""Random attention inputs for the tests: standard-normal q, k, v and do, drawn in that order."""

import numpy as np


def attention_inputs(seed, b, n, h, hkv, d, n_kv=None, dv=None, do=True):
    """``(q, k, v, do)`` in float64, drawn in that order from ``np.random.default_rng(seed)``
    (a Generator given as ``seed`` is used and goes on): q ``(b, n, h, d)``, k ``(b, n_kv, hkv, d)``,
    v ``(b, n_kv, hkv, dv)``, do ``(b, n, h, dv)``; ``n_kv`` is ``n`` and ``dv`` is ``d`` unless given;
    without ``do``, ``(q, k, v)``.  Callers cast (bfloat16 with ``to_dtype``: rounded once)."""
    rng = np.random.default_rng(seed)
    n_kv = n if n_kv is None else n_kv
    dv = d if dv is None else dv
    shapes = [(b, n, h, d), (b, n_kv, hkv, d), (b, n_kv, hkv, dv)] + ([(b, n, h, dv)] if do else [])
    return tuple(rng.standard_normal(shape) for shape in shapes)
