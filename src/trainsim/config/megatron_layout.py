"""Megatron-LM / Megatron-Bridge launch arguments <-> ParallelismConfig.

import_megatron reads the parallelism, precision, batch and recomputation arguments of a Megatron-LM launch
line with Megatron's own defaults and derivations (megatron/training/arguments.py, Megatron-Core's
TransformerConfig and DistributedDataParallel): dp = world size / (tp * pp * cp), expert tensor parallelism
defaults to tp, the token dispatcher to 'allgather', bf16 reduces gradients in fp32 unless --grad-reduce-in-bf16,
gradient-accumulation fusion is on unless --no-gradient-accumulation-fusion, and without --overlap-grad-reduce
the gradients go in one bucket. A value trainsim cannot model is refused with what is accepted; model-shape
arguments are listed apart. megatron_arguments writes a layout back as arguments, so that importing them
gives the same layout (megatron_round_trip_mismatches).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import shlex
from collections.abc import Sequence

from trainsim.config.bridge_overrides import bridge_to_megatron
from trainsim.config.choices import BUILT_RECOMPUTE_MODULES, gradient_reduce_bytes
from trainsim.config.framework import megatron_core_bucket_bytes
from trainsim.config.imported_layout import ONE_BUCKET_BYTES, ImportedLayout, layout_fields, refuse
from trainsim.config.launch_line import launch_tokens
from trainsim.config.schema import ParallelismConfig
from trainsim.errors import ConfigError
from trainsim.parallel.pipeline_split import PipelineSplitError, parse_pipeline_layout

FLAG, INT, FLOAT, TEXT, LIST = "flag", "int", "float", "text", "list"

LAYOUT_ARGUMENTS = {
    "--tensor-model-parallel-size": INT, "--pipeline-model-parallel-size": INT,
    "--num-layers-per-virtual-pipeline-stage": INT, "--num-virtual-stages-per-pipeline-rank": INT,
    "--decoder-first-pipeline-num-layers": INT, "--decoder-last-pipeline-num-layers": INT,
    "--account-for-embedding-in-pipeline-split": FLAG, "--account-for-loss-in-pipeline-split": FLAG,
    "--pipeline-model-parallel-layout": TEXT, "--context-parallel-size": INT, "--cp-comm-type": LIST,
    "--expert-model-parallel-size": INT, "--expert-tensor-parallel-size": INT, "--sequence-parallel": FLAG,
    "--use-distributed-optimizer": FLAG, "--num-distributed-optimizer-instances": INT,
    "--overlap-grad-reduce": FLAG, "--overlap-param-gather": FLAG, "--tp-comm-overlap": FLAG,
    "--recompute-activations": FLAG, "--recompute-granularity": TEXT, "--recompute-method": TEXT,
    "--recompute-num-layers": INT, "--recompute-modules": LIST, "--fp8-format": TEXT, "--fp8-recipe": TEXT,
    "--fp8-param-gather": FLAG, "--fp4-format": TEXT, "--fp4-recipe": TEXT, "--bf16": FLAG, "--fp16": FLAG,
    "--micro-batch-size": INT, "--global-batch-size": INT, "--moe-token-dispatcher-type": TEXT,
    "--moe-grouped-gemm": FLAG, "--overlap-moe-expert-parallel-comm": FLAG, "--clip-grad": FLOAT,
    "--accumulate-allreduce-grads-in-fp32": FLAG, "--grad-reduce-in-bf16": FLAG,
    "--gradient-accumulation-fusion": FLAG, "--no-gradient-accumulation-fusion": FLAG, "--ddp-bucket-size": INT,
    "--use-megatron-fsdp": FLAG, "--data-parallel-sharding-strategy": TEXT, "--use-torch-fsdp2": FLAG,
    "--torch-fsdp2-no-reshard-after-forward": FLAG, "--cpu-offloading": FLAG, "--cpu-offloading-num-layers": INT,
}
"""The arguments import_megatron turns into layout fields, with the kind of value each takes."""

MODEL_ARGUMENTS = {
    "--num-layers": INT, "--hidden-size": INT, "--ffn-hidden-size": INT, "--num-attention-heads": INT,
    "--num-query-groups": INT, "--group-query-attention": FLAG, "--kv-channels": INT, "--seq-length": INT,
    "--max-position-embeddings": INT, "--vocab-size": INT, "--make-vocab-size-divisible-by": INT,
    "--swiglu": FLAG, "--squared-relu": FLAG, "--normalization": TEXT, "--norm-epsilon": FLOAT,
    "--position-embedding-type": TEXT, "--rotary-base": INT, "--rotary-percent": FLOAT,
    "--untie-embeddings-and-output-weights": FLAG, "--disable-bias-linear": FLAG, "--add-qkv-bias": FLAG,
    "--attention-dropout": FLOAT, "--hidden-dropout": FLOAT, "--qk-layernorm": FLAG,
    "--num-experts": INT, "--moe-router-topk": INT, "--moe-ffn-hidden-size": INT,
    "--moe-shared-expert-intermediate-size": INT, "--moe-layer-freq": TEXT, "--moe-router-load-balancing-type": TEXT,
    "--moe-router-score-function": TEXT, "--moe-router-enable-expert-bias": FLAG, "--moe-aux-loss-coeff": FLOAT,
    "--moe-router-pre-softmax": FLAG, "--moe-router-topk-scaling-factor": FLOAT, "--moe-router-num-groups": INT,
    "--moe-router-group-topk": INT, "--moe-router-dtype": TEXT, "--moe-permute-fusion": FLAG,
    "--multi-latent-attention": FLAG, "--q-lora-rank": INT, "--kv-lora-rank": INT, "--qk-head-dim": INT,
    "--qk-pos-emb-head-dim": INT, "--v-head-dim": INT, "--mtp-num-layers": INT, "--window-size": LIST,
    "--hybrid-override-pattern": TEXT, "--hybrid-layer-pattern": TEXT, "--mamba-state-dim": INT,
    "--mamba-head-dim": INT, "--mamba-num-groups": INT, "--mamba-num-heads": INT,
}
"""Model-shape arguments: recognised (listed as not imported, they belong to conf/model), never guessed at."""

RECIPE_OF_MEGATRON = {"delayed": "delayed", "tensorwise": "current", "mxfp8": "mxfp8", "blockwise": "blockwise"}
"""--fp8-recipe -> parallelism.fp8_recipe ('tensorwise' is per-tensor current scaling)."""
CP_COMM_OF_MEGATRON = {"p2p": "p2p", "allgather": "all_gather"}
FSDP_STRATEGIES = {"no_shard": 0, "optim": 1, "optim_grads_params": 3}
"""--data-parallel-sharding-strategy of Megatron-FSDP -> zero_stage ('optim_grads', which shards gradients but
keeps the weights replicated, has no trainsim counterpart)."""


def parse_arguments(arguments: str | Sequence[str]) -> tuple[dict[str, object], list[str], list[str]]:
    """Split a launch line (`--tensor-model-parallel-size 8 --bf16 --cp-comm-type p2p`, `--x=1`; underscores
    as dashes) into layout arguments, model arguments and unknown ones.
    Returns ({flag: value}, model arguments as written, unknown arguments as written)."""
    tokens = shlex.split(arguments) if isinstance(arguments, str) else list(arguments)
    layout: dict[str, object] = {}
    model: list[str] = []
    unknown: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("--"):
            unknown.append(token)
            continue
        flag, _, inline = token.partition("=")
        flag = "--" + flag[2:].replace("_", "-")
        kind = LAYOUT_ARGUMENTS.get(flag) or MODEL_ARGUMENTS.get(flag)
        values = [inline] if inline else []
        while not inline and kind != FLAG and i < len(tokens) and not tokens[i].startswith("--"):
            values.append(tokens[i])
            i += 1
        written = " ".join([flag, *values])
        if kind is None:
            unknown.append(written)
        elif flag in MODEL_ARGUMENTS:
            model.append(written)
            if flag == "--num-layers" and len(values) == 1:
                layout[flag] = _convert(flag, INT, values)
        else:
            layout[flag] = _convert(flag, kind, values)
    return layout, model, unknown


def _convert(flag: str, kind: str, values: list[str]) -> object:
    expected = {FLAG: "no value", INT: "one integer", FLOAT: "one number", TEXT: "one value",
                LIST: "one or more values"}[kind]
    if (kind == FLAG) != (not values) or (kind not in (FLAG, LIST) and len(values) != 1):
        raise ConfigError(f"{flag} {' '.join(values)}: takes {expected}")
    try:
        if kind == INT:
            return int(values[0])
        if kind == FLOAT:
            return float(values[0])
    except ValueError:
        raise ConfigError(f"{flag} {values[0]!r}: takes {expected}") from None
    return True if kind == FLAG else values if kind == LIST else values[0]


def import_megatron(arguments: str | Sequence[str], world_size: int | None = None, name: str = "",
                    allow_unknown: bool = False) -> ImportedLayout:
    """The layout of a Megatron-LM launch on `world_size` GPUs (Megatron derives dp from the world size; None:
    from a torchrun launcher in the line). Unknown arguments raise ConfigError listing them, unless
    `allow_unknown` (then they are listed in the result)."""
    script_arguments, launched = launch_tokens(arguments)
    if world_size is None:
        world_size = launched
    if world_size is None:
        raise ConfigError("import-layout --megatron needs the world size (Megatron derives dp from it): --gpus N, "
                          "or --nodes N [--gpus-per-node 8], or a torchrun launcher with --nproc-per-node")
    tokens, notes = bridge_to_megatron(script_arguments)
    args, model_arguments, unknown = parse_arguments(tokens)
    tp, ep = args.get("--tensor-model-parallel-size", 1), args.get("--expert-model-parallel-size", 1)
    if "--expert-tensor-parallel-size" not in args and tp > 1 and ep == 1 and not any(
            a.startswith("--num-experts ") for a in model_arguments):
        args["--expert-tensor-parallel-size"] = 1  # trainsim refuses etp > 1 for a model without experts
        notes.append(f"--expert-tensor-parallel-size not given: Megatron's default is tp ({tp}), written as 1 since "
                     f"no --num-experts or --expert-model-parallel-size says the model has experts; for a mixture "
                     f"of experts set parallelism.etp={tp}")
    if unknown and not allow_unknown:
        hints = [f"{u.split()[0]} (did you mean {' or '.join(close)}?)" for u in unknown
                 if (close := difflib.get_close_matches(u.split()[0], [*LAYOUT_ARGUMENTS, *MODEL_ARGUMENTS], n=2))]
        raise ConfigError(f"Megatron arguments not known to import-layout: {unknown}; pass --allow-unknown to import "
                          f"the rest (they are listed in the output){'; ' + ', '.join(hints) if hints else ''}. "
                          f"Known: the layout arguments of megatron_layout.LAYOUT_ARGUMENTS and the model arguments "
                          f"of MODEL_ARGUMENTS")
    fields = _megatron_fields(args, world_size)
    source = f"Megatron-LM arguments on {world_size} GPUs: " + " ".join(shlex.quote(t) for t in script_arguments)
    return ImportedLayout(layout_fields(fields, name), source, model_arguments, unknown, notes, "megatron-core")


def _megatron_fields(args: dict[str, object], world_size: int) -> dict[str, object]:
    tp = args.get("--tensor-model-parallel-size", 1)
    pp = args.get("--pipeline-model-parallel-size", 1)
    cp = args.get("--context-parallel-size", 1)
    if world_size < 1 or world_size % (tp * pp * cp):
        raise ConfigError(f"world size {world_size} (--gpus) is not divisible by tp * pp * cp = {tp} * {pp} * {cp} "
                          f"(Megatron: dp = world size / (tp * pp * cp))")
    dp = world_size // (tp * pp * cp)
    f: dict[str, object] = {"dp": dp, "tp": tp, "pp": pp, "cp": cp,
                            "ep": args.get("--expert-model-parallel-size", 1),
                            "etp": args.get("--expert-tensor-parallel-size", tp)}
    f.update(_pipeline_fields(args, pp))
    f.update(_precision_fields(args))
    f.update(_recompute_fields(args, pp * f["virtual_stages"], max(f["first_stage_layers"], f["last_stage_layers"])
                               // f["virtual_stages"]))
    f.update(_data_parallel_fields(args, dp * cp, f))
    micro = args.get("--micro-batch-size")
    if micro is None:
        raise ConfigError("--micro-batch-size is missing: Megatron-LM requires it")
    global_batch = args.get("--global-batch-size", micro * dp)
    if global_batch % (micro * dp):
        raise ConfigError(f"--global-batch-size {global_batch} is not divisible by --micro-batch-size x dp = "
                          f"{micro} x {dp} (Megatron requires it)")
    f.update(micro_batch_size=micro, global_batch_size=global_batch)
    f["sequence_parallel"] = bool(args.get("--sequence-parallel")) and tp > 1  # Megatron drops it at tp 1
    f["tp_comm_overlap"] = bool(args.get("--tp-comm-overlap"))
    f["cpu_offload_layers"] = args.get("--cpu-offloading-num-layers", 0) if args.get("--cpu-offloading") else 0
    if f["tp_comm_overlap"] and not f["sequence_parallel"]:
        raise ConfigError("--tp-comm-overlap needs --sequence-parallel with --tensor-model-parallel-size > 1 "
                          "(Megatron asserts it)")
    dispatcher = args.get("--moe-token-dispatcher-type", "allgather")  # Megatron-Core's default
    if dispatcher not in ("alltoall", "allgather"):
        raise refuse("--moe-token-dispatcher-type", dispatcher, "alltoall, allgather")
    comm = args.get("--cp-comm-type", ["p2p"])
    if len(set(comm)) != 1 or comm[0] not in CP_COMM_OF_MEGATRON:
        raise refuse("--cp-comm-type", " ".join(comm), f"one of {sorted(CP_COMM_OF_MEGATRON)} for all layers")
    f.update(moe_token_dispatcher=dispatcher, moe_grouped_gemm=bool(args.get("--moe-grouped-gemm")),
             moe_a2a_overlap=bool(args.get("--overlap-moe-expert-parallel-comm")),
             cp_comm_type=CP_COMM_OF_MEGATRON[comm[0]], clip_grad=args.get("--clip-grad", 1.0),
             gradient_accumulation_fusion=not args.get("--no-gradient-accumulation-fusion"))
    return f


def _pipeline_fields(args: dict[str, object], pp: int) -> dict[str, object]:
    layout = args.get("--pipeline-model-parallel-layout", "")
    per_chunk = args.get("--num-layers-per-virtual-pipeline-stage")
    chunks = args.get("--num-virtual-stages-per-pipeline-rank")
    given = [a for a in ("--pipeline-model-parallel-layout", "--num-layers-per-virtual-pipeline-stage",
                         "--num-virtual-stages-per-pipeline-rank") if a in args]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)}: Megatron accepts no more than one of them")
    first = args.get("--decoder-first-pipeline-num-layers", 0)
    last = args.get("--decoder-last-pipeline-num-layers", 0)
    embedding = bool(args.get("--account-for-embedding-in-pipeline-split"))
    loss = bool(args.get("--account-for-loss-in-pipeline-split"))
    if layout and (first or last or embedding or loss):
        raise ConfigError("--pipeline-model-parallel-layout cannot be set with --decoder-first/last-pipeline-num-"
                          "layers or --account-for-embedding/loss-in-pipeline-split (Megatron-Core refuses it): the "
                          "layout string places the embedding, the loss and every layer itself")
    if (first or last) and (embedding or loss):
        raise ConfigError("--decoder-first/last-pipeline-num-layers cannot be set with --account-for-embedding/loss-in-"
                          "pipeline-split (Megatron-Core refuses it); choose one way to lighten the outer stages")
    for flag, value in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if flag in args and value <= 0:
            raise refuse(flag, value, "a layer count larger than 0 (Megatron-Core requires it)")
    virtual = 1
    if layout:
        stages = layout_stage_count(layout)
        if stages % pp:
            raise ConfigError(f"--pipeline-model-parallel-layout {layout!r} has {stages} stages, not divisible by "
                              f"--pipeline-model-parallel-size {pp} (Megatron requires it)")
        virtual = stages // pp
    elif chunks is not None:
        virtual = chunks
    elif per_chunk is not None:
        if first or last:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage with --decoder-first/last-pipeline-num-layers:"
                              " Megatron wants --num-virtual-stages-per-pipeline-rank for uneven stages")
        num_layers = args.get("--num-layers")
        if num_layers is None:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage needs --num-layers (the model's) to give the "
                              "virtual stages; or pass --num-virtual-stages-per-pipeline-rank")
        per_stage, rest = divmod(num_layers + embedding + loss, pp)
        if rest or per_stage % per_chunk:
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {per_chunk}: {num_layers} layers "
                              f"(+ embedding/loss accounted: {int(embedding) + int(loss)}) over {pp} stages do not "
                              f"split into chunks of {per_chunk} (Megatron requires it)")
        virtual = per_stage // per_chunk
    for flag, value in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if value % virtual:
            raise refuse(flag, value, f"a multiple of the {virtual} virtual stages per rank (Megatron-Core requires "
                                      f"each virtual stage of the first and last rank to hold the same layers)")
    if virtual > 1 and pp < 2:
        raise ConfigError(f"{given[0]} gives {virtual} virtual stages with --pipeline-model-parallel-size {pp}: "
                          f"interleaving needs pp >= 2")
    return {"virtual_stages": virtual, "schedule": "interleaved-1f1b" if virtual > 1 else "1f1b",
            "first_stage_layers": first, "last_stage_layers": last, "pipeline_layout": layout,
            "account_for_embedding_in_pipeline_split": embedding, "account_for_loss_in_pipeline_split": loss}


def layout_stage_count(layout: str) -> int:
    """Stages (pp x virtual) of a --pipeline-model-parallel-layout string, parsed as the pipeline split parses it."""
    try:
        return len(parse_pipeline_layout(layout))
    except PipelineSplitError as error:
        raise refuse("--pipeline-model-parallel-layout", layout, str(error)) from None


def _precision_fields(args: dict[str, object]) -> dict[str, object]:
    bf16, fp16 = bool(args.get("--bf16")), bool(args.get("--fp16"))
    if bf16 and fp16:
        raise ConfigError("--bf16 and --fp16 together: Megatron accepts one of them")
    base = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    fp8, fp4 = args.get("--fp8-format"), args.get("--fp4-format")
    f: dict[str, object] = {"precision": base, "fp8_recipe": "delayed"}
    if fp8 and fp4:
        raise ConfigError("--fp8-format and --fp4-format together: Megatron accepts one of them")
    if fp8 or fp4:
        if base != "bf16":
            raise refuse("--fp8-format" if fp8 else "--fp4-format", fp8 or fp4,
                         "with --bf16 (trainsim's FP8 and FP4 runs keep bf16 weights)")
    if fp8:
        if fp8 not in ("hybrid", "e4m3"):
            raise refuse("--fp8-format", fp8, "hybrid, e4m3")
        recipe = args.get("--fp8-recipe", "delayed")  # Megatron-Core's default
        if recipe not in RECIPE_OF_MEGATRON:
            raise refuse("--fp8-recipe", recipe, f"{sorted(RECIPE_OF_MEGATRON)}")
        f.update(precision="fp8", fp8_recipe=RECIPE_OF_MEGATRON[recipe])
    elif fp4:
        if fp4 != "e2m1" or args.get("--fp4-recipe", "nvfp4") != "nvfp4":
            raise refuse("--fp4-format/--fp4-recipe", f"{fp4}/{args.get('--fp4-recipe', 'nvfp4')}",
                         "e2m1 with the nvfp4 recipe")
        f["precision"] = "fp4"
    f["fp8_param_gather"] = bool(args.get("--fp8-param-gather"))
    if f["fp8_param_gather"] and f["precision"] != "fp8":
        raise ConfigError("--fp8-param-gather needs --fp8-format (FP8 weights)")
    in_fp32 = bool(args.get("--accumulate-allreduce-grads-in-fp32"))
    if args.get("--grad-reduce-in-bf16"):
        if in_fp32:
            raise ConfigError("--grad-reduce-in-bf16 with --accumulate-allreduce-grads-in-fp32: choose one")
        if not bf16:
            raise ConfigError("--grad-reduce-in-bf16 needs --bf16")
    elif bf16:
        in_fp32 = True  # Megatron: bf16 accumulates and reduces gradients in fp32 unless --grad-reduce-in-bf16
    f["grad_reduce_in_fp32"] = in_fp32
    return f


def _recompute_fields(args: dict[str, object], chunks: int, outer_chunk_layers: int) -> dict[str, object]:
    """`chunks` model chunks (pp x virtual stages); `outer_chunk_layers`: the layers of an uneven first or last
    stage's chunk (0 when even), which a block recomputation must also cover."""
    granularity = args.get("--recompute-granularity", "selective" if args.get("--recompute-activations") else None)
    method, count = args.get("--recompute-method"), args.get("--recompute-num-layers")
    modules = args.get("--recompute-modules", ["core_attn"])
    if granularity is None:
        if method or count is not None:
            raise ConfigError("--recompute-method / --recompute-num-layers need --recompute-granularity full")
        return {"recompute": "none"}
    if granularity == "selective":
        if method or count is not None:
            raise ConfigError("--recompute-method / --recompute-num-layers with --recompute-granularity selective: "
                              "Megatron accepts them only with full")
        unbuilt = [m for m in modules if m not in BUILT_RECOMPUTE_MODULES]
        if unbuilt:
            raise refuse("--recompute-modules", " ".join(unbuilt), ", ".join(BUILT_RECOMPUTE_MODULES))
        return {"recompute": "selective", "recompute_modules": list(modules)}
    if granularity != "full":
        raise refuse("--recompute-granularity", granularity, "full, selective")
    if method is None or count is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method and --recompute-num-layers "
                          "(Megatron-Core requires them)")
    if method == "uniform" and count == 1:
        return {"recompute": "full"}
    if method == "block" and "--num-layers" in args and count >= max(math.ceil(args["--num-layers"] / chunks),
                                                                   outer_chunk_layers):
        return {"recompute": "full"}  # every layer of every model chunk recomputed
    raise refuse("--recompute-method/--recompute-num-layers", f"{method} {count}",
                 "uniform 1, or block with at least the layers of a model chunk and --num-layers given "
                 "(trainsim recomputes every layer from its own input)")


