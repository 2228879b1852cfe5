"""The chunked recurrence of a linear-attention layer over one run of tokens: a chunk is an affine map.

Per head the state ``S`` (``K x V``) follows ``S_t = A_t S_{t-1} + b_t k_t w_t^T`` and the output
is ``o_t = S_t^T q_t``, with

* the gated delta rule (``delta=True``): ``A_t = a_t (I - beta_t k_t k_t^T)``, ``w_t = v_t``,
  ``b_t = beta_t`` (flash-linear-attention's ``chunk_gated_delta_rule``);
* scalar decay (``delta=False``; Mamba-2 / RetNet / simple GLA, plain linear attention when
  ``g = 0``): ``A_t = a_t I``, ``b_t = 1``;

``a_t = exp(g_t)``, ``g`` the log decay.  A run of ``T`` tokens is cut in chunks of
:data:`CHUNK`; inside a chunk everything is dense products (BLAS), and the chunk as a whole
is an affine map of its entering state ``S``::

    o     = Qt S + A Wv          (C x V)       Qt: the queries as they see S
    S_end = Mc S + Kt^T Wv       (K x V)       Mc: K x K (delta rule) or the scalar gC

with ``A = tril(q k^T o Gamma)``, ``Gamma_ij = exp(c_i - c_j)``, ``c = cumsum(g)``; for the
delta rule the UT transform ``(I + L) [Wv | Kc] = [beta v | beta k exp(c)]``,
``L = strict_tril(beta k k^T o Gamma)``, ``Qt = q exp(c) - A Kc``, ``Mc = gC I - Kt^T Kc``,
``Kt = k exp(c_C - c)``, ``gC = exp(c_C)`` (transformers' ``torch_chunk_gated_delta_rule``
computes the same pieces).  The chunks are then composed in order, one ``K x K`` product
each; the ranks compose their runs' maps the same way (``core/state_maps.py``,
``parallel/state_scan.py``).  :func:`run_forward` can also carry the run's own map along
(``track_map``): beside the states it composes the chunks' maps from ``M_0 = I``, giving the
run's map ``M`` and each chunk's entering map, so that once the run's true entering state
``S_in`` is known the chunks' entering states follow (:func:`entered`) and the outputs are
made from them once (:func:`outputs_of`).  :func:`run_backward` is the reverse-mode of the same
steps; :func:`state_grads` alone is its reverse recursion over the chunks, which with a zero
end-state gradient gives what a run's outputs ask of its entering state (``c_r``, the reverse
scan's offset), before that scan.  Work is ``O(T (C d + d^2))`` per head.

Arrays are head-major: ``q, k (B, H, T, K)`` (q already scaled), ``v (B, H, T, V)``,
``g, beta (B, H, T)``, states ``(B, H, K, V)``; float32 or float64 throughout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .host import array_module
from .state_maps import apply_m

CHUNK = 64


def _t(x):
    return x.swapaxes(-1, -2)


def _chunked(x, n: int):
    """``(B, H, T, ...) -> (B, H, n, CHUNK, ...)``, zero-padded at the end (a padded token has
    ``k = v = q = 0`` and ``g = 0``: it changes nothing)."""
    pad = n * CHUNK - x.shape[2]
    if pad:
        xp = array_module(x)
        x = xp.concatenate([x, xp.zeros(x.shape[:2] + (pad,) + x.shape[3:], x.dtype)], axis=2)
    return x.reshape(x.shape[:2] + (n, CHUNK) + x.shape[3:])


def _unchunked(x, t: int):
    return x.reshape(x.shape[:2] + (-1,) + x.shape[4:])[:, :, :t]


@dataclass
class Chunks:
    """The per-chunk pieces of one run, batched over ``(B, H, n)``."""

    t: int
    delta: bool
    q: np.ndarray      # (B, H, n, C, K)
    k: np.ndarray
    v: np.ndarray      # (B, H, n, C, V)
    beta: Optional[np.ndarray]  # (B, H, n, C)
    c: np.ndarray      # cumsum of g inside each chunk
    gamma: np.ndarray  # exp(c)
    decay: Optional[np.ndarray]  # Gamma (C x C), zero above the diagonal (None per key: made where used)
    e: np.ndarray      # exp(c_C - c)
    gc: np.ndarray     # exp(c_C), (B, H, n) (or (B, H, n, K) per key)
    attn: np.ndarray   # A
    wv: np.ndarray     # Wv
    kc: Optional[np.ndarray]
    qt: np.ndarray     # Qt
    kt: np.ndarray     # Kt
    mc: np.ndarray     # (B, H, n, K, K), or gc without the delta rule
    uc: np.ndarray     # Kt^T Wv, (B, H, n, K, V)
    ut_inv: Optional[np.ndarray] = None  # (I + L)^-1 (the delta rule's UT system)

    @property
    def per_key(self) -> bool:
        return self.c.ndim == 5  # (B, H, n, C, K)

    @property
    def n(self) -> int:
        return self.q.shape[2]


def _per_token(x, per_key: bool):
    """A per-token factor ``(..., C)`` or per-key one ``(..., C, K)`` ready to scale ``(..., C, K)``."""
    return x if per_key else x[..., None]


def _keys_summed(x, per_key: bool):
    """What reaches a per-token decay from ``(..., C, K)``: the sum over keys, or each key's own."""
    return x if per_key else x.sum(axis=-1)


