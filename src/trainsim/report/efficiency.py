"""What a step costs and how well it uses the hardware: tokens/s, model FLOPs utilisation, dollars; and
what a whole training run of a token budget costs.

MFU counts model FLOPs only (no recomputation), as PaLM (Chowdhery et al. 2022, appendix B) and
Megatron-LM (Narayanan et al. 2021, eq. 3) define it, so layouts with and without recomputation compare
on the work the model needs, not the work they chose to do. HFU adds the recomputed work (what the GPUs
really ran), as Korthikanti et al. 2022 report it next to MFU.

With precision 'fp8' (and 'fp4', NVFP4, likewise) MFU is still taken against the bf16 dense peak: only the
linear layers' GEMMs run in FP8 (attention, embedding, output layer and the elementwise work stay bf16), and
NeMo and Megatron-LM report FP8 runs as model TFLOP/s per GPU on the same footing as bf16 runs. So an FP8 run
that is faster shows a higher MFU, and MFU can compare bf16 and FP8 layouts; against the FP8 peak it would
halve for the same speed.
"""

from __future__ import annotations

import math
from typing import Any

from trainsim.config.schema import MAMBA_CHUNK_TOKENS


def attended_keys(model: dict[str, Any], layer: int) -> float:
    """Keys per query of layer `layer` on the full-square convention of 4 s a d (a causal kernel computes half):
    s for full attention; with a window of w keys 2 w - w^2 / s (sliding) or w (chunked), which is s at w = s."""
    s, window = model["seq_length"], model.get("window_size") or 0
    every = model.get("global_attention_every") or 0
    if not window or window >= s or (every and (layer + 1) % every == 0):
        return float(s)
    return float(window) if model.get("window_kind") == "chunked" else 2.0 * window - window * window / s


def attention_projection_flops(model: dict[str, Any]) -> float:
    """Forward FLOPs per token of a layer's attention projections (2 per multiply-add): QKV and output, or with
    multi-head latent attention (kv_lora_rank > 0) its down, up and output projections."""
    h, heads = model["hidden_size"], model["num_attention_heads"]
    d = model.get("head_dim") or h // heads
    if not model.get("kv_lora_rank"):
        kv_heads = model.get("num_kv_heads") or heads
        return 2 * (h * (heads + 2 * kv_heads) * d + heads * d * h)
    rope, kv_rank, q_rank = model.get("qk_rope_head_dim") or 0, model["kv_lora_rank"], model.get("q_lora_rank") or 0
    v = model.get("v_head_dim") or d
    query = h * q_rank + q_rank * heads * (d + rope) if q_rank else h * heads * (d + rope)
    return 2 * (query + h * (kv_rank + rope) + kv_rank * heads * (d + v) + heads * v * h)


def forward_flops_per_token(model: dict[str, Any]) -> dict[str, float]:
    """Forward matmul FLOPs per token: the transformer layers, the part of them that is core attention
    (scores and values), and the output layer (logits).

    Per layer: 2 x (QKV h (a + 2 a_kv) d + output projection a d h + MLP n h f) plus 4 s a d for attention
    scores and values (a heads of width d, a_kv key/value heads; 2 s a (d_qk + d_v) with latent attention, and
    the window's keys in place of s in windowed layers: attended_keys); logits 2 h V. In an MoE layer the MLP
    term counts what a token activates: its top-k experts, the shared expert and the router (2 h E), as MFU of
    MoE runs is reported. Which layers have experts: after moe_first_dense_layers, every moe_layer_freq-th. A
    hybrid model (model.hybrid_layer_pattern) counts each layer as its kind: attention alone, an MLP, an MoE
    layer or a Mamba-2 mixer (mamba_flops_per_token).
    """
    h, layers = model["hidden_size"], model["num_layers"]
    heads = model["num_attention_heads"]
    d = model.get("head_dim") or h // heads
    qk, v = (d + (model.get("qk_rope_head_dim") or 0), model.get("v_head_dim") or d) if model.get("kv_lora_rank") \
        else (d, d)
    ffn = model.get("ffn_hidden_size") or 4 * h
    mlp_matrices = 3 if model.get("family") == "llama" else 2  # SwiGLU has gate, up and down
    core_attention = sum(2 * attended_keys(model, layer) * heads * (qk + v) for layer in range(layers))
    dense_mlp = 2 * mlp_matrices * h * ffn
    experts = model.get("num_experts") or 0
    first_dense, freq = model.get("moe_first_dense_layers") or 0, model.get("moe_layer_freq") or 1
    moe_layers = sum(1 for layer in range(first_dense, layers) if (layer + 1) % freq == 0) if experts else 0
    moe_mlp = 2 * mlp_matrices * h * (model.get("moe_top_k", 2) * (model.get("moe_ffn_hidden_size") or ffn)
                                      + (model.get("moe_shared_expert_ffn_hidden_size") or 0)) + 2 * h * experts
    pattern = model.get("hybrid_layer_pattern") or ""
    if pattern:  # a hybrid model's layers each hold one of these
        core = sum(2 * attended_keys(model, i) * heads * (qk + v) for i, kind in enumerate(pattern) if kind == "*")
        per_kind = {"*": attention_projection_flops(model), "-": dense_mlp, "E": moe_mlp,
                    "M": mamba_flops_per_token(model)}
        return {"layers": sum(per_kind[kind] for kind in pattern) + core, "core_attention": core,
                "logits": 2 * h * model["vocab_size"]}
    return {"layers": layers * attention_projection_flops(model) + core_attention + (layers - moe_layers) * dense_mlp
            + moe_layers * moe_mlp, "core_attention": core_attention, "logits": 2 * h * model["vocab_size"]}


