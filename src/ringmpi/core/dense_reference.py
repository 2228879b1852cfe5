"""The dense attention reference and the tolerance rule every accuracy check uses.

:class:`DenseReference` recomputes attention of one batch entry densely, per
head and per block of query rows; in float64 it is the reference, in the
input's dtype it is the naive computation whose error sets the bound.
:func:`tolerance` is the rule (docs/design.md): an output is accurate when
its max abs error against the float64 reference is at most ``2 x`` the naive
same-dtype error ``+ 1e-6`` (``o``, ``lse``) or ``3 x + 1e-5`` (``dq``,
``dk``, ``dv``).  ``ringmpi verify`` and the GPU tests use both; the tests
under ``tests/`` otherwise keep their own independent reference.

:class:`SampledReference` computes chosen rows of the same attention over the
whole sequence in ``O(rows * N)`` (``ringmpi verify --sample``): query rows
(``o``, ``lse``, ``dq``) fold the keys chunk by chunk, key rows (``dk``,
``dv``) fold the queries chunk by chunk, each in any dtype, with the scores
made as :class:`DenseReference` makes them.
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


def _mm(a, b, dt):
    """``a @ b`` in ``dt``: bfloat16 operands give a float32 product, rounded back."""
    return (a @ b).astype(dt, copy=False)


class _Scores:
    """The scores of one head as the references make them, in ``dt``: ``(q . k) * scale``, the
    softcap (``t = tanh(s / c)`` kept for the backward), the score modifiers' terms, then
    ``-inf`` where ``mask`` hides the pair."""

    def __init__(self, mask: ScoreSpec, scale: float, dt):
        self.mask, self.dt = mask, dt
        self.scale = dt.type(scale)
        self.cap = None if mask.softcap is None else dt.type(mask.softcap)

    def __call__(self, q, k, q_pos, kv_pos, seg_q, seg_kv, h):
        """``(s, t)``: ``q (R, D)`` x ``k (C, D)`` of head ``h`` at global positions ``q_pos (R,)``,
        ``kv_pos (C,)`` (segment ids ``(R,)``, ``(C,)`` or None); ``t`` None without a softcap."""
        dt, t = self.dt, None
        s = _mm(q, k.T, dt) * self.scale
        if self.cap is not None:
            t = np.tanh((s / self.cap).astype(dt)).astype(dt)
            s = (self.cap * t).astype(dt)
        terms = self.mask.modifier_terms(q_pos, kv_pos, dt)  # after the softcap; d/d(score) = 1
        if terms is not None:
            s = (s + terms(h)).astype(dt)
        s = np.where(self.mask.visible(q_pos, kv_pos, seg_q, seg_kv), s, dt.type(-np.inf))
        return s, t


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

        def mm(a, b):
            return _mm(a, b, dt)

        n_q, heads, dim = q.shape
        n_kv, kv_heads, _ = k.shape
        group = heads // kv_heads
        kv_pos = np.arange(n_kv)
        scale = dt.type(self.scale)
        scores = _Scores(self.mask, self.scale, dt)
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
                s, t = scores(qb, kh, rows, kv_pos, None if seg_q is None else seg_q[rows], seg_kv, h)
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
                if t is not None:
                    ds = (ds * (1 - t * t)).astype(dt, copy=False)
                out["dq"][rows, h, :] = mm(ds, kh) * scale
                out["dk"][:, g, :] += mm(ds.T, qb) * scale
        return out


class SampledReference:
    """Chosen rows of the attention of one batch entry over the whole sequence, in ``dtype``,
    in ``O(rows * N)`` time and ``O(rows * chunk)`` memory: in float64 the reference of
    ``ringmpi verify --sample``, in the input's dtype the naive computation that sets its bound.

    The caller streams the sequence in chunks (``key_chunks`` / ``query_chunks``: a function
    returning an iterable, called once per pass); global positions place every row and chunk,
    so visibility, score modifiers and dropout are those of :class:`DenseReference` (``mask``,
    ``scale``, ``sinks``, ``batch_index`` as there).

    * :meth:`query_rows`: ``o``, ``lse`` and (with ``do``) ``dq`` of query rows.  The keys are
      folded into an online softmax (a running maximum, exact in float64), then, for ``dq``,
      a second pass takes ``P = exp(S - lse)`` and ``rowsum(do * o)`` of those rows.
    * :meth:`key_rows`: ``dk``, ``dv`` of key rows, which sum over every query that sees them:
      each query's ``P = exp(S - lse)`` and ``rowsum(do * o)`` come from the ``lse`` and ``o``
      given with the query chunks (the output's, as the ring's backward takes them: a full row's
      ``lse`` needs the whole row, ``O(N^2)`` over all of them; :meth:`query_rows` checks the
      sampled rows of both).
    """

    def __init__(self, mask: ScoreSpec, scale: float, dtype, sinks=None):
        self.mask, self.scale = mask, scale
        self.dtype = resolve_dtype(dtype)
        self.sinks = None if sinks is None else np.asarray(sinks, dtype=np.float64)

    def _dropout(self, batch_index, h, q_pos, kv_pos):
        drop = self.mask.dropout
        return None if drop is None else drop.multiplier(batch_index, h, q_pos, kv_pos, self.dtype)

    def query_rows(self, rows, q, key_chunks, do=None, seg_q=None, batch_index=0) -> dict:
        """``{"o" (R, H, D_v), "lse" (H, R), with do "dq" (R, H, D)}`` in ``dtype``.

        ``rows (R,)`` int global query positions, ``q (R, H, D)`` and ``do (R, H, D_v)`` (or
        None) those rows, ``seg_q (R,)`` their segment ids or None; ``key_chunks()`` yields
        ``(kv_pos (C,), k (C, H_kv, D), v (C, H_kv, D_v), seg_kv (C,) or None)`` covering the keys.
        """
        dt = self.dtype
        rows = np.asarray(rows, dtype=np.int64)
        n, heads, dim = q.shape
        scores = _Scores(self.mask, self.scale, dt)
        qh = [q[:, h, :].astype(dt) for h in range(heads)]
        m = np.full((heads, n), -np.inf, dt)
        l = np.zeros((heads, n), dt)
        acc = None
        if self.sinks is not None:  # one more key of logit sinks[h] and value 0: m = sink, l = 1
            m[:] = self.sinks.astype(dt)[:, None]
            l[:] = 1
        for kv_pos, k, v, seg_kv in key_chunks():
            group = heads // k.shape[1]
            if acc is None:
                acc = np.zeros((heads, n, v.shape[2]), dt)
            for h in range(heads):
                g = h // group
                s, _ = scores(qh[h], k[:, g, :].astype(dt), rows, kv_pos, seg_q, seg_kv, h)
                if s.size == 0:
                    continue
                top = np.maximum(m[h], s.max(axis=1))
                shift = np.where(np.isfinite(top), top, 0).astype(dt)
                alpha = np.exp(m[h] - shift).astype(dt)
                p = np.exp(s - shift[:, None]).astype(dt)
                l[h] = (l[h] * alpha + p.sum(axis=1)).astype(dt)
                drop = self._dropout(batch_index, h, rows, kv_pos)
                pz = p if drop is None else (p * drop).astype(dt)
                acc[h] = (acc[h] * alpha[:, None] + _mm(pz, v[:, g, :].astype(dt), dt)).astype(dt)
                m[h] = top
        if acc is None:
            raise ValueError("key_chunks() yielded no chunk")
        seen = l > 0
        l_safe = np.where(seen, l, 1).astype(dt)
        o = np.where(seen[..., None], acc / l_safe[..., None], 0).astype(dt)
        shift = np.where(np.isfinite(m), m, 0).astype(dt)
        with np.errstate(divide="ignore"):
            lse = np.where(seen, shift + np.log(l_safe), -np.inf).astype(dt)
        out = {"o": o.transpose(1, 0, 2), "lse": lse}
        if do is None:
            return out
        doh = [do[:, h, :].astype(dt) for h in range(heads)]
        dvec = [(doh[h] * o[h]).sum(axis=-1).astype(dt) for h in range(heads)]
        lse_use = np.where(np.isneginf(lse), np.inf, lse).astype(dt)  # a row that saw nothing: P = 0
        dq = np.zeros((heads, n, dim), dt)
        for kv_pos, k, v, seg_kv in key_chunks():
            group = heads // k.shape[1]
            for h in range(heads):
                g = h // group
                kg = k[:, g, :].astype(dt)
                s, t = scores(qh[h], kg, rows, kv_pos, seg_q, seg_kv, h)
                p = np.exp(s - lse_use[h][:, None]).astype(dt)
                dp = _mm(doh[h], v[:, g, :].astype(dt).T, dt)
                drop = self._dropout(batch_index, h, rows, kv_pos)
                if drop is not None:
                    dp = (dp * drop).astype(dt)
                ds = (p * (dp - dvec[h][:, None])).astype(dt)
                if t is not None:
                    ds = (ds * (1 - t * t)).astype(dt)
                dq[h] = (dq[h] + _mm(ds, kg, dt)).astype(dt)
        out["dq"] = (dq * dt.type(self.scale)).astype(dt).transpose(1, 0, 2)
        return out

    def key_rows(self, cols, k, v, query_chunks, seg_kv=None, batch_index=0) -> dict:
        """``{"dk" (R, H_kv, D), "dv" (R, H_kv, D_v)}`` in ``dtype``.

        ``cols (R,)`` int global key positions, ``k (R, H_kv, D)``, ``v (R, H_kv, D_v)`` those
        rows, ``seg_kv (R,)`` their segment ids or None; ``query_chunks()`` yields ``(q_pos (C,),
        q (C, H, D), do (C, H, D_v), o (C, H, D_v), lse (H, C), seg_q (C,) or None)`` covering
        the queries, with each query's ``o`` and ``lse`` as the forward gave them.
        """
        dt = self.dtype
        cols = np.asarray(cols, dtype=np.int64)
        n, kv_heads, dim = k.shape
        scores = _Scores(self.mask, self.scale, dt)
        kg = [k[:, g, :].astype(dt) for g in range(kv_heads)]
        vg = [v[:, g, :].astype(dt) for g in range(kv_heads)]
        dk = np.zeros((kv_heads, n, dim), dt)
        dv = np.zeros((kv_heads, n, v.shape[2]), dt)
        for q_pos, q, do, o, lse, seg_q in query_chunks():
            heads = q.shape[1]
            group = heads // kv_heads
            lse_use = np.where(np.isneginf(lse), np.inf, lse).astype(dt)
            for h in range(heads):
                g = h // group
                qb, dob = q[:, h, :].astype(dt), do[:, h, :].astype(dt)
                s, t = scores(qb, kg[g], q_pos, cols, seg_q, seg_kv, h)
                p = np.exp(s - lse_use[h][:, None]).astype(dt)
                drop = self._dropout(batch_index, h, q_pos, cols)
                pz = p if drop is None else (p * drop).astype(dt)
                dv[g] = (dv[g] + _mm(pz.T, dob, dt)).astype(dt)
                dp = _mm(dob, vg[g].T, dt)
                if drop is not None:
                    dp = (dp * drop).astype(dt)
                dvec = (dob * o[:, h, :].astype(dt)).sum(axis=-1).astype(dt)
                ds = (p * (dp - dvec[:, None])).astype(dt)
                if t is not None:
                    ds = (ds * (1 - t * t)).astype(dt)
                dk[g] = (dk[g] + _mm(ds.T, qb, dt)).astype(dt)
        return {"dk": (dk * dt.type(self.scale)).astype(dt).transpose(1, 0, 2), "dv": dv.transpose(1, 0, 2)}


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


