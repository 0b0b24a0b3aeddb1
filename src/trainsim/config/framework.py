"""The software stack as configuration: a framework's settings resolved into the groups a run is made of.

Published tables and recipes rarely state gradient buckets, gradient-accumulation fusion or the attention kernel:
the framework (Megatron-LM 2021, Megatron-Core, NeMo, torchtitan, Megatron-DeepSpeed) decides them for its users.
conf/framework/<name>.yaml states them once (schema.FrameworkConfig) and `apply_framework` writes them into the
parallelism, model and hardware groups when a run is composed, so the trace, profile and compose stages see
concrete values and the artifact keys change with them. Precedence: a field set on the command line or in a
chosen option file (a value other than the schema's default) wins over the framework; the framework over the
schema's defaults.
"""

from __future__ import annotations

import dataclasses

from trainsim.config.choices import TP_OVERLAP_BACKWARDS, gradient_reduce_bytes
from trainsim.config.data_path import DATA_DIR
from trainsim.config.devices import gpu_generation
from trainsim.config.schema import FrameworkConfig, HardwareConfig, ModelConfig, ParallelismConfig
from trainsim.errors import ConfigError

MEGATRON_DEFAULT_BUCKET_PARAMS = 40_000_000  # cite: Megatron-Core DistributedDataParallel: max(40M, 1M x dp)
MEGATRON_BUCKET_PARAMS_PER_RANK = 1_000_000  # cite: Megatron-Core DistributedDataParallel: max(40M, 1M x dp)
PYTORCH_DDP_BUCKET_BYTES = 25 * 1024 * 1024  # cite: torch.nn.parallel.DistributedDataParallel bucket_cap_mb=25
DP_BUCKETS = ("", "pytorch-ddp", "megatron-core")
ATTENTION_KERNELS = ("", "fused", "unfused")
FLASH_ATTENTION_RATES = DATA_DIR / "kernels/h100_flash-attn2-vs-3_fwd-bwd_pr1791.csv"
"""Causal forward and backward TFLOP/s of FlashAttention-2 ('Fav2') and -3 ('Fav3') measured on H100."""
FLASH_ATTENTION_MEASURED_PEAK = 989.0e12  # cite: H100 SXM datasheet, dense bf16 (the rates were measured on an H100)
"""The bf16 peak of the GPU the rates were measured on: they carry to another Hopper part as fractions of it."""


def validate_framework(fw: FrameworkConfig) -> None:
    """The framework's own fields: its bucket rule, attention kernel and flash-attention release."""
    where = f"framework '{fw.name}'"
    if fw.dp_bucket not in DP_BUCKETS:
        raise ConfigError(f"{where}: framework.dp_bucket={fw.dp_bucket!r}; accepted: "
                          f"{', '.join(map(repr, DP_BUCKETS))}")
    if fw.attention not in ATTENTION_KERNELS:
        raise ConfigError(f"{where}: framework.attention={fw.attention!r}; accepted: "
                          f"{', '.join(map(repr, ATTENTION_KERNELS))}")
    if fw.tp_overlap_backward not in ("", *TP_OVERLAP_BACKWARDS):
        raise ConfigError(f"{where}: framework.tp_overlap_backward={fw.tp_overlap_backward!r}; accepted: '' or "
                          f"{', '.join(map(repr, TP_OVERLAP_BACKWARDS))}")
    if fw.flash_attention and fw.flash_attention not in flash_attention_kernels():
        kernels = ", ".join(map(repr, flash_attention_kernels()))
        raise ConfigError(f"{where}: framework.flash_attention={fw.flash_attention!r}; accepted: '' or {kernels} "
                          f"(kernels of {FLASH_ATTENTION_RATES.name})")
    if fw.host_dispatch_s is not None and not 0.0 <= fw.host_dispatch_s < 1.0:
        raise ConfigError(f"{where}: framework.host_dispatch_s={fw.host_dispatch_s} must be seconds per op in [0, 1) "
                          "or null (the hardware's)")


def flash_attention_kernels() -> tuple[str, ...]:
    import pandas as pd

    return tuple(sorted(set(pd.read_csv(FLASH_ATTENTION_RATES, comment="#")["kernel"])))


