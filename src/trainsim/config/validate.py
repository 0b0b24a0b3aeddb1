"""Cross-field rules of a run, checked at composition so a stage never starts on an impossible layout.

Each message names the field, its value and what would be accepted.
"""

from __future__ import annotations

import dataclasses

from trainsim.config.choices import (
    BUILT_RECOMPUTE_MODULES,
    COMM_BACKENDS,
    CP_COMM_TYPES,
    DEVICE_KINDS,
    FLOAT_DTYPES,
    FP8_RECIPES,
    MOE_DISPATCHERS,
    OP_KINDS,
    PRECISIONS,
    PROFILE_BACKENDS,
    RECOMPUTE_MODES,
    RECOMPUTE_MODULES,
    SCHEDULES,
    SLOWDOWN_SOURCES,
    SLOWDOWN_USES,
    ZERO_STAGES,
    fp8_weights_only,
)
from trainsim.config.schema import RANGE_SETTINGS, HardwareConfig, ModelConfig, ParallelismConfig, WhatIfConfig
from trainsim.config.validate_model import divisors, one_of, positive, validate_model
from trainsim.config.validate_nccl import validate_links
from trainsim.config.validate_precision import validate_block_scaling, validate_precision_hardware
from trainsim.errors import ConfigError
from trainsim.parallel.pipeline_split import PipelineSplitError, split_of


def validate_recompute_modules(model: ModelConfig, par: ParallelismConfig) -> None:
    """Megatron-Core's recompute_modules: known, built, and where Megatron requires it, applicable."""
    modules = list(par.recompute_modules)
    if par.recompute != "selective":
        if modules != ["core_attn"]:
            raise ConfigError(f"parallelism.recompute_modules={modules} applies with parallelism.recompute="
                              f"'selective' (got '{par.recompute}'); set recompute=selective, or leave "
                              "recompute_modules at its default [core_attn]")
        return
    for module in modules:
        one_of("parallelism", "recompute_modules", module, RECOMPUTE_MODULES)
        if module not in BUILT_RECOMPUTE_MODULES:
            raise ConfigError(f"parallelism.recompute_modules: '{module}' is not built (built: "
                              f"{', '.join(BUILT_RECOMPUTE_MODULES)}); leave it out")
    if "mla_up_proj" in modules and not model.latent_attention:
        raise ConfigError(f"parallelism.recompute_modules: 'mla_up_proj' needs multi-head latent attention "
                          f"(model.latent_attention is false for {model.name}), as Megatron-Core requires")


