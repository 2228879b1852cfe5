"""Which Hugging Face models a sharded forward computes exactly: the check before it, and the adaptations.

``ringmpi.transformers`` shards the attention and nothing else.  Whatever else in
a model depends on the whole sequence would run on this rank's shard as if it
were the whole sequence and give a silently wrong answer, so every sharded
forward passes through :func:`sharded_call` first:

* **The check, before any compute.**  :func:`model_problem` reads the model
  (its config's ``layer_types`` and the modules actually present) and names what
  ringmpi does not shard: a sequence mixer other than attention (state-space
  and Mamba mixers, linear attention and gated delta rules, convolutions along
  the sequence, token shift, recurrences), a layer type other than full or
  sliding attention (chunked, indexed, compressed attention, hybrids), an
  attention module that computes its scores itself instead of through
  transformers' attention interface or folds its own ALiBi into a mask (MPT,
  Falcon with ``alibi``, and the like; ringmpi never sees those), a model with no
  attention at all, a model that computes its own loss when given labels (its
  ``out.loss`` would be a per-shard mean), and a model whose attention is HF's own.  The verdict is a function of the
  model, the same on every rank, agreed with one allgather the first time a
  model meets a communicator; a refused model raises one ConfigError on every
  rank, naming the module and what to do, before the embedding runs.
* **Where it hooks in.**  ``ringmpi.transformers.register()`` wraps
  ``transformers.PreTrainedModel.__call__`` (once, process-wide): a call that
  carries ``ringmpi_context`` (what ``shard_batch`` adds) runs the check, then the
  forward with that context *active* (a context variable), so even a plain
  ``model(**shard)`` is checked, and a call without it is untouched.  An
  attention whose model drops the keyword arguments on their way down
  (StableLM, Falcon) finds the active context instead.
* **Adaptations**, installed on the model by the check:

  - *Bloom's attention*, which computes its scores itself with an ALiBi bias of
    local key positions, runs through the attention interface with
    ``alibi_slopes``: ringmpi's ALiBi in global positions, the same softmax under
    the causal mask.

  - *The Gated DeltaNet layers* of Qwen3-Next, Qwen3.5, Qwen3.5-MoE and Qwen4-Exp, and
    *Kimi Linear's KDA layers* (a decay per key: ``ringmpi.kda``) (``linear_attention`` in their
    ``layer_types``) run sharded: the short causal convolution with its halo from
    the previous rank (``ringmpi.torch_linear.causal_conv1d``) and the gated delta
    rule through ringmpi's state scan (``ringmpi.torch_linear.gated_delta_rule``), on
    contiguous shards; under the zigzag and balanced layouts the layer's input and
    output move to contiguous shards and back (``ringmpi.torch_linear.relayout``, one
    Alltoallv each way).  Packed documents and padding (the context's segment ids) of one row
    (several rows under ``layout="balanced"`` are one) are the rule's and the convolution's
    ``cu_seqlens``: each document its own state; padded rows otherwise are refused by name
    before compute, and so is a recurrent-state cache.
  - *Rotary embeddings whose frequencies depend on the sequence length* (HF's
    ``dynamic_rope_update``: dynamic NTK, LongRoPE, any rope type it
    recomputes): the frequencies are computed from the global largest position
    (agreed across the ranks with the position check), then the rotation of this
    rank's positions, for every layout and explicit positions.
  - *Router auxiliary losses* (a module's ``load_balancing_loss_func``: per-expert
    token fractions times mean router probabilities, not a sum over tokens): the
    router logits of every rank are gathered, the model's own function runs on the
    whole sequence, and this rank keeps ``L - (P - 1)/P * L.detach()``: the shares
    sum over the ranks to one process's loss and each rank's gradient flows through
    its own tokens' logits, as one process's does.

Importing this module imports torch and transformers.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import re
import sys
import weakref
from typing import Optional

import torch
import transformers
from transformers import modeling_rope_utils

from .context import RingContext
from .runtime.errors import ConfigError, agree
from .runtime.watchdog import phase

CONTEXT_KEY = "ringmpi_context"
NAME = "ringmpi"

# the ShardContext of the sharded forward running now (None outside one)
ACTIVE: contextvars.ContextVar = contextvars.ContextVar("ringmpi_active_context", default=None)

# config layer types the integration runs exactly: attention it shards, layers that mix no tokens
SHARDED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "moe", "mlp", "sparse", "dense"})
# modules that mix tokens along the sequence outside attention, by class name
_MIXER = re.compile(r"mamba|mixer|ssm|deltanet|delta_?attention|linear_?attention|lightning|rwkv|lstm|recurrent"
                    r"|rglru|retention|short_?conv|time_?mix|token_?shift|time_?shift", re.I)
_ATTENTION = re.compile(r"attention|attn|mla$", re.I)
_NOT_A_MIXER = re.compile(r"norm|embedding|rotary|mlp$|feedforward$|experts?$|gate$|router$", re.I)

_verdicts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (key, problem)


@functools.lru_cache(maxsize=None)
def _dispatches(cls) -> bool:
    """Does ``cls.forward`` compute its attention through transformers' attention interface?"""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source


