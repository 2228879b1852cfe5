"""Every decoder-only causal-LM architecture of the installed transformers, as a tiny config.

The list comes from the library itself: ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` less the
encoders (also in the masked-LM mapping) and the encoder-decoders (also in the
seq2seq mapping).  A tiny config sets, of the fields its config class declares, the
sizes of :data:`TINY` (two layers, width 32, 4 experts, ...), then the few values of
:data:`OVERRIDES` a model needs; an architecture whose model still does not build, or
whose forward fails on a plain ``input_ids`` batch, is "not buildable from a tiny config"
and counted as such, with the reason.
"""

import dataclasses

import torch
import transformers
from transformers.models.auto import configuration_auto, modeling_auto

# a config field -> its tiny value, for whichever of these fields a config class declares
TINY = dict(
    vocab_size=64, hidden_size=32, n_embd=32, d_model=32, dim=32, intermediate_size=48, ffn_dim=48, n_inner=48,
    ffn_hidden_size=48, dense_intermediate_size=48, first_dense_intermediate_size=48, intermediate_size_mlp=48,
    mlp_only_intermediate_size=48, dim_ff=48, dff=48, d_inner=48,
    num_hidden_layers=2, n_layer=2, n_layers=2, num_layers=2,
    num_attention_heads=4, n_head=4, num_heads=4, n_heads=4, num_key_value_heads=2, head_dim=8, dim_head=8,
    kv_channels=8, rotary_dim=4,
    moe_intermediate_size=16, shared_expert_intermediate_size=16, shared_intermediate_size=16,
    shared_experts_intermediate_size=16, moe_shared_expert_intermediate_size=16, expert_ffn_hidden_size=16,
    n_routed_experts=4, num_experts=4, num_local_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, first_k_dense_replace=1, topk_group=1, n_group=1,
    kv_lora_rank=8, q_lora_rank=16, o_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
    index_n_heads=2, index_head_dim=8, index_topk=8,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2,
    linear_head_dim=8, linear_num_heads=4,
    mamba_d_state=8, mamba_n_heads=4, mamba_head_dim=16, mamba_num_heads=4, mamba_d_ssm=64, mamba_chunk_size=16,
    ssm_state_size=8, state_size=8, chunk_size=16,
    max_position_embeddings=256, n_positions=256, n_ctx=256, max_seq_len=256, context_length=256,
    max_window_layers=2, initializer_range=0.2, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
MAX_PARAMETERS = 10_000_000  # a config whose model is bigger than this is not tiny
# per model type: values TINY cannot guess (a layer pattern, a divisibility a model needs)
OVERRIDES = {
    "mamba2": dict(num_heads=8),                      # hidden_size * expand = num_heads * head_dim
    "lfm2": dict(layer_types=["conv", "full_attention"]),  # the hybrid, not two attention layers
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=7),
    "zaya": dict(num_experts_per_tok=1),
    "dots3_note_text": dict(num_key_value_heads=4),
    "gemma4_text": dict(vocab_size_per_layer_input=64, hidden_size_per_layer_input=8),
    "whisper": dict(decoder_attention_heads=4, encoder_attention_heads=4, decoder_layers=2, encoder_layers=2,
                    decoder_ffn_dim=48, encoder_ffn_dim=48, max_target_positions=256, max_source_positions=256),
}


def decoder_types():
    """Model types of the decoder-only causal LMs the installed transformers ships, sorted."""
    skip = set(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES) | set(
        modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    return sorted(t for t in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t not in skip)


def tiny_config(model_type, **extra):
    """The tiny config of ``model_type`` (raises what the config class raises)."""
    cls = configuration_auto.CONFIG_MAPPING[model_type]
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    kw = {name: value for name, value in TINY.items() if name in fields}
    if "qk_rope_head_dim" in kw:  # multi-head latent attention: head sizes of its own
        kw.pop("head_dim", None)
        if "num_key_value_heads" in kw:  # its keys have every head
            kw["num_key_value_heads"] = kw["num_attention_heads"]
    kw.update(OVERRIDES.get(model_type, {}))
    kw.update(extra)
    return cls(experts_implementation="eager", **kw)  # torch's grouped_mm has no float64


def build(model_type, attn_implementation, seed=0, **extra):
    """(config, float64 model with ``attn_implementation``) of ``model_type``'s tiny config."""
    cfg = tiny_config(model_type, **extra)
    towers = [name for name in ("vision_config", "audio_config") if getattr(cfg, name, None) is not None]
    if towers:
        raise ValueError(f"a multimodal config ({', '.join(towers)}): its towers are not made tiny")
    with torch.device("meta"):
        size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(cfg).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"{size} parameters: the tiny config leaves a field large")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    return cfg, model.to(torch.float64)

# rotary embeddings whose frequencies depend on the sequence length: the sweep's N = 20 passes the
# length they were trained for (16), and one rank's shard does not
VARIANTS = {
    "falcon-alibi": dict(type="falcon", config=dict(alibi=True)),  # ALiBi folded into a mask of its own
    "llama-dynamic-ntk": dict(type="llama", config=dict(
        max_position_embeddings=16, rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0))),
    "phi3-longrope": dict(type="phi3", config=dict(
        max_position_embeddings=64, original_max_position_embeddings=16,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.1, 1.2, 1.3],
                             long_factor=[2.0, 2.5, 3.0, 3.5], original_max_position_embeddings=16))),
}
