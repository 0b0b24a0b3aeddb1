"""Predict published large-scale Megatron runs (achieved TFLOP/s per GPU) as step times.

Tables (data/published, each file's header names its source):
  * megatron2021_a100: Megatron-LM weak scaling on Selene (Narayanan et al., SC21, Table 1): GPT 1.7B-1T,
    32-3072 A100-80GB, seq 2048, vocab 51,200, fp16, full recomputation, interleaved 1F1B.
  * mcore2024_h100: Megatron-Core r0.8 on H100 (README model table): GPT 1.7B-462B, 48-6144 H100, seq 4096,
    vocab 131,072, bf16 (assumed), DP 48 everywhere.
  * nemo2407_h100_fp8: NeMo 24.07 (Megatron-Core backend) pre-training on DGX-H100 in FP8 (NeMo's performance
    summary): GPT-3 5B-175B, Llama 2 7B-70B, Nemotron 8B-340B, Llama 3 8B/70B, 8-512 H100, TP/PP/CP and virtual
    stages per row. The csv has no architecture columns: NEMO_ARCHITECTURES gives each model's, with its source.

The first two report throughput; their step time follows from the FLOP formula the source states:
  megatron2021: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))          (counts the recomputed forward)
  mcore2024:    F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h))          (Megatron-LM's num_floating_point_operations
                                                                      for a GPT with 4h MLP, MHA: model FLOPs)
  step_s = F / (gpus * tflops_per_gpu * 1e12)
The NeMo table carries the step time itself (derived_step_time_s = GBS * seq / (tokens/s/GPU * gpus)): no
FLOP formula is involved (Table.step_time_column).
Rows a config cannot express (layers that do not split into the row's pipeline stages) are kept in the table
with the reason (`skip_reason`) and left out of the fit and the figures, counted (`TableResult.skipped`).
Settings the sources leave open are stated in ASSUMPTIONS and applied the same way to every row.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from trainsim.config.data_path import DATA_DIR
from trainsim.config.framework import apply_framework
from trainsim.config.schema import FrameworkConfig, HardwareConfig, ModelConfig, ParallelismConfig
from trainsim.validation.fitting import calibrated_comm, pipeline_slowdown
from trainsim.validation.kernel_fit import (
    FITTED_PER_GPU,
    FitRow,
    GaussNewton,
    StepTimes,
    alternate_groups,
    data_free_params,
    fit_gauss_newton,
    leave_one_row_out,
)
from trainsim.validation.traces import TRACE_CACHE, analytical_step, is_traced, trace_directory, trace_jobs, traced


@dataclass(frozen=True)
class Architecture:
    """A model's shape and recipe dropout where the table has no architecture columns."""

    family: str
    """trainsim's model.family: 'gpt' (LayerNorm, GELU, learned positions, biases) or 'llama'"""
    layers: int
    hidden: int
    heads: int
    kv_heads: int | None
    """query groups (GQA); None = heads"""
    ffn: int
    vocab: int
    """the tokenizer's vocabulary before padding (trainsim pads to a multiple of 128 * tp as NeMo does)"""
    dropout: float
    """hidden and attention dropout of the recipe"""
    source: str
    tp_comm_overlap: bool = True
    """the recipe's ub_tp_comm_overlap (tensor-parallel communication overlapped with the GEMMs where tp > 1)"""
    recompute: str = "none"
    """the recipe's activations_checkpoint_granularity: 'none' (null) or 'selective'"""


@dataclass(frozen=True)
class Table:
    name: str
    path: str
    hardware: str
    precision: str
    recompute: str
    """activation recomputation of every row where the table has no architectures (else each Architecture's)"""
    seq: int | None
    """tokens per sample; None: the csv's seq_len column"""
    vocab: int | None
    """None: the architecture's (architectures)"""
    framework: str
    """the software stack that ran it (conf/framework/): its gradient buckets, gradient-accumulation fusion,
    attention kernel and flash-attention release (config/framework.py applies them to every row)"""
    most_virtual_stages: int | None
    """interleaving: the most virtual stages per pipeline rank that divide its layers, up to this many; None: the
    csv's vp column"""
    sequence_parallel: bool
    """Megatron-Core's scaling runs use sequence parallelism with TP, its communication overlapped with the
    GEMMs (--tp-comm-overlap, stated in the source); neither existed in 2021"""
    distributed_optimizer: bool
    """Megatron-Core's distributed optimizer with --overlap-param-gather (the source names the flag, which needs
    --use-distributed-optimizer); Megatron-LM 2021 kept the optimizer replicated"""
    flops_factor: float | None
    """F = flops_factor * B s l h^2 (1 + s/(6h) + V/(vocab_divisor l h)); None where step_time_column is set"""
    vocab_divisor: float | None
    step_time_column: str | None = None
    """the csv column holding the measured step time in seconds; None: from the FLOP formula and throughput"""
    architectures: Mapping[str, Architecture] | None = None
    """model name -> architecture where the csv has no architecture columns (layers, hidden, attn_heads); with
    it, seq (None), micro batch, context parallelism and virtual stages come from the csv's seq_len, micro_batch,
    cp and vp columns"""