def _layer_types(config) -> list:
    """``layer_types`` of the model's (text) config, or []."""
    for cfg in (config, getattr(config, "get_text_config", lambda: None)()):
        types = getattr(cfg, "layer_types", None) if cfg is not None else None
        if isinstance(types, (list, tuple)):
            return list(types)
    return []


def _module_names(found: list, limit: int = 3) -> str:
    shown = ", ".join(f"{name} ({cls})" for name, cls in found[:limit])
    return shown + (f" and {len(found) - limit} more" if len(found) > limit else "")


def _own_alibi(config) -> Optional[str]:
    """The config field that turns on a model's own ALiBi, or None."""
    for name, cfg in (("config", config), ("config.attn_config", getattr(config, "attn_config", None))):
        if cfg is None:
            continue
        for field in ("alibi", "use_alibi"):
            value = cfg.get(field) if isinstance(cfg, dict) else getattr(cfg, field, None)
            if value is True:
                return f"{name}.{field}"
        if getattr(cfg, "position_embedding_type", None) == "alibi":
            return f"{name}.position_embedding_type"
    return None


def model_problem(model: torch.nn.Module) -> Optional[str]:
    """Why a sharded forward of ``model`` would not compute what one process computes, or None.

    A pure function of the model (its config and modules): the same on every rank."""
    arch = type(model).__name__
    handled = _adapted_layer_types(model)
    odd = sorted({t for t in _layer_types(model.config) if t not in SHARDED_LAYER_TYPES | handled})
    if odd:
        layers = [i for i, t in enumerate(_layer_types(model.config)) if t in odd]
        return (f"{arch} has {'/'.join(odd)} layers (layers {layers[:6]}{' ...' if len(layers) > 6 else ''} of "
                "config.layer_types), which mix tokens along the sequence in a way ringmpi does not shard (it "
                "shards full and sliding-window softmax attention only): run this model on one process, or "
                "without those layers")
    alibi = _own_alibi(model.config)
    if alibi:
        return (f"{arch} adds its own ALiBi position bias ({alibi}), built from each shard's local positions and "
                "not handed to ringmpi's ALiBi: run it on one process")
    convs, mixers, own, dispatching, adapted = [], [], [], [], []
    for name, module in model.named_modules():
        cls = type(module)
        if any(name.startswith(prefix) for prefix in adapted):  # inside a module ringmpi runs sharded
            continue
        if _adapter(cls) is not None:
            adapted.append(name + ".")
        if _dispatches(cls) or _adapter(cls) is not None:
            dispatching.append(name)
            continue
        if isinstance(module, torch.nn.Conv1d) and module.kernel_size[0] > 1:
            convs.append((name, f"Conv1d, kernel {module.kernel_size[0]}"))
        elif isinstance(module, transformers.PreTrainedModel) or _NOT_A_MIXER.search(cls.__name__):
            continue
        elif _MIXER.search(cls.__name__):
            mixers.append((name, cls.__name__))
        elif _ATTENTION.search(cls.__name__) and not any(
                _dispatches(type(m)) for m in module.modules()):
            own.append((name, cls.__name__))
    if mixers or convs:
        kind = "state-space / linear-attention / recurrent" if mixers else "convolution along the sequence"
        return (f"{arch} contains a {kind} sequence mixer that ringmpi does not shard: "
                f"{_module_names(mixers + convs)}; it would run on each rank's shard as if it were the whole "
                "sequence. ringmpi shards softmax attention only: run this model on one process")
    if own:
        return (f"{arch}'s attention {_module_names(own)} computes its scores itself (its own position bias or "
                "mask, e.g. ALiBi) instead of through transformers' attention interface, so ringmpi never sees "
                "it: this architecture cannot run sharded; run it on one process")
    if not dispatching:
        return (f"{arch} has no attention layer that calls transformers' attention interface, so there is "
                "nothing for ringmpi to shard and its sequence mixing would run per shard: run it on one process")
    impl = getattr(model.config, "_attn_implementation", None)
    function = transformers.AttentionInterface._global_mapping.get(impl) if isinstance(impl, str) else None
    if function is None or getattr(function, "__module__", "").startswith("transformers"):  # HF's own (or eager)
        return (f"{arch} got a ringmpi_context but its attention is {impl!r}: build it with "
                f"attn_implementation='{NAME}' (after ringmpi.transformers.register())")
    return None