def mamba_flops_per_token(model: dict[str, Any]) -> float:
    """Forward matmul FLOPs per token of one Mamba-2 layer (workloads/mamba.py): in_proj 2 h (2 e + 2 g n + H),
    out_proj 2 e h, and the chunked scan: C B^T inside a chunk 2 l g n, its product with x 2 l e, each chunk's
    state and the outputs from the states 2 x 2 e n (e = H P the inner width, l the chunk's tokens; the states
    passed between chunks are negligible)."""
    h, head_dim = model["hidden_size"], model.get("mamba_head_dim") or 64
    heads = model.get("mamba_num_heads") or 2 * h // head_dim
    groups, state = model.get("mamba_num_groups") or 8, model.get("mamba_state_dim") or 128
    inner, chunk = heads * head_dim, min(MAMBA_CHUNK_TOKENS, model["seq_length"])
    return (2 * h * (2 * inner + 2 * groups * state + heads) + 2 * inner * h
            + 2 * chunk * groups * state + 2 * chunk * inner + 4 * inner * state)


def selective_recomputed_flops_per_token(model: dict[str, Any], forward: dict[str, float], modules: list[str]) -> float:
    """Forward FLOPs per token Megatron's selective recomputation runs again: the core attention ('core_attn'), the
    latent attention's up projections ('mla_up_proj'), the dense layers' MLPs ('mlp') and the MoE layers' shared
    experts ('shared_experts'); a hybrid model counts its core attention only."""
    flops = forward["core_attention"] if "core_attn" in modules else 0.0
    if model.get("hybrid_layer_pattern"):
        return flops
    h, layers, heads = model["hidden_size"], model["num_layers"], model["num_attention_heads"]
    d = model.get("head_dim") or h // heads
    matrices = 3 if model.get("family") == "llama" else 2
    experts, first_dense, freq = (model.get("num_experts") or 0, model.get("moe_first_dense_layers") or 0,
                                  model.get("moe_layer_freq") or 1)
    moe_layers = sum(1 for layer in range(first_dense, layers) if (layer + 1) % freq == 0) if experts else 0
    if "mla_up_proj" in modules and model.get("kv_lora_rank"):
        qk, v = d + (model.get("qk_rope_head_dim") or 0), model.get("v_head_dim") or d
        q_in = model.get("q_lora_rank") or h
        flops += layers * 2 * heads * (q_in * qk + model["kv_lora_rank"] * (d + v))
    if "mlp" in modules:
        flops += (layers - moe_layers) * 2 * matrices * h * (model.get("ffn_hidden_size") or 4 * h)
    if "shared_experts" in modules:
        flops += moe_layers * 2 * matrices * h * (model.get("moe_shared_expert_ffn_hidden_size") or 0)
    return flops


def op_recomputed_flops_per_token(model: dict[str, Any], forward: dict[str, float]) -> float:
    """Forward FLOPs per token torchtitan's op-level checkpointing recomputes: every second linear of a dense block
    in the order it runs them (wq, wk, wv, wo, w1, w3, w2 with separate projections: wk, wo, w3), over the layers;
    other blocks (MoE, latent attention, hybrids) half their matmuls."""
    if model.get("num_experts") or model.get("kv_lora_rank") or model.get("hybrid_layer_pattern"):
        return (forward["layers"] - forward["core_attention"]) / 2
    h, heads = model["hidden_size"], model["num_attention_heads"]
    d = model.get("head_dim") or h // heads
    kv, ffn = model.get("num_kv_heads") or heads, model.get("ffn_hidden_size") or 4 * h
    swiglu = model.get("family") == "llama"
    if model.get("separate_projections"):
        widths = [heads * d, kv * d, kv * d, h] + ([ffn, ffn] if swiglu else [ffn]) + [h]
        inputs = [h, h, h, heads * d] + [h] * (2 if swiglu else 1) + [ffn]
    else:
        widths, inputs = [(heads + 2 * kv) * d, h, (2 if swiglu else 1) * ffn, h], [h, heads * d, h, ffn]
    return model["num_layers"] * sum(2 * n * k for n, k in list(zip(widths, inputs))[1::2])


def model_flops_per_step(model: dict[str, Any], par: dict[str, Any]) -> float:
    """Training FLOPs of one step: 3x the forward pass (backward = 2x forward).

    For GPT (n = 2, f = 4h, a d = h, a_kv = a) this is Narayanan et al. 2021 eq. 3 without recomputation:
    72 B s l h^2 (1 + s/6h + V/12lh).
    """
    forward = forward_flops_per_token(model)
    return 3.0 * (forward["layers"] + forward["logits"]) * tokens_per_step(model, par)