LAUNCHER = "NVIDIA/NeMo-Framework-Launcher tag 24.07, launcher_scripts/conf/training/"
NEMO_ARCHITECTURES = {
    "GPT3-5B": Architecture("gpt", 24, 4096, 32, None, 16384, 50257, 0.1,
                            LAUNCHER + "gpt3/5b.yaml (ffn 4h; GPT2BPETokenizer: 50,257)"),
    "GPT3-20B": Architecture("gpt", 44, 6144, 48, None, 24576, 50257, 0.1,
                             LAUNCHER + "gpt3/20b.yaml (ffn 4h; GPT2BPETokenizer)"),
    "GPT3-175B": Architecture("gpt", 96, 12288, 96, None, 49152, 50257, 0.1,
                              LAUNCHER + "gpt3/175b.yaml and 175b_fp8.yaml (ffn 4h; GPT2BPETokenizer; "
                              "ub_tp_comm_overlap: False)", tp_comm_overlap=False),
    "LLAMA2-7B": Architecture("llama", 32, 4096, 32, None, 11008, 32000, 0.0,
                              LAUNCHER + "llama/llama2_7b.yaml (Llama 2 tokenizer: 32,000)"),
    "LLAMA2-13B": Architecture("llama", 40, 5120, 40, None, 13824, 32000, 0.0, LAUNCHER + "llama/llama2_13b.yaml"),
    "LLAMA2-70B": Architecture("llama", 80, 8192, 64, 8, 28672, 32000, 0.0, LAUNCHER + "llama/llama2_70b.yaml"),
    "Nemotron-8B": Architecture("gpt", 32, 4096, 32, None, 16384, 256000, 0.0,
                                LAUNCHER + "nemotron/nemotron_8b.yaml; NVIDIA/NeMo nemo/collections/llm/gpt/model/"
                                "nemotron.py Nemotron3Config8B (vocabulary: the 256K SentencePiece of Nemotron)"),
    "Nemotron-22B": Architecture("gpt", 40, 6144, 48, None, 24576, 256000, 0.0,
                                 LAUNCHER + "nemotron/nemotron_22b.yaml (vocabulary: 256K as the other Nemotrons)"),
    "Nemotron-340B": Architecture("gpt", 96, 18432, 96, 8, 73728, 256000, 0.0,
                                  LAUNCHER + "nemotron/nemotron_340b.yaml (tokenizer nemotron_2_256k; "
                                  "ub_tp_comm_overlap: False; activations_checkpoint_granularity: selective); "
                                  "NVIDIA/NeMo nemotron.py Nemotron4Config340B", tp_comm_overlap=False,
                                  recompute="selective"),
    "LLAMA3-8B": Architecture("llama", 32, 4096, 32, 8, 14336, 128256, 0.0,
                              "conf/model/llama3-8b.yaml (Llama 3 paper, Table 3; released config.json)"),
    "LLAMA3-70B": Architecture("llama", 80, 8192, 64, 8, 28672, 128256, 0.0,
                               "conf/model/llama3-70b.yaml (Llama 3 paper, Table 3; released config.json)"),
}
"""Architectures of the NeMo 24.07 performance-summary models (the csv names only the model). Nemotron
(squared-ReLU MLP without gating, LayerNorm1p, rotary on half the head dimensions, no biases) maps to family
'gpt' with its ffn_hidden_size and query groups: see ASSUMPTIONS['nemotron']."""