def flash_attention_hardware(kernel: str, hw: HardwareConfig) -> HardwareConfig:
    """`hw` with `kernel`'s measured causal forward and backward TFLOP/s over the measuring H100's bf16 peak as its
    attention efficiencies, at the measurement's sequence length (the kernel model reaches
    attention_*_efficiency at long sequences: keys / (keys + attention_tile_keys) of it at that length; the tile
    work and dropout cost kept).

    The rates were measured on Hopper, where the release matters (FlashAttention-2 reaches about half of what
    FlashAttention-3 and cuDNN do). They carry to the other Hopper parts as a fraction of peak, as the matmul
    ceilings do (validation/kernel_fit.CEILING_ROWS): the same TFLOP/s on the H100, H200 and H800 (one peak),
    fewer on the 500 W Grand Teton H100, whose peak is its power-limited clock's. On other generations the
    hardware config's own attention rates stand: Ampere's are FlashAttention-2's measurements, and no release of
    these tables runs on Blackwell."""
    import pandas as pd

    if gpu_generation(hw.device_name) != "hopper":
        return hw
    rates = pd.read_csv(FLASH_ATTENTION_RATES, comment="#")
    rates = rates[(rates["kernel"] == kernel) & rates["causal"]].set_index("pass")
    long_sequence = 1 + hw.kernel_model.attention_tile_keys / rates["seqlen"]
    efficiency = (rates["tflops"] * 1e12 / FLASH_ATTENTION_MEASURED_PEAK * long_sequence).clip(upper=1.0)
    return dataclasses.replace(hw, kernel_model=dataclasses.replace(
        hw.kernel_model, attention_forward_efficiency=float(efficiency["fwd"]),
        attention_backward_efficiency=float(efficiency["bwd"])))


def megatron_core_bucket_bytes(dp: int, grad_bytes: int) -> int:
    """Megatron-Core DDP's default gradient bucket: max(40M, 1M x dp) parameters (dp counts the context-parallel
    ranks, which reduce gradients with it), each `grad_bytes` long."""
    return max(MEGATRON_DEFAULT_BUCKET_PARAMS, MEGATRON_BUCKET_PARAMS_PER_RANK * dp) * grad_bytes


def dp_bucket_bytes(rule: str, par: ParallelismConfig) -> int:
    """The gradient bucket a framework's data-parallel reduction uses for `par`."""
    if rule == "pytorch-ddp":
        return PYTORCH_DDP_BUCKET_BYTES
    grad_bytes = gradient_reduce_bytes(par.precision, par.grad_reduce_in_fp32)
    return megatron_core_bucket_bytes(par.weight_replicas, grad_bytes)


def apply_framework(fw: FrameworkConfig, hw: HardwareConfig, model: ModelConfig, par: ParallelismConfig,
                    explicit: tuple[str, ...] = ()) -> tuple[HardwareConfig, ModelConfig, ParallelismConfig]:
    """The groups with the framework's settings written in, except the dotted fields in `explicit` (stated by the
    user: compose.explicit_fields). tp_comm_overlap on a stack without it is refused."""
    validate_framework(fw)

    def decides(field: str, value) -> bool:
        return value not in (None, "") and field not in explicit

    if decides("parallelism.grad_reduce_in_fp32", fw.grad_reduce_in_fp32):  # first: the bucket rule counts its bytes
        par = dataclasses.replace(par, grad_reduce_in_fp32=fw.grad_reduce_in_fp32)
    if decides("parallelism.dp_bucket_size_bytes", fw.dp_bucket):
        par = dataclasses.replace(par, dp_bucket_size_bytes=dp_bucket_bytes(fw.dp_bucket, par))
    if decides("parallelism.gradient_accumulation_fusion", fw.gradient_accumulation_fusion):
        par = dataclasses.replace(par, gradient_accumulation_fusion=fw.gradient_accumulation_fusion)
    if decides("model.attention", fw.attention):
        model = dataclasses.replace(model, attention=fw.attention)
    if decides("model.fused_elementwise", fw.fused_elementwise):
        model = dataclasses.replace(model, fused_elementwise=fw.fused_elementwise)
    if decides("model.fused_cross_entropy", fw.fused_cross_entropy):
        model = dataclasses.replace(model, fused_cross_entropy=fw.fused_cross_entropy)
    if decides("model.moe_probs_in_experts", fw.moe_probs_in_experts):
        model = dataclasses.replace(model, moe_probs_in_experts=fw.moe_probs_in_experts)
    if decides("model.separate_projections", fw.separate_projections):
        model = dataclasses.replace(model, separate_projections=fw.separate_projections)
    if decides("model.tp_overlap_backward", fw.tp_overlap_backward):
        model = dataclasses.replace(model, tp_overlap_backward=fw.tp_overlap_backward)
    if decides("hardware.host_dispatch_s", fw.host_dispatch_s):
        hw = dataclasses.replace(hw, host_dispatch_s=fw.host_dispatch_s)
    if fw.flash_attention:
        hw = flash_attention_hardware(fw.flash_attention, hw)
    if par.tp_comm_overlap and not fw.tp_comm_overlap:
        raise ConfigError(f"parallelism.tp_comm_overlap=true: framework '{fw.name}' cannot overlap tensor-parallel "
                          "communication with the GEMMs (framework.tp_comm_overlap is false); set "
                          "parallelism.tp_comm_overlap=false or choose a framework that can (megatron-core, "
                          "megatron-bridge, torchtitan)")
    return hw, model, par