def _data_parallel_fields(args: dict[str, object], replicas: int, f: dict[str, object]) -> dict[str, object]:
    megatron_fsdp, torch_fsdp = bool(args.get("--use-megatron-fsdp")), bool(args.get("--use-torch-fsdp2"))
    zero = 1 if args.get("--use-distributed-optimizer") else 0
    if megatron_fsdp and torch_fsdp:
        raise ConfigError("--use-megatron-fsdp and --use-torch-fsdp2 together: choose one")
    if megatron_fsdp:
        strategy = args.get("--data-parallel-sharding-strategy", "optim_grads_params")
        if strategy not in FSDP_STRATEGIES:
            raise refuse("--data-parallel-sharding-strategy", strategy,
                         f"{sorted(FSDP_STRATEGIES)} (optim_grads keeps replicated weights with sharded "
                         f"gradients, which trainsim does not model)")
        zero = FSDP_STRATEGIES[strategy]
    elif "--data-parallel-sharding-strategy" in args:
        raise ConfigError("--data-parallel-sharding-strategy needs --use-megatron-fsdp")
    if torch_fsdp:
        if f["pp"] > 1 or f["ep"] > 1 or zero:
            raise ConfigError("--use-torch-fsdp2 with pipeline or expert parallelism or --use-distributed-optimizer: "
                              "Megatron-LM refuses it (use --use-megatron-fsdp)")
        zero = 2 if args.get("--torch-fsdp2-no-reshard-after-forward") else 3
    instances = args.get("--num-distributed-optimizer-instances", 1)
    if instances < 1 or replicas % instances:
        raise ConfigError(f"--num-distributed-optimizer-instances {instances} must divide dp x cp = {replicas}")
    if f["fp8_param_gather"] and zero == 0:
        raise ConfigError("--fp8-param-gather needs --use-distributed-optimizer or FSDP (Megatron asserts it)")
    if instances > 1 and zero == 0:
        raise ConfigError("--num-distributed-optimizer-instances needs --use-distributed-optimizer or FSDP")
    grad_bytes = gradient_reduce_bytes(f["precision"], f["grad_reduce_in_fp32"])
    overlap = bool(args.get("--overlap-grad-reduce"))
    bucket_params = args.get("--ddp-bucket-size")
    if not overlap:
        bucket = ONE_BUCKET_BYTES  # Megatron-Core: without overlap, one bucket after the backward
    elif bucket_params is not None:
        bucket = bucket_params * grad_bytes
    else:
        bucket = megatron_core_bucket_bytes(replicas, grad_bytes)
    overlap_gather = bool(args.get("--overlap-param-gather"))
    if overlap_gather and not (overlap and zero >= 1):
        raise ConfigError("--overlap-param-gather needs --overlap-grad-reduce and --use-distributed-optimizer "
                          "(Megatron asserts it)")
    return {"zero_stage": zero, "dp_shard_size": replicas // instances if instances > 1 else 0,
            "dp_bucket_size_bytes": bucket, "overlap_param_gather": overlap_gather}