TABLES = {
    "megatron2021_a100": Table("megatron2021_a100", "published/megatron-lm_readme_2021_a100_selene_weak_scaling.csv",
                               "a100-80g-selene", "fp16", "full", 2048, 51200, "megatron-lm-2021", 4, False, False,
                               96.0, 16.0),
    "mcore2024_h100": Table("mcore2024_h100", "published/megatron-lm_readme_2024_h100_core_r0.8.csv",
                            "h100-sxm-dgx", "bf16", "none", 4096, 131072, "megatron-core", 1024, True, True, 72.0,
                            12.0),
    "nemo2407_h100_fp8": Table("nemo2407_h100_fp8", "published/nemo_24.07_dgx-h100_fp8_pretrain.csv",
                               "h100-sxm-dgx", "fp8", "none", None, None, "nemo-24.07", None, True, True, None, None,
                               step_time_column="derived_step_time_s", architectures=NEMO_ARCHITECTURES),
}

DROPOUT = 0.1
ASSUMPTIONS = {
    "micro_batch_size": "1 (Megatron's large-model runs; the sources do not state it); NeMo 24.07: the csv's",
    "schedule": "interleaved 1F1B where pp > 1 with the most virtual stages that divide the stage's layers: at "
                "most 4 in 2021 (SC21), one layer per virtual stage in 2024 (as NVIDIA's NeMo 24.07 recipes in "
                "data/published use 1-2); NeMo 24.07: the csv's vp column (virtual stages per pipeline rank)",
    "dropout": "0.1 after attention and MLP and on the attention probabilities (Megatron-LM's argument defaults); "
               "NeMo 24.07: the recipe's hidden/attention dropout, 0.1 for GPT-3, 0.0 for Llama 2 and Nemotron "
               "(NEMO_ARCHITECTURES' sources)",
    "sequence_parallel": "on for the 2024 H100 runs (Megatron-Core's scaling scripts; not stated in the README) "
                         "and for the NeMo 24.07 rows with tp > 1; tp_comm_overlap with it where the model's "
                         "24.07 launcher recipe sets ub_tp_comm_overlap: every model but GPT-3 175B and "
                         "Nemotron-340B, whose yamls leave it off (NEMO_ARCHITECTURES' tp_comm_overlap and "
                         "sources)",
    "dp_bucket": "gradients reduced in buckets overlapped with backward: 25 MiB in 2021 (Megatron DDP with "
                 "overlap); Megatron-Core r0.8 and NeMo 24.07 (Megatron-Core's DDP): its default of max(40M, 1M x "
                 "data-parallel size) parameters per bucket (DistributedDataParallelConfig.bucket_size: larger DP "
                 "sizes need larger buckets so that collectives are not latency-bound), 96 MB of bf16 gradients at "
                 "dp 48; with the distributed optimizer reduce-scattered in the same buckets",
    "grad_dtype": "gradients reduced in the weights' dtype (parallelism.grad_reduce_in_fp32 false). Megatron-LM "
                  "forces fp32 for bf16, but at fp32 the 2024 pp=1 rows cannot reach their measured times (32B tp8: "
                  "16 GB per GPU reduce-scattered through one 50 GB/s NIC after the last micro-batch); the sources "
                  "do not state the precision",
    "gradient_accumulation_fusion": "Megatron-Core r0.8 and NeMo 24.07: on (Megatron-Core's default "
                                    "--gradient-accumulation-fusion; the NeMo launcher's GPT-3 recipes set "
                                    "gradient_accumulation_fusion: True): the linears' weight-gradient GEMMs "
                                    "accumulate into the gradient buffer; Megatron-LM 2021: off (its backward hook "
                                    "added each gradient)",
    "distributed_optimizer": "Megatron-Core r0.8 and NeMo 24.07: zero_stage 1 with overlap_param_gather (NeMo's "
                             "recipes: optim distributed_fused_adam / mcore_distributed_optim, overlap_grad_sync "
                             "and overlap_param_sync true)",
    "recompute_nemo": "NeMo 24.07: the model's 24.07 launcher recipe (the performance summary does not state "
                      "it): none, except Nemotron-340B's selective (nemotron_340b.yaml, whose layout pp12 vp8 "
                      "differs from the table's row; NEMO_ARCHITECTURES' recompute)",
    "fp8": "NeMo 24.07: Transformer Engine FP8 (HYBRID: E4M3 forward, E5M2 backward) on the transformer linears "
           "with the delayed-scaling recipe (fp8_recipe 'delayed'); the h100-sxm-dgx FP8 peak. The 24.07 launcher "
           "sets NVTE_DP_AMAX_REDUCE_INTERVAL=0 and NVTE_ASYNC_AMAX_REDUCTION=1 (amax reduced over tp only, "
           "asynchronously); trainsim all-reduces the amaxes over dp x tp synchronously (workloads/fp8.py)",
    "attention_nemo": "NeMo 24.07: fused attention timed at FlashAttention-2's causal H100 measurement "
                      "(data/kernels/h100_flash-attn2-vs-3_fwd-bwd_pr1791.csv: forward 284.1, backward 287.1 "
                      "TFLOP/s of 989, at seq 8,192: the long-sequence efficiency is that rate times 1 + "
                      "attention_tile_keys / 8192, the config's call, tile and dropout costs kept), not the "
                      "h100-sxm-dgx config's cuDNN rates: the 24.07 launcher (conf/config.yaml) sets "
                      "NVTE_FUSED_ATTN=0, so Transformer Engine runs the flash-attn 2 package (its "
                      "FlashAttention-3 support came in later releases)",
    "nemotron": "Nemotron (squared-ReLU MLP without gating, LayerNorm1p, rotary on half of each head, no biases) "
                "runs as trainsim's family 'gpt' with its ffn_hidden_size and query groups: the same GEMMs "
                "(h -> ffn -> h, no gate), GELU in place of squared ReLU (one elementwise kernel either way), "
                "LayerNorm for LayerNorm1p, learned positions (one embedding add) in place of rotary, and bias adds "
                "that Nemotron does not have",
    "context_parallel": "NeMo 24.07 rows with cp > 1 (the two Llama 3 rows, cp = 2) run ring attention "
                        "(parallelism.cp_comm_type=p2p, Megatron-Core's default cp_comm_type)",
}