def _decay(c, axis: int):
    """``Gamma_ij = exp(c_i - c_j)`` below and on the diagonal, 0 above, of the log decays ``c``
    summed within a chunk, its tokens on ``axis``: ``(..., C, C)`` from a per-token ``c (..., C)``
    (``axis=-1``), ``(..., C, C, K)`` from a per-key ``c (..., C, K)`` (``axis=-2``, each key its own)."""
    xp = array_module(c)
    lower = xp.tril(xp.ones((CHUNK, CHUNK), dtype=bool)).reshape((CHUNK, CHUNK) + (1,) * (-1 - axis))
    with np.errstate(invalid="ignore"):  # NumPy's flags only; harmless around CuPy work
        return xp.exp(xp.where(lower, xp.expand_dims(c, axis) - xp.expand_dims(c, axis - 1), -np.inf))


def unit_lower_inverse(t):
    """``(I + L)^-1`` of unit lower-triangular ``t`` ``(..., C, C)``, by
    doubling diagonal blocks: ``[[A, 0], [X, B]]^-1 = [[A^-1, 0], [-B^-1 X A^-1, B^-1]]``.  Every
    step is a batched product (BLAS), against a LAPACK solve per chunk: 7x faster at ``C = 64``
    (float32), and the inverse serves the forward's system and the backward's transposed one."""
    xp = array_module(t)
    m = t.shape[-1]
    inv = xp.zeros_like(t)
    diag = xp.arange(m)
    inv[..., diag, diag] = 1
    s = 1
    while s < m:
        for o in range(0, m, 2 * s):
            lo, hi = slice(o, o + s), slice(o + s, o + 2 * s)
            inv[..., hi, lo] = -(inv[..., hi, hi] @ (t[..., hi, lo] @ inv[..., lo, lo]))
        s *= 2
    return inv


def decayed(x, y, p: "Chunks"):
    """``M_ij = sum_d x_id y_jd Gamma_ijd``, zero above the diagonal: ``(x y^T) o Gamma`` for a
    per-token decay, each key's own for a per-key one (``Gamma (C, C, K)`` made one chunk at a
    time, so a run never holds ``T C K`` numbers)."""
    if not p.per_key:
        return (x @ _t(y)) * p.decay
    xp = array_module(x)
    out = xp.empty(x.shape[:-1] + (CHUNK,), x.dtype)
    for i in range(x.shape[2]):
        out[:, :, i] = xp.einsum("...id,...jd,...ijd->...ij", x[:, :, i], y[:, :, i], _decay(p.c[:, :, i], axis=-2))
    return out