def megatron_arguments(par: ParallelismConfig) -> list[str]:
    """Megatron-LM arguments that import_megatron (with world size par.world_size) reads back as `par`.
    Raises ConfigError for a layout Megatron-LM cannot run (GPipe, recomputation settings it has no flag for)."""
    get = lambda key, default: getattr(par, key, default)  # noqa: E731 (contract fields may be missing)
    if par.schedule == "gpipe" and par.pp > 1:
        raise ConfigError(f"parallelism.schedule='gpipe' ({par.name}): Megatron-LM has no GPipe schedule "
                          f"(its pipelines run 1F1B or interleaved 1F1B)")
    if (par.schedule == "interleaved-1f1b") != (par.virtual_stages > 1):
        raise ConfigError(f"parallelism.schedule={par.schedule!r} with virtual_stages={par.virtual_stages}: "
                          f"Megatron interleaves exactly when there are virtual stages")
    out = ["--tensor-model-parallel-size", str(par.tp), "--pipeline-model-parallel-size", str(par.pp),
           "--context-parallel-size", str(par.cp), "--expert-model-parallel-size", str(par.ep),
           "--expert-tensor-parallel-size", str(par.etp),
           "--micro-batch-size", str(par.micro_batch_size), "--global-batch-size", str(par.global_batch_size)]
    if get("pipeline_layout", ""):
        out += ["--pipeline-model-parallel-layout", par.pipeline_layout]
    elif par.virtual_stages > 1:
        out += ["--num-virtual-stages-per-pipeline-rank", str(par.virtual_stages)]
    for value, flag in ((par.first_stage_layers, "--decoder-first-pipeline-num-layers"),
                        (par.last_stage_layers, "--decoder-last-pipeline-num-layers")):
        out += [flag, str(value)] if value else []
    out += _flags((get("account_for_embedding_in_pipeline_split", False), "--account-for-embedding-in-pipeline-split"),
                  (get("account_for_loss_in_pipeline_split", False), "--account-for-loss-in-pipeline-split"),
                  (par.sequence_parallel, "--sequence-parallel"), (par.tp_comm_overlap, "--tp-comm-overlap"))
    out += ["--cp-comm-type", {v: k for k, v in CP_COMM_OF_MEGATRON.items()}[par.cp_comm_type]]
    out += _precision_arguments(par, get("fp8_param_gather", False))
    out += {"none": [], "selective": ["--recompute-granularity", "selective"],
            "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
                     "1"]}[par.recompute]
    if par.recompute == "selective" and list(par.recompute_modules) != ["core_attn"]:
        out += ["--recompute-modules", *par.recompute_modules]
    out += _data_parallel_arguments(par, get("dp_shard_size", 0))
    if get("cpu_offload_layers", 0):
        out += ["--cpu-offloading", "--cpu-offloading-num-layers", str(par.cpu_offload_layers)]
    out += ["--moe-token-dispatcher-type", par.moe_token_dispatcher, "--clip-grad", repr(float(par.clip_grad))]
    out += _flags((par.moe_grouped_gemm, "--moe-grouped-gemm"),
                  (par.moe_a2a_overlap, "--overlap-moe-expert-parallel-comm"),
                  (not par.gradient_accumulation_fusion, "--no-gradient-accumulation-fusion"))
    return out


