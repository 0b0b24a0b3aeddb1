"""Analytical kernel time: a roofline per op class, with the shape effects GPUs have, and its fit.

  GEMM       t = launch + max(flops / (R_mm * sat(flops, F_half) * q_shape), bytes / (R_mem * sat(bytes, B_half)))
  grouped    the same with its own floor and bandwidth (grouped_gemm_setup_s, grouped_gemm_memory_efficiency)
  attention  t = t_setup + c * flops / (peak * e_attn) * (1 + K_tile / keys) + c * scores * d_drop   (per pass)
             c = 1/2 when causal (masked tiles skipped); d_drop = seconds per score of in-kernel dropout
  other ops  t = launch + max(flops / (R_vec * e_k), bytes / (R_mem * e_k * sat(bytes, B_half)))
  sat(x, h) = x / (x + h)

R_mm = peak FLOP/s of the op's dtype x matmul_efficiency, R_mem = memory bandwidth x memory_efficiency
(Williams et al. 2009 roofline; the saturation terms model that small kernels cannot fill the device,
as vTrain and Calculon do with size-dependent efficiency). q_shape (gemm_shape_efficiency) is what a
GEMM's shape costs on a device with `sm_count` SMs: output tiles are spread over the SMs in waves, and a
last, partly filled wave runs at the speed of a full one (wave quantisation); a dimension that is not a
multiple of 16 bytes forbids the vectorised loads the fast kernels use (alignment). Fused attention is its
own class: it does not reach GEMM rates (softmax and masking between its two matmuls), each query tile's fixed
work (loading it, rescaling and writing its output) is amortised over the keys it visits (K_tile, in keys),
a call has a fixed device time (t_setup: several kernels, a last wave's tail), and dropout inside the kernel
draws a random number per score; all per pass and GPU, fitted to measured attention (data/kernels,
benchmarks/attention_accuracy.py). GEMMs split to overlap tensor-parallel communication are priced as
Transformer Engine runs them (`kernel_notes`: SMs held by the communication kernels, reductions done there);
each block pays its own waves (measured on H100: 8 token blocks of a tp-8 GEMM run at 0.81-0.88 of the whole
GEMM's rate one after another, 0.69-0.82 round-robin on three streams; benchmarks/gpu_accuracy.py). e_k is
the efficiency of the op's kind (normalisation, softmax/loss, optimizer, ...; 1 for elementwise): kernels of
one kind share an access pattern. Parameters live in `hardware.kernel_model`; `fit_rates` estimates them from
measured rows (least squares on log time).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trainsim.config.choices import DTYPE_BYTES, FLOAT_DTYPES, MATMUL_KINDS
from trainsim.config.schema import HardwareConfig
from trainsim.errors import ConfigError

FP8_INPUT_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
"""The recorder's names of FP8 tensors (trace/recorder.py dtype_name)."""
FP4_INPUT_DTYPES = ("float4_e2m1fn_x2",)
"""The recorder's name of packed FP4 (E2M1, two values per byte) tensors."""
MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "convolution", "scaled_mm",
              "grouped_mm", "grouped_mm_weight_grad", "fp8_grouped_mm", "fp8_grouped_mm_weight_grad",
              "block_scaled_mm")
# op kind (config.choices.OP_KINDS) -> name fragments (first match wins; anything else is 'elementwise')
OP_KIND_PATTERNS = {
    "attention": ("scaled_dot_product", "flash_attention", "efficient_attention"),
    "optimizer": ("_foreach_", "_fused_adam"),
    "normalization": ("layer_norm", "rms_norm", "batch_norm", "group_norm"),
    "softmax_loss": ("softmax", "nll_loss", "cross_entropy"),
    "reduction": ("sum", "mean", "max", "min", "norm", "amax", "var", "std"),
    "indexing": ("embedding", "gather", "scatter", "index", "masked_fill", "where"),
    "copy": ("copy", "clone", "cat", "stack", "fill", "zero", "ones", "zeros", "full", "arange", "uniform", "normal"),
}


def op_kind(op: str) -> str:
    """The op's kind, one of OP_KINDS."""
    base = op.split("::")[-1].split(".")[0]
    if base.lstrip("_") in MATMUL_OPS:
        return "matmul"
    for kind, fragments in OP_KIND_PATTERNS.items():
        if any(f in base for f in fragments):
            return kind
    return "elementwise"