@functools.lru_cache(maxsize=None)
def _uses_loss_function(cls) -> bool:
    """Does ``cls.forward`` compute its loss with transformers' ``self.loss_function``?"""
    try:
        return "self.loss_function(" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def check(model: torch.nn.Module, comm) -> None:
    """Collective the first time ``model`` meets ``comm``: one ConfigError on every rank when
    :func:`model_problem` finds one; else install the adaptations (idempotent)."""
    key = (id(comm), getattr(model.config, "_attn_implementation", None))
    seen = _verdicts.get(model)
    if seen is not None and seen[0] == key:
        problem = seen[1]
        if problem is not None:
            raise ConfigError(problem)
        return
    problem = model_problem(model)
    _verdicts[model] = (key, problem)
    agree(comm, problem)
    _adapt_attention(model)
    _adapt_rotary(model)
    _adapt_router_losses(model)


def sharded_call(call, model, args, kwargs):
    """``call(model, *args, **kwargs)`` for a model call carrying a ringmpi_context: checked first
    (:func:`check`, ``position_ids`` too), then run with the context active."""
    ctx = kwargs.get(CONTEXT_KEY)
    if ctx is None or ACTIVE.get() is not None:  # not sharded, or an inner model of a sharded forward
        return call(model, *args, **kwargs)
    check(model, ctx.comm)
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing and model.training and any(
            _adapter(type(m)) is not None for m in model.modules()):  # the same on every rank
        raise ConfigError(f"{type(model).__name__} with gradient checkpointing would recompute its adapted "
                          "attention in the backward, outside the sharded forward: turn gradient checkpointing off")
    if kwargs.get("labels") is not None and not _uses_loss_function(type(model)):  # the same on every rank
        raise ConfigError(f"{type(model).__name__} computes its loss itself, not with transformers' "
                          "loss_function (which takes shard_batch's num_items_in_batch and shift_labels), so its "
                          "out.loss would be a per-shard mean: drop labels and compute the loss from out.logits "
                          "and shard['shift_labels'] / shard['num_items_in_batch']")
    if ctx.segment_ids is not None and ctx.batch_shape[0] > 1:  # from the global batch: alike on every rank
        linear = _linear_modules(model)
        if linear:
            raise ConfigError(f"{type(model).__name__}'s {_module_names(linear)} take packed documents and "
                              "padding in one row only (a row's documents are their cu_seqlens): with several "
                              "rows use layout='balanced' (which packs the rows into one), or one row per call")
    ctx.check_positions(kwargs.get("position_ids"))
    token = ACTIVE.set(ctx)
    try:
        return call(model, *args, **kwargs)
    finally:
        ACTIVE.reset(token)


# ---- attention modules that compute their scores themselves, mapped onto ringmpi's

def _adapter(cls):
    """The sharded forward of an attention class that computes its own scores, or None."""
    return _ADAPTERS.get(_qualname(cls))


def _adapt_attention(model) -> None:
    for module in model.modules():
        adapter = _adapter(type(module))
        if adapter is not None and "forward" not in module.__dict__:
            module.forward = adapter(module, model.config, module.forward)


