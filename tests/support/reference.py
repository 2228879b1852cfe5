"""Dense attention references for the tests, written independently of ringmpi.

``dense_forward``/``dense_backward`` compute on whole global arrays in the
dtype given (float64 for the reference, the input dtype for the "naive
same-dtype" computation that sets the tolerance).  In float16 and bfloat16
(``ml_dtypes.bfloat16``) every intermediate is rounded to that dtype, as a
plain framework computation in it does (a GEMM accumulates in float32 and
rounds its result; NumPy's bfloat16 matmul would return float32).
``tolerance_check`` applies the tolerance rule of docs/design.md.
Dropout: ``dropout_factors`` draws the keep matrix straight from the Philox
generator (``ringmpi.core.philox``, itself checked against the Random123
known-answer vectors) with the packing documented in ``ringmpi.core.dropout``,
written out again here; ``drop=`` applies it.
"""

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def _mm(a, b, dtype):
    """``a @ b`` rounded to ``dtype`` (float32 accumulation for 16-bit inputs)."""
    if dtype.itemsize == 2:
        return (a.astype(np.float32) @ b.astype(np.float32)).astype(dtype)
    return a @ b


def visible(n_q, n_kv, causal=False, window=None, seg_q=None, seg_kv=None):
    """(B or 1, n_q, n_kv) bool visibility, bottom-right aligned.  ``window``: ``(left, right)``,
    a side of -1 (flash-attn's convention) or None unbounded; None: no window."""
    i = np.arange(n_q)[:, None] + (n_kv - n_q)
    j = np.arange(n_kv)[None, :]
    vis = np.ones((n_q, n_kv), dtype=bool)
    if causal:
        vis &= j <= i
    if window is not None:
        left, right = window
        if left is not None and left != -1:
            vis &= j >= i - left
        if right is not None and right != -1:
            vis &= j <= i + right
    vis = vis[None]
    if seg_q is not None:
        vis = vis & (seg_q[:, :, None] == seg_kv[:, None, :])
    return vis


def dropout_factors(seed, p, batch, heads, n_q, n_kv):
    """(B, H, n_q, n_kv) float64: ``1/(1-p)`` where weight (b, h, i, j) is kept, else 0.

    Counter ``(j, i, 0, b*H + h)`` (positions < 2^32 here), key ``(seed lo, seed hi)``;
    kept iff Philox word 0 >= ceil(p * 2^32)."""
    from ringmpi.core.philox import philox4x32
    i = np.arange(n_q, dtype=np.uint64)[:, None]
    j = np.arange(n_kv, dtype=np.uint64)[None, :]
    out = np.empty((batch, heads, n_q, n_kv))
    threshold = int(np.ceil(p * 2.0 ** 32))
    for b in range(batch):
        for h in range(heads):
            word = philox4x32(j, i, 0, b * heads + h, seed & 0xFFFFFFFF, seed >> 32)[0]
            out[b, h] = np.where(word.astype(np.uint64) >= threshold, 1.0 / (1.0 - p), 0.0)
    return out


def _expand_kv(x, heads):
    """(B, N, Hkv, D) -> (B, Hq, N, D) by repeating each kv head."""
    group = heads // x.shape[2]
    return np.repeat(x.transpose(0, 2, 1, 3), group, axis=1)


def _capped(s, softcap, dtype):
    """Logit softcap ``c * tanh(s / c)`` in ``dtype`` (identity when ``softcap`` is None)."""
    if softcap is None:
        return s
    c = dtype.type(softcap)
    return (c * np.tanh((s / c).astype(dtype))).astype(dtype)


def _with_alibi(s, alibi, dtype):
    """Scores ``(B, H, N_q, N_kv)`` plus ALiBi's ``-slopes[h] * |i + N_kv - N_q - j|`` in ``dtype``
    (unchanged when ``alibi`` is None)."""
    if alibi is None:
        return s
    n_q, n_kv = s.shape[2:]
    dist = np.abs(np.arange(n_q)[:, None] + (n_kv - n_q) - np.arange(n_kv)[None, :]).astype(np.float64)
    term = -np.asarray(alibi, dtype=np.float64)[None, :, None, None] * dist[None, None]
    return (s + term.astype(dtype)).astype(dtype)


