"""Megatron-Bridge's Hydra-style overrides (`model.tensor_model_parallel_size=4 train.micro_batch_size=1
mixed_precision=bf16_with_mxfp8_mixed`) as the Megatron-LM arguments they set.

Megatron-Bridge configures Megatron-Core through a ConfigContainer whose fields (model.*, train.*, ddp.*,
optimizer.*) carry Megatron-Core's own names, so each override names one Megatron-LM argument; its precision
comes as a named mixed_precision recipe. A dotted override not listed here is passed on unchanged, and the
Megatron import lists it as unknown.
"""

from __future__ import annotations

BRIDGE_ARGUMENTS = {
    "model.tensor_model_parallel_size": "--tensor-model-parallel-size",
    "model.pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "model.virtual_pipeline_model_parallel_size": "--num-virtual-stages-per-pipeline-rank",
    "model.num_layers_in_first_pipeline_stage": "--decoder-first-pipeline-num-layers",
    "model.num_layers_in_last_pipeline_stage": "--decoder-last-pipeline-num-layers",
    "model.account_for_embedding_in_pipeline_split": "--account-for-embedding-in-pipeline-split",
    "model.account_for_loss_in_pipeline_split": "--account-for-loss-in-pipeline-split",
    "model.pipeline_model_parallel_layout": "--pipeline-model-parallel-layout",
    "model.context_parallel_size": "--context-parallel-size", "model.cp_comm_type": "--cp-comm-type",
    "model.expert_model_parallel_size": "--expert-model-parallel-size",
    "model.expert_tensor_parallel_size": "--expert-tensor-parallel-size",
    "model.sequence_parallel": "--sequence-parallel", "model.tp_comm_overlap": "--tp-comm-overlap",
    "model.recompute_granularity": "--recompute-granularity", "model.recompute_method": "--recompute-method",
    "model.recompute_num_layers": "--recompute-num-layers", "model.recompute_modules": "--recompute-modules",
    "model.moe_token_dispatcher_type": "--moe-token-dispatcher-type", "model.moe_grouped_gemm": "--moe-grouped-gemm",
    "model.overlap_moe_expert_parallel_comm": "--overlap-moe-expert-parallel-comm",
    "model.fp8": "--fp8-format", "model.fp8_recipe": "--fp8-recipe", "model.fp8_param": "--fp8-param-gather",
    "model.fp4": "--fp4-format", "model.fp4_recipe": "--fp4-recipe",
    "train.micro_batch_size": "--micro-batch-size", "train.global_batch_size": "--global-batch-size",
    "ddp.use_distributed_optimizer": "--use-distributed-optimizer",
    "optimizer.use_distributed_optimizer": "--use-distributed-optimizer",
    "ddp.num_distributed_optimizer_instances": "--num-distributed-optimizer-instances",
    "ddp.overlap_grad_reduce": "--overlap-grad-reduce", "ddp.overlap_param_gather": "--overlap-param-gather",
    "ddp.bucket_size": "--ddp-bucket-size", "ddp.use_megatron_fsdp": "--use-megatron-fsdp",
    "ddp.data_parallel_sharding_strategy": "--data-parallel-sharding-strategy",
    "ddp.fp8_param_gather": "--fp8-param-gather", "optimizer.clip_grad": "--clip-grad",
    "model.cpu_offloading": "--cpu-offloading", "model.cpu_offloading_num_layers": "--cpu-offloading-num-layers",
    "model.num_layers": "--num-layers", "model.hidden_size": "--hidden-size", "model.seq_length": "--seq-length",
    "model.ffn_hidden_size": "--ffn-hidden-size", "model.num_attention_heads": "--num-attention-heads",
    "model.num_query_groups": "--num-query-groups", "model.num_moe_experts": "--num-experts",
    "model.moe_router_topk": "--moe-router-topk",
}
"""Megatron-Bridge ConfigContainer field -> the Megatron-LM argument it sets (true/false fields: the flag or none)."""

