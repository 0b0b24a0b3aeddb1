"""A torchtitan TOML job config -> ParallelismConfig.

torchtitan (torchtitan/config/job_config.py) names its layout in [parallelism] (data_parallel_replicate_degree x
data_parallel_shard_degree x context x tensor x pipeline degrees, expert parallelism folded over them), its batch
and precision in [training], recomputation in [activation_checkpoint] and FP8 in [float8] / [quantize.linear.*]
with model.converters. Its defaults are taken where the file says nothing (data_parallel_shard_degree -1 = the
remaining ranks, activation_checkpoint.mode 'selective' every 2nd layer, first and last pipeline stages one layer
lighter). FSDP2 (shard degree or cp > 1) shards weights, gradients and optimizer states (zero_stage 3, or 2 when
weights stay gathered after the forward: fsdp_reshard_after_forward 'never', or 'default' with pipelining).
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

from trainsim.config.imported_layout import ImportedLayout, layout_fields, refuse
from trainsim.errors import ConfigError

PARALLELISM_KEYS = {
    "data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1, "fsdp_reshard_after_forward": "default",
    "tensor_parallel_degree": 1, "enable_async_tensor_parallel": False, "pipeline_parallel_degree": 1,
    "pipeline_parallel_schedule": "1F1B", "pipeline_parallel_microbatch_size": 1,
    "pipeline_parallel_layers_per_stage": None, "pipeline_parallel_first_stage_less_layers": 1,
    "pipeline_parallel_last_stage_less_layers": 1, "context_parallel_degree": 1,
    "context_parallel_rotate_method": "allgather", "expert_parallel_degree": 1, "expert_tensor_parallel_degree": 1,
}
"""[parallelism] keys import_torchtitan reads, with torchtitan's defaults."""

SCHEDULES = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "interleaved-1f1b"}
"""torchtitan's pipeline_parallel_schedule -> parallelism.schedule (the looped zero-bubble and DualPipeV schedules
are not built)."""
LOOPED_DEFAULT_STAGES_PER_RANK = 2  # cite: torchtitan distributed/pipeline_parallel.py: stages_per_rank = 2 if looped
ROTATE_METHODS = {"allgather": "all_gather", "alltoall": "p2p"}
"""context_parallel_rotate_method -> cp_comm_type: all-gather of K/V, or K/V shards passed on around the ring."""
FLOAT8_RECIPES = {None: "current", "tensorwise": "current", "rowwise": "rowwise"}
"""[float8] recipe_name -> fp8_recipe: per-tensor dynamic (current) scaling, or a scale per row (rowwise)."""
NOT_LAYOUT_SECTIONS = ("job", "metrics", "checkpoint", "optimizer", "lr_scheduler", "profiling", "comm", "validation",
                       "fault_tolerance", "memory_estimation", "experimental", "debug", "dataloader")
"""Sections that set no part of the layout: listed in the output as not imported."""
MODEL_KEYS = ("model.name", "model.flavor", "model.hf_assets_path", "model.tokenizer_path", "training.seq_len")
"""Settings of the model trained (conf/model): listed, not imported."""
NOT_LAYOUT_KEYS = ("training.dataset", "training.dataset_path", "training.steps", "training.gc_freq",
                   "training.gc_debug", "training.seed", "training.deterministic", "training.warmup_steps",
                   "training.mixed_precision_reduce", "activation_checkpoint.preserve_rng_state",
                   "activation_checkpoint.determinism_check", "activation_checkpoint.debug",
                   "activation_checkpoint.early_stop",
                   "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",
                   "model.print_after_conversion", "compile.enable", "compile.components", "compile.backend",
                   "float8.precompute_float8_dynamic_scale_for_fsdp",
                   "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
                   "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice")
"""Keys of the layout's sections that change no step time trainsim models (or only numerics): listed."""


LEGACY_KEYS = {
    "training.batch_size": "training.local_batch_size",
    "training.data_parallel_replicate_degree": "parallelism.data_parallel_replicate_degree",
    "training.data_parallel_shard_degree": "parallelism.data_parallel_shard_degree",
    "training.tensor_parallel_degree": "parallelism.tensor_parallel_degree",
    "experimental.enable_async_tensor_parallel": "parallelism.enable_async_tensor_parallel",
    "experimental.pipeline_parallel_degree": "parallelism.pipeline_parallel_degree",
    "experimental.pipeline_parallel_schedule": "parallelism.pipeline_parallel_schedule",
    "experimental.context_parallel_degree": "parallelism.context_parallel_degree",
    "experimental.context_parallel_rotate_method": "parallelism.context_parallel_rotate_method",
    "training.compile": "compile.enable",
}
"""Keys of torchtitan's 2024 job configs (the published torchtitan benchmarks ran them) -> today's names."""