def hardware_flops_per_step(model: dict[str, Any], par: dict[str, Any]) -> float:
    """What the GPUs compute: the model FLOPs plus the forward work recomputed in the backward pass, all
    of the layers' with full recomputation (Megatron's 96 B s l h^2 (1 + s/6h + V/16lh), Korthikanti et al.
    2022), the recompute_modules with selective recomputation (the core attention by default), about half their
    matmuls with torchtitan's op-level policy (every second one); the output layer is never recomputed."""
    forward = forward_flops_per_token(model)
    recompute = par.get("recompute")
    recomputed = {"full": forward["layers"], "op": op_recomputed_flops_per_token(model, forward)}.get(recompute, 0.0)
    if recompute == "selective":
        recomputed = selective_recomputed_flops_per_token(model, forward, par.get("recompute_modules", ["core_attn"]))
    return model_flops_per_step(model, par) + recomputed * tokens_per_step(model, par)


def tokens_per_step(model: dict[str, Any], par: dict[str, Any]) -> int:
    return int(par["global_batch_size"]) * int(model["seq_length"])


def world_size(par: dict[str, Any]) -> int:
    return par["dp"] * par.get("cp", 1) * par["tp"] * par["pp"]


def efficiency(step_time_s: float, hardware: dict[str, Any], model: dict[str, Any], par: dict[str, Any],
               train_tokens: float = 0.0) -> dict[str, float | None]:
    """The step in the field's numbers: tokens/s (per GPU too), model TFLOP/s per GPU, MFU and HFU (None
    without a peak rate for the precision), cost per step and per million tokens (None without
    hardware.price_per_device_hour), and with a token budget the whole run (`training_totals`)."""
    world = world_size(par)
    tokens = tokens_per_step(model, par)
    precision = "bf16" if par["precision"] in ("fp8", "fp4") else par["precision"]  # see the module docstring
    peak = hardware.get("peak_flops_per_s", {}).get(precision)
    price = hardware.get("price_per_device_hour") or 0.0
    cost = price * world * step_time_s / 3600 if price > 0 else None
    flops, hardware_flops = model_flops_per_step(model, par), hardware_flops_per_step(model, par)
    return {
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_time_s,
        "tokens_per_s_per_gpu": tokens / step_time_s / world,
        "model_flops_per_step": flops,
        "model_tflops_per_s_per_gpu": flops / (step_time_s * world) / 1e12,
        "mfu_pct": 100 * flops / (step_time_s * world * peak) if peak else None,
        "hfu_pct": 100 * hardware_flops / (step_time_s * world * peak) if peak else None,
        "cost_per_step_usd": cost,
        "cost_per_million_tokens_usd": cost / tokens * 1e6 if cost is not None else None,
        **training_totals(step_time_s, tokens, world, hardware, train_tokens),
    }


def efficiency_intervals(bounds_s: tuple[float, float], hardware: dict[str, Any], model: dict[str, Any],
                         par: dict[str, Any], train_tokens: float = 0.0) -> dict[str, tuple[float, float]]:
    """Each figure of `efficiency` that moves with the step time, as (low, high) over a step-time interval:
    throughput and MFU fall as the step lengthens, days and dollars rise."""
    ends = [efficiency(seconds, hardware, model, par, train_tokens) for seconds in bounds_s]
    return {name: (min(ends[0][name], ends[1][name]), max(ends[0][name], ends[1][name])) for name in ends[0]
            if ends[0][name] is not None and ends[0][name] != ends[1][name]}


TRAINING_TOTALS = ("training_tokens", "training_steps", "training_days", "training_gpu_hours", "training_cost_usd",
                   "training_energy_mwh")


def training_totals(step_time_s: float, tokens_per_step: int, world: int, hardware: dict[str, Any],
                    train_tokens: float) -> dict[str, float | None]:
    """A run of `train_tokens` at this step: whole steps (the last one full), wall-clock days, GPU-hours,
    cost at hardware.price_per_device_hour and energy at hardware.power_per_device_w (None where not
    configured). Steady-state steps only: no start-up, checkpoints, evaluation or failures."""
    if not train_tokens:
        return dict.fromkeys(TRAINING_TOTALS)
    steps = math.ceil(train_tokens / tokens_per_step)
    seconds = steps * step_time_s
    gpu_hours = world * seconds / 3600
    price, power = hardware.get("price_per_device_hour") or 0.0, hardware.get("power_per_device_w") or 0.0
    return {"training_tokens": float(train_tokens), "training_steps": steps, "training_days": seconds / 86400,
            "training_gpu_hours": gpu_hours, "training_cost_usd": gpu_hours * price if price > 0 else None,
            "training_energy_mwh": power * world * seconds / 3.6e9 if power > 0 else None}


def token_count(tokens: float) -> str:
    """'300 billion', '1 trillion', '15.6 million': a token budget as people say it."""
    for scale, unit in ((1e12, " trillion"), (1e9, " billion"), (1e6, " million")):
        if tokens >= scale:
            return f"{tokens / scale:,.4g}{unit}"
    return f"{tokens:,.0f}"