def _bloom_attention(module, config, original):
    """Bloom's attention through the attention interface, its ALiBi as ringmpi's in global positions.

    Bloom scores ``inv_norm_factor * q.k + beta * slope_h * j`` (key position ``j``); under the causal
    mask that is, row by row, ``-beta * slope_h * (i - j)`` plus a constant, which softmax drops:
    ringmpi's ALiBi with slopes ``beta * slopes``."""
    from transformers.models.bloom import modeling_bloom as bloom

    def forward(hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        if ACTIVE.get() is None:
            return original(hidden_states, residual, alibi, attention_mask, layer_past, use_cache,
                            output_attentions, **kwargs)
        batch, length, _ = hidden_states.shape
        query, key, value = module._reshape(module.query_key_value(hidden_states))
        slopes = bloom._get_alibi_slopes(module.num_heads, hidden_states.device) * module.beta
        attend = transformers.AttentionInterface._global_mapping[config._attn_implementation]
        out, _ = attend(module, query, key, value, None,
                        dropout=module.attention_dropout.p if module.training else 0.0,
                        scaling=module.inv_norm_factor, is_causal=True, alibi_slopes=slopes.float())
        context = out.reshape(batch, length, module.num_heads * module.head_dim)
        if module.pretraining_tp > 1 and module.slow_but_exact:
            slices = module.hidden_size / module.pretraining_tp
            output = torch.zeros_like(context)
            for i in range(module.pretraining_tp):
                cut = slice(int(i * slices), int((i + 1) * slices))
                output = output + torch.nn.functional.linear(context[:, :, cut], module.dense.weight[:, cut])
        else:
            output = module.dense(context)
        return bloom.dropout_add(output, residual, module.hidden_dropout, module.training), None
    return forward


def _contiguous_mixer(module, family, mix, original):
    """The forward of an adapted recurrent mixer: ``mix(hidden, comm, cu_seqlens)`` on contiguous
    shards (other layouts move the layer's input there and its output back, one Alltoallv each
    way), the padding mask applied first as the layer does (``family.apply_mask_to_padding_states``),
    the row's documents and padding runs as ``cu_seqlens`` (global positions, each its own state
    and convolution: ``ShardContext.document_bounds``); the layer's own forward outside a sharded
    call, and a recurrent-state cache refused."""
    from . import torch_linear
    from .core.layout import Layout

    def forward(hidden_states, cache=None, attention_mask=None, **kwargs):
        ctx = ACTIVE.get()
        if ctx is None:
            return original(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        cache = kwargs.pop("cache_params", cache)
        if cache is not None:  # alike on every rank (the call's arguments)
            raise ConfigError(f"{type(module).__name__} (layer {module.layer_idx}) runs sharded without a cache "
                              "(shard_batch sets use_cache=False): do not pass a cache to a sharded forward")
        hidden_states = family.apply_mask_to_padding_states(hidden_states, attention_mask)
        bounds = ctx.document_bounds()
        if ctx.layout.kind == "contiguous":
            return mix(hidden_states, ctx.comm, bounds)
        contiguous = Layout("contiguous", ctx.layout.n, ctx.layout.world_size)
        hidden = torch_linear.relayout(hidden_states, ctx.layout, contiguous, context=ctx.ring)
        return torch_linear.relayout(mix(hidden, ctx.comm, bounds), contiguous, ctx.layout, context=ctx.ring)
    return forward


def _interleaved_projections(module, hidden):
    """Qwen3-Next's projections: q, k, v, z interleaved per key head in one, b and a in another
    (the layer's own ``fix_query_key_value_ordering`` takes them apart); q|k|v before the
    convolution as ``(B, T, 2 key_dim + value_dim)``, ``z (B, T, HV, d_v)``, ``b, a (B, T, HV)``."""
    q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden), module.in_proj_ba(hidden))
    return torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (q, k, v)], dim=-1), z, b, a


def _split_projections(module, hidden):
    """Qwen3.5's (and its MoE's, Qwen4-Exp's) projections: q|k|v, z, b and a each their own, the
    same four tensors as :func:`_interleaved_projections`."""
    z = module.in_proj_z(hidden).reshape(hidden.shape[0], hidden.shape[1], -1, module.head_v_dim)
    return module.in_proj_qkv(hidden), z, module.in_proj_b(hidden), module.in_proj_a(hidden)