def is_matmul(op: str) -> bool:
    return op_kind(op) in MATMUL_KINDS


GEMM_TILES = ((256, 128, 1.0), (128, 256, 1.0), (128, 128, 1.0), (64, 128, 0.99), (64, 64, 1.0))
"""Output tiles (rows, columns) a GEMM library chooses from, with the throughput of one SM on that tile
relative to the largest. cuBLAS-like heuristic: the tile with the best (wave fill x tile throughput) wins.
fit: python benchmarks/kernel_accuracy.py (the speeds, with SPLIT_K, MIN_SPLIT_K and matmul_half_flops, to the
290 GEMMs measured alone on one H100, data/kernels/h100_published-rows-ops_trainsim.csv: figure
kernel_gemm_tile_speed_h100_*). Measured, a smaller tile costs its SM nothing per output element within 1 %; what
sets a shape's efficiency is wave quantisation. (0.9 / 0.75 / 0.55 until 2026-11-28: not fitted.)"""
# cite: data/kernels/h100_swiglu-ffn-bmm-tflops_mlengineering.csv (272.7 / 395.5 TFLOP/s)
MISALIGNED_EFFICIENCY = 0.69
"""Throughput of a GEMM with a dimension that is not a multiple of 16 bytes, relative to an aligned one:
272.7 / 395.5 TFLOP/s measured for d_ff 10922 vs 10848-11008 on H100 (data/kernels/h100_swiglu-ffn-bmm...)."""


