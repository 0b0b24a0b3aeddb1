"""Rules of the block-scaled precisions: FP8 'mxfp8' / 'blockwise' recipes and NVFP4 ('fp4'): which GPUs run
them and which shapes their quantisation kernels take (workloads/block_scaling.py)."""

from __future__ import annotations

from trainsim.config.choices import BLOCK_FP8_RECIPES
from trainsim.config.schema import HardwareConfig, ModelConfig, ParallelismConfig
from trainsim.errors import ConfigError

BLACKWELL_NAMES = ("B200", "B300", "GB200", "GB300")
"""Device names of Blackwell GPUs (sm_100 and later): MXFP8 and NVFP4 tensor cores (TE refuses both elsewhere)."""
HOPPER_NAMES = ("H100", "H200", "H800", "H20", "GH200")
"""Device names of Hopper GPUs (sm_90): TE's Float8BlockScaling needs Hopper or later."""
# cite: TE MXFP8BlockScaling (1 x 32), Float8BlockScaling (1 x 128, 128 x 128), NVFP4BlockScaling (1 x 16, 16 x 16);
# torch._scaled_mm (row-wise scales): every GEMM dimension a multiple of 16
BLOCK_ELEMENTS = {"mxfp8": 32, "blockwise": 128, "rowwise": 16, "fp4": 16}
"""Elements along a block's side: every dimension a quantisation kernel blocks must be a multiple of it."""


def block_recipe(par: ParallelismConfig) -> str | None:
    """'mxfp8', 'blockwise', 'rowwise' or 'fp4' where the run uses a block-scaled precision, else None."""
    if par.precision == "fp4":
        return "fp4"
    if par.precision == "fp8" and par.fp8_recipe in BLOCK_FP8_RECIPES:
        return par.fp8_recipe
    return None


def _describe(recipe: str) -> str:
    return "parallelism.precision='fp4'" if recipe == "fp4" else f"parallelism.fp8_recipe='{recipe}'"


def validate_block_scaling(model: ModelConfig, par: ParallelismConfig) -> None:
    """Shapes and layouts a block-scaled precision needs: the linears' widths per tensor-parallel rank and the
    tokens of a micro-batch (blocked too: the column-wise copies for wgrad block along the tokens) multiples of
    the block."""
    recipe = block_recipe(par)
    if recipe is None:
        return
    what = _describe(recipe)
    block = BLOCK_ELEMENTS[recipe]
    if par.zero_stage >= 2 and model.num_experts:
        raise ConfigError(f"parallelism.zero_stage={par.zero_stage} (FSDP) with {what} and experts "
                          f"(model.num_experts={model.num_experts}) is not modelled: use zero_stage 0 or 1")
    if par.fp8_param_gather and par.zero_stage >= 2:
        raise ConfigError(f"parallelism.fp8_param_gather=true with {what} and FSDP: FP8 all-gathers of block-scaled "
                          "weights are not built (they gather per-tensor-scaled E4M3); set fp8_param_gather=false "
                          "(the weights are gathered in bf16 and cast at each use)")
    if recipe == "fp4" and model.num_experts:
        raise ConfigError(f"{what} with experts (model.num_experts={model.num_experts}) is not modelled (NVFP4 "
                          "grouped GEMMs are not built): use parallelism.precision='fp8'")
    head_dim = model.head_dim or model.hidden_size // model.num_attention_heads
    kv_heads = model.num_kv_heads or model.num_attention_heads
    ffn = model.ffn_hidden_size or 4 * model.hidden_size
    widths = {
        "model.hidden_size": model.hidden_size,
        "the attention output's width per tp rank (num_attention_heads * head_dim / tp)":
            model.num_attention_heads * head_dim // par.tp,
        "the key/value width per tp rank (num_kv_heads * head_dim / tp)": kv_heads * head_dim // par.tp,
        "model.ffn_hidden_size / tp": ffn // par.tp,
        "the tokens of a micro-batch (micro_batch_size * seq_length / cp)":
            par.micro_batch_size * model.seq_length // par.cp,
    }
    if par.tp_comm_overlap:  # the ring carries each rank's tokens in whole blocks
        widths["the tokens of a micro-batch per tp rank (micro_batch_size * seq_length / cp / tp, "
               "parallelism.tp_comm_overlap)"] = par.micro_batch_size * model.seq_length // par.cp // par.tp
    if model.num_experts:
        widths["model.moe_ffn_hidden_size / etp"] = model.expert_ffn_hidden_size // par.etp
    for name, value in widths.items():
        if value % block:
            raise ConfigError(f"{what} quantises in blocks of {block} elements: {name} = {value} is not a multiple "
                              f"of {block}; choose sizes that are, or parallelism.precision='bf16'")


def validate_precision_hardware(hw: HardwareConfig, par: ParallelismConfig) -> None:
    """The GPU a block-scaled precision needs (TE: MXFP8 and NVFP4 on Blackwell, blockwise FP8 on Hopper or
    later) and its peak: 'fp4' needs hardware.peak_flops_per_s.fp4. CPU devices run the emulation, measured."""
    recipe = block_recipe(par)
    if recipe is None or hw.device_kind == "cpu":
        return
    name = hw.device_name.upper()
    blackwell = any(n in name for n in BLACKWELL_NAMES)
    if recipe in ("mxfp8", "fp4") and not blackwell:
        raise ConfigError(f"{_describe(recipe)} runs on Blackwell tensor cores only (Transformer Engine refuses it "
                          f"elsewhere): hardware '{hw.name}' has device_name {hw.device_name!r}, none of "
                          f"{', '.join(BLACKWELL_NAMES)}; use fp8_recipe 'blockwise' or 'delayed' on Hopper")
    if recipe in ("blockwise", "rowwise") and not (blackwell or any(n in name for n in HOPPER_NAMES)):
        raise ConfigError(f"parallelism.fp8_recipe='{recipe}' needs Hopper or later (Transformer Engine's "
                          f"Float8BlockScaling, torch's row-wise scaled FP8 GEMM): hardware '{hw.name}' has "
                          f"device_name {hw.device_name!r}, none of "
                          f"{', '.join(HOPPER_NAMES + BLACKWELL_NAMES)}")
    if recipe == "fp4" and "fp4" not in hw.peak_flops_per_s:
        known = ", ".join(sorted(hw.peak_flops_per_s)) or "none"
        raise ConfigError(f"parallelism.precision='fp4' needs an FP4 peak: hardware '{hw.name}' has no "
                          f"hardware.peak_flops_per_s.fp4 (known: {known}); add the datasheet's dense FP4 FLOP/s")