def modern_keys(keys: dict[str, object], where: str) -> dict[str, object]:
    """A 2024 torchtitan job's keys under today's names: `float8.enable_float8_linear` becomes the float8
    converter, `experimental.pipeline_parallel_microbatches` a micro-batch size."""
    out = {LEGACY_KEYS.get(key, key): value for key, value in keys.items()}
    if out.pop("float8.enable_float8_linear", False):
        out["model.converters"] = [*out.get("model.converters", []), "float8"]
    scaling = {out.pop(f"float8.scaling_type_{t}", "dynamic") for t in ("input", "weight", "grad_output")}
    if scaling != {"dynamic"}:
        raise refuse("float8.scaling_type_*", sorted(scaling), "dynamic (per-tensor current scaling)")
    micro = out.pop("experimental.pipeline_parallel_microbatches", None)
    if out.get("parallelism.pipeline_parallel_degree", 1) > 1 and "experimental.pipeline_parallel_degree" in keys:
        local = out.get("training.local_batch_size", 8)
        if micro is None or local % micro:
            raise ConfigError(f"{where}: experimental.pipeline_parallel_microbatches {micro}: import-layout needs it "
                              f"given and dividing training.batch_size {local}")
        out["parallelism.pipeline_parallel_microbatch_size"] = local // micro
    return out


def flatten(table: dict, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, object] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def import_torchtitan(toml: str | Path, world_size: int | None = None, name: str = "", allow_unknown: bool = False,
                      num_layers: int | None = None) -> ImportedLayout:
    """The layout of a torchtitan job config (a TOML file path or its text). `world_size` is needed when
    data_parallel_shard_degree is -1 (the remaining ranks); `num_layers` only for pipeline_parallel_layers_per_stage."""
    path = Path(toml) if isinstance(toml, Path) or (isinstance(toml, str) and toml.endswith(".toml")) else None
    try:
        text = path.read_text() if path else str(toml)
        keys = flatten(tomllib.loads(text))
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"torchtitan job config {path or '<text>'}: {error}") from error
    where = str(path) if path else "torchtitan TOML"
    keys = modern_keys(keys, where)
    used: set[str] = set()

    def get(key: str, default: object) -> object:
        used.add(key)
        return keys.get(key, default)

    fields = _torchtitan_fields(get, where, world_size, num_layers)
    model = [f"{k} = {keys[k]!r}" for k in keys if k in MODEL_KEYS]
    listed = set(MODEL_KEYS) | set(NOT_LAYOUT_KEYS)
    if fields["precision"] != "fp8":  # torchtitan reads the float8 / MX sections only for an active converter
        listed |= {k for k in keys if k.startswith(("float8.", "quantize.linear."))}
    other = [k for k in keys if k not in used and k not in listed and (k.split(".")[0] not in NOT_LAYOUT_SECTIONS
                                                                    or k.startswith("experimental.pipeline"))]
    if other and not allow_unknown:
        raise ConfigError(f"{where}: settings not known to import-layout: {other}; pass --allow-unknown to import the "
                          f"rest (they are listed in the output). Known parallelism.* keys: {sorted(PARALLELISM_KEYS)}")
    unknown = [f"{k} = {keys[k]!r}" for k in other]
    notes = ["compile.enable = true: torch.compile's fusions are not priced (trainsim times eager kernels)"] \
        if keys.get("compile.enable") else []
    if fields["ep"] == 1 and fields["tp"] > 1:  # trainsim refuses etp > 1 for a model without experts
        fields["etp"] = 1
        notes.append(f"expert_parallel_degree 1: torchtitan shards a mixture of experts' experts over tp, written as "
                     f"etp 1 for a dense model; for a mixture of experts set parallelism.etp={fields['tp']}")
    return ImportedLayout(layout_fields(fields, name), f"torchtitan job config {where}", model, unknown, notes,
                          "torchtitan")