STRUCTURAL_CHOICES = {
    "grad_dtype": "gradients reduced in the weights' dtype, not fp32 (ASSUMPTIONS['grad_dtype']): at fp32 the "
                  "Megatron-Core pp=1 rows cannot reach their measured times (docs/CHANGELOG.md 2026-11-22: fp32 "
                  "H100 7.29 -> 10.37 %, NeMo 5.41 -> 7.75 %)",
    "split_k": "split-K in the GEMM shape model (profile/analytical.py SPLIT_K, MIN_SPLIT_K), kept after it "
               "lowered the Selene table's error 4.8 -> 4.4 % (docs/CHANGELOG.md)",
    "pooled_per_gpu_fit": "one fit of the GPU's efficiencies over all its tables, not one per table (session 23: "
                          "with Megatron-Core's table alone DeepSeek-V3 fell to -19.9 %)",
    "dp_bucket_order": "data-parallel buckets in forward order (session 23: H100 9.02 -> 7.28 %)",
    "column_parallel_input_gradient": "the column-parallel input gradient in bulk (session 28: H100 5.18 -> "
                                      "4.73 %)",
    "variants_not_kept": "variants tried on these rows and not kept, e.g. bias-dropout-add as notes (session 27: "
                         "A100 4.51, Megatron-Core 5.24, NeMo 4.43 %)",
}
"""Choices of the model's structure made by watching the published tables' errors (so no leave-one-row-out
fold is blind to them). The leave-one-table-out figures (`leave_one_table_out`) measure what they are worth on
a table of the same GPU they were not tuned on; docs/validation.md lists them."""


def _skip_reason(row) -> str | None:
    """Why a row cannot be expressed as a config yet (None where it can)."""
    if int(row["layers"]) % (int(row["pp"]) * int(row["virtual_stages"])):
        return (f"layers={int(row['layers'])} not divisible by pp*vp={int(row['pp'])}*{int(row['virtual_stages'])}")
    return None


