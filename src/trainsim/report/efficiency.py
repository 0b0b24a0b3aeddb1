"""What a step costs and how well it uses the hardware: tokens/s, model FLOPs utilisation, dollars.

MFU counts model FLOPs only (no recomputation), as PaLM (Chowdhery et al. 2022, appendix B) and
Megatron-LM (Narayanan et al. 2021, eq. 3) define it, so layouts with and without recomputation compare
on the work the model needs, not the work they chose to do.

With precision 'fp8' MFU is still taken against the bf16 dense peak: only the linear layers' GEMMs run in
FP8 (attention, embedding, output layer and the elementwise work stay bf16), and NeMo and Megatron-LM report
FP8 runs as model TFLOP/s per GPU on the same footing as bf16 runs. So an FP8 run that is faster shows a
higher MFU, and MFU can compare bf16 and FP8 layouts; against the FP8 peak it would halve for the same speed.
"""

from __future__ import annotations

from typing import Any


def model_flops_per_step(model: dict[str, Any], par: dict[str, Any]) -> float:
    """Training FLOPs of one step: 3x the forward pass (backward = 2x forward).

    Forward per token and layer: 2 x (QKV h (a + 2 a_kv) d + output projection a d h + MLP n h f) matmul
    FLOPs plus 4 s a d for attention scores and values (a heads of width d, a_kv key/value heads); logits
    2 h V per token. For GPT (n = 2, f = 4h, a d = h, a_kv = a) this is Narayanan et al. 2021 eq. 3 without
    recomputation: 72 B s l h^2 (1 + s/6h + V/12lh). In an MoE layer the MLP term counts what a token
    activates: its top-k experts, the shared expert and the router (2 h E), as MFU of MoE runs is reported.
    """
    h, layers, s = model["hidden_size"], model["num_layers"], model["seq_length"]
    heads = model["num_attention_heads"]
    d = model.get("head_dim") or h // heads
    kv_heads = model.get("num_kv_heads") or heads
    ffn = model.get("ffn_hidden_size") or 4 * h
    mlp_matrices = 3 if model.get("family") == "llama" else 2  # SwiGLU has gate, up and down
    attention = 2 * (h * (heads + 2 * kv_heads) * d + heads * d * h) + 4 * s * heads * d
    dense_mlp = 2 * mlp_matrices * h * ffn
    experts = model.get("num_experts") or 0
    moe_layers = layers - (model.get("moe_first_dense_layers") or 0) if experts else 0
    moe_mlp = 2 * mlp_matrices * h * (model.get("moe_top_k", 2) * (model.get("moe_ffn_hidden_size") or ffn)
                                      + (model.get("moe_shared_expert_ffn_hidden_size") or 0)) + 2 * h * experts
    per_token = (layers * attention + (layers - moe_layers) * dense_mlp + moe_layers * moe_mlp
                 + 2 * h * model["vocab_size"])
    return 3.0 * per_token * tokens_per_step(model, par)


def tokens_per_step(model: dict[str, Any], par: dict[str, Any]) -> int:
    return int(par["global_batch_size"]) * int(model["seq_length"])


def efficiency(step_time_s: float, hardware: dict[str, Any], model: dict[str, Any],
               par: dict[str, Any]) -> dict[str, float | None]:
    """tokens/s, MFU (None without a peak rate for the precision), cost per step and per million tokens
    (None without hardware.price_per_device_hour)."""
    world = par["dp"] * par.get("cp", 1) * par["tp"] * par["pp"]
    tokens = tokens_per_step(model, par)
    precision = "bf16" if par["precision"] == "fp8" else par["precision"]  # see the module docstring
    peak = hardware.get("peak_flops_per_s", {}).get(precision)
    price = hardware.get("price_per_device_hour") or 0.0
    cost = price * world * step_time_s / 3600 if price > 0 else None
    flops = model_flops_per_step(model, par)
    return {
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_time_s,
        "model_flops_per_step": flops,
        "mfu_pct": 100 * flops / (step_time_s * world * peak) if peak else None,
        "cost_per_step_usd": cost,
        "cost_per_million_tokens_usd": cost / tokens * 1e6 if cost is not None else None,
    }