def _torchtitan_fields(get, where: str, world_size: int | None, num_layers: int | None) -> dict[str, object]:
    par = {key: get(f"parallelism.{key}", default) for key, default in PARALLELISM_KEYS.items()}
    replicate, shard = par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]
    tp, pp, cp = par["tensor_parallel_degree"], par["pipeline_parallel_degree"], par["context_parallel_degree"]
    others = replicate * cp * tp * pp
    if shard == -1:
        if world_size is None:
            raise ConfigError(f"{where}: parallelism.data_parallel_shard_degree = -1 (the remaining ranks) needs the "
                              f"world size: pass --gpus N or --nodes/--gpus-per-node")
        if world_size % others:
            raise ConfigError(f"{where}: world size {world_size} is not divisible by replicate x cp x tp x pp = "
                              f"{others}")
        shard = world_size // others
    elif world_size is not None and shard * others != world_size:
        raise ConfigError(f"{where}: replicate x shard x cp x tp x pp = {shard * others}, not the world size "
                          f"{world_size} (torchtitan requires them equal)")
    dp = replicate * shard
    fsdp = shard > 1 or cp > 1
    f: dict[str, object] = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": par["expert_parallel_degree"],
                            "etp": par["expert_tensor_parallel_degree"], "sequence_parallel": tp > 1,
                            "tp_comm_overlap": bool(par["enable_async_tensor_parallel"]) and tp > 1,
                            "moe_token_dispatcher": "alltoall", "moe_grouped_gemm": True,
                            "gradient_accumulation_fusion": False,
                            "clip_grad": float(get("training.max_norm", 1.0))}
    rotate = par["context_parallel_rotate_method"]
    if rotate not in ROTATE_METHODS:
        raise refuse("parallelism.context_parallel_rotate_method", rotate, f"{sorted(ROTATE_METHODS)}")
    f["cp_comm_type"] = ROTATE_METHODS[rotate]
    if fsdp:
        policy = par["fsdp_reshard_after_forward"]
        if policy not in ("default", "always", "never"):
            raise refuse("parallelism.fsdp_reshard_after_forward", policy, "default, always, never")
        keep = policy == "never" or (policy == "default" and pp > 1)  # torchtitan: default = not pipelined
        f.update(zero_stage=2 if keep else 3, dp_shard_size=shard * cp if replicate > 1 else 0,
                 grad_reduce_in_fp32=True)  # FSDP2 reduce-scatters in fp32 (training.mixed_precision_reduce)
    f.update(_schedule_fields(par, where, num_layers))
    f.update(_batch_fields(get, where, dp, pp, par["pipeline_parallel_microbatch_size"]))
    f.update(_precision_fields(get, where, fsdp, replicate > 1 and tp == pp == 1))
    f.update(_recompute_fields(get, where))
    return f


def _schedule_fields(par: dict, where: str, num_layers: int | None) -> dict[str, object]:
    pp = par["pipeline_parallel_degree"]
    if pp == 1:
        return {"schedule": "1f1b", "virtual_stages": 1}
    schedule = par["pipeline_parallel_schedule"]
    if schedule not in SCHEDULES:
        raise refuse("parallelism.pipeline_parallel_schedule", schedule, f"{sorted(SCHEDULES)}")
    first, last = par["pipeline_parallel_first_stage_less_layers"], par["pipeline_parallel_last_stage_less_layers"]
    for key, value in (("first", first), ("last", last)):
        if value not in (0, 1):
            raise refuse(f"parallelism.pipeline_parallel_{key}_stage_less_layers", value,
                         "1 (the embedding / output layer counted as a layer) or 0")
    virtual = 1
    if SCHEDULES[schedule] == "interleaved-1f1b":
        per_stage = par["pipeline_parallel_layers_per_stage"]
        if per_stage is None:
            virtual = LOOPED_DEFAULT_STAGES_PER_RANK
        elif num_layers is None:
            raise ConfigError(f"{where}: parallelism.pipeline_parallel_layers_per_stage needs the model's layer count "
                              f"to give the stages: pass --num-layers")
        else:
            stages = math.ceil((num_layers + first + last) / per_stage)
            if stages % pp:
                raise ConfigError(f"{where}: {stages} stages of {per_stage} layers do not divide over "
                                  f"pipeline_parallel_degree {pp}")
            virtual = stages // pp
    elif par["pipeline_parallel_layers_per_stage"] is not None:
        raise refuse("parallelism.pipeline_parallel_layers_per_stage", par["pipeline_parallel_layers_per_stage"],
                     f"unset with the single-stage schedule {schedule} (its stages follow pipeline_parallel_degree)")
    return {"schedule": SCHEDULES[schedule], "virtual_stages": virtual,
            "account_for_embedding_in_pipeline_split": bool(first), "account_for_loss_in_pipeline_split": bool(last)}


