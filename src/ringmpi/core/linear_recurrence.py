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
(``track_map``): the state is widened to ``[S | M]`` with ``M_0 = I``, so one pass gives the
run's map ``M`` and each token's query as it sees the entering state (``q~_t``, so that
``o_t += S_in^T q~_t`` once ``S_in`` is known).  :func:`run_backward` is the reverse-mode of
the same steps.  Work is ``O(T (C d + d^2))`` per head.

Arrays are head-major: ``q, k (B, H, T, K)`` (q already scaled), ``v (B, H, T, V)``,
``g, beta (B, H, T)``, states ``(B, H, K, V)``; float32 or float64 throughout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

CHUNK = 64


def _t(x):
    return np.swapaxes(x, -1, -2)


def _chunked(x, n: int):
    """``(B, H, T, ...) -> (B, H, n, CHUNK, ...)``, zero-padded at the end (a padded token has
    ``k = v = q = 0`` and ``g = 0``: it changes nothing)."""
    pad = n * CHUNK - x.shape[2]
    if pad:
        x = np.concatenate([x, np.zeros(x.shape[:2] + (pad,) + x.shape[3:], x.dtype)], axis=2)
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
    decay: np.ndarray  # Gamma (C x C), zero above the diagonal
    e: np.ndarray      # exp(c_C - c)
    gc: np.ndarray     # exp(c_C), (B, H, n)
    attn: np.ndarray   # A
    wv: np.ndarray     # Wv
    kc: Optional[np.ndarray]
    qt: np.ndarray     # Qt
    kt: np.ndarray     # Kt
    mc: np.ndarray     # (B, H, n, K, K), or gc for scalar decay
    uc: np.ndarray     # Kt^T Wv, (B, H, n, K, V)
    ut: Optional[np.ndarray] = None  # I + L (the delta rule's UT system)
    kbk: Optional[np.ndarray] = None  # beta k k^T

    @property
    def n(self) -> int:
        return self.q.shape[2]