def _flags(*pairs: tuple[bool, str]) -> list[str]:
    return [flag for on, flag in pairs if on]


def _precision_arguments(par: ParallelismConfig, fp8_param_gather: bool) -> list[str]:
    low = par.precision in ("bf16", "fp8", "fp4")
    out = ["--bf16"] if low else ["--fp16"] if par.precision == "fp16" else []
    if par.precision == "fp8":
        out += ["--fp8-format", "hybrid",
                "--fp8-recipe", {v: k for k, v in RECIPE_OF_MEGATRON.items()}[par.fp8_recipe]]
    elif par.precision == "fp4":
        out += ["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"]
    out += _flags((fp8_param_gather, "--fp8-param-gather"))
    if low and not par.grad_reduce_in_fp32:
        out.append("--grad-reduce-in-bf16")
    elif not low and par.grad_reduce_in_fp32:
        out.append("--accumulate-allreduce-grads-in-fp32")
    return out


def _data_parallel_arguments(par: ParallelismConfig, dp_shard_size: int) -> list[str]:
    out = {0: [], 1: ["--use-distributed-optimizer"],
           2: ["--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"],
           3: ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]}[par.zero_stage]
    if dp_shard_size:
        out += ["--num-distributed-optimizer-instances", str(par.weight_replicas // dp_shard_size)]
    if par.dp_bucket_size_bytes < ONE_BUCKET_BYTES:
        grad_bytes = gradient_reduce_bytes(par.precision, par.grad_reduce_in_fp32)
        params, rest = divmod(par.dp_bucket_size_bytes, grad_bytes)
        if rest:
            raise ConfigError(f"parallelism.dp_bucket_size_bytes={par.dp_bucket_size_bytes} is not a whole number of "
                              f"{grad_bytes}-byte gradients: Megatron's --ddp-bucket-size counts parameters")
        out += ["--overlap-grad-reduce", "--ddp-bucket-size", str(params)]
    out += _flags((par.overlap_param_gather, "--overlap-param-gather"))
    return out


def megatron_round_trip_mismatches(par: ParallelismConfig) -> list[str]:
    """Fields that differ after `par` goes through megatron_arguments and back (empty: the round trip holds);
    a layout Megatron-LM cannot express gives its reason as the one entry."""
    try:
        imported = import_megatron(megatron_arguments(par), par.world_size, name=par.name).fields
    except ConfigError as error:
        return [str(error)]
    plain = dataclasses.asdict(par)
    return [f"{key}: {plain.get(key)!r} -> {value!r}" for key, value in imported.items() if plain.get(key) != value]