def gemm_dims(op: str, shapes: list) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of a matmul-class aten op from its input shapes; None when they do not say."""
    base = op.split("::")[-1].split(".")[0].lstrip("_")
    try:
        if base == "block_scaled_mm" and len(shapes) >= 2:  # a [m, k], b_t [n, k] (FP4: k/2, see op_dtype)
            (m, k), n = shapes[0], shapes[1][0]
            return 1, m, n, k
        if base in ("mm", "matmul", "scaled_mm") and len(shapes) >= 2 and len(shapes[0]) == 2:
            (m, k), n = shapes[0], shapes[1][-1]
            return 1, m, n, k
        if base == "addmm" and len(shapes) >= 3:
            (m, k), n = shapes[1], shapes[2][-1]
            return 1, m, n, k
        if base == "bmm" and len(shapes) >= 2:
            (b, m, k), n = shapes[0], shapes[1][-1]
            return b, m, n, k
        if base in ("baddbmm", "addbmm") and len(shapes) >= 3:
            (b, m, k), n = shapes[1], shapes[2][-1]
            return b, m, n, k
        if base == "linear" and len(shapes) >= 2:
            *lead, k = shapes[0]
            return 1, math.prod(lead), shapes[1][0], k
    except (TypeError, ValueError):
        return None
    return None


SPLIT_K = ((1, 1.0), (2, 0.83), (4, 0.69), (8, 0.58))
"""Splits of the reduction dimension a GEMM library uses when the output has too few tiles to fill the SMs
(cuBLAS split-K / stream-K), with the share of the time left after writing and summing the partial tiles.
fit: python benchmarks/kernel_accuracy.py (one speed per doubling of the splits, 0.833: figure
kernel_split_k_speed_per_doubling_h100; 0.95 / 0.9 / 0.85 until 2026-11-28: not fitted)"""
MIN_SPLIT_K = 1024
"""Smallest reduction length per split (shorter slices cannot keep the tensor cores fed).
fit: python benchmarks/kernel_accuracy.py (the best of 256, 512, 1024: figure kernel_min_split_k_h100; 512 until
2026-11-28: not fitted)"""


def gemm_shape_efficiency(batch: int, m: int, n: int, k: int, sm_count: int, dtype: str = "bf16",
                          tile_speeds=GEMM_TILES, split_speeds=SPLIT_K, min_split_k: int = MIN_SPLIT_K) -> float:
    """Fraction of a large GEMM's throughput this shape reaches: wave quantisation of its output tiles (times
    split-K slices) over `sm_count` SMs, for the best tile and split, times the alignment penalty. 1 when
    sm_count is 0 (unknown). `tile_speeds`, `split_speeds` and `min_split_k` are there for their fit
    (benchmarks/kernel_accuracy.py)."""
    aligned = all((d * DTYPE_BYTES.get(dtype, 2)) % 16 == 0 for d in (m, n, k))
    alignment = 1.0 if aligned else MISALIGNED_EFFICIENCY
    if sm_count <= 0:
        return alignment
    best = 0.0
    for split, split_speed in split_speeds:
        if split > 1 and k // split < min_split_k:
            continue
        for rows, cols, speed in tile_speeds:
            tiles = batch * -(-m // rows) * -(-n // cols) * split
            waves = -(-tiles // sm_count)
            useful = batch * m * n * split / (waves * sm_count * rows * cols)  # padded tiles, idle SMs: no work
            best = max(best, useful * speed * split_speed)
    return alignment * best


GROUPED_GEMM_OPS = ("trainsim::grouped_mm", "trainsim::fp8_grouped_mm")
"""Name prefixes of the grouped GEMM ops (workloads/grouped_gemm.py), weight gradients included."""


def grouped_gemm_groups(op: str, shapes: list, args: str) -> list[tuple[int, int, int]] | None:
    """(m, n, k) of each group of a grouped GEMM of workloads/grouped_gemm.py: trainsim::grouped_mm (x [T, k]
    times w [E, k, n], expert e owning counts[e] rows), its FP8 twin (x [T, k] times w_t [E, n, k]), and their
    weight gradients (x [T, k] and grad [T, n], or FP8 x^T [k, T] and grad^T [n, T], -> [E, k, n]: each group
    reduces over its rows)."""
    name = op.split("::")[-1].split(".")[0]
    try:
        parsed = json.loads(args)["args"]
        if name == "grouped_mm_weight_grad":
            (_, k), (_, n) = shapes[0], shapes[1]
            return [(k, n, c) for c in parsed[2]]
        if name == "grouped_mm":
            (_, k), n = shapes[0], shapes[1][-1]
            return [(c, n, k) for c in parsed[2]]
        if name == "fp8_grouped_mm_weight_grad":
            (k, _), (n, _) = shapes[0], shapes[1]
            return [(k, n, c) for c in parsed[4]]
        if name == "fp8_grouped_mm":
            (_, k), n = shapes[0], shapes[1][1]
            return [(c, n, k) for c in parsed[4]]
    except (TypeError, ValueError, KeyError, IndexError):
        return None
    return None


def grouped_gemm_efficiency(groups: list[tuple[int, int, int]], sm_count: int, dtype: str = "bf16",
                            tokens_axis: int = 0) -> float:
    """gemm_shape_efficiency for one kernel over many GEMMs (a CUTLASS/TE grouped GEMM): the groups' output
    tiles share the waves, so a small group pads only its own last tile; no split-K. `tokens_axis` is the
    dimension of (m, n, k) that counts each expert's tokens (0: forward and input gradient, 2: weight gradient);
    it only sets where a group starts, so it does not count for alignment (measured: skewed token counts cost
    the weight gradient nothing, data/kernels/h100_grouped-gemm-bf16_trainsim.csv)."""
    groups = [g for g in groups if min(g) > 0]
    aligned = all((d * DTYPE_BYTES.get(dtype, 2)) % 16 == 0
                  for group in groups for axis, d in enumerate(group) if axis != tokens_axis)
    alignment = 1.0 if aligned else MISALIGNED_EFFICIENCY
    if not groups or sm_count <= 0:
        return alignment
    useful = sum(m * n * k for m, n, k in groups)
    best = 0.0
    for rows, cols, speed in GEMM_TILES:
        tiles = sum(-(-m // rows) * -(-n // cols) for m, n, _ in groups)
        padded = sum(-(-m // rows) * rows * -(-n // cols) * cols * k for m, n, k in groups)
        wave_fill = tiles / (-(-tiles // sm_count) * sm_count)
        best = max(best, useful / padded * wave_fill * speed)
    return alignment * best


def _shape_efficiency(rows: pd.DataFrame, kinds: np.ndarray, dtypes, sm_count: int, args: list[str],
                      notes: list[dict[str, float]]) -> np.ndarray:
    out = np.ones(len(rows))
    if "input_shapes" not in rows:
        return out
    for i, (op, shapes, kind, dtype, arg, note) in enumerate(zip(rows["op"], rows["input_shapes"], kinds, dtypes,
                                                                 args, notes)):
        if kind != "matmul":
            continue
        shapes = json.loads(shapes) if isinstance(shapes, str) else shapes
        if op.startswith(GROUPED_GEMM_OPS):
            groups = grouped_gemm_groups(op, shapes, arg)
            if groups is not None:
                out[i] = grouped_gemm_efficiency(groups, sm_count, dtype, 2 if "weight_grad" in op else 0)
            continue
        dims = gemm_dims(op, shapes)
        if dims is not None and min(dims) > 0:
            batch, m, n, k = dims
            k = 2 * k if dtype == "fp4" else k  # two E2M1 values per byte along the reduction
            if sm_count > 0:
                sms = max(sm_count - int(note.get("comm_sms", 0)), 1)  # the SMs communication kernels leave it
                out[i] = sms / sm_count * gemm_shape_efficiency(batch, m, n, k, sms, dtype)
            else:
                out[i] = gemm_shape_efficiency(batch, m, n, k, 0, dtype)
    return out


KERNEL_NOTES = ("comm_sms", "comm_kernel", "dropout_p", "fused", "causal_mask", "window_keys", "window_chunked",
                "value_width", "to_host", "from_host")


def kernel_notes(args: str) -> dict[str, float]:
    """What the workload noted about the op's kernel (observer.kernel_notes, in its op_args):

    comm_sms    a communication kernel holds this many SMs meanwhile (the GEMM runs on the others), as Transformer
                Engine's comm-GEMM overlap runs a reduce-scatter's GEMMs.
    comm_kernel the op is that communication kernel's own work (a reduce-scatter's additions): no time of its own
                on the compute stream, its cost is the SMs the GEMMs go without.
    dropout_p   fused attention drops probabilities inside its kernel (a CPU trace's kernel cannot).
    fused       the op's work is done inside the kernel that produced its input (TE's FP8 cast records the amax
                and writes the transposed copy in the same pass): no time of its own (the transpose's extra
                write, 1 byte per element, is not priced).
    causal_mask fused attention's explicit mask (windows, sinks: workloads/core_attention.py) is causal.
    window_keys a query attends to this many keys (0 = all before it); window_chunked: 1 when the window is a fixed
                chunk (Llama 4) rather than sliding. Flash attention skips the blocks outside the window.
    value_width the values' head width where the CPU kernel ran them padded to the queries' (MLA).
    to_host, from_host  the op copies a tensor between device and host memory (activation offloading): its bytes
                cross the host link (hardware.host_link_bandwidth_bytes_per_s) once.
    {} for an op without notes."""
    if not args or not any(f'"{k}"' in args for k in KERNEL_NOTES):
        return {}
    try:
        parsed = json.loads(args)
        return {k: float(parsed[k]) for k in KERNEL_NOTES if k in parsed}
    except (TypeError, ValueError, AttributeError):
        return {}


def _sdpa_arguments(args) -> tuple[bool, float]:
    """(is_causal, dropout_p) of an SDPA op's recorded arguments: keywords, or aten's kernels' first boolean and
    first float positional (after the tensors)."""
    try:
        parsed = json.loads(args)
    except (TypeError, ValueError):
        return False, 0.0
    positional, keywords = parsed.get("args", []), parsed.get("kwargs", {})
    flags = [a for a in positional if isinstance(a, bool)]
    causal = bool(keywords["is_causal"]) if "is_causal" in keywords else bool(flags) and flags[0]
    dropout = keywords.get("dropout_p", next((a for a in positional if isinstance(a, float)), 0.0))
    return causal, float(dropout or 0.0)


def op_dtype(input_dtypes: str, op: str = "") -> str:
    """The compute dtype of an op: 'fp8' for a GEMM on FP8 inputs (_scaled_mm, block_scaled_mm: their scales do
    not set the rate), 'fp4' for one on packed FP4 inputs (NVFP4), else its first floating-point input (fp32 if
    none). Other ops that read FP8 or FP4 tensors (casts, transposes) are memory-bound and keep the rate of their
    other inputs (fp32 if none)."""
    dtypes = input_dtypes.split(",")
    if op and op_kind(op) == "matmul" and dtypes and dtypes[0] in FP8_INPUT_DTYPES:
        return "fp8"
    if op and op_kind(op) == "matmul" and dtypes and dtypes[0] in FP4_INPUT_DTYPES:
        return "fp4"
    return next((d for d in dtypes if d in FLOAT_DTYPES), "fp32")


@dataclass(frozen=True)
class RooflineRates:
    matmul_flops_per_s: float
    matmul_half_flops: float
    memory_bytes_per_s: float
    memory_half_bytes: float
    vector_flops_per_s: float
    launch_overhead_s: float
    kind_efficiency: tuple[tuple[str, float], ...] = ()
    """(op kind, efficiency) pairs; kinds not listed have 1."""
    attention_flops_per_s: tuple[float, float] = (0.0, 0.0)
    """Flash attention's (forward, backward) FLOP/s; 0 = the matmul rate."""
    attention_tile_keys: float = 0.0
    """A query tile's fixed work in keys visited (kernel_model.attention_tile_keys)."""
    attention_dropout_s_per_score: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) seconds per attention score of in-kernel dropout."""
    attention_setup_s: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) fixed seconds of one fused-attention call; 0 = launch_overhead_s."""
    sm_count: int = 0
    """SMs of the device for GEMM wave quantisation; 0 = not modelled."""
    grouped_setup_s: float = 0.0
    """Floor of a grouped GEMM; 0 = launch_overhead_s."""
    grouped_memory_bytes_per_s: float = 0.0
    """Bandwidth of a grouped GEMM; 0 = memory_bytes_per_s."""
    host_link_bytes_per_s: float = 0.0
    """Per-direction bandwidth of the device's link to host memory (copies noted to_host / from_host)."""


