"""The dense attention reference and the tolerance rule every accuracy check uses.

:class:`DenseReference` recomputes attention of one batch entry densely, per
head and per block of query rows; in float64 it is the reference, in the
input's dtype it is the naive computation whose error sets the bound.
:func:`tolerance` is the rule (docs/design.md): an output is accurate when
its max abs error against the float64 reference is at most ``2 x`` the naive
same-dtype error ``+ 1e-6`` (``o``, ``lse``) or ``3 x + 1e-5`` (``dq``,
``dk``, ``dv``).  ``ringmpi verify`` and the GPU tests use both; the tests
under ``tests/`` otherwise keep their own independent reference.
"""

from __future__ import annotations

import math

import numpy as np

from .dtypes import resolve as resolve_dtype
from .masks import ScoreSpec

ROW_BLOCK = 1024
GRADIENTS = ("dq", "dk", "dv")


def tolerance(naive_err: float, gradient: bool) -> float:
    """The largest accepted max abs error, given the naive same-dtype error."""
    factor, floor = (3.0, 1e-5) if gradient else (2.0, 1e-6)
    return factor * naive_err + floor


class DenseReference:
    """Dense attention of one batch entry, computed in ``dtype`` block by block.

    ``q (N_q, H, D)``, ``k (N_kv, H_kv, D)``, ``v (N_kv, H_kv, D_v)``, ``do`` like ``o`` ``(N_q, H, D_v)`` or None;
    ``seg_q (N_q,)``/``seg_kv (N_kv,)`` ints or None.  Which pairs are visible
    is ``mask.visible`` (:class:`ringmpi.core.masks.ScoreSpec`) over positions
    ``0 .. N_q - 1`` and ``0 .. N_kv - 1``; ``mask.offset`` aligns them
    (``N_kv - N_q`` for bottom-right alignment, as ``ringmpi run`` uses).
    With ``mask.dropout`` the weights of batch entry ``batch_index`` are
    dropped as :mod:`ringmpi.core.dropout` says (``lse`` without dropout).
    Memory ``O(ROW_BLOCK * N_kv)`` per call beyond inputs and outputs.
    ``mask.softcap`` caps the scores (``c * tanh(s / c)``); ``sinks (H,)``, when
    given, add one zero-value key of logit ``sinks[h]`` to every row; the mask's score
    modifiers (ALiBi) add their terms after the softcap (:meth:`ScoreSpec.modifier_terms`).
    """

    def __init__(self, mask: ScoreSpec, scale: float, dtype, sinks=None):
        self.mask, self.scale = mask, scale
        self.dtype = resolve_dtype(dtype)
        self.sinks = None if sinks is None else np.asarray(sinks, dtype=np.float64)

    def compute(self, q, k, v, do=None, seg_q=None, seg_kv=None, batch_index=0):
        """``{"o", "lse", "max_logit" (H,), and with do "dq", "dk", "dv" (and "dsinks" (H,)
        with sinks)}`` in ``dtype``; lse ``(H, N_q)``."""
        dt = self.dtype

        def mm(a, b):  # a GEMM in dt: bfloat16 operands give a float32 product, rounded back
            return (a @ b).astype(dt, copy=False)

        n_q, heads, dim = q.shape
        n_kv, kv_heads, _ = k.shape
        group = heads // kv_heads
        kv_pos = np.arange(n_kv)
        scale = dt.type(self.scale)
        cap = None if self.mask.softcap is None else dt.type(self.mask.softcap)
        out = {"o": np.zeros(q.shape[:2] + v.shape[2:], dt), "lse": np.full((heads, n_q), -np.inf, dt),  # o: D_v wide
               "max_logit": np.full(heads, -np.inf, dt)}
        if do is not None:
            out.update(dq=np.zeros(q.shape, dt), dk=np.zeros(k.shape, dt), dv=np.zeros(v.shape, dt))
            if self.sinks is not None:
                out["dsinks"] = np.zeros(heads, dt)
        for h in range(heads):
            g = h // group
            kh, vh = k[:, g, :].astype(dt), v[:, g, :].astype(dt)
            for r0 in range(0, n_q, ROW_BLOCK):
                rows = np.arange(r0, min(r0 + ROW_BLOCK, n_q))
                qb = q[rows, h, :].astype(dt)
                vis = self.mask.visible(rows, kv_pos, None if seg_q is None else seg_q[rows], seg_kv)
                s = mm(qb, kh.T) * scale
                if cap is not None:
                    t = np.tanh((s / cap).astype(dt)).astype(dt)
                    s = (cap * t).astype(dt)
                terms = self.mask.modifier_terms(rows, kv_pos, dt)  # after the softcap; d/d(score) = 1
                if terms is not None:
                    s = (s + terms(h)).astype(dt)
                s = np.where(vis, s, dt.type(-np.inf))
                out["max_logit"][h] = max(out["max_logit"][h], s.max()) if s.size else out["max_logit"][h]
                if self.sinks is not None:  # the sink: one more column, value 0
                    s = np.concatenate([s, np.full((len(rows), 1), self.sinks[h], dt)], axis=1)
                m = s.max(axis=-1, keepdims=True)
                m = np.where(np.isfinite(m), m, 0).astype(dt)
                p = np.exp(s - m)
                l = p.sum(axis=-1, keepdims=True)
                seen = l > 0
                l_safe = np.where(seen, l, 1).astype(dt)
                p = np.where(seen, p / l_safe, 0).astype(dt)
                p_sink = None
                if self.sinks is not None:
                    p, p_sink = p[:, :-1], p[:, -1]
                drop = None if self.mask.dropout is None else self.mask.dropout.multiplier(
                    batch_index, h, rows, kv_pos, dt)
                pz = p if drop is None else (p * drop).astype(dt)
                out["o"][rows, h, :] = mm(pz, vh)
                with np.errstate(divide="ignore"):
                    out["lse"][h, rows] = np.where(seen[:, 0], m[:, 0] + np.log(l_safe[:, 0]), -np.inf)
                if do is None:
                    continue
                dob = do[rows, h, :].astype(dt)
                out["dv"][:, g, :] += mm(pz.T, dob)
                dp = mm(dob, vh.T)
                if drop is not None:
                    dp = (dp * drop).astype(dt)
                dvec = (dp * p).sum(axis=-1, keepdims=True)
                ds = (p * (dp - dvec)).astype(dt, copy=False)
                if p_sink is not None:
                    out["dsinks"][h] -= (p_sink * dvec[:, 0]).sum()
                if cap is not None:
                    ds = (ds * (1 - t * t)).astype(dt, copy=False)
                out["dq"][rows, h, :] = mm(ds, kh) * scale
                out["dk"][:, g, :] += mm(ds.T, qb) * scale
        return out


def max_err(x, ref) -> float:
    """Max abs error; equal infinities count as exact, NaN or mismatched infinities as inf."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if np.isnan(x).any():
        return math.inf
    same_inf = np.isinf(ref) & (x == ref)
    if (np.isinf(ref) & ~same_inf).any() or (np.isinf(x) & ~np.isinf(ref)).any():
        return math.inf
    with np.errstate(invalid="ignore"):
        diff = np.where(same_inf, 0.0, np.abs(x - ref))
    return float(diff.max()) if diff.size else 0.0


