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
    """transformers' chunked gated delta rule (Qwen3-Next's, and its copies in Qwen3.5, Qwen3.5-MoE
    and Qwen4-Exp) and Kimi Linear's KDA compute in float32 whatever the dtype; inside this context a float64 reference
    model runs :func:`recurrence` in float64 instead."""
    import importlib

    families = [(importlib.import_module(f"transformers.models.{name}.modeling_{name}"), rule)
                for name, rule in (("qwen3_next", "torch_chunk_gated_delta_rule"),
                                   ("qwen3_5", "torch_chunk_gated_delta_rule"),
                                   ("qwen3_5_moe", "torch_chunk_gated_delta_rule"),
                                   ("qwen4_exp", "torch_chunk_gated_delta_rule"),
                                   ("kimi_linear", "chunk_kimi_delta_attention"))]  # KDA: g per key
    reals = [getattr(family, rule) for family, rule in families]

    def rule_of(family, real):
        def rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, **_):
            if query.dtype != torch.float64:
                return real(query, key, value, g=g, beta=beta, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            if use_qk_l2norm_in_kernel:
                query, key = (family.l2norm(x, dim=-1, eps=1e-6) for x in (query, key))
            o, final = recurrence(query, key, value, g.to(query.dtype), beta, query.shape[-1] ** -0.5, initial_state)
            return o, final if output_final_state else None
        return rule

    for (family, rule), real in zip(families, reals):
        setattr(family, rule, rule_of(family, real))
    try:
        yield
    finally:
        for (family, rule), real in zip(families, reals):
            setattr(family, rule, real)


@contextlib.contextmanager
def float64_gated_norms():
    """The gated RMSNorm after transformers' Gated DeltaNet layers (Qwen3-Next's and its copies) and KDA
    computes in float32 whatever the dtype; inside this context a float64 model keeps float64 there
    (ours and the reference alike: the same module serves both)."""
    import importlib

    from transformers.activations import ACT2FN

    classes = [getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
               for module, name in (("qwen3_next", "Qwen3NextRMSNormGated"), ("qwen3_5", "Qwen3_5RMSNormGated"),
                                    ("qwen3_5_moe", "Qwen3_5MoeRMSNormGated"),
                                    ("qwen4_exp", "Qwen4ExpTextRMSNormGated"),
                                    ("kimi_linear", "KimiLinearRMSNormGated"))]
    reals = [cls.forward for cls in classes]

    def forward_of(real):
        def forward(self, x, gate=None):
            if x.dtype != torch.float64 or gate is None:
                return real(self, x, gate)
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * normed * ACT2FN[getattr(self, "activation", "silu")](gate)
        return forward

    for cls, real in zip(classes, reals):
        cls.forward = forward_of(real)
    try:
        yield
    finally:
        for cls, real in zip(classes, reals):
            cls.forward = real