def _with_sinks(s, vh, vis, sinks, dtype):
    """Scores, values and visibility with the sinks as one more key column:
    logit ``sinks[h]``, a zero value, visible from every query."""
    b, h, n_q, n_kv = s.shape
    col = np.broadcast_to(np.asarray(sinks, dtype=np.float64).astype(dtype)[None, :, None, None], (b, h, n_q, 1))
    s = np.concatenate([s, col], axis=-1)
    vh = np.concatenate([vh, np.zeros(vh.shape[:2] + (1, vh.shape[3]), dtype=vh.dtype)], axis=2)
    vis = np.concatenate([np.broadcast_to(vis, (max(b, vis.shape[0]), n_q, n_kv)),
                          np.ones((max(b, vis.shape[0]), n_q, 1), dtype=bool)], axis=-1)
    return s, vh, vis


def _drop_sink_column(drop):
    """Dropout factors with a factor 1 for the sink column (the sink is never dropped)."""
    return np.concatenate([drop, np.ones(drop.shape[:3] + (1,), dtype=drop.dtype)], axis=-1)


def dense_max_logit(q, k, vis, scale, dtype, softcap=None, alibi=None):
    """(H,): per head the largest visible score (after scale, softcap and ALiBi) over
    batch and rows; -inf for a head with none."""
    dtype = np.dtype(dtype)
    qh = q.transpose(0, 2, 1, 3).astype(dtype)
    kh = _expand_kv(k, q.shape[2]).astype(dtype)
    s = _capped(_mm(qh, kh.transpose(0, 1, 3, 2), dtype) * dtype.type(scale), softcap, dtype)
    s = np.where(vis[:, None], _with_alibi(s, alibi, dtype), -np.inf)
    return s.max(axis=(0, 2, 3))


def dense_forward(q, k, v, vis, scale, dtype, sinks=None, softcap=None, drop=None, alibi=None):
    """o (B, N, H, D_v) and lse (B, H, N) computed densely in ``dtype``
    (v: (B, N, Hkv, D_v); sinks as an extra key column with a zero value, softcap through tanh,
    then ALiBi's ``alibi`` (H,) slopes: ``-slope_h |i + N_kv - N_q - j|``);
    ``drop`` (B, H, N_q, N_kv): dropout factors on the weights (lse without them)."""
    dtype = np.dtype(dtype)
    qh = q.transpose(0, 2, 1, 3).astype(dtype)
    kh = _expand_kv(k, q.shape[2]).astype(dtype)
    vh = _expand_kv(v, q.shape[2]).astype(dtype)
    s = _capped(_mm(qh, kh.transpose(0, 1, 3, 2), dtype) * dtype.type(scale), softcap, dtype)
    s = _with_alibi(s, alibi, dtype)
    if sinks is not None:
        s, vh, vis = _with_sinks(s, vh, vis, sinks, dtype)
    mask = vis[:, None]
    s = np.where(mask, s, dtype.type(-np.inf))
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0).astype(dtype)
    p = np.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    l_safe = np.where(l > 0, l, 1).astype(dtype)
    w = (p / l_safe).astype(dtype)
    if drop is not None:
        w = (w * (drop if sinks is None else _drop_sink_column(drop))).astype(dtype)
    o = np.where(l > 0, _mm(w, vh, dtype), 0).astype(dtype)
    with np.errstate(divide="ignore"):
        lse = np.where(l[..., 0] > 0, m_safe[..., 0] + np.log(l_safe[..., 0]), -np.inf).astype(dtype)
    return o.transpose(0, 2, 1, 3), lse