def read_table(name: str) -> pd.DataFrame:
    """One row per published run, normalised to the columns row_configs reads: model, gpus, global_batch,
    micro_batch, seq, layers, hidden, attn_heads, kv_heads, ffn, vocab, family, dropout, tp, pp, cp, dp,
    virtual_stages, measured_s, skip_reason (None where the row can run)."""
    table = TABLES[name]
    rows = pd.read_csv(DATA_DIR / table.path, comment="#")
    rows = rows.rename(columns={"attn_heads_unverified": "attn_heads", "tp_unverified": "tp", "pp_unverified": "pp"})
    if table.architectures is not None:
        unknown = set(rows["model"]) - set(table.architectures)
        if unknown:
            raise ValueError(f"{table.path}: no architecture for {sorted(unknown)} in the table's architectures")
        arch = pd.DataFrame([dataclasses.asdict(table.architectures[m]) for m in rows["model"]], index=rows.index)
        rows = rows.join(arch.rename(columns={"heads": "attn_heads"}).drop(columns="source"))
    else:
        rows["family"], rows["kv_heads"], rows["ffn"] = "gpt", None, None
        rows["vocab"], rows["dropout"] = table.vocab, DROPOUT
        rows["tp_comm_overlap"], rows["recompute"] = table.sequence_parallel, table.recompute
    rows["seq"] = rows["seq_len"] if table.seq is None else table.seq
    if "micro_batch" not in rows:
        rows["micro_batch"] = 1
    if "cp" not in rows:
        rows["cp"] = 1
    rows["dp"] = rows["gpus"] // (rows["tp"] * rows["pp"] * rows["cp"])
    if table.most_virtual_stages is None:
        rows["virtual_stages"] = rows["vp"]
    else:
        rows["virtual_stages"] = [virtual_stages(int(n), int(p), table.most_virtual_stages)
                                  for n, p in zip(rows["layers"], rows["pp"])]
    if table.step_time_column is not None:
        rows["measured_s"] = rows[table.step_time_column].astype(float)
    else:
        b, s, n, h, v = rows["global_batch"], rows["seq"], rows["layers"], rows["hidden"], rows["vocab"]
        flops = table.flops_factor * b * s * n * h**2 * (1 + s / (6 * h) + v / (table.vocab_divisor * n * h))
        tflops = rows["achieved_tflops_per_gpu"] if "achieved_tflops_per_gpu" in rows else rows["tflops_per_gpu"]
        rows["measured_s"] = flops / (rows["gpus"] * tflops * 1e12)
        rows["model_flops"] = flops
    rows["skip_reason"] = [_skip_reason(row) for _, row in rows.iterrows()]
    return rows


def virtual_stages(layers: int, pp: int, most: int = 4) -> int:
    if pp == 1:
        return 1
    per_stage = layers // pp
    return max(v for v in range(1, most + 1) if per_stage % v == 0)


def row_configs(table: Table, row, base_model: ModelConfig, base_par: ParallelismConfig
                ) -> tuple[ModelConfig, ParallelismConfig]:
    """The model and layout of one row of read_table (not for rows with a skip_reason)."""
    def optional(value):
        return None if value is None or pd.isna(value) else int(value)

    model = dataclasses.replace(base_model, name=f"{table.name}-{row['model']}", family=row["family"],
                                hidden_size=int(row["hidden"]), num_attention_heads=int(row["attn_heads"]),
                                num_layers=int(row["layers"]), seq_length=int(row["seq"]),
                                vocab_size=int(row["vocab"]), num_kv_heads=optional(row["kv_heads"]),
                                ffn_hidden_size=optional(row["ffn"]),
                                dropout=float(row["dropout"]), attention_dropout=float(row["dropout"]))
    tp, pp, v = int(row["tp"]), int(row["pp"]), int(row["virtual_stages"])
    sp = table.sequence_parallel and tp > 1
    par = dataclasses.replace(base_par, name=f"{table.name}-{row['model']}", tp=tp, pp=pp,
                              dp=int(row["dp"]), cp=int(row["cp"]), cp_comm_type="p2p",
                              micro_batch_size=int(row["micro_batch"]),
                              global_batch_size=int(row["global_batch"]),
                              precision=table.precision, recompute=row["recompute"],
                              sequence_parallel=sp, tp_comm_overlap=sp and bool(row["tp_comm_overlap"]),
                              zero_stage=int(table.distributed_optimizer),
                              overlap_param_gather=table.distributed_optimizer,
                              schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v)
    return apply_framework(table_framework(table), HardwareConfig(), model, par)[1:]


