"""The sequential recurrences of the linear-attention layers, token by token, in torch (float64):
the reference that the chunked and distributed forms are tested against (autograd gives its
gradients; ``tests/unit/test_linear_recurrence.py`` checks it with ``torch.autograd.gradcheck``).

Shapes as flash-linear-attention: ``q, k (B, T, H, K)``, ``v (B, T, HV, V)``, ``g, beta (B, T, HV)``
(``g (B, T, HV, K)``: a decay per key, KDA and GLA),
states ``(B or N_docs, HV, K, V)``; with ``cu_seqlens`` (B = 1) each document starts from its own
initial state (zero when None) and ends in its own final state.
"""

import contextlib

import torch


def recurrence(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, delta=True):
    """``(o, final_state)``: ``S_t = (I - beta_t k_t k_t^T) D_t S_{t-1} + beta_t k_t v_t^T``
    (``delta``), else ``S_t = D_t S_{t-1} + k_t v_t^T``, ``D_t = exp(g_t)`` (a diagonal for a
    per-key ``g``); ``o_t = S_t^T (scale q_t)``."""
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    group = hv // h
    q = q.repeat_interleave(group, dim=2) * scale
    k = k.repeat_interleave(group, dim=2)
    bounds = [0, t] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    rows = b if cu_seqlens is None else len(bounds) - 1
    outs, finals = [], []
    for d in range(len(bounds) - 1):
        lo, hi = bounds[d], bounds[d + 1]
        sl = slice(None) if cu_seqlens is None else slice(d, d + 1)
        nb = b if cu_seqlens is None else 1
        s = (q.new_zeros(nb, hv, kd, vd) if initial_state is None else initial_state[sl])
        for i in range(lo, hi):
            kt, vt, qt = k[:, i], v[:, i], q[:, i]           # (nb, hv, K), (nb, hv, V)
            s = s * (torch.exp(g[:, i])[..., :, None] if g.dim() == 4 else torch.exp(g[:, i])[..., None, None])
            if delta:
                pred = torch.einsum("bhkv,bhk->bhv", s, kt)
                upd = (vt - pred) * beta[:, i][..., None]
            else:
                upd = vt
            s = s + torch.einsum("bhk,bhv->bhkv", kt, upd)
            outs.append(torch.einsum("bhkv,bhk->bhv", s, qt))
        finals.append(s)
    o = torch.stack(outs, dim=1) if outs else q.new_zeros(b, 0, hv, vd)
    final = finals[0] if cu_seqlens is None else torch.cat(finals, dim=0)
    assert rows == final.shape[0]
    return o, final


@contextlib.contextmanager
def float64_delta_rule():
    """transformers' chunked gated delta rule (Qwen3-Next's) computes in float32 whatever the dtype;
    inside this context a float64 reference model runs :func:`recurrence` in float64 instead."""
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    def rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **_):
        if query.dtype != torch.float64:
            return real(query, key, value, g=g, beta=beta, initial_state=initial_state,
                        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        if use_qk_l2norm_in_kernel:
            query, key = (qwen3_next.l2norm(x, dim=-1, eps=1e-6) for x in (query, key))
        o, final = recurrence(query, key, value, g.to(query.dtype), beta, query.shape[-1] ** -0.5, initial_state)
        return o, final if output_final_state else None
    real = qwen3_next.torch_chunk_gated_delta_rule
    qwen3_next.torch_chunk_gated_delta_rule = rule
    try:
        yield
    finally:
        qwen3_next.torch_chunk_gated_delta_rule = real