def chunks(q, k, v, g, beta, delta: bool) -> Chunks:
    """The chunk pieces of a run of ``T >= 1`` tokens (module docstring)."""
    t = q.shape[2]
    n = -(-t // CHUNK)
    qc, kc_, vc, gcum = _chunked(q, n), _chunked(k, n), _chunked(v, n), np.cumsum(_chunked(g, n), axis=-1)
    lower = np.tril(np.ones((CHUNK, CHUNK), dtype=bool))
    gamma = np.exp(gcum)
    with np.errstate(invalid="ignore"):
        decay = np.exp(np.where(lower, gcum[..., :, None] - gcum[..., None, :], -np.inf))
    e = np.exp(gcum[..., -1:] - gcum)
    gc = gamma[..., -1]
    attn = (qc @ _t(kc_)) * decay
    kt = kc_ * e[..., None]
    bc = ut = kbk = kcum = None
    if delta:
        bc = _chunked(beta, n)
        kb = kc_ * bc[..., None]
        kbk = kb @ _t(kc_)
        eye = np.eye(CHUNK, dtype=q.dtype)
        ut = kbk * decay * (1 - eye) + eye
        r = np.linalg.solve(ut, np.concatenate([vc * bc[..., None], kb * gamma[..., None]], axis=-1))
        wv, kcum = r[..., :v.shape[-1]], r[..., v.shape[-1]:]
        qt = qc * gamma[..., None] - attn @ kcum
        mc = gc[..., None, None] * np.eye(q.shape[-1], dtype=q.dtype) - _t(kt) @ kcum
    else:
        wv = vc
        qt = qc * gamma[..., None]
        mc = gc
    return Chunks(t=t, delta=delta, q=qc, k=kc_, v=vc, beta=bc, c=gcum, gamma=gamma, decay=decay, e=e, gc=gc,
                  attn=attn, wv=wv, kc=kcum, qt=qt, kt=kt, mc=mc, uc=_t(kt) @ wv, ut=ut, kbk=kbk)


@dataclass
class Forward:
    """A run's outputs from its entering state ``s0``; ``states`` are the chunks' entering
    states (what :func:`run_backward` needs).  With ``track_map``: ``m``, the run's map
    (``(B, H, K, K)`` for the delta rule, ``(B, H)`` for scalar decay), and ``qs``, each
    token's query as it sees the entering state, ``(B, H, T, K)``; ``states_m`` the map
    part of the chunks' entering states (``(B, H, n, K, K)`` or ``(B, H, n)``)."""

    o: np.ndarray
    s_end: np.ndarray
    states: np.ndarray
    m: Optional[np.ndarray] = None
    qs: Optional[np.ndarray] = None
    states_m: Optional[np.ndarray] = None


def run_forward(p: Chunks, s0, track_map: bool = False) -> Forward:
    """Compose the chunk maps in order from ``s0`` ``(B, H, K, V)``; the outputs of every token."""
    b, h, n, _, kdim = p.q.shape
    vdim = s0.shape[-1]
    dense = p.delta
    width = vdim + (kdim if track_map and dense else 0)
    x = s0
    if track_map and dense:
        x = np.concatenate([s0, np.broadcast_to(np.eye(kdim, dtype=s0.dtype), (b, h, kdim, kdim))], axis=-1)
    states = np.empty((b, h, n, kdim, width), dtype=s0.dtype)
    for i in range(n):
        states[:, :, i] = x
        if dense:
            x = p.mc[:, :, i] @ x
        else:
            x = p.gc[:, :, i, None, None] * x
        x[..., :vdim] += p.uc[:, :, i]
    seen = p.qt @ states
    o = _unchunked(seen[..., :vdim] + p.attn @ p.wv, p.t)
    out = Forward(o=o, s_end=x[..., :vdim], states=states[..., :vdim])
    if track_map:
        if dense:
            out.m, out.states_m = x[..., vdim:], states[..., vdim:]
            out.qs = _unchunked(seen[..., vdim:], p.t)
        else:
            before = np.cumprod(np.concatenate([np.ones((b, h, 1), s0.dtype), p.gc[:, :, :-1]], axis=-1), axis=-1)
            out.m, out.states_m = before[..., -1] * p.gc[..., -1], before
            out.qs = _unchunked(p.qt * before[..., None, None], p.t)
    return out


@dataclass
class Grads:
    """Gradients of one run: ``dq`` (of the scaled q), ``dk``, ``dv``, ``dg``, ``dbeta``
    (None for scalar decay) in the inputs' head-major shapes, and ``ds0`` of the entering state."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dg: np.ndarray
    dbeta: Optional[np.ndarray]
    ds0: np.ndarray


def run_backward(p: Chunks, states, do, ds_end) -> Grads:
    """Reverse mode of :func:`run_forward` (and :func:`chunks`): ``states`` are the chunks'
    entering states of the forward that ran, ``do (B, H, T, V)``, ``ds_end`` the gradient of
    the run's end state ``(B, H, K, V)``."""
    n = p.n
    doc = _chunked(do, n)
    seen_do = _t(p.qt) @ doc                      # Qt^T do: what the outputs ask of each entering state
    ds_after = np.empty_like(states)
    ds = ds_end
    for i in range(n - 1, -1, -1):
        ds_after[:, :, i] = ds
        if p.delta:
            ds = _t(p.mc[:, :, i]) @ ds + seen_do[:, :, i]
        else:
            ds = p.gc[:, :, i, None, None] * ds + seen_do[:, :, i]
    # o = Qt S + A Wv; S_end = Mc S + Kt^T Wv
    dqt = doc @ _t(states)
    dattn = doc @ _t(p.wv)
    dwv = _t(p.attn) @ doc + p.kt @ ds_after
    dkt = p.wv @ _t(ds_after)
    dkc = None
    if p.delta:
        dmc = ds_after @ _t(states)
        dgc = np.trace(dmc, axis1=-2, axis2=-1)
        dkt -= p.kc @ _t(dmc)                      # Mc = gC I - Kt^T Kc
        dkc = -(p.kt @ dmc)
        dattn -= dqt @ _t(p.kc)                    # Qt = q gamma - A Kc
        dkc -= _t(p.attn) @ dqt
    else:
        dgc = np.sum(ds_after * states, axis=(-2, -1))
    dq = dqt * p.gamma[..., None]
    dgamma = np.sum(dqt * p.q, axis=-1)
    dk = dkt * p.e[..., None]
    de = np.sum(dkt * p.k, axis=-1) * p.e
    dc = -de
    dc_last = de.sum(axis=-1) + dgc * p.gc
    d_attn_decay = dattn * p.decay                 # A = (q k^T) o Gamma
    dq += d_attn_decay @ p.k
    dk += _t(d_attn_decay) @ p.q
    ddecay = dattn * (p.q @ _t(p.k))
    dbeta = None
    if p.delta:
        vdim = p.v.shape[-1]
        rhs_grad = np.linalg.solve(_t(p.ut), np.concatenate([dwv, dkc], axis=-1))
        dl = -(rhs_grad @ _t(np.concatenate([p.wv, p.kc], axis=-1)))
        dvb, dkbg = rhs_grad[..., :vdim], rhs_grad[..., vdim:]
        dv = dvb * p.beta[..., None]
        dbeta = np.sum(dvb * p.v, axis=-1)
        kb = p.k * p.beta[..., None]
        dkb = dkbg * p.gamma[..., None]
        dgamma += np.sum(dkbg * kb, axis=-1)
        strict = p.decay * (1 - np.eye(CHUNK, dtype=p.decay.dtype))
        dl_decay = dl * strict                      # L = strict(beta k k^T o Gamma)
        dkb += dl_decay @ p.k
        dk += _t(dl_decay) @ kb
        ddecay += dl * (1 - np.eye(CHUNK, dtype=dl.dtype)) * p.kbk
        dbeta += np.sum(dkb * p.k, axis=-1)
        dk += dkb * p.beta[..., None]
    else:
        dv = dwv
    dc += dgamma * p.gamma
    through = ddecay * p.decay
    dc += through.sum(axis=-1) - through.sum(axis=-2)
    dc[..., -1] += dc_last
    dg = np.flip(np.cumsum(np.flip(dc, axis=-1), axis=-1), axis=-1)
    t = p.t
    return Grads(dq=_unchunked(dq, t), dk=_unchunked(dk, t), dv=_unchunked(dv, t),
                 dg=dg.reshape(dg.shape[:2] + (-1,))[:, :, :t],
                 dbeta=None if dbeta is None else dbeta.reshape(dbeta.shape[:2] + (-1,))[:, :, :t], ds0=ds)