def compose_row(model: ModelConfig, par: ParallelismConfig, hw: HardwareConfig, comm, slowdown):
    """The composed step of one row with the analytical kernel model of `hw` (its trace cached on first use)
    and the overlap slowdown a compose on that hardware applies (fitting.pipeline_slowdown)."""
    return analytical_step(traced(model, par), par, hw, comm, slowdown)


@dataclass
class RowRun:
    model: ModelConfig
    par: ParallelismConfig
    directory: Path


@dataclass
class TableResult:
    rows: pd.DataFrame
    """per row: measured_s, predicted_s (leave-one-row-out), error_pct, and that fold's fitted parameters"""
    all_rows_fit: dict[str, float]
    """FITTED_PER_GPU from every row of the GPU's tables evaluated with it (what the hardware config carries;
    the parameters some row depends on)"""
    seconds: float
    skipped: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)
    """rows that cannot be expressed yet, with their skip_reason (not in rows, the fit or the figures)"""
    all_rows_convergence: GaussNewton | None = None
    """how the all-rows fit converged (iterations, last move)"""
    gpu: GpuRows | None = None
    """the GPU's rows and step times the fits composed (shared by the GPU's tables)"""


def table_framework(table: Table) -> FrameworkConfig:
    """The table's conf/framework option."""
    return framework_named(table.framework)


@functools.cache
def framework_named(name: str) -> FrameworkConfig:
    from trainsim.config import compose_run

    return compose_run([f"framework={name}"], check="layout").framework


def table_hardware(table: Table, hw: HardwareConfig) -> HardwareConfig:
    """`hw` as the table's framework runs it (its flash-attention release: config/framework.py)."""
    return apply_framework(table_framework(table), hw, ModelConfig(), ParallelismConfig())[0]


def trace_rows(runs: list[RowRun], workers: int = 2) -> list[RowRun]:
    """Each run with its cached trace directory, tracing the missing ones on `workers` processes."""
    runs = [dataclasses.replace(r, directory=trace_directory(r.model, r.par, TRACE_CACHE)) for r in runs]
    trace_jobs([(r.model, r.par, str(r.directory)) for r in runs if not is_traced(r.directory)], TRACE_CACHE, workers)
    return runs


def table_run(name: str):
    """The run a table's rows start from: its hardware (whose calibration composes them), gpt-small and a
    single device, which each row's model and layout replace."""
    from trainsim.config import compose_run

    return compose_run([f"hardware={TABLES[name].hardware}", "model=gpt-small", "parallelism=single"])


@dataclass
class GpuRows:
    """The runnable rows of the tables of one GPU, traced, with their step times (composed once per point)."""

    times: StepTimes
    rows: pd.DataFrame
    """read_table's columns and `table`, in the order of times.rows"""
    skipped: dict[str, pd.DataFrame]
    """table -> its rows with a skip_reason"""

    @property
    def groups(self) -> np.ndarray:
        return alternate_groups(list(self.rows["table"]))

    def measured(self, poison: Mapping[tuple[str, int], float] | None = None) -> np.ndarray:
        """The rows' measured step times; `poison`: (table, runnable row index) -> a factor on that row's."""
        measured = self.rows["measured_s"].to_numpy(dtype=float).copy()
        for (name, index), factor in (poison or {}).items():
            measured[np.flatnonzero(self.rows["table"] == name)[index]] *= factor
        return measured


def table_fit_rows(name: str, workers: int = 2, slowdown=None) -> tuple[pd.DataFrame, list[FitRow], pd.DataFrame]:
    """A table's runnable rows (read_table's columns), traced, as the FitRows the fits compose, and its rows with
    a skip_reason. `slowdown`: the overlap slowdown to compose with; None = the one `trainsim compose` applies on
    the table's hardware (its slowdown_model artifact, fitting.pipeline_slowdown)."""
    table = TABLES[name]
    table_rows = read_table(name)
    runnable = table_rows["skip_reason"].isna()
    rows = table_rows[runnable].reset_index(drop=True)
    run = table_run(name)
    comm = calibrated_comm(run)
    runs = trace_rows([RowRun(*row_configs(table, row, run.model, run.parallelism), Path())
                       for _, row in rows.iterrows()], workers)
    hw = table_hardware(table, run.hardware)
    table_slowdown = pipeline_slowdown(run) if slowdown is None else slowdown
    return (rows, [FitRow(r.directory, r.par, hw, comm, table_slowdown) for r in runs],
            table_rows[~runnable].reset_index(drop=True))


