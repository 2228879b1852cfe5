"""Random attention inputs for the tests: standard-normal q, k, v and do, drawn in that order."""

import numpy as np


def attention_inputs(seed, b, n, h, hkv, d, n_kv=None, dv=None, do=True, dtype=None, segments=None):
    """``(q, k, v, do)`` drawn in that order from ``np.random.default_rng(seed)`` (a Generator
    given as ``seed`` is used and goes on): q ``(b, n, h, d)``, k ``(b, n_kv, hkv, d)``,
    v ``(b, n_kv, hkv, dv)``, do ``(b, n, h, dv)``; ``n_kv`` is ``n`` and ``dv`` is ``d`` unless given;
    without ``do``, ``(q, k, v)``.

    float64 unless ``dtype`` is given (a NumPy dtype, or a name of ``ringmpi.core.dtypes``:
    bfloat16 is rounded once from float64).  With ``segments``, one more array: ``(b, n)`` int64
    segment ids, each row ``segments`` ids drawn next from the same generator, sorted."""
    rng = np.random.default_rng(seed)
    n_kv = n if n_kv is None else n_kv
    dv = d if dv is None else dv
    shapes = [(b, n, h, d), (b, n_kv, hkv, d), (b, n_kv, hkv, dv)] + ([(b, n, h, dv)] if do else [])
    arrays = [rng.standard_normal(shape) for shape in shapes]
    if dtype is not None:
        from ringmpi.core.dtypes import to_dtype

        arrays = [to_dtype(x, dtype) for x in arrays]
    if segments is not None:
        arrays.append(np.sort(rng.integers(0, segments, (b, n)), axis=1).astype(np.int64))
    return tuple(arrays)


def linear_inputs(seed, b, t, h, hv, kd, vd, per_key=False, delta=True, g=(0.0, 0.5), beta=(0.05, 1.0)):
    """A linear-attention layer's inputs (float64) drawn in this order from
    ``np.random.default_rng(seed)`` (a Generator given as ``seed`` is used and goes on): q, k
    ``(b, t, h, kd)`` (k l2-normalised, as the models keep the delta rule stable), v
    ``(b, t, hv, vd)``, the log decay ``g`` uniform in ``-(g[1]) .. -(g[0])``, ``(b, t, hv)`` or
    ``(b, t, hv, kd)`` ``per_key``, and with ``delta`` ``beta`` uniform in ``beta``; a dict of
    q, k, v, g, beta (None without ``delta``)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, kd))
    k = rng.standard_normal((b, t, h, kd))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, t, hv, vd))
    decay = -rng.uniform(g[0], g[1], (b, t, hv) + ((kd,) if per_key else ()))
    return dict(q=q, k=k, v=v, g=decay, beta=rng.uniform(beta[0], beta[1], (b, t, hv)) if delta else None)