NEGATED = {
    "model.gradient_accumulation_fusion": ("", "--no-gradient-accumulation-fusion"),
    "ddp.grad_reduce_in_fp32": ("--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16"),
}
"""Boolean fields whose true and false each have their own argument (or none, "")."""

FP8_PARAMS = "--fp8-param-gather"
MIXED_PRECISION_RECIPES = {
    "fp32": [], "bf16_mixed": ["--bf16"], "fp16_mixed": ["--fp16"],
    "bf16_with_fp8_delayed_scaling_mixed": ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed", FP8_PARAMS],
    "bf16_with_fp8_current_scaling_mixed": ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise",
                                            FP8_PARAMS],
    "bf16_with_fp8_subchannel_scaling_mixed": ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "blockwise"],
    "bf16_with_mxfp8_mixed": ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", FP8_PARAMS],
    "bf16_with_nvfp4_mixed": ["--bf16", "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"],
}
"""Megatron-Bridge's named mixed_precision recipes (megatron/bridge/training/mixed_precision.py) as Megatron
arguments: each FP8 recipe but the blockwise one keeps FP8 weights and all-gathers them in FP8."""
RECIPE_NOTES = {
    "bf16_with_fp8_current_scaling_mixed": "mixed_precision keeps the first and last transformer layers in bf16 "
                                           "(first_last_layers_bf16); trainsim runs them in FP8 too",
}
RECIPE_MODIFIERS = {"_bf16_params": "drops --fp8-param-gather", "_bf16_grad_reduce": "adds --grad-reduce-in-bf16"}
"""Suffixes Megatron-Bridge accepts after a recipe name (in this order)."""


def mixed_precision_arguments(name: str) -> tuple[list[str], list[str]] | None:
    """(Megatron arguments, notes) of a Megatron-Bridge mixed_precision recipe name (hyphens or underscores, with
    the modifiers of RECIPE_MODIFIERS), or None for a name not known here."""
    stem, applied = name.replace("-", "_"), []
    for modifier in reversed(RECIPE_MODIFIERS):
        if stem.endswith(modifier):
            stem, applied = stem.removesuffix(modifier), [modifier, *applied]
    base = stem if stem in MIXED_PRECISION_RECIPES else f"{stem}_mixed"
    if base not in MIXED_PRECISION_RECIPES or ("_bf16_params" in applied and
                                               FP8_PARAMS not in MIXED_PRECISION_RECIPES[base]):
        return None
    arguments = list(MIXED_PRECISION_RECIPES[base])
    if "_bf16_params" in applied:
        arguments.remove(FP8_PARAMS)
    if "_bf16_grad_reduce" in applied:
        arguments.append("--grad-reduce-in-bf16")
    return arguments, [f"{note} ({name})" for key, note in RECIPE_NOTES.items() if key == base]


def bridge_to_megatron(tokens: list[str]) -> tuple[list[str], list[str]]:
    """Megatron-LM arguments for the Megatron-Bridge overrides among `tokens` (other tokens kept as they are), and
    notes on what a recipe sets that trainsim does not model."""
    out: list[str] = []
    notes: list[str] = []
    for token in tokens:
        key, equals, value = token.partition("=")
        key = key.lstrip("+")
        recipe = mixed_precision_arguments(value) if key == "mixed_precision" else None
        if token.startswith("-") or not equals:
            out.append(token)
        elif recipe is not None:
            out += recipe[0]
            notes += recipe[1]
        elif key in NEGATED and value.lower() in ("true", "false"):
            flag = NEGATED[key][value.lower() == "false"]
            out += [flag] if flag else []
        elif key in BRIDGE_ARGUMENTS and value.lower() in ("true", "false"):
            out += [BRIDGE_ARGUMENTS[key]] if value.lower() == "true" else []
        elif key in BRIDGE_ARGUMENTS:
            listed = value.startswith("[") and value.endswith("]")
            values = [v.strip(" '\"") for v in value[1:-1].split(",")] if listed else [value]
            out += [BRIDGE_ARGUMENTS[key], *values]
        else:
            out.append(token)
    return out, notes