def gpu_rows(names: list[str], workers: int = 2, slowdown=None) -> GpuRows:
    """The runnable rows of the tables `names` (all on one GPU), traced, their StepTimes starting from the
    GPU's data-free point (table_fit_rows)."""
    hardware = {TABLES[name].hardware for name in names}
    if len(hardware) != 1:
        raise ValueError(f"tables {names} run on {sorted(hardware)}: a fit pools the tables of one GPU")
    fit_rows, frames, skipped = [], [], {}
    for name in names:
        rows, table_rows, skipped[name] = table_fit_rows(name, workers, slowdown)
        fit_rows += table_rows
        frames.append(rows.assign(table=name))
    return GpuRows(StepTimes(fit_rows, data_free_params(fit_rows[0].hw)), pd.concat(frames, ignore_index=True),
                   skipped)


def active_params(times: StepTimes) -> list[str]:
    """FITTED_PER_GPU that some row depends on (the others stay at the data-free start)."""
    slopes = times.slopes_of(range(len(times.rows)))
    return [n for n, used in zip(FITTED_PER_GPU, np.abs(slopes).sum(axis=0) > 0) if used]


def evaluate_tables(names: list[str], workers: int = 2, gpus: Mapping[str, GpuRows] | None = None
                    ) -> dict[str, TableResult]:
    """Leave-one-row-out over the rows that can run, pooled per GPU (kernel_fit.leave_one_row_out): each row is
    composed with FITTED_PER_GPU fitted to every other row of the tables in `names` on the same hardware (its
    GEMM and memory efficiencies are the GPU's, whichever framework ran the row; FP8 GEMMs have their own),
    from a data-free start. Rows with a skip_reason are returned in TableResult.skipped, never silently
    dropped. `gpus`: hardware -> its GpuRows already composed (TableResult.gpu), to reuse their step times.
    Each table's hardware calibration and slowdown model must be there (pipeline.build_point(table_run(name),
    'calibration') and 'slowdown_model' build them)."""
    import time

    results = {}
    for hardware in dict.fromkeys(TABLES[name].hardware for name in names):
        started = time.perf_counter()
        group = [name for name in names if TABLES[name].hardware == hardware]
        gpu = (gpus or {}).get(hardware) or gpu_rows(group, workers)
        times, rows, measured = gpu.times, gpu.rows.copy(), gpu.measured()
        active = active_params(times)
        all_rows = fit_gauss_newton(times, range(len(rows)), measured)
        folds = leave_one_row_out(times, measured, gpu.groups)
        rows["predicted_s"] = folds.predicted_s
        rows["error_pct"] = 100 * (rows["predicted_s"] / rows["measured_s"] - 1)
        for param in active:
            rows[param] = [f[param] for f in folds.folds]
        seconds = time.perf_counter() - started
        for name in group:
            results[name] = TableResult(rows[rows["table"] == name].drop(columns="table").reset_index(drop=True),
                                        {p: all_rows.params[p] for p in active}, seconds, gpu.skipped[name],
                                        all_rows, gpu)
    return results


def leave_one_table_out(evaluated: Mapping[str, TableResult]) -> dict[str, pd.DataFrame]:
    """Each table of a GPU with another table predicted by FITTED_PER_GPU fitted (Gauss-Newton from the
    data-free start) to the GPU's other tables alone: what the structural choices made by watching the
    tables are worth on a table they were not tuned on (a parameter only the held-out table depends on, FP8
    for the bf16 tables' fit, stays at its data-free start). Tables alone on their GPU, and results without
    their GpuRows, are left out."""
    out = {}
    for name, result in evaluated.items():
        gpu = result.gpu
        if gpu is None or (gpu.rows["table"] == name).all():
            continue
        held_out = (gpu.rows["table"] == name).to_numpy()
        fit = fit_gauss_newton(gpu.times, np.flatnonzero(~held_out), gpu.measured()).params
        table = gpu.rows[held_out].drop(columns="table").reset_index(drop=True)
        table["predicted_s"] = gpu.times.seconds_of(np.flatnonzero(held_out), fit)
        table["error_pct"] = 100 * (table["predicted_s"] / table["measured_s"] - 1)
        out[name] = table
    return out