def matmul_efficiency(km, dtype: str) -> float:
    """The fraction of `dtype`'s peak its large GEMMs reach: FP8's own efficiency where the config sets one. FP4
    (NVFP4) GEMMs take the FP8 one too: no measured NVFP4 GEMM sweep is in data/kernels to give them their own,
    and like FP8 they carry block scales the bf16 GEMMs lack."""
    low_precision = dtype in ("fp8", "fp4") and km.fp8_matmul_efficiency
    return km.fp8_matmul_efficiency if low_precision else km.matmul_efficiency


def rates_for(hw: HardwareConfig, dtype: str) -> RooflineRates:
    """The hardware's rates for one dtype; names the missing field when the config lacks one."""
    if dtype not in hw.peak_flops_per_s:
        known = ", ".join(sorted(hw.peak_flops_per_s)) or "none"
        raise ConfigError(f"hardware '{hw.name}': the analytical backend needs hardware.peak_flops_per_s.{dtype} "
                          f"(known: {known}); add it, or fit the kernel model with `trainsim profile-fit`")
    if hw.memory_bandwidth_bytes_per_s <= 0:
        raise ConfigError(f"hardware '{hw.name}': the analytical backend needs "
                          "hardware.memory_bandwidth_bytes_per_s > 0; set it from the device's datasheet in bytes/s "
                          "(e.g. 2.039e12 for an A100 80GB SXM), or measure the kernels on that device")
    km = hw.kernel_model
    vector = km.vector_flops_per_s or hw.peak_flops_per_s.get("fp32", hw.peak_flops_per_s[dtype]) / 2
    attention = tuple(hw.peak_flops_per_s[dtype] * e for e in (km.attention_forward_efficiency,
                                                                km.attention_backward_efficiency))
    return RooflineRates(
        matmul_flops_per_s=hw.peak_flops_per_s[dtype] * matmul_efficiency(km, dtype),
        matmul_half_flops=km.matmul_half_flops,
        memory_bytes_per_s=hw.memory_bandwidth_bytes_per_s * km.memory_efficiency,
        memory_half_bytes=km.memory_half_bytes,
        vector_flops_per_s=vector,
        launch_overhead_s=km.launch_overhead_s,
        kind_efficiency=tuple(sorted(km.kind_efficiency.items())),
        attention_flops_per_s=attention,
        attention_tile_keys=km.attention_tile_keys,
        attention_dropout_s_per_score=(km.attention_dropout_forward_s_per_score,
                                       km.attention_dropout_backward_s_per_score),
        attention_setup_s=(km.attention_setup_forward_s, km.attention_setup_backward_s),
        sm_count=hw.sm_count,
        grouped_setup_s=km.grouped_gemm_setup_s,
        grouped_memory_bytes_per_s=hw.memory_bandwidth_bytes_per_s * km.grouped_gemm_memory_efficiency,
        host_link_bytes_per_s=hw.host_link_bandwidth_bytes_per_s,
    )


