"""The published recipes of data/published as a user writes them: each table row becomes Hydra overrides.

A row names a system, a model and a layout (GPUs, batch sizes, TP/PP/CP/VP/EP, FSDP, precision); this module
turns it into the overrides a user would type (`hardware=gb200-nvl72 model=llama3-70b parallelism.tp=2 ...`),
states every setting the source leaves out, and composes them through `compose_run`, the path every user
command takes. A row that cannot be written is a refusal with its reason, never dropped: benchmarks/recipes.py
counts them (`figure recipes_rows_refused`). The three tables the kernel model is fitted to keep their own
row mapping (validation/published.py); here they are read as their sources state the layout.
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from trainsim.config.data_path import DATA_DIR
from trainsim.errors import ConfigError

SYSTEMS = {
    "DGX-H100": "h100-sxm-dgx",
    "DGX-B200": "dgx-b200",
    "DGX-B300": "dgx-b300",
    "DGX-GB200": "gb200-nvl72",
    "DGX-GB300": "gb300-nvl72",
    "H100 (96GB HBM2e 500W)": "h100-grand-teton",
    "H200 (8/host; 400Gb/s CX-7 per GPU)": "h200-sxm-dgx",
    "A100 80GB": "a100-80g-dgx",
}
"""System named by a table -> conf/hardware option."""

MODELS = {
    "LLAMA3_8B": "llama3-8b", "LLAMA3-8B": "llama3-8b", "Llama 3 8B": "llama3-8b", "Llama3 8B": "llama3-8b",
    "Llama 3.1 8B": "llama3-8b",
    "LLAMA3_70B": "llama3-70b", "LLAMA3-70B": "llama3-70b", "Llama 3 70B": "llama3-70b", "Llama3 70B": "llama3-70b",
    "Llama 3.1 70B": "llama3-70b",
    "LLAMA2-7B": "llama2-7b", "LLAMA2-13B": "llama2-13b", "LLAMA2-70B": "llama2-70b",
    "Llama 2 13B": "llama2-13b", "Llama 2 70B": "llama2-70b",
    "GPT3-5B": "gpt-5b", "GPT3-20B": "gpt-20b", "GPT3-175B": "gpt-175b",
    "Nemotron-8B": "nemotron-8b", "Nemotron-22B": "nemotron-22b",
    "Nemotron-15B": "nemotron4-15b", "Nemotron-340B": "nemotron4-340b",
    "Mixtral-8x7B": "mixtral-8x7b", "Mixtral-8x22B": "mixtral-8x22b",
    "LLAMA4-Scout-LLM": "llama4-scout",
    "DeepSeekV3": "deepseek-v3", "Kimi_K2": "kimi-k2",
    "Nemotron_3_Nano": "nemotron-3-nano",
}
"""Model named by a table -> conf/model option (Llama 3.1 has Llama 3's shape: MODEL_NOTES)."""

NOT_BUILT = {
    "Nemotron_3_Super": "Nemotron 3 Super: its architecture (a hybrid Mamba-Transformer with latent MoE layers) "
                        "has no published config.json in the project's reach; not built",
}
"""Architectures listed as not built: their rows are refused with this reason and counted apart
(`figure recipes_rows_not_built`)."""

MODEL_NOTES = {
    "Llama 3.1 8B": "Llama 3.1 8B as llama3-8b (the same shape; Llama 3.1's rope scaling changes no kernel)",
    "Llama 3.1 70B": "Llama 3.1 70B as llama3-70b (the same shape; Llama 3.1's rope scaling changes no kernel)",
}

SIXTY_ONE_LAYER_SPLITS = {
    4: "Et*16|t*16|t*16|t*13L",
    8: "Et*8|(t*8|)*6t*5L",
    16: "Et*4|(tttt|)*14tL",
    32: "Et|(tt|)*30L",
}
"""pp * virtual stages -> Megatron-Bridge's pipeline layout of DeepSeek-V3's 61 layers (its recipes'
set_deepseek_v3_pipeline_model_parallel_layout, multi-token prediction, not built, left out of the last stage);
Kimi K2 has the same 61 layers and is split alike."""

PRECISIONS = {
    "FP8": ("fp8", "current"),
    "MXFP8": ("fp8", "mxfp8"),
    "NVFP4": ("fp4", None),
    "BF16": ("bf16", None),
}
"""A Megatron-Bridge precision column -> (parallelism.precision, fp8_recipe). Its 'FP8' is per-tensor current
scaling (the 26.x recipes' fp8_cs; NeMo 25.04/25.07 state it)."""


@dataclass(frozen=True)
class Recipe:
    """One published run written as a user would compose it."""

    table: str
    """the csv's file name in data/published"""
    row: int
    """0-based data row of the csv"""
    label: str
    """model, system, GPUs and precision, as the table names them"""
    overrides: tuple[str, ...]
    measured_s: float | None
    """the step time the table implies (global batch x sequence / tokens per second), None where it gives none"""
    notes: tuple[str, ...] = ()
    """settings the source leaves out and what trainsim substitutes"""
    refusal: str | None = None
    """why the row cannot be written (None: it can)"""
    variant: str = ""
    """'' for a row's main result; 'alternative' for the configuration a cell shows in parentheses"""
    megatron_rejects: bool = False
    """the layout as the source states it is one Megatron-Core itself refuses (the refusal gives its reason):
    counted apart from trainsim's own refusals"""


@dataclass
class Composed:
    """A recipe composed through compose_run: its Run, or the reason it was refused."""

    recipe: Recipe
    run: object | None = None
    refusal: str | None = None
    notes: list[str] = field(default_factory=list)


def cell(value, alternative: bool) -> str:
    """A cell's value: 'a (b)' holds the main configuration's a and the alternative's b."""
    text = str(value).strip()
    match = re.fullmatch(r"(.*?)\s*\((.*)\)", text)
    if not match:
        return text
    return match.group(2).strip() if alternative else match.group(1).strip()


def number(value) -> int | None:
    text = str(value).replace(",", "").strip()
    if text in ("", "n/a", "nan", "None"):
        return None
    return int(float(text))


def step_seconds(global_batch: int, seq: int, tokens_per_s_per_gpu: float, gpus: int) -> float:
    """The step time a throughput implies: tokens per step over tokens per second of all GPUs."""
    return global_batch * seq / (tokens_per_s_per_gpu * gpus)


def precision_of(table: str, system: str, alternative: bool, column: str | None) -> tuple[str, str | None, str]:
    """(precision, fp8_recipe, note) of a NeMo / Megatron-Bridge row."""
    if column:
        precision, recipe = PRECISIONS[column.upper()]
        return precision, recipe, ""
    if table.startswith("megatron-bridge_25.09") and alternative:
        # the 25.09 notes: parentheses are other quantisation granularities, 32x32 blocks on Blackwell,
        # DeepSeek-V3's 1x128 / 128x128 on H100
        recipe = "blockwise" if system == "DGX-H100" else "mxfp8"
        return "fp8", recipe, f"the parenthesised result: FP8 with {recipe} scaling (the release's notes)"
    if table.startswith(("nemo_24.07", "nemo_25.02")):
        return "fp8", "delayed", "FP8 with delayed scaling (the NeMo launcher's and NeMo 2.0's recipes' default; " \
                                 "the table says FP8)"
    return "fp8", "current", "FP8 with per-tensor current scaling (the release's notes)"


def nvidia_recipe(table: str, index: int, row: pd.Series, alternative: bool) -> Recipe:
    """A row of a NeMo or Megatron-Bridge performance summary."""
    def get(name: str) -> str | None:
        """The column's value for this configuration (None where the table has no such column or cell)."""
        return cell(row[name], alternative) if name in row and not pd.isna(row[name]) else None

    system, name = get("System"), str(row["Model"]).strip()
    precision_column = get("Precision")
    label = f"{name} {system} {get('#-GPUs')} GPUs{' ' + precision_column if precision_column else ''}"
    if alternative:
        label += " (alternative)"
    notes: list[str] = []
    gpus, gbs, mbs, seq = (number(get(c)) for c in ("#-GPUs", "GBS", "MBS", "Sequence Length"))
    if gbs is not None and mbs is not None and gbs < mbs:
        notes.append(f"GBS={gbs}, MBS={mbs} read as swapped (the table's header: 'looks swapped')")
        gbs, mbs = mbs, gbs
    tp, pp, cp = (number(get(c)) or 1 for c in ("TP", "PP", "CP"))
    vp, ep = number(get("VP")) or 1, number(get("EP")) or 1
    fsdp = number(get("FSDP")) or 0
    throughput = float(str(get("Tokens / sec / GPU")).replace(",", ""))
    measured = step_seconds(gbs, seq, throughput, gpus)
    base = dict(table=table, row=index, label=label, measured_s=measured, variant="alternative" * alternative)
    model_name = re.sub(r"\s*\(.*\)$", "", name)
    if system not in SYSTEMS:
        return Recipe(**base, overrides=(), refusal=f"system {system!r}: no hardware config")
    if model_name in NOT_BUILT:
        return Recipe(**base, overrides=(), refusal=NOT_BUILT[model_name])
    if model_name not in MODELS:
        return Recipe(**base, overrides=(), refusal=f"model {model_name!r}: no model config")
    if gpus % (pp * ep):
        return Recipe(**base, overrides=(), megatron_rejects=True,
                      refusal=f"the layout as stated (EP={ep}, PP={pp} on {gpus} GPUs) is one Megatron-Core refuses: "
                              f"its world size {gpus} must be a multiple of pp * ep * etp = {pp * ep} (experts are "
                              "folded over the ranks of a pipeline stage)"
                              + ("; the cell's alternative states no EP of its own" if alternative else ""))
    dp = gpus // (tp * pp * cp)
    accumulation = number(get("GA"))
    if alternative and accumulation and gbs % (dp * accumulation) == 0 and gbs // (dp * accumulation) != mbs:
        notes.append(f"MBS {gbs // (dp * accumulation)} = GBS / (DP x GA) = {gbs} / ({dp} x {accumulation}): the "
                     f"MBS cell ({mbs}) is the main configuration's, the GA cell has one per configuration")
        mbs = gbs // (dp * accumulation)
    precision, fp8_recipe, note = precision_of(table, system, alternative, precision_column)
    if note:
        notes.append(note)
    framework = "nemo-24.07" if table.startswith("nemo_24.07") else "megatron-bridge"
    overrides = [f"hardware={SYSTEMS[system]}", f"framework={framework}", f"model={MODELS[model_name]}",
                 "parallelism=single",
                 f"model.seq_length={seq}", f"parallelism.dp={dp}", f"parallelism.tp={tp}", f"parallelism.pp={pp}",
                 f"parallelism.cp={cp}", f"parallelism.micro_batch_size={mbs}",
                 f"parallelism.global_batch_size={gbs}", f"parallelism.precision={precision}"]
    if fp8_recipe:
        overrides.append(f"parallelism.fp8_recipe={fp8_recipe}")
    if vp > 1:
        overrides += [f"parallelism.virtual_stages={vp}", "parallelism.schedule=interleaved-1f1b"]
    if ep > 1:
        overrides.append(f"parallelism.ep={ep}")
    if MODELS[model_name] in ("deepseek-v3", "kimi-k2") and pp > 1:
        if pp * vp not in SIXTY_ONE_LAYER_SPLITS:
            return Recipe(**base, overrides=(), refusal=f"{model_name} on pp * vp = {pp} * {vp}: Megatron-Bridge "
                                                         "states no pipeline layout for it")
        overrides.append(f"parallelism.pipeline_layout='{SIXTY_ONE_LAYER_SPLITS[pp * vp]}'")
        notes.append("Megatron-Bridge's pipeline layout for 61 layers, without the multi-token-prediction layer "
                     "(not built)")
    if "tokendrop" in name:
        overrides.append("model.moe_capacity_factor=1.0")
        notes.append("token dropping at capacity factor 1.0 (the row says tokendrop; the factor is not stated)")
    if tp > 1:
        overrides += ["parallelism.sequence_parallel=true", "parallelism.tp_comm_overlap=true"]
        notes.append("sequence parallelism with TP communication overlap (NVIDIA's performance recipes)")
    if fsdp:
        overrides.append("parallelism.zero_stage=3")
        notes.append(f"FSDP over the {dp * cp} data-parallel ranks (Megatron-FSDP, the table's FSDP={fsdp})")
        offloaded = CPU_OFFLOADED_LAYERS.get((MODELS[model_name], system, precision, mbs), 0)
        if offloaded:
            overrides.append(f"parallelism.cpu_offload_layers={offloaded}")
            notes.append(f"activations of {offloaded} layers offloaded to the host (Megatron-Bridge's recipe for "
                         "this model, system and precision)")
    else:
        overrides += ["parallelism.zero_stage=1", "parallelism.overlap_param_gather=true"]
        notes.append("distributed optimizer with overlapped gradient reduce and parameter gather (Megatron-Core)")
        if fp8_recipe == "mxfp8" and framework == "megatron-bridge":
            overrides.append("parallelism.fp8_param_gather=true")
            notes.append("weights held in MXFP8 alone (Megatron-Bridge's bf16_with_mxfp8_mixed: fp8_param_gather, "
                         "reuse_grad_buf_for_mxfp8_param_ag)")
    release = table.split("_")[1] if table.startswith("megatron-bridge_") else ""
    if (release, MODELS[model_name], system) in MOE_A2A_OVERLAP:
        overrides.append("parallelism.moe_a2a_overlap=true")
        notes.append("expert all-to-alls overlapped by combined forward-backward passes (Megatron-Bridge's "
                     "performance recipe of the release: overlap_moe_expert_parallel_comm)")
    modules = RECOMPUTE_MODULES.get((release, MODELS[model_name], system))
    if modules is None:
        overrides.append("parallelism.recompute=none")
        notes.append("no activation recomputation (not stated)")
    else:
        overrides += ["parallelism.recompute=selective", f"parallelism.recompute_modules=[{','.join(modules)}]"]
        notes.append(f"recompute modules {', '.join(modules) or 'none'} (Megatron-Bridge's performance recipe of the "
                     "release)")
    notes.append(f"hardware.num_nodes for {gpus} GPUs")
    if model_name in MODEL_NOTES:
        notes.append(MODEL_NOTES[model_name])
    return Recipe(**base, overrides=tuple(overrides), notes=tuple(notes))


CPU_OFFLOADED_LAYERS = {
    ("llama3-70b", "DGX-GB200", "fp8", 2): 40, ("llama3-70b", "DGX-GB300", "fp8", 2): 20,
    ("llama3-70b", "DGX-B200", "fp8", 1): 5, ("llama3-70b", "DGX-GB200", "bf16", 1): 20,
    ("llama3-70b", "DGX-GB300", "bf16", 2): 30,
}
"""(model, system, precision, micro-batch) -> layers whose activations Megatron-Bridge's performance recipes for Llama 3
70B with Megatron-FSDP offload to the host (src/megatron/bridge/perf_recipes/llama/<gpu>/llama3.py @ 067f987d:
cpu_offloading_num_layers, activations only); an FSDP row of that model, system, precision and micro-batch composes
them (parallelism.cpu_offload_layers)."""

RECOMPUTE_MODULES = {
    **{("25.09", "deepseek-v3", system): modules for system, modules in (
        ("DGX-H100", ("mla_up_proj", "mlp")), ("DGX-B200", ("mla_up_proj",)), ("DGX-GB200", ("mla_up_proj",)))},
    **{("26.02", "deepseek-v3", system): ("mla_up_proj",)
       for system in ("DGX-GB300", "DGX-GB200", "DGX-B300", "DGX-B200")},
    **{("26.04", "deepseek-v3", system): ("mla_up_proj",) for system in ("DGX-GB300", "DGX-B300", "DGX-B200")},
    ("26.04", "deepseek-v3", "DGX-GB200"): ("mlp",),
    ("26.04", "kimi-k2", "DGX-GB300"): ("mla_up_proj",),
}
"""(Megatron-Bridge release, model, system) -> the selective recompute modules of the release's performance recipe
(Megatron-Bridge v0.1.0rc4 scripts/performance/run_script.py for 25.09, the GB200 row's token-drop case; v0.3.0 and
v0.4.0 scripts/performance/configs/<model>/*_workload_base_configs.py, the V1/V2 presets of the table's layout, for
26.02 and 26.04). Rows of models whose recipes recompute modules not built (moe_act, layernorm, moe: Nemotron 3's
H100 recipe) are not listed: they compose without recomputation."""

MOE_A2A_OVERLAP = {("25.09", "deepseek-v3", "DGX-H100")}
"""(Megatron-Bridge release, model, system) whose performance recipe overlaps the expert all-to-alls with another
micro-batch's compute (overlap_moe_expert_parallel_comm with delay_wgrad_compute: Megatron-Bridge v0.1.0rc4
scripts/performance/run_script.py, A2A_1F1B for H100; the v0.3.0 and v0.4.0 presets of the 26.02 and 26.04 rows set
moe_a2a_overlap=False). The recipe's DeepEP dispatcher (flex) is not built: the all-to-all dispatcher stands in."""

TORCHTITAN_RECOMPUTE = {
    "selective": "op", "selective layer": "selective", "selective op": "op", "per op SAC": "op",
    "full": "full", "no": "none",
}
"""torchtitan's activation_checkpoint.mode (and its option) -> parallelism.recompute. A plain 'selective' is the
op-level policy of torchtitan's Llama configs (llama3_8b.toml: selective_ac_option = 'op'). 'selective layer'
(every n-th block fully recomputed) differs from Megatron's selective recompute of core attention it is composed
as: the note says so."""


def torchtitan_recipe(table: str, index: int, row: pd.Series) -> Recipe:
    """A row of torchtitan's Llama performance tables (FSDP2, TP, PP, CP, Float8, async TP)."""
    techniques = str(row["techniques"])
    gpus = number(row["num_gpus"])
    label = f"{row['model']} {row['gpu']} {gpus} GPUs {techniques}"
    compiled = "compile" in techniques
    notes: list[str] = [] if compiled else ["torch.compile not named: eager kernels (torchtitan's training.compile "
                                           "default)"]
    tp = number(row["tp"]) or number(row["derived_tp"]) or 1
    pp, cp = number(row["pp"]) or 1, number(row["cp"]) or 1
    local = number(row["local_batch_size"])
    seq = number(row["seq_len"])
    if seq is None:
        seq = 4096 if "Llama 2" in row["model"] else 8192
        notes.append(f"sequence length {seq:,} (torchtitan's TOML default for the model; the table does not state "
                     "it)")
    dp = gpus // (tp * pp * cp)
    gbs = number(row["global_batch_size"]) or local * dp
    throughput = float(str(row["tps_per_gpu_raw"]).replace(",", ""))
    base = dict(table=table, row=index, label=label, measured_s=step_seconds(gbs, seq, throughput, gpus))
    if row["model"] not in MODELS or row["gpu"] not in SYSTEMS:
        missing = "model" if row["model"] not in MODELS else "system"
        return Recipe(**base, overrides=(), refusal=f"{missing} {row[missing if missing == 'model' else 'gpu']!r}: "
                                                     "no config")
    mode = str(row["activation_checkpointing"]).strip()
    recompute = TORCHTITAN_RECOMPUTE.get(mode, "op" if "default" in mode else None)
    if recompute is None:
        return Recipe(**base, overrides=(), refusal=f"activation_checkpointing={mode!r}: not one of "
                                                     f"{', '.join(TORCHTITAN_RECOMPUTE)}")
    lowered = techniques.lower()
    asynchronous_tp = tp > 1 and "async" in lowered
    if recompute == "op" and asynchronous_tp:  # validate refuses recompute=op with the overlap rings
        recompute = "selective"
        notes.append("op-level checkpointing with async TP not built: composed as Megatron's selective recompute")
    elif mode != recompute:
        notes.append(f"activation checkpointing {mode!r} composed as recompute={recompute}")
    overrides = [f"hardware={SYSTEMS[row['gpu']]}", "framework=torchtitan", f"model={MODELS[row['model']]}",
                 "parallelism=single", *(["framework.fused_elementwise=true"] if compiled else []),
                 f"model.seq_length={seq}", f"parallelism.dp={dp}", f"parallelism.tp={tp}", f"parallelism.pp={pp}",
                 f"parallelism.cp={cp}", f"parallelism.micro_batch_size={local}",
                 f"parallelism.global_batch_size={gbs}", "parallelism.zero_stage=3",
                 "parallelism.grad_reduce_in_fp32=true", f"parallelism.recompute={recompute}"]
    if "rowwise" in lowered:
        overrides += ["parallelism.precision=fp8", "parallelism.fp8_recipe=rowwise"]
    elif "float8" in lowered:
        overrides += ["parallelism.precision=fp8", "parallelism.fp8_recipe=current"]
        notes.append("Float8 with tensorwise dynamic scaling (torchao's default) as fp8_recipe=current")
        if "float8 all-gather" in lowered:
            overrides.append("parallelism.fp8_param_gather=true")
    else:  # torchtitan trains in bf16 (FSDP2 MixedPrecisionPolicy param_dtype, training.mixed_precision_param)
        overrides.append("parallelism.precision=bf16")
    if tp > 1:
        overrides.append("parallelism.sequence_parallel=true")
        if asynchronous_tp:
            overrides.append("parallelism.tp_comm_overlap=true")
    if cp > 1:
        overrides.append("parallelism.cp_comm_type=all_gather")
        notes.append("context parallelism as all-gathered keys and values (torch's context_parallel rotates "
                     "them: ring attention; trainsim's p2p needs seq divisible by 2 * cp, either is allowed)")
    if row["model"] in MODEL_NOTES:
        notes.append(MODEL_NOTES[row["model"]])
    notes.append(f"hardware.num_nodes for {gpus} GPUs")
    return Recipe(**base, overrides=tuple(overrides), notes=tuple(notes))


RECIPE_TABLES = {
    "megatron-bridge_25.09_pretrain.csv": "nvidia",
    "megatron-bridge_26.02_pretrain.csv": "nvidia",
    "megatron-bridge_26.04_pretrain.csv": "nvidia",
    "nemo_25.02_pretrain_partial.csv": "nvidia",
    "nemo_25.04_pretrain_partial.csv": "nvidia",
    "nemo_25.07_pretrain_partial.csv": "nvidia",
    "nemo_24.07_dgx-h100_fp8_pretrain.csv": "nemo2407",
    "torchtitan_llama_perf.csv": "torchtitan",
}
"""Tables of data/published read as recipes, by the shape of their columns. The 2021 Selene and 2024
Megatron-Core README tables name no micro-batch, precision or virtual stages (validation/published.py states
what it assumes for them), and vTrain's rows are single-node Megatron-DeepSpeed runs (validation/vtrain.py)."""


def nemo2407_recipe(table: str, index: int, row: pd.Series) -> Recipe:
    """NeMo 24.07's DGX-H100 table: the NeMo columns (lower-case) of a 24.07 FP8 run."""
    renamed = pd.Series({"System": "DGX-H100", "Model": row["model"], "#-GPUs": row["gpus"], "GBS": row["global_batch"],
                         "MBS": row["micro_batch"], "Sequence Length": row["seq_len"], "TP": row["tp"],
                         "PP": row["pp"], "CP": row["cp"], "VP": row["vp"], "EP": 1,
                         "Tokens / sec / GPU": row["tokens_per_sec_per_gpu"]})
    return nvidia_recipe(table, index, renamed, False)


def read_published_csv(path: Path) -> pd.DataFrame:
    """A published table without its '#' source lines, every cell as text ('#-GPUs' is a column name, so
    pandas' comment='#' would cut the header)."""
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    return pd.read_csv(io.StringIO("\n".join(lines)), dtype=str)


def read_recipes(name: str, data_dir: Path = DATA_DIR) -> list[Recipe]:
    """Every row of one table as recipes (a row with an 'a (b)' cell gives two: main and alternative)."""
    kind = RECIPE_TABLES[name]
    rows = read_published_csv(data_dir / "published" / name)
    recipes = []
    for index, row in rows.iterrows():
        if kind == "torchtitan":
            recipes.append(torchtitan_recipe(name, index, row))
        elif kind == "nemo2407":
            recipes.append(nemo2407_recipe(name, index, row))
        else:
            recipes.append(nvidia_recipe(name, index, row, False))
            if any("(" in str(v) for k, v in row.items() if k != "Model"):
                recipes.append(nvidia_recipe(name, index, row, True))
    return recipes


def compose_recipe(recipe: Recipe) -> Composed:
    """Compose a recipe as a user would (hardware.num_nodes sized to its GPUs); a ConfigError is its refusal."""
    from trainsim.config import compose_run
    from trainsim.config.compose import default_config_dir

    if recipe.refusal:
        return Composed(recipe, refusal=recipe.refusal)
    for group, option in (o.split("=", 1) for o in recipe.overrides if "." not in o.split("=", 1)[0]):
        if not (default_config_dir() / group / f"{option}.yaml").is_file():
            return Composed(recipe, refusal=f"{group}={option}: no conf/{group}/{option}.yaml (not built)")
    try:
        hardware = compose_run([o for o in recipe.overrides if o.startswith("hardware=")], check="layout").hardware
        gpus = math.prod(int(o.split("=")[1]) for o in recipe.overrides
                         if o.split("=")[0] in ("parallelism.dp", "parallelism.tp", "parallelism.pp", "parallelism.cp"))
        nodes = -(-gpus // hardware.devices_per_node)
        run = compose_run([*recipe.overrides, f"hardware.num_nodes={nodes}"])
    except ConfigError as exc:
        return Composed(recipe, refusal=str(exc))
    return Composed(recipe, run=run, notes=list(recipe.notes))