def validate_layout(model: ModelConfig, par: ParallelismConfig) -> None:
    """Rules tying the parallel layout to the model (enough to trace; no hardware needed)."""
    validate_model(model)
    positive("parallelism", par, "dp", "cp", "tp", "pp", "virtual_stages", "micro_batch_size", "global_batch_size")
    one_of("parallelism", "schedule", par.schedule, SCHEDULES)
    one_of("parallelism", "recompute", par.recompute, RECOMPUTE_MODES)
    validate_recompute_modules(model, par)
    one_of("parallelism", "precision", par.precision, PRECISIONS)
    if par.precision == "fp8":
        one_of("parallelism", "fp8_recipe", par.fp8_recipe, FP8_RECIPES)
    validate_block_scaling(model, par)
    if par.dp_bucket_size_bytes < 1:
        raise ConfigError(f"parallelism.dp_bucket_size_bytes={par.dp_bucket_size_bytes} must be positive "
                          "(bytes per gradient bucket; the default is 26214400, 25 MiB)")
    if par.sequence_parallel and (par.micro_batch_size * model.seq_length) % par.tp:
        raise ConfigError(f"parallelism.sequence_parallel=true splits each micro-batch's tokens over tp: "
                          f"micro_batch_size * model.seq_length = {par.micro_batch_size * model.seq_length} is not "
                          f"divisible by parallelism.tp={par.tp}; set parallelism.sequence_parallel=false, or a tp "
                          "or micro_batch_size that divides it")
    if par.tp_comm_overlap and not (par.sequence_parallel and par.tp > 1):
        raise ConfigError(f"parallelism.tp_comm_overlap=true overlaps the sequence-parallel collectives: it needs "
                          f"parallelism.sequence_parallel=true and tp > 1 (got sequence_parallel="
                          f"{par.sequence_parallel}, tp={par.tp})")
    if par.recompute == "op" and par.tp_comm_overlap:
        raise ConfigError("parallelism.recompute='op' with parallelism.tp_comm_overlap=true: torchtitan's op-level "
                          "checkpointing chooses among the projections' GEMMs before torch.compile fuses them into "
                          "the overlap rings, which are built as one GEMM per ring step; not built. Set "
                          "tp_comm_overlap=false, or recompute to 'full' or 'none'")
    one_of("parallelism", "zero_stage", par.zero_stage, ZERO_STAGES)
    one_of("parallelism", "cp_comm_type", par.cp_comm_type, CP_COMM_TYPES)
    _validate_cpu_offload(model, par)
    if par.cp > 1:
        if model.seq_length % (2 * par.cp):
            raise ConfigError(f"parallelism.cp={par.cp} cuts each sequence into 2 * cp = {2 * par.cp} chunks "
                              f"(load-balanced causal split): model.seq_length={model.seq_length} is not divisible "
                              f"by {2 * par.cp}; choose cp among "
                              f"{divisors(model.seq_length // 2) if model.seq_length % 2 == 0 else '1'}")
        variants = [name for name, on in (("model.window_size", model.window_size),
                                          ("model.attention_sinks", model.attention_sinks),
                                          ("model.kv_lora_rank", model.kv_lora_rank)) if on]
        if variants:
            raise ConfigError(f"parallelism.cp={par.cp}: context-parallel attention is built for full causal "
                              f"multi-/grouped-query attention only; {', '.join(variants)} (windows, sinks, latent "
                              "attention) with context parallelism is not built. Set parallelism.cp=1")
        if model.attention != "fused":
            raise ConfigError(f"parallelism.cp={par.cp} runs attention as flash-attention blocks: it needs "
                              f"model.attention='fused' (got {model.attention!r})")
        if par.sequence_parallel and (par.micro_batch_size * model.seq_length // par.cp) % par.tp:
            raise ConfigError(f"parallelism.sequence_parallel=true splits each context-parallel rank's "
                              f"{par.micro_batch_size * model.seq_length // par.cp} tokens per micro-batch over "
                              f"tp={par.tp}: not divisible; set parallelism.sequence_parallel=false, or a tp, cp "
                              "or micro_batch_size that makes it divisible")
    if par.overlap_param_gather and par.zero_stage != 1:
        raise ConfigError("parallelism.overlap_param_gather=true overlaps the distributed optimizer's parameter "
                          f"all-gather: it needs parallelism.zero_stage=1 (got {par.zero_stage}; FSDP, stages 2 "
                          "and 3, always prefetches the next layer's weights)")
    _validate_sharding(model, par)
    _validate_expert_layout(model, par)
    if "M" in model.hybrid_layer_pattern:
        _validate_mamba_layout(model, par)
    if par.clip_grad < 0:
        raise ConfigError(f"parallelism.clip_grad={par.clip_grad} must be >= 0 (0 = no gradient clipping)")

    kv_heads = model.num_kv_heads or model.num_attention_heads
    for field_name, value in (("num_attention_heads", model.num_attention_heads), ("num_kv_heads", kv_heads)):
        if value % par.tp:
            raise ConfigError(
                f"parallelism.tp={par.tp} does not divide model.{field_name}={value} of '{model.name}'; "
                f"choose tp among {divisors(value)}"
            )
    ffn = model.ffn_hidden_size or 4 * model.hidden_size
    if ffn % par.tp:
        raise ConfigError(f"parallelism.tp={par.tp} does not divide the MLP width {ffn} (model.ffn_hidden_size) of "
                          f"'{model.name}'; choose tp among {divisors(ffn)}")

    _validate_pipeline_split(model, par)

    samples_per_microbatch_round = par.micro_batch_size * par.dp
    if par.global_batch_size % samples_per_microbatch_round:
        above = -(-par.global_batch_size // samples_per_microbatch_round) * samples_per_microbatch_round
        raise ConfigError(
            f"parallelism.global_batch_size={par.global_batch_size} is not a multiple of "
            f"micro_batch_size * dp = {par.micro_batch_size} * {par.dp} = {samples_per_microbatch_round}; set "
            f"parallelism.global_batch_size={above} (the next multiple) or change micro_batch_size / dp"
        )

    if par.schedule == "interleaved-1f1b":
        if par.virtual_stages < 2 or par.pp < 2:
            raise ConfigError(
                "parallelism.schedule='interleaved-1f1b' needs pp >= 2 and virtual_stages >= 2 "
                f"(got pp={par.pp}, virtual_stages={par.virtual_stages}); use '1f1b' otherwise"
            )
        if par.num_microbatches % par.pp:
            raise ConfigError(
                f"interleaved-1f1b needs num_microbatches (= {par.num_microbatches}) to be a multiple of "
                f"pp={par.pp}; change parallelism.global_batch_size"
            )
    elif par.virtual_stages != 1:
        raise ConfigError(
            f"parallelism.virtual_stages={par.virtual_stages} needs schedule='interleaved-1f1b' "
            f"(got '{par.schedule}'); set parallelism.schedule=interleaved-1f1b (pp >= 2) or "
            "parallelism.virtual_stages=1"
        )


def _validate_pipeline_split(model: ModelConfig, par: ParallelismConfig) -> None:
    """The layers of every pipeline chunk, as Megatron-Core splits them; its refusals, with the fields named."""
    uneven = {name: getattr(par, name) for name in ("first_stage_layers", "last_stage_layers",
                                                     "account_for_embedding_in_pipeline_split",
                                                     "account_for_loss_in_pipeline_split", "pipeline_layout")
              if getattr(par, name)}
    try:
        split_of(model, par)
    except PipelineSplitError as exc:
        if not uneven:
            raise ConfigError(
                f"model.num_layers={model.num_layers} of '{model.name}' cannot be split evenly into "
                f"parallelism.pp * parallelism.virtual_stages = {par.pp} * {par.virtual_stages} = "
                f"{par.pp * par.virtual_stages} stages; choose pp * virtual_stages among "
                f"{divisors(model.num_layers)}, or set parallelism.first_stage_layers / last_stage_layers, "
                "account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split or pipeline_layout"
            ) from None
        fields = ", ".join(f"parallelism.{name}={value!r}" for name, value in uneven.items())
        raise ConfigError(f"{fields} with parallelism.pp={par.pp}, virtual_stages={par.virtual_stages} for "
                          f"model.num_layers={model.num_layers} of '{model.name}': {exc} (Megatron-Core refuses "
                          "this split; see parallel/pipeline_split.py)") from None


def _validate_mamba_layout(model: ModelConfig, par: ParallelismConfig) -> None:
    """Megatron-Core's MambaMixer splits heads and groups over tp; context parallelism of Mamba is not built."""
    for field_name, value in (("mamba heads (model.mamba_num_heads, or 2 * hidden_size / mamba_head_dim)",
                               model.mamba_heads), ("model.mamba_num_groups", model.mamba_num_groups)):
        if value % par.tp:
            raise ConfigError(f"parallelism.tp={par.tp} does not divide the {field_name} = {value} of "
                              f"'{model.name}'; choose tp among {divisors(value)}")
    if par.cp > 1:
        raise ConfigError(f"parallelism.cp={par.cp} with Mamba layers (model.hybrid_layer_pattern has 'M') is not "
                          "built: the Mamba-2 scan runs over the whole sequence on one rank; use cp=1")


def _validate_sharding(model: ModelConfig, par: ParallelismConfig) -> None:
    """HSDP (dp_shard_size) and FP8 weight all-gathers (fp8_param_gather)."""
    replicas = par.dp * par.cp
    if par.dp_shard_size:
        field = f"parallelism.dp_shard_size={par.dp_shard_size}"
        if par.dp_shard_size < 0 or replicas % par.dp_shard_size:
            raise ConfigError(f"{field} must divide dp * cp = {par.dp} * {par.cp} = {replicas} (the ranks holding "
                              f"the same weights; 0 = all of them); choose among 0, {divisors(replicas)}")
        if par.zero_stage < 1:
            raise ConfigError(f"{field} splits the sharded training state, but parallelism.zero_stage=0 shards "
                              "nothing; set zero_stage 1 (distributed-optimizer instances), 2 or 3 (HSDP), or "
                              "dp_shard_size=0")
        if model.num_experts and par.dp_shard_size < replicas:
            raise ConfigError(f"{field} < dp * cp = {replicas} (HSDP / several distributed-optimizer instances) "
                              f"with experts (model '{model.name}', num_experts={model.num_experts}) is not built: "
                              "the expert-data-parallel group is not cut into shard and replica groups; set "
                              f"dp_shard_size=0 or {replicas}")
    elif par.dp_shard_size < 0:
        raise ConfigError(f"parallelism.dp_shard_size={par.dp_shard_size} must be >= 0 (0 = all dp * cp ranks)")
    if par.fp8_param_gather:
        if par.precision != "fp8":
            raise ConfigError(f"parallelism.fp8_param_gather=true all-gathers FP8 weights: it needs "
                              f"parallelism.precision='fp8' (got {par.precision!r})")
        if par.zero_stage < 2 and not fp8_weights_only(par):
            raise ConfigError(f"parallelism.fp8_param_gather=true with parallelism.zero_stage={par.zero_stage} and "
                              f"fp8_recipe={par.fp8_recipe!r}: FP8 weights are built for FSDP (zero_stage 2 or 3, "
                              "torchtitan's enable_fsdp_float8_all_gather) and, with the distributed optimizer "
                              "(zero_stage 1), for MXFP8 (Megatron's --fp8-param-gather with "
                              "reuse_grad_buf_for_mxfp8_param_ag); the per-tensor recipes' FP8 all-gather under the "
                              "distributed optimizer is not built yet; set zero_stage 2 or 3, fp8_recipe=mxfp8, or "
                              "fp8_param_gather=false")


def _validate_expert_layout(model: ModelConfig, par: ParallelismConfig) -> None:
    for name in ("ep", "etp"):
        if getattr(par, name) < 1:
            raise ConfigError(f"parallelism.{name}={getattr(par, name)} must be >= 1")
    if not model.num_experts:
        for name in ("ep", "etp"):
            if getattr(par, name) > 1:
                raise ConfigError(f"parallelism.{name}={getattr(par, name)} splits experts, but model "
                                  f"'{model.name}' has none (model.num_experts=0); use {name}=1")
        if par.moe_a2a_overlap:
            raise ConfigError(f"parallelism.moe_a2a_overlap=true overlaps expert all-to-alls, but model "
                              f"'{model.name}' has no experts (model.num_experts=0); set it false")
        return
    if model.num_experts % par.ep:
        raise ConfigError(f"parallelism.ep={par.ep} does not divide model.num_experts={model.num_experts}; "
                          f"choose ep among {divisors(model.num_experts)}")
    stage = par.dp * par.cp * par.tp
    if stage % (par.ep * par.etp):
        raise ConfigError(f"parallelism.ep * etp = {par.ep} * {par.etp} must divide dp * cp * tp = {stage} (expert "
                          f"parallelism is folded over those ranks of a stage); choose ep * etp among "
                          f"{divisors(stage)}")
    ffn = model.expert_ffn_hidden_size
    if ffn % par.etp:
        raise ConfigError(f"parallelism.etp={par.etp} does not divide the experts' inner width {ffn} "
                          f"(model.moe_ffn_hidden_size); choose etp among {divisors(ffn)}")
    if par.precision == "fp8" and (ffn // par.etp) % 16:
        raise ConfigError(f"parallelism.etp={par.etp} leaves each expert an inner width of {ffn // par.etp}, not a "
                          "multiple of 16 as FP8 GEMMs need; choose a smaller etp or precision bf16")
    if par.tp > 1 and not par.sequence_parallel:
        raise ConfigError(f"model '{model.name}' has experts and parallelism.tp={par.tp}: MoE layers route each tp "
                          "rank's own tokens, so set parallelism.sequence_parallel=true (as Megatron-Core requires)")
    one_of("parallelism", "moe_token_dispatcher", par.moe_token_dispatcher, MOE_DISPATCHERS)
    if par.moe_token_dispatcher == "allgather" and model.moe_capacity_factor:
        raise ConfigError("parallelism.moe_token_dispatcher='allgather' with model.moe_capacity_factor="
                          f"{model.moe_capacity_factor}: token dropping is modelled with the 'alltoall' "
                          "dispatcher only; set parallelism.moe_token_dispatcher=alltoall or "
                          "model.moe_capacity_factor=0 (no dropping)")
    if model.moe_shared_expert_ffn_hidden_size % par.tp:
        raise ConfigError(f"parallelism.tp={par.tp} does not divide model.moe_shared_expert_ffn_hidden_size="
                          f"{model.moe_shared_expert_ffn_hidden_size} (the shared expert is tensor-parallel); choose "
                          f"tp among {divisors(model.moe_shared_expert_ffn_hidden_size)}")
    if par.precision == "fp8" and not par.moe_grouped_gemm:
        raise ConfigError("parallelism.precision='fp8' with experts runs them as FP8 grouped GEMMs (Transformer "
                          "Engine's GroupedLinear): set parallelism.moe_grouped_gemm=true")
    if par.moe_a2a_overlap and (why := a2a_overlap_refusal(par)):
        raise ConfigError(why)


def a2a_overlap_refusal(par: ParallelismConfig) -> str | None:
    """Why parallelism.moe_a2a_overlap cannot apply to this layout (None: it can): what the combined
    forward-backward passes (workloads/combined_passes.py) are built for."""
    needs = [("ep", par.ep > 1, f"ep={par.ep}: there is no all-to-all to hide; set ep > 1"),
             ("moe_token_dispatcher", par.moe_token_dispatcher == "alltoall",
              f"moe_token_dispatcher='{par.moe_token_dispatcher}': only the 'alltoall' dispatcher's exchanges are "
              "overlapped"),
             ("schedule", par.schedule in ("1f1b", "interleaved-1f1b"),
              f"schedule='{par.schedule}': combined passes pair the steady-state forwards and backwards of "
              "'1f1b' (pp = 1 included) and 'interleaved-1f1b'; use one of them"),
             ("recompute", par.recompute not in ("full", "op"),
              f"recompute='{par.recompute}': a block checkpointed as a whole cannot be split at its all-to-alls; use "
              "'selective' or 'none' (as Megatron-Core requires)"),
             ("zero_stage", par.zero_stage < 2, f"zero_stage={par.zero_stage}: FSDP with overlapped all-to-alls "
              "is not built; use zero_stage 0 or 1")]
    for field_name, ok, why in needs:
        if not ok:
            return f"parallelism.moe_a2a_overlap=true with parallelism.{why} (field {field_name})"
    return None


def validate_hardware(hw: HardwareConfig) -> None:
    one_of("hardware", "device_kind", hw.device_kind, DEVICE_KINDS)
    one_of("hardware", "comm_backend", hw.comm_backend, COMM_BACKENDS)
    positive("hardware", hw, "devices_per_node", "num_nodes", "threads_per_device")
    if hw.device_kind == "cpu" and hw.comm_backend != "gloo":
        raise ConfigError(f"hardware.comm_backend='{hw.comm_backend}' cannot run on CPU devices; use 'gloo'")
    one_of("hardware", "profile_backend", hw.profile_backend, PROFILE_BACKENDS)
    one_of("hardware", "slowdown.source", hw.slowdown.source, SLOWDOWN_SOURCES)
    one_of("hardware", "slowdown.use", hw.slowdown.use, SLOWDOWN_USES)
    _validate_rates(hw)
    if not 0.0 <= hw.host_dispatch_s < 1.0:
        raise ConfigError(f"hardware.host_dispatch_s={hw.host_dispatch_s} must be seconds per op in [0, 1) "
                          "(0 = the host never limits)")
    validate_links(hw)
    validate_what_if(hw)


def validate_what_if(hw: HardwareConfig) -> None:
    for f in dataclasses.fields(WhatIfConfig):
        value = getattr(hw.what_if, f.name)
        if not value > 0:
            raise ConfigError(f"hardware.what_if.{f.name}={value} must be positive (1.0 = unchanged)")
    compute = hw.what_if.peak_flops_scale != 1.0 or hw.what_if.memory_bandwidth_scale != 1.0
    if compute and (not hw.peak_flops_per_s or not hw.memory_bandwidth_bytes_per_s):
        raise ConfigError(f"hardware '{hw.name}': what_if.peak_flops_scale / memory_bandwidth_scale need "
                          "hardware.peak_flops_per_s and hardware.memory_bandwidth_bytes_per_s (the roofline "
                          "that decides how much each kernel speeds up)")


def _validate_rates(hw: HardwareConfig) -> None:
    """Peak rates only for dtypes ops run in, efficiencies only for op kinds the kernel model has."""
    for dtype, rate in hw.peak_flops_per_s.items():
        if dtype not in FLOAT_DTYPES:
            raise ConfigError(f"hardware.peak_flops_per_s.{dtype}={rate:g}: no op is timed at a {dtype!r} rate; "
                              f"supported: {', '.join(FLOAT_DTYPES)}")
        if rate <= 0:
            raise ConfigError(f"hardware.peak_flops_per_s.{dtype}={rate} must be positive (or leave it out)")
    kinds = OP_KINDS
    for kind, efficiency in hw.kernel_model.kind_efficiency.items():
        if kind not in kinds or efficiency <= 0:
            raise ConfigError(f"hardware.kernel_model.kind_efficiency.{kind}={efficiency}: supported: a positive "
                              f"efficiency for one of {', '.join(kinds)}")
    for name, bounds in hw.kernel_model.fitted_range.items():
        if name not in RANGE_SETTINGS or len(bounds) != 2 or bounds[0] > bounds[1]:
            raise ConfigError(f"hardware.kernel_model.fitted_range.{name}={list(bounds)}: supported: [low, high] "
                              f"with low <= high for one of {', '.join(RANGE_SETTINGS)}")
    for name in ("attention_forward_efficiency", "attention_backward_efficiency", "fp8_matmul_efficiency"):
        if not 0 <= getattr(hw.kernel_model, name) <= 1:
            raise ConfigError(f"hardware.kernel_model.{name}={getattr(hw.kernel_model, name)} must be in [0, 1] "
                              "(a fraction of the dtype's peak; 0 = matmul_efficiency)")
    for name in ("attention_tile_keys", "attention_dropout_forward_s_per_score",
                 "attention_dropout_backward_s_per_score", "attention_setup_forward_s", "attention_setup_backward_s"):
        if getattr(hw.kernel_model, name) < 0:
            raise ConfigError(f"hardware.kernel_model.{name}={getattr(hw.kernel_model, name)} must be >= 0 (0 = none)")
    if hw.sm_count < 0:
        raise ConfigError(f"hardware.sm_count={hw.sm_count} must be >= 0 (0 = no wave quantisation)")
    for name in ("memory_bandwidth_bytes_per_s", "memory_capacity_bytes", "host_link_bandwidth_bytes_per_s",
                 "price_per_device_hour"):
        if getattr(hw, name) < 0:
            raise ConfigError(f"hardware.{name}={getattr(hw, name)} must be >= 0 (0 = unknown)")


def _validate_fp8_hardware(hw: HardwareConfig, par: ParallelismConfig) -> None:
    """FP8 GEMMs need a device with FP8 tensor cores: a GPU config must state its FP8 peak. CPU devices are
    measured, not modelled from a peak (torch runs _scaled_mm on the CPU), so they run FP8 without one."""
    if par.precision == "fp8" and hw.device_kind != "cpu" and "fp8" not in hw.peak_flops_per_s:
        known = ", ".join(sorted(hw.peak_flops_per_s)) or "none"
        raise ConfigError(f"parallelism.precision='fp8' needs an FP8 peak: hardware '{hw.name}' has no "
                          f"hardware.peak_flops_per_s.fp8 (known: {known}); use a device with FP8 tensor cores "
                          "(H100, H800, GB200) or parallelism.precision=bf16")


def _validate_cpu_offload(model: ModelConfig, par: ParallelismConfig) -> None:
    """Megatron-Core's own rules for --cpu-offloading-num-layers (TransformerConfig.__post_init__)."""
    n = par.cpu_offload_layers
    if n == 0:
        return
    if not 0 < n < model.num_layers:
        raise ConfigError(f"parallelism.cpu_offload_layers={n}: offloads the activations of the first N layers, "
                          f"0 <= N < model.num_layers={model.num_layers} (Megatron-Core's bound)")
    for field, value, accepted in (("pp", par.pp, 1), ("recompute", par.recompute, "none"),
                                   ("moe_a2a_overlap", par.moe_a2a_overlap, False)):
        if value != accepted:
            raise ConfigError(f"parallelism.cpu_offload_layers={n} with parallelism.{field}={value!r}: Megatron-Core "
                              f"offloads activations only without pipeline parallelism, recomputation or combined "
                              f"passes; set parallelism.{field}={accepted!r} or cpu_offload_layers=0")


def validate_run(hw: HardwareConfig, model: ModelConfig, par: ParallelismConfig) -> None:
    """All rules of a full simulation point."""
    validate_hardware(hw)
    validate_layout(model, par)
    validate_precision_hardware(hw, par)  # (first: names the GPU a block recipe needs, not only its FP8 peak)
    _validate_fp8_hardware(hw, par)
    if par.cpu_offload_layers and hw.device_kind == "cuda" and hw.host_link_bandwidth_bytes_per_s <= 0:
        raise ConfigError(f"parallelism.cpu_offload_layers={par.cpu_offload_layers} copies activations to host memory: "
                          f"hardware '{hw.name}' states no hardware.host_link_bandwidth_bytes_per_s (the GPU's "
                          "per-direction link to its host: PCIe Gen5 x16 64e9, NVLink-C2C ...); set it")
    devices = hw.num_nodes * hw.devices_per_node
    if par.world_size > devices:
        raise ConfigError(
            f"parallelism dp*cp*tp*pp = {par.dp}*{par.cp}*{par.tp}*{par.pp} = {par.world_size} devices, but hardware "
            f"'{hw.name}' has {devices} (num_nodes={hw.num_nodes} x devices_per_node={hw.devices_per_node}); "
            f"lower dp/cp/tp/pp or raise hardware.num_nodes to {-(-par.world_size // hw.devices_per_node)}"
        )