def predict(rates: RooflineRates, flops, bytes_moved, kinds, shape_efficiency=None, attention=None,
            grouped=None) -> np.ndarray:
    """Seconds per op (vectorised); `kinds` are op kinds from `op_kind`; `shape_efficiency` the GEMMs'
    q_shape (1 = a large aligned GEMM); `attention` = AttentionRows (pass 0: not flash attention), timed at the
    attention rates where the hardware has them; `grouped` marks grouped GEMMs, timed with their own floor and
    bandwidth where the hardware has them."""
    flops = np.asarray(flops, dtype=float)
    bytes_moved = np.asarray(bytes_moved, dtype=float)
    kinds = np.asarray(kinds, dtype=object)
    shape = np.ones(len(flops)) if shape_efficiency is None else np.asarray(shape_efficiency, dtype=float)
    efficiency = dict(rates.kind_efficiency)
    kind_eff = np.array([efficiency.get(k, 1.0) for k in kinds])
    matmul = np.isin(kinds, MATMUL_KINDS)
    bandwidth, launch = rates.memory_bytes_per_s * kind_eff, np.full(len(flops), rates.launch_overhead_s)
    if grouped is not None:
        grouped = np.asarray(grouped, dtype=bool)
        if rates.grouped_memory_bytes_per_s > 0:
            bandwidth = np.where(grouped, rates.grouped_memory_bytes_per_s, bandwidth)
        if rates.grouped_setup_s > 0:
            launch[grouped] = rates.grouped_setup_s
    memory = (bytes_moved + rates.memory_half_bytes) / bandwidth
    mm = (flops + rates.matmul_half_flops) / (rates.matmul_flops_per_s * shape)
    vector = flops / (rates.vector_flops_per_s * kind_eff)
    compute = np.where(matmul, mm, vector)
    time = launch + np.maximum(compute, memory)
    if attention is not None:
        known = attention.keys > 0  # rows without shapes: no tile term
        tiles = 1 + np.where(known, rates.attention_tile_keys / np.where(known, attention.keys, 1), 0.0)
        dropped = attention.factor * attention.scores * (attention.dropout_p > 0)
        for which, rate, dropout_s, setup_s in zip((1, 2), rates.attention_flops_per_s,
                                                   rates.attention_dropout_s_per_score, rates.attention_setup_s):
            sel = (attention.pass_ == which) & (rate > 0)
            math_s = attention.factor[sel] * flops[sel] / rate * tiles[sel]
            setup_s = setup_s or rates.launch_overhead_s
            time[sel] = setup_s + np.maximum(math_s, memory[sel]) + dropped[sel] * dropout_s
    return time