def _gated_deltanet(module, config, original):
    """A Gated DeltaNet layer (Qwen3-Next's, Qwen3.5's) on this rank's shard: its convolution with
    the previous rank's halo and its gated delta rule from the state the earlier ranks' shards
    leave (ringmpi's scan), on contiguous shards (other layouts move the layer's input and output
    there and back).

    The same computation as the layer's own forward: projections (the model's own split,
    :data:`_GDN_PROJECTIONS`), the causal convolution (SiLU), q and k L2-normalised (the kernel's
    ``use_qk_l2norm_in_kernel``), the decay ``g = -exp(A_log) softplus(a + dt_bias)`` in float32
    as the layer computes it, ``beta = sigmoid(b)``, the rule with scale ``1/sqrt(d_k)``, the
    gated RMSNorm and the output projection."""
    import sys

    from . import torch_linear

    family = sys.modules[type(module).__module__]  # the model's own l2norm and padding mask
    projections = _GDN_PROJECTIONS[_qualname(type(module))]

    def mix(hidden, comm, cu_seqlens):
        mixed, z, b, a = projections(module, hidden)
        mixed = torch_linear.causal_conv1d(mixed, module.conv1d.weight[:, 0, :], module.conv1d.bias,
                                           activation=module.activation, cu_seqlens=cu_seqlens,
                                           context=RingContext(comm))
        q, k, v = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
        q, k = (family.l2norm(x.reshape(x.shape[0], x.shape[1], -1, module.head_k_dim), dim=-1, eps=1e-6)
                for x in (q, k))
        v = v.reshape(v.shape[0], v.shape[1], -1, module.head_v_dim)
        g = -module.A_log.float().exp() * torch.nn.functional.softplus(a.float() + module.dt_bias)
        o, _ = torch_linear.gated_delta_rule(q, k, v, g.to(hidden.dtype), b.sigmoid(), cu_seqlens=cu_seqlens,
                                             context=RingContext(comm))
        o = module.norm(o.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
        return module.out_proj(o.reshape(hidden.shape[0], hidden.shape[1], -1))

    return _contiguous_mixer(module, family, mix, original)


def _kimi_delta_attention(module, config, original):
    """Kimi Linear's KDA layer on this rank's shard, as :func:`_gated_deltanet` runs a Gated
    DeltaNet: q, k, v projected apart and convolved together (the previous rank's halo), q and k
    L2-normalised, the per-key log decay of the layer's forget gate (float32, as the layer makes
    it) and ``beta = sigmoid(b)`` into ringmpi's KDA on the state scan (scale ``1/sqrt(d)``),
    then the sigmoid-gated RMSNorm and the output projection."""
    import sys

    from . import torch_linear

    family = sys.modules[type(module).__module__]  # the model's own l2norm and padding mask

    def mix(hidden, comm, cu_seqlens):
        shape = (hidden.shape[0], hidden.shape[1], -1, module.head_dim)
        mixed = torch.cat([module.q_proj(hidden), module.k_proj(hidden), module.v_proj(hidden)], dim=-1)
        mixed = torch_linear.causal_conv1d(mixed, module.conv1d.weight[:, 0, :], module.conv1d.bias,
                                           activation=module.activation, cu_seqlens=cu_seqlens,
                                           context=RingContext(comm))
        q, k, v = (x.reshape(shape) for x in torch.split(mixed, [module.qkv_dim] * 3, dim=-1))
        q, k = (family.l2norm(x, dim=-1, eps=1e-6) for x in (q, k))
        g = module.forget_gate(hidden)  # (B, T, H, d): a log decay per key
        beta = torch.sigmoid(module.b_proj(hidden))
        o, _ = torch_linear.gated_delta_rule(q, k, v, g.to(hidden.dtype), beta, cu_seqlens=cu_seqlens,
                                             context=RingContext(comm))
        gate = module.g_b_proj(module.g_a_proj(hidden)).reshape(shape)
        return module.o_proj(module.o_norm(o, gate).reshape(hidden.shape[0], hidden.shape[1], -1))

    return _contiguous_mixer(module, family, mix, original)


# the Gated DeltaNet layers ringmpi runs sharded, each with its model's projections
_GDN_PROJECTIONS = {
    "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet": _interleaved_projections,
    "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet": _split_projections,
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet": _split_projections,
    "transformers.models.qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextGatedDeltaNet": _split_projections,
}
# the Kimi Delta Attention layers ringmpi runs sharded
_KDA_LAYERS = ("transformers.models.kimi_linear.modeling_kimi_linear.KimiLinearDeltaAttention",)
_ADAPTERS = {"transformers.models.bloom.modeling_bloom.BloomAttention": _bloom_attention,
             **{name: _gated_deltanet for name in _GDN_PROJECTIONS},
             **{name: _kimi_delta_attention for name in _KDA_LAYERS}}
# the config layer type each adapted sequence mixer runs sharded (attention adapters: none)
_ADAPTED_LAYER_TYPES = {name: "linear_attention" for name in (*_GDN_PROJECTIONS, *_KDA_LAYERS)}


def _qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _adapted_layer_types(model) -> frozenset:
    """The config layer types whose mixers in ``model`` ringmpi runs sharded."""
    return frozenset(_ADAPTED_LAYER_TYPES[_qualname(type(m))] for m in model.modules()
                     if _qualname(type(m)) in _ADAPTED_LAYER_TYPES)


def _linear_modules(model) -> list:
    """(name, class) of the adapted recurrent mixers in ``model``."""
    return [(name, type(m).__name__) for name, m in model.named_modules() if _qualname(type(m)) in _ADAPTED_LAYER_TYPES]


# ---- rotary embeddings whose frequencies depend on the sequence length

_DYNAMIC_ROPE_CODE = modeling_rope_utils.dynamic_rope_update(lambda self, x, position_ids: None).__code__


def _adapt_rotary(model) -> None:
    """Every rotary module whose forward is HF's ``dynamic_rope_update`` wrapper computes its
    frequencies from the global largest position during a sharded forward."""
    for module in model.modules():
        forward = type(module).__dict__.get("forward") or getattr(type(module), "forward", None)
        if getattr(forward, "__code__", None) is not _DYNAMIC_ROPE_CODE or "forward" in module.__dict__:
            continue
        module.forward = _global_length_forward(module, forward)


def _global_length_forward(module, wrapper):
    rope_forward = wrapper.__wrapped__

    def forward(x, position_ids, *args, **kwargs):
        ctx = ACTIVE.get()
        if ctx is None or ctx.position_max is None:
            return wrapper(module, x, position_ids, *args, **kwargs)
        last = torch.full((1, 1), ctx.position_max, dtype=position_ids.dtype, device=position_ids.device)
        wrapper(module, x, last, *args, **kwargs)  # the frequency update, from the whole sequence's length
        return rope_forward(module, x, position_ids, *args, **kwargs)
    return forward


# ---- router losses that are not sums over tokens

def _adapt_router_losses(model) -> None:
    """The model's modeling module's ``load_balancing_loss_func`` computes from every rank's
    router logits during a sharded forward (wrapped once per module, a no-op outside one)."""
    module = sys.modules.get(type(model).__module__)
    original = getattr(module, "load_balancing_loss_func", None)
    if original is None or getattr(original, "_ringmpi_global", False):
        return
    module.load_balancing_loss_func = _global_router_loss(original)


def _global_router_loss(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def loss(*args, **kwargs):
        ctx = ACTIVE.get()
        bound = signature.bind(*args, **kwargs)
        names = list(signature.parameters)
        gate_logits = bound.arguments.get(names[0])
        if ctx is None or not isinstance(gate_logits, (tuple, list)):
            return original(*args, **kwargs)
        bound.arguments[names[0]] = type(gate_logits)(
            _gather_tokens(g, ctx) if isinstance(g, torch.Tensor) else g for g in gate_logits)
        if "attention_mask" in signature.parameters:
            bound.arguments["attention_mask"] = ctx.global_padding_mask()
        whole = original(*bound.args, **bound.kwargs)
        if not isinstance(whole, torch.Tensor):
            return whole
        size = ctx.comm.Get_size()
        return whole - whole.detach() * ((size - 1) / size)
    loss._ringmpi_global = True
    return loss


def _gather_tokens(logits, ctx):
    """``(B * S_local, E)`` router logits of this rank -> ``(B * N, E)``: every rank's rows, rank
    after rank (the losses are sums over tokens: order is free), this rank's still in the graph."""
    batch, local = ctx.batch_shape
    fits = logits.shape[0] == batch * local
    rows = logits.reshape(batch, local, -1) if fits else None
    with phase("transformers: every rank's router logits (allgather)"):
        parts = ctx.comm.allgather(None if rows is None else rows.detach().cpu())
    if any(p is None for p in parts):  # on every rank alike
        raise ConfigError(f"rank {parts.index(None)}'s router logits are not one row per token: ringmpi cannot make this model's router loss global; set "
                          "output_router_logits=False")
    parts[ctx.comm.Get_rank()] = rows
    whole = torch.cat([p.to(rows.device, rows.dtype) for p in parts], dim=1)
    return whole.reshape(-1, whole.shape[-1])