def _batch_fields(get, where: str, dp: int, pp: int, pp_micro: int) -> dict[str, object]:
    local = get("training.local_batch_size", 8)
    global_batch = get("training.global_batch_size", -1)
    global_batch = local * dp if global_batch == -1 else global_batch
    if global_batch % (local * dp):
        raise ConfigError(f"{where}: training.global_batch_size {global_batch} is not a multiple of local_batch_size x "
                          f"data-parallel degree = {local} x {dp}")
    micro = pp_micro if pp > 1 else local
    if local % micro:
        raise ConfigError(f"{where}: training.local_batch_size {local} is not a multiple of "
                          f"parallelism.pipeline_parallel_microbatch_size {micro}")
    return {"micro_batch_size": micro, "global_batch_size": global_batch}


def _precision_fields(get, where: str, fsdp: bool, autocast: bool) -> dict[str, object]:
    param = get("training.mixed_precision_param", "bfloat16")
    if get("training.dtype", "float32") != "float32":
        raise refuse("training.dtype", get("training.dtype", ""), "float32 (trainsim keeps fp32 master weights)")
    if get("training.enable_cpu_offload", False):
        raise refuse("training.enable_cpu_offload", True, "false (CPU offload is not modelled)")
    if param not in ("bfloat16", "float32"):
        raise refuse("training.mixed_precision_param", param, "bfloat16, float32")
    if param == "bfloat16" and not fsdp and autocast:
        raise refuse("training.mixed_precision_param", param, "FSDP, or float32 (without FSDP "
                     "torchtitan runs DDP under torch.autocast: fp32 weights, bf16 compute, not modelled)")
    precision = "bf16" if param == "bfloat16" and fsdp else "fp32"  # TP/PP without FSDP: torchtitan trains fp32
    converters = get("model.converters", [])
    converters = [converters] if isinstance(converters, str) else list(converters)
    float8 = [c for c in converters if c in ("float8", "quantize.linear.float8")]
    mx = [c for c in converters if c in ("mx", "quantize.linear.mx")]
    rest = sorted(set(converters) - set(float8) - set(mx))
    if rest:
        raise refuse("model.converters", rest, "float8 / quantize.linear.float8, mx / quantize.linear.mx")
    f: dict[str, object] = {"precision": precision, "fp8_recipe": "delayed"}
    section = "quantize.linear.float8" if get("quantize.linear.float8.recipe_name", None) is not None or \
        get("quantize.linear.float8.enable_fsdp_float8_all_gather", None) is not None else "float8"
    gather = bool(get(f"{section}.enable_fsdp_float8_all_gather", False))
    if float8 or mx:
        if precision != "bf16":
            raise refuse("model.converters", converters, "FSDP with training.mixed_precision_param "
                         "bfloat16 (trainsim's FP8 keeps bf16 weights)")
        if float8:
            recipe = get(f"{section}.recipe_name", None)
            if recipe not in FLOAT8_RECIPES:
                raise refuse(f"{section}.recipe_name", recipe, ", ".join(str(r) for r in FLOAT8_RECIPES if r))
            f.update(precision="fp8", fp8_recipe=FLOAT8_RECIPES[recipe])
        else:
            recipe = get("quantize.linear.mx.recipe_name", "mxfp8_cublas")
            if not str(recipe).startswith("mxfp8"):
                raise refuse("quantize.linear.mx.recipe_name", recipe, "mxfp8 recipes")
            f.update(precision="fp8", fp8_recipe="mxfp8")
        for key in (f"{section}.filter_fqns", "quantize.linear.mx.filter_fqns"):
            skipped = get(key, [])
            if set(skipped if isinstance(skipped, list) else [skipped]) - {"output"}:
                raise refuse(key, skipped, "[] or ['output'] (trainsim runs every transformer linear in FP8)")
    f["fp8_param_gather"] = gather and fsdp and f["precision"] == "fp8"
    return f


def _recompute_fields(get, where: str) -> dict[str, object]:
    mode = get("activation_checkpoint.mode", "selective")
    option = str(get("activation_checkpoint.selective_ac_option", "2"))
    if mode in ("none", "full"):
        return {"recompute": mode}
    if mode == "selective" and option == "1":
        return {"recompute": "full"}  # every layer checkpointed
    if mode == "selective" and option == "op":
        return {"recompute": "op"}
    raise refuse("activation_checkpoint", f"mode {mode}, selective_ac_option {option}",
                 "mode none or full, or selective with selective_ac_option 'op' or '1' (trainsim recomputes every "
                 "layer, none, or with torchtitan's op-level policy; not every n-th layer)")
