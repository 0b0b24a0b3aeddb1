"""Rules of a model config alone (no layout, no hardware): shapes, experts, latent attention, windows, hybrid
layers. validate.py adds the rules that tie a model to its layout and hardware.

Each message names the field, its value and what would be accepted.
"""

from __future__ import annotations

from pathlib import Path

from trainsim.config.choices import (
    ATTENTION_KERNELS,
    FAMILIES,
    HYBRID_LAYER_KINDS,
    MOE_ROUTERS,
    MOE_ROUTINGS,
    TP_OVERLAP_BACKWARDS,
    WINDOW_KINDS,
)
from trainsim.config.schema import ModelConfig
from trainsim.errors import ConfigError


def divisors(n: int) -> str:
    """The divisors of n, as a message lists them."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def one_of(group: str, name: str, value: object, accepted: tuple) -> None:
    """Refuse a value outside a closed set, naming the field and the set."""
    if value not in accepted:
        raise ConfigError(f"{group}.{name}={value!r} is not supported; accepted: {', '.join(map(str, accepted))}")


def positive(group: str, obj: object, *names: str) -> None:
    """Refuse fields that must be positive integers."""
    for name in names:
        value = getattr(obj, name)
        if value is None or value < 1:
            raise ConfigError(f"{group}.{name}={value!r} must be a positive integer")


def validate_model(model: ModelConfig) -> None:
    one_of("model", "family", model.family, FAMILIES)
    positive("model", model, "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
    if model.head_dim is None and model.hidden_size % model.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={model.hidden_size} is not divisible by model.num_attention_heads="
            f"{model.num_attention_heads}; choose heads among {divisors(model.hidden_size)}"
        )
    kv_heads = model.num_kv_heads or model.num_attention_heads
    if model.num_attention_heads % kv_heads:
        raise ConfigError(
            f"model.num_kv_heads={kv_heads} must divide model.num_attention_heads={model.num_attention_heads}; "
            f"choose num_kv_heads among {divisors(model.num_attention_heads)}"
        )
    head_dim = model.head_dim or model.hidden_size // model.num_attention_heads
    if head_dim < 1:
        raise ConfigError(f"model.head_dim={model.head_dim} must be >= 1 (or null: hidden_size / num_attention_heads)")
    if model.family == "llama" and head_dim % 2:
        raise ConfigError(f"the attention head width {head_dim} (model.head_dim, or hidden_size / "
                          "num_attention_heads) must be even for rotary position embeddings (family 'llama')")
    for name in ("dropout", "attention_dropout"):
        if not 0.0 <= getattr(model, name) < 1.0:
            raise ConfigError(f"model.{name}={getattr(model, name)} must be in [0, 1)")
    if model.attention not in ATTENTION_KERNELS:
        raise ConfigError(f"model.attention={model.attention!r} is not supported; use one of {ATTENTION_KERNELS}")
    if model.tp_overlap_backward not in TP_OVERLAP_BACKWARDS:
        raise ConfigError(f"model.tp_overlap_backward={model.tp_overlap_backward!r} is not supported; use one of "
                          f"{TP_OVERLAP_BACKWARDS}")
    _validate_latent_attention(model)
    _validate_window(model)
    if not isinstance(model.approximations, (list, tuple)) or not all(isinstance(a, str) and a.strip()
                                                                       for a in model.approximations):
        raise ConfigError(f"model.approximations={model.approximations!r} must be a list of sentences (strings), "
                          "one per thing this config asks that trainsim approximates")
    if model.num_experts:
        _validate_experts(model)
    elif model.num_experts < 0:
        raise ConfigError(f"model.num_experts={model.num_experts} must be >= 0 (0 = a dense model)")
    if model.hybrid_layer_pattern:
        _validate_hybrid(model)


def _validate_hybrid(model: ModelConfig) -> None:
    """Megatron-Core's rules for a hybrid Mamba stack (mamba_hybrid_layer_allocation.py, MambaMixer)."""
    pattern = model.hybrid_layer_pattern
    accepted = ", ".join(f"'{c}' {kind}" for c, kind in HYBRID_LAYER_KINDS.items())
    unknown = sorted(set(pattern) - set(HYBRID_LAYER_KINDS))
    if unknown:
        raise ConfigError(f"model.hybrid_layer_pattern={pattern!r} has {', '.join(map(repr, unknown))}; accepted "
                          f"characters: {accepted} (Megatron's --hybrid-override-pattern; no '|' pipeline marks)")
    if len(pattern) != model.num_layers:
        raise ConfigError(f"model.hybrid_layer_pattern has {len(pattern)} layers but model.num_layers="
                          f"{model.num_layers}; set num_layers to the pattern's length")
    if "E" in pattern and not model.num_experts:
        raise ConfigError(f"model.hybrid_layer_pattern={pattern!r} has MoE layers ('E') but model.num_experts=0; "
                          "set num_experts, or use '-' for dense MLP layers")
    if model.moe_first_dense_layers:
        raise ConfigError(f"model.moe_first_dense_layers={model.moe_first_dense_layers} with "
                          "model.hybrid_layer_pattern: the pattern says which layers are MoE ('E') and which dense "
                          "('-'); set it to 0")
    if "M" not in pattern:
        return
    positive("model", model, "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_conv_kernel")
    if model.mamba_num_heads < 0:
        raise ConfigError(f"model.mamba_num_heads={model.mamba_num_heads} must be >= 0 "
                          "(0 = 2 * hidden_size / mamba_head_dim)")
    heads = model.mamba_heads
    if heads < 1 or (not model.mamba_num_heads and (2 * model.hidden_size) % model.mamba_head_dim):
        raise ConfigError(f"model.mamba_head_dim={model.mamba_head_dim} does not divide 2 * hidden_size="
                          f"{2 * model.hidden_size}; set model.mamba_num_heads, or a head dim among "
                          f"{divisors(2 * model.hidden_size)}")
    if heads % model.mamba_num_groups:
        raise ConfigError(f"model.mamba_num_groups={model.mamba_num_groups} must divide the {heads} Mamba heads "
                          f"(model.mamba_num_heads, or 2 * hidden_size / mamba_head_dim); choose among "
                          f"{divisors(heads)}")