def dense_backward(do, q, k, v, vis, scale, dtype, sinks=None, softcap=None, drop=None, alibi=None):
    """dq, dk, dv computed densely in ``dtype`` (shapes like q, k, v; ``do`` like o, D_v wide), and dsinks
    (H,) after them when ``sinks`` is given: the extra column's dS summed over
    batch and rows.  The softcap's slope ``1 - tanh^2`` multiplies dS (ALiBi's is 1);
    ``drop`` and ``alibi`` as for :func:`dense_forward`."""
    dtype = np.dtype(dtype)
    heads, kv_heads = q.shape[2], k.shape[2]
    group = heads // kv_heads
    n_kv = k.shape[1]
    qh = q.transpose(0, 2, 1, 3).astype(dtype)
    kh = _expand_kv(k, heads).astype(dtype)
    vh = _expand_kv(v, heads).astype(dtype)
    doh = do.transpose(0, 2, 1, 3).astype(dtype)
    raw = _mm(qh, kh.transpose(0, 1, 3, 2), dtype) * dtype.type(scale)
    s = _with_alibi(_capped(raw, softcap, dtype), alibi, dtype)
    if sinks is not None:
        s, vh, vis = _with_sinks(s, vh, vis, sinks, dtype)
    s = np.where(vis[:, None], s, dtype.type(-np.inf))
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0).astype(dtype)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    p = np.where(l > 0, p / np.where(l > 0, l, 1), 0).astype(dtype)
    if drop is not None and sinks is not None:
        drop = _drop_sink_column(drop)
    pz = p if drop is None else (p * drop).astype(dtype)
    dv = _mm(pz.transpose(0, 1, 3, 2), doh, dtype)
    dp = _mm(doh, vh.transpose(0, 1, 3, 2), dtype)
    if drop is not None:
        dp = (dp * drop).astype(dtype)
    ds = (p * (dp - (dp * p).sum(axis=-1, keepdims=True))).astype(dtype)
    dsinks = ds[..., n_kv:].sum(axis=(0, 2, 3)) if sinks is not None else None
    ds, dv = ds[..., :n_kv], dv[:, :, :n_kv]
    if softcap is not None:
        c = dtype.type(softcap)
        ds = (ds * (1 - np.square(np.tanh((raw / c).astype(dtype))))).astype(dtype)
    dq = _mm(ds, kh, dtype) * dtype.type(scale)
    dk = _mm(ds.transpose(0, 1, 3, 2), qh, dtype) * dtype.type(scale)
    b, _, n_kv, d = dk.shape
    dk = dk.reshape(b, kv_heads, group, n_kv, d).sum(axis=2).astype(dtype)
    dv = dv.reshape(b, kv_heads, group, n_kv, dv.shape[-1]).sum(axis=2).astype(dtype)  # D_v may differ
    grads = (dq.transpose(0, 2, 1, 3), dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3))
    return grads if sinks is None else grads + (dsinks,)


def max_err(x, ref):
    """Max abs error, treating equal infinities as exact; inf where they disagree."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if x.shape != ref.shape:
        raise AssertionError(f"shape {x.shape} != reference {ref.shape}")
    if np.isnan(x).any():
        return float("inf")
    same_inf = np.isinf(ref) & (x == ref)
    if (np.isinf(ref) != same_inf).any() or (np.isinf(x) & ~np.isinf(ref)).any():
        return float("inf")
    with np.errstate(invalid="ignore"):
        diff = np.where(same_inf, 0.0, np.abs(x - ref))
    return float(diff.max()) if diff.size else 0.0


def dense_forward_both_orders(q, k, v, vis, scale, dtype):
    """``dense_forward`` twice, over the keys in order and reversed: two equally plain
    same-dtype computations.  Where scores are ~1e4, float32's score rounding dominates
    and the naive error depends on the GEMM's summation order by a factor of ~3 (seen:
    4.5e-5 in order, 1.4e-4 reversed), so one order alone is a lucky, not a fair, bound.
    Returns ([o, o_reversed], [lse, lse_reversed])."""
    fwd = dense_forward(q, k, v, vis, scale, dtype)
    rev = dense_forward(q, k[:, ::-1], v[:, ::-1], vis[..., ::-1], scale, dtype)
    return [fwd[0], rev[0]], [fwd[1], rev[1]]


def tolerance_check(name, ours, ref64, naive, gradient=False):
    """The rule of docs/design.md: err <= 2x naive + 1e-6 (3x + 1e-5 for gradients).
    ``naive`` may be a list of equally plain computations: the bound uses the worst.

    Returns (ok, message)."""
    factor, floor = (3.0, 1e-5) if gradient else (2.0, 1e-6)
    naives = naive if isinstance(naive, list) else [naive]
    err, base = max_err(ours, ref64), max(max_err(n, ref64) for n in naives)
    if not np.isfinite(base):
        base = 0.0
    bound = factor * base + floor
    ok = err <= bound
    return ok, f"{name}: err {err:.3g} bound {bound:.3g} (naive {base:.3g})"