@dataclass(frozen=True)
class AttentionRows:
    """Per row, what fused attention's time depends on beyond its FLOPs (pass 0: not fused attention)."""

    pass_: np.ndarray
    """1 = forward, 2 = backward, 0 = another op"""
    factor: np.ndarray
    """share of the counted FLOPs and scores computed: 1/2 causal"""
    keys: np.ndarray
    """keys each query attends to (the sequence length of k)"""
    scores: np.ndarray
    """batch x heads x queries x keys (the full square)"""
    dropout_p: np.ndarray
    """attention dropout inside the kernel (noted by the workload, or the op's own argument)"""
    mask_bytes: np.ndarray
    """bytes of the explicit mask a CPU trace's kernel read (windows, sinks); a GPU kernel reads none"""


def window_fraction(keys: float, window: float, chunked: bool) -> float:
    """Share of the [s, s] score square a windowed causal kernel computes (s = keys): a sliding window of w keys
    sees s w - w^2 / 2 scores, chunks of w tokens s w / 2 (both 1/2 at w = s, as a causal kernel)."""
    share = window / keys
    return share / 2 if chunked else share - share * share / 2


def _attention_rows(rows: pd.DataFrame, kinds: np.ndarray, notes: list[dict[str, float]]) -> AttentionRows:
    attention = kinds == "attention"
    backward = rows["op"].astype(str).str.contains("backward").to_numpy()
    pass_ = np.where(attention, np.where(backward, 2, 1), 0)
    factor, keys, scores, dropout = np.ones(len(rows)), np.zeros(len(rows)), np.zeros(len(rows)), np.zeros(len(rows))
    mask_bytes = np.zeros(len(rows))
    dtypes = rows["input_dtypes"].tolist() if "input_dtypes" in rows else [""] * len(rows)
    flops = rows["flops"].to_numpy(dtype=float)
    shapes = rows["input_shapes"].tolist() if "input_shapes" in rows else [None] * len(rows)
    args = rows["op_args"].tolist() if "op_args" in rows else [None] * len(rows)
    for i in np.flatnonzero(attention):
        causal, dropout_argument = _sdpa_arguments(args[i])
        causal = causal or bool(notes[i].get("causal_mask"))
        factor[i] = 0.5 if causal else 1.0  # causal kernels skip the masked tiles; the trace counts the full square
        dropout[i] = max(notes[i].get("dropout_p", 0.0), dropout_argument)
        parsed = json.loads(shapes[i]) if isinstance(shapes[i], str) else shapes[i]
        k = 2 if backward[i] else 1  # the backward's tensors start with the output's gradient, then q, k, v
        if parsed and len(parsed) > k and len(parsed[k]) >= 2:
            keys[i], head_dim = parsed[k][-2], parsed[0][-1]
            scores[i] = flops[i] / ((10 if backward[i] else 4) * max(head_dim, 1))  # sdpa_flops, inverted
            window = notes[i].get("window_keys", 0.0)
            if causal and window and window < keys[i]:
                factor[i] = window_fraction(keys[i], window, bool(notes[i].get("window_chunked")))
                keys[i] = window
            if notes[i].get("value_width"):  # the second matmul (and its gradients) at the values' width
                factor[i] *= (head_dim + notes[i]["value_width"]) / (2 * head_dim)
            if notes[i].get("causal_mask") and len(parsed[-1]) == 2:  # the mask is the last (2-D) input
                mask_dtype = str(dtypes[i]).split(",")[-1]
                mask_bytes[i] = parsed[-1][0] * parsed[-1][1] * DTYPE_BYTES.get(mask_dtype, 2)
    return AttentionRows(pass_, factor, keys, scores, dropout, mask_bytes)