def _validate_latent_attention(model: ModelConfig) -> None:
    """Multi-head latent attention's widths (workloads/latent_attention.py)."""
    for name in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim"):
        if getattr(model, name) < 0:
            raise ConfigError(f"model.{name}={getattr(model, name)} must be >= 0 (0 = off)")
    if model.v_head_dim is not None and model.v_head_dim < 1:
        raise ConfigError(f"model.v_head_dim={model.v_head_dim} must be a positive integer (or null: head_dim)")
    if not model.latent_attention:
        for name in ("q_lora_rank", "qk_rope_head_dim"):
            if getattr(model, name):
                raise ConfigError(f"model.{name}={getattr(model, name)} belongs to multi-head latent attention, "
                                  "which needs model.kv_lora_rank > 0 (DeepSeek-V3: 512); set it, or set "
                                  f"model.{name}=0")
        if model.v_head_dim is not None:
            raise ConfigError(f"model.v_head_dim={model.v_head_dim} is only modelled with multi-head latent attention "
                              "(model.kv_lora_rank > 0); set model.v_head_dim=null")
        return
    if model.family != "llama":
        raise ConfigError(f"model.kv_lora_rank={model.kv_lora_rank} (multi-head latent attention) needs "
                          f"model.family='llama' (RMSNorm, rotary positions); got {model.family!r}")
    if model.qk_rope_head_dim < 2 or model.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim={model.qk_rope_head_dim} must be an even number >= 2 with "
                          "multi-head latent attention (the decoupled rotary part; DeepSeek-V3: 64)")
    if model.num_kv_heads not in (None, model.num_attention_heads):
        raise ConfigError(f"model.num_kv_heads={model.num_kv_heads}: multi-head latent attention projects keys "
                          "and values for every head; set model.num_kv_heads=null")


def _validate_window(model: ModelConfig) -> None:
    """Windowed attention (workloads/core_attention.py)."""
    if model.window_size < 0:
        raise ConfigError(f"model.window_size={model.window_size} must be >= 0 (0 = full causal attention)")
    one_of("model", "window_kind", model.window_kind, WINDOW_KINDS)
    if model.global_attention_every < 0:
        raise ConfigError(f"model.global_attention_every={model.global_attention_every} must be >= 0 "
                          "(0 = every layer windowed)")
    if model.global_attention_every and not model.window_size:
        raise ConfigError(f"model.global_attention_every={model.global_attention_every} picks the full-attention "
                          "layers among windowed ones: it needs model.window_size > 0")


def _validate_experts(model: ModelConfig) -> None:
    if not 1 <= model.moe_top_k <= model.num_experts:
        raise ConfigError(f"model.moe_top_k={model.moe_top_k} must be in [1, num_experts={model.num_experts}]")
    one_of("model", "moe_router", model.moe_router, MOE_ROUTERS)
    for name in ("moe_capacity_factor", "moe_aux_loss_coeff", "moe_shared_expert_ffn_hidden_size"):
        if getattr(model, name) < 0:
            raise ConfigError(f"model.{name}={getattr(model, name)} must be >= 0 (0 = off)")
    if model.moe_layer_freq < 1:
        raise ConfigError(f"model.moe_layer_freq={model.moe_layer_freq} must be a positive integer (1 = every layer "
                          "after moe_first_dense_layers has experts, 2 = every second one)")
    if not any(model.has_experts(layer) for layer in range(model.num_layers)):
        raise ConfigError(f"model.moe_layer_freq={model.moe_layer_freq} with moe_first_dense_layers="
                          f"{model.moe_first_dense_layers} leaves no MoE layer among num_layers={model.num_layers}")
    if not 0 <= model.moe_first_dense_layers < model.num_layers:
        raise ConfigError(f"model.moe_first_dense_layers={model.moe_first_dense_layers} must be in "
                          f"[0, num_layers={model.num_layers})")
    kind, _, value = model.moe_routing.partition(":")
    if kind in ("zipf", "dirichlet"):
        try:
            ok = float(value) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"model.moe_routing={model.moe_routing!r}: {kind} needs a positive number, e.g. "
                              f"'{kind}:{'1.2' if kind == 'zipf' else '0.5'}'")
    elif kind != "balanced" and not Path(model.moe_routing).is_file():
        raise ConfigError(f"model.moe_routing={model.moe_routing!r} is neither {', '.join(MOE_ROUTINGS)} nor an "
                          "existing routing histogram file (CSV, workloads/routing.py)")