def decayed_grads(dm, x, y, p: "Chunks"):
    """``(dx, dy)`` of :func:`decayed` given ``dm``.  What reaches the log decays ``c`` is
    ``x o dx - y o dy`` (summed over keys for a per-token decay): ``Gamma_ij = exp(c_i - c_j)``."""
    if not p.per_key:
        through = dm * p.decay
        return through @ y, _t(through) @ x
    xp = array_module(x)
    dx, dy = xp.empty_like(x), xp.empty_like(y)
    for i in range(x.shape[2]):
        decay = _decay(p.c[:, :, i], axis=-2)
        dx[:, :, i] = xp.einsum("...ij,...jd,...ijd->...id", dm[:, :, i], y[:, :, i], decay)
        dy[:, :, i] = xp.einsum("...ij,...id,...ijd->...jd", dm[:, :, i], x[:, :, i], decay)
    return dx, dy


def chunks(q, k, v, g, beta, delta: bool) -> Chunks:
    """The chunk pieces of a run of ``T >= 1`` tokens (module docstring).  ``g`` is a log decay
    per token ``(B, H, T)`` or per token and key ``(B, H, T, K)`` (KDA, GLA: ``Gamma`` and
    everything made of it then has one entry per key)."""
    xp = array_module(q)
    t = q.shape[2]
    n = -(-t // CHUNK)
    per_key = g.ndim == 4
    tok = -2 if per_key else -1
    qc, kc_, vc, gcum = _chunked(q, n), _chunked(k, n), _chunked(v, n), xp.cumsum(_chunked(g, n), axis=tok)
    gamma = xp.exp(gcum)
    decay = None if per_key else _decay(gcum, axis=tok)  # a per-key Gamma is made chunk by chunk where it is used
    last = gcum[..., -1:, :] if per_key else gcum[..., -1:]
    e = xp.exp(last - gcum)
    gc = gamma[..., -1, :] if per_key else gamma[..., -1]
    p = Chunks(t=t, delta=delta, q=qc, k=kc_, v=vc, beta=None, c=gcum, gamma=gamma, decay=decay, e=e, gc=gc,
               attn=None, wv=vc, kc=None, qt=None, kt=kc_ * _per_token(e, per_key), mc=gc, uc=None)
    p.attn = decayed(qc, kc_, p)
    if delta:
        bc = p.beta = _chunked(beta, n)
        kb = kc_ * bc[..., None]
        eye = xp.eye(CHUNK, dtype=q.dtype)
        p.ut_inv = unit_lower_inverse(decayed(kb, kc_, p) * (1 - eye) + eye)  # (I + L)^-1
        r = p.ut_inv @ xp.concatenate([vc * bc[..., None], kb * _per_token(gamma, per_key)], axis=-1)
        p.wv, p.kc = r[..., :v.shape[-1]], r[..., v.shape[-1]:]
        p.qt = qc * _per_token(gamma, per_key) - p.attn @ p.kc
        diag = gc[..., :, None] if per_key else gc[..., None, None]
        p.mc = diag * xp.eye(q.shape[-1], dtype=q.dtype) - _t(p.kt) @ p.kc
    else:
        p.qt = qc * _per_token(gamma, per_key)
    p.uc = _t(p.kt) @ p.wv
    return p


@dataclass
class Forward:
    """A run's outputs from its entering state ``s0``; ``states`` are the chunks' entering
    states (what :func:`run_backward` needs).  With ``track_map``: ``m``, the run's map
    (``(B, H, K, K)`` for the delta rule, ``(B, H)`` for scalar decay, ``(B, H, K)`` per key),
    and ``states_m`` the map part of the chunks' entering states (``(B, H, n, K, K)``,
    ``(B, H, n)`` or ``(B, H, n, K)``)."""

    o: Optional[np.ndarray]
    s_end: np.ndarray
    states: np.ndarray
    m: Optional[np.ndarray] = None
    states_m: Optional[np.ndarray] = None


def _flushed(x):
    """``x`` with its entries below ``tiny / eps`` set to 0, in place.  A run's map decays
    geometrically (``exp(c_C)`` per chunk): a few thousand tokens take it to where its products
    with ``q`` and the chunk maps fall below the smallest normal number, and a subnormal result
    costs x86 many times a normal one (measured: 8x on ``Qt M`` at T = 8192, g in [-0.1, 0)).
    What is dropped is below ``2^-103`` (float32) or ``2^-970`` (float64) against the map's
    start ``I``."""
    info = np.finfo(x.dtype)
    x[array_module(x).abs(x) < info.tiny / info.eps] = 0
    return x


def within(p: Chunks):
    """The outputs' part that needs no entering state, ``A Wv`` per chunk ``(B, H, n, C, V)``:
    a run still waiting for its entering state can make it meanwhile."""
    return p.attn @ p.wv


def outputs_of(p: Chunks, states, inside=None):
    """Every token's output ``(B, H, T, V)`` from the chunks' entering states: ``Qt S + A Wv``
    (``inside``: :func:`within`, when already made)."""
    return _unchunked(p.qt @ states + (within(p) if inside is None else inside), p.t)


def run_forward(p: Chunks, s0, track_map: bool = False, outputs: bool = True) -> Forward:
    """Compose the chunk maps in order from ``s0`` ``(B, H, K, V)``; the outputs of every token
    (``o`` None without ``outputs``: the backward's recomputation needs only the states, and a
    run whose entering state is not yet known makes them after :func:`entered`)."""
    xp = array_module(s0)
    b, h, n, _, kdim = p.q.shape
    dense = p.delta
    x = s0
    states = xp.empty((b, h, n) + s0.shape[2:], dtype=s0.dtype)
    for i in range(n):
        states[:, :, i] = x
        if dense:
            x = p.mc[:, :, i] @ x
        else:
            x = (p.gc[:, :, i, :, None] if p.per_key else p.gc[:, :, i, None, None]) * x
        x += p.uc[:, :, i]
    out = Forward(o=outputs_of(p, states) if outputs else None, s_end=x, states=states)
    if track_map:
        if dense:  # the chunks' entering maps, composed apart from the states (K x K each)
            m = xp.broadcast_to(xp.eye(kdim, dtype=s0.dtype), (b, h, kdim, kdim))
            before = xp.empty((b, h, n, kdim, kdim), dtype=s0.dtype)
            for i in range(n):
                before[:, :, i] = m
                m = _flushed(p.mc[:, :, i] @ m)
            out.m, out.states_m = m, before
        else:
            ones = xp.ones((b, h, 1) + p.gc.shape[3:], s0.dtype)
            before = _flushed(xp.cumprod(xp.concatenate([ones, p.gc[:, :, :-1]], axis=2), axis=2))  # entering maps
            out.m, out.states_m = _flushed(before[:, :, -1] * p.gc[:, :, -1]), before
    return out


def entered(p: Chunks, fwd: Forward, s_in):
    """The chunks' entering states of a run tracked from a zero state (``track_map``) once its
    true entering state ``s_in`` ``(B, H, K, V)`` is known: ``states + states_m S_in``, each
    chunk's map applied as the ranks' maps are (``state_maps.apply_m``)."""
    kind = "dense" if p.delta else ("diagonal" if p.per_key else "scalar")
    return fwd.states + apply_m(kind, fwd.states_m, s_in[:, :, None])


def seen_outputs(p: Chunks, do):
    """``Qt^T do`` per chunk ``(B, H, n, K, V)``: what the outputs' gradient ``do (B, H, T, V)``
    asks of each chunk's entering state."""
    return _t(p.qt) @ _chunked(do, p.n)


def state_grads(p: Chunks, seen_do, ds_end):
    """The reverse recursion over the chunks: ``(ds_after, ds0)``, the gradients of each
    chunk's end state ``(B, H, n, K, V)`` and of the run's entering state, from ``seen_do``
    (:func:`seen_outputs`) and ``ds_end``, the gradient of the run's end state."""
    xp = array_module(seen_do)
    ds_after = xp.empty_like(seen_do)
    ds = ds_end
    for i in range(p.n - 1, -1, -1):
        ds_after[:, :, i] = ds
        if p.delta:
            ds = _t(p.mc[:, :, i]) @ ds + seen_do[:, :, i]
        else:
            ds = (p.gc[:, :, i, :, None] if p.per_key else p.gc[:, :, i, None, None]) * ds + seen_do[:, :, i]
    return ds_after, ds


@dataclass
class Grads:
    """Gradients of one run: ``dq`` (of the scaled q), ``dk``, ``dv``, ``dg``, ``dbeta``
    (None without the delta rule) in the inputs' head-major shapes, and ``ds0`` of the entering state."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dg: np.ndarray
    dbeta: Optional[np.ndarray]
    ds0: np.ndarray


def run_backward(p: Chunks, states, do, ds_end, reverse=None) -> Grads:
    """Reverse mode of :func:`run_forward` (and :func:`chunks`): ``states`` are the chunks'
    entering states of the forward that ran, ``do (B, H, T, V)``, ``ds_end`` the gradient of
    the run's end state ``(B, H, K, V)``; ``reverse`` the run's :func:`state_grads` for this
    ``ds_end`` when already made."""
    xp = array_module(do)
    n = p.n
    per_key = p.per_key
    doc = _chunked(do, n)
    ds_after, ds = state_grads(p, seen_outputs(p, do), ds_end) if reverse is None else reverse
    # o = Qt S + A Wv; S_end = Mc S + Kt^T Wv
    dqt = doc @ _t(states)
    dattn = doc @ _t(p.wv)
    dwv = _t(p.attn) @ doc + p.kt @ ds_after
    dkt = p.wv @ _t(ds_after)
    dkc = None
    if p.delta:
        dmc = ds_after @ _t(states)
        dgc = xp.diagonal(dmc, axis1=-2, axis2=-1) if per_key else xp.trace(dmc, axis1=-2, axis2=-1)
        dkt -= p.kc @ _t(dmc)                      # Mc = Diag(gC) - Kt^T Kc
        dkc = -(p.kt @ dmc)
        dattn -= dqt @ _t(p.kc)                    # Qt = q gamma - A Kc
        dkc -= _t(p.attn) @ dqt
    else:
        dgc = xp.sum(ds_after * states, axis=-1 if per_key else (-2, -1))
    gamma = _per_token(p.gamma, per_key)
    dq = dqt * gamma
    dc = _keys_summed(dqt * p.q, per_key) * p.gamma           # q gamma, gamma = exp(c)
    dk = dkt * _per_token(p.e, per_key)
    de = _keys_summed(dkt * p.k, per_key) * p.e               # Kt = k exp(c_C - c)
    dc -= de
    dc_last = de.sum(axis=-2 if per_key else -1) + dgc * p.gc
    dq_a, dk_a = decayed_grads(dattn, p.q, p.k, p)           # A = decayed(q, k)
    dq += dq_a
    dk += dk_a
    dc += _keys_summed(p.q * dq_a - p.k * dk_a, per_key)
    dbeta = None
    if p.delta:
        vdim = p.v.shape[-1]
        rhs_grad = _t(p.ut_inv) @ xp.concatenate([dwv, dkc], axis=-1)
        dl = -(rhs_grad @ _t(xp.concatenate([p.wv, p.kc], axis=-1))) * (1 - xp.eye(CHUNK, dtype=dwv.dtype))
        dvb, dkbg = rhs_grad[..., :vdim], rhs_grad[..., vdim:]
        dv = dvb * p.beta[..., None]
        dbeta = xp.sum(dvb * p.v, axis=-1)
        kb = p.k * p.beta[..., None]
        dkb = dkbg * gamma
        dc += _keys_summed(dkbg * kb, per_key) * p.gamma
        dkb_l, dk_l = decayed_grads(dl, kb, p.k, p)          # L = strict(decayed(beta k, k))
        dkb += dkb_l
        dk += dk_l
        dc += _keys_summed(kb * dkb_l - p.k * dk_l, per_key)
        dbeta += xp.sum(dkb * p.k, axis=-1)
        dk += dkb * p.beta[..., None]
    else:
        dv = dwv
    if per_key:
        dc[..., -1, :] += dc_last
    else:
        dc[..., -1] += dc_last
    tok = -2 if per_key else -1
    dg = xp.flip(xp.cumsum(xp.flip(dc, axis=tok), axis=tok), axis=tok)
    t = p.t
    return Grads(dq=_unchunked(dq, t), dk=_unchunked(dk, t), dv=_unchunked(dv, t), dg=_unchunked(dg, t),
                 dbeta=None if dbeta is None else _unchunked(dbeta, t), ds0=ds)