def predict_ops(rates: RooflineRates, rows: pd.DataFrame, dtype: str = "bf16") -> np.ndarray:
    """Seconds per op row (op, flops, bytes_moved, and input_shapes / op_args where known) at `rates`."""
    kinds = _kinds(rows)
    args = rows["op_args"].tolist() if "op_args" in rows else [""] * len(rows)
    notes = [kernel_notes(a) for a in args]
    shape = _shape_efficiency(rows, kinds, [dtype] * len(rows), rates.sm_count, args, notes)
    grouped = rows["op"].astype(str).str.startswith(GROUPED_GEMM_OPS).to_numpy()
    attention = _attention_rows(rows, kinds, notes)
    bytes_moved = rows["bytes_moved"].to_numpy(dtype=float) - attention.mask_bytes
    time = predict(rates, rows["flops"], bytes_moved, kinds, shape, attention, grouped)
    time[[bool(n.get("comm_kernel") or n.get("fused")) for n in notes]] = 0.0
    host = np.array([bool(n.get("to_host") or n.get("from_host")) for n in notes], dtype=bool)
    if host.any() and rates.host_link_bytes_per_s > 0:  # a copy's bytes moved count its read and its write
        time[host] = rates.launch_overhead_s + bytes_moved[host] / 2 / rates.host_link_bytes_per_s
    return time


def _kinds(rows: pd.DataFrame) -> np.ndarray:
    return rows["op"].map(op_kind).to_numpy(dtype=object)


def predict_rows(rows: pd.DataFrame, hw: HardwareConfig) -> np.ndarray:
    """Analytical seconds for execution-graph or profile rows on `hw` (per-dtype rates)."""
    out = np.zeros(len(rows))
    dtypes = np.array([op_dtype(d, op) for d, op in zip(rows["input_dtypes"], rows["op"])], dtype=object)
    for dtype in set(dtypes):
        sel = dtypes == dtype
        out[sel] = predict_ops(rates_for(hw, dtype), rows[sel], dtype)
    return out


def fit_rates(rows: pd.DataFrame) -> RooflineRates:
    """Least-squares fit (on log time, robust loss) of the rates and per-kind efficiencies to measured rows."""
    from scipy.optimize import least_squares  # here, not at the top: composing never fits, and the import takes 0.5 s
    if len(rows) < 6:
        raise ValueError(f"fitting the kernel model needs at least 6 measured ops, got {len(rows)}")
    flops = rows["flops"].to_numpy(float)
    bytes_moved = rows["bytes_moved"].to_numpy(float)
    kinds = _kinds(rows)
    measured = rows["median_s"].to_numpy(float)
    matmul = np.isin(kinds, MATMUL_KINDS)
    fitted_kinds = sorted(k for k in set(kinds) if k not in ("elementwise", "matmul"))
    mm_rate = np.quantile(flops[matmul] / measured[matmul], 0.9) if matmul.any() else 1e10
    mem_rate = np.quantile(bytes_moved / measured, 0.9)
    start = np.concatenate([np.log([mm_rate, 1e6, mem_rate, 1e5, mem_rate / 4, max(np.min(measured) / 2, 1e-7)]),
                            np.zeros(len(fitted_kinds))])

    def rates_of(x) -> RooflineRates:
        return RooflineRates(*np.exp(x[:6]), kind_efficiency=tuple(zip(fitted_kinds, np.exp(x[6:]))))

    def residuals(x):
        return np.log(predict(rates_of(x), flops, bytes_moved, kinds)) - np.log(measured)

    result = least_squares(residuals, start, loss="soft_l1", f_scale=0.1)
    return rates_of(result.x)


def fitted_kernel_model(rates: RooflineRates, hw: HardwareConfig, dtype: str = "fp32") -> dict:
    """Rates expressed as the hardware config's fields (a YAML-ready dict of plain floats to paste into
    conf/hardware)."""
    peak = hw.peak_flops_per_s.get(dtype)
    bandwidth = hw.memory_bandwidth_bytes_per_s
    config: dict = {
        "kernel_model": {
            "matmul_efficiency": float(rates.matmul_flops_per_s / peak) if peak else 1.0,
            "matmul_half_flops": float(rates.matmul_half_flops),
            "memory_efficiency": float(rates.memory_bytes_per_s / bandwidth) if bandwidth else 1.0,
            "memory_half_bytes": float(rates.memory_half_bytes),
            "vector_flops_per_s": float(rates.vector_flops_per_s),
            "launch_overhead_s": float(rates.launch_overhead_s),
            "kind_efficiency": {kind: float(e) for kind, e in rates.kind_efficiency},
        }
    }
    if not peak:
        config["peak_flops_per_s"] = {dtype: float(rates.matmul_flops_per_s)}
    if not bandwidth:
        config["memory_bandwidth_bytes_per_s"] = float(rates.memory_bytes_per_s)
    return config


@dataclass(frozen=True)
class FitReport:
    rates: RooflineRates
    train_ops: int
    test_ops: int
    median_error_pct: float
    p90_error_pct: float


def evaluate_fit(rows: pd.DataFrame, train_fraction: float = 0.5, seed: int = 0) -> FitReport:
    """Fit on a random `train_fraction` of the distinct signatures, report |error| on the rest."""
    if not 0 < train_fraction < 1:
        raise ValueError(f"train_fraction={train_fraction} must be in (0, 1)")
    shuffled = rows.drop_duplicates("signature").sample(frac=1.0, random_state=seed)
    cut = int(round(len(shuffled) * train_fraction))
    train, test = shuffled.iloc[:cut], shuffled.iloc[cut:]
    if len(test) == 0:
        raise ValueError(f"no held-out ops: {len(shuffled)} distinct signatures with train_fraction={train_fraction}")
    rates = fit_rates(train)
    predicted = predict(rates, test["flops"], test["bytes_moved"], _kinds(test))
    error = 100 * np.abs(predicted / test["median_s"].to_numpy() - 1)
    return FitReport(rates, len(train), len(test), float(np.median(error)), float(np.quantile(error, 0.9)))
