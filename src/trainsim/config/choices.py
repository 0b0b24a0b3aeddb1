"""Every closed set of values a config field or a table column may take, in one place.

Validation (config/validate.py, validate_nccl.py) checks fields against these sets, and the code that acts on
a value (the composer, the collective model, the kernel model, the search) reads the same names, so the accepted
values and the modelled ones cannot drift apart. Sets of a table's columns stay beside the table.
"""

from __future__ import annotations

# parallelism
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
"""Built-in pipeline schedules (parallel/schedules.py); timeline.register_schedule adds more."""
RECOMPUTE_MODES = ("none", "full", "selective", "op")
"""Activation recomputation (parallelism.recompute): none; every block ('full'); Megatron's recompute modules
('selective'); torchtitan's op-level policy ('op': workloads/op_checkpoint.py)."""
RECOMPUTE_MODULES = ("core_attn", "mla_up_proj", "mlp", "shared_experts", "moe_act", "layernorm", "moe")
"""Megatron-Core's recompute_modules (TransformerConfig) of current models (workloads/module_recompute.py)."""
BUILT_RECOMPUTE_MODULES = ("core_attn", "mla_up_proj", "mlp", "shared_experts")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp4")
"""Training precisions (parallelism.precision); 'fp4' is NVFP4 (workloads/block_scaling.py)."""
PRECISION_WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2, "fp4": 2}
"""Bytes per weight (and gradient) element a precision trains with: FP8 and FP4 training keep bf16 weights and
cast them for their GEMMs (workloads/fp8.py)."""


def gradient_reduce_bytes(precision: str, in_fp32: bool) -> int:
    """Bytes per gradient element a data-parallel reduction moves: fp32 with parallelism.grad_reduce_in_fp32, else
    the weights' dtype."""
    return 4 if in_fp32 else PRECISION_WEIGHT_BYTES.get(precision, 2)


def fp8_weights_only(par) -> bool:
    """The FP8 linears' weights are held in MXFP8 alone: parallelism.fp8_param_gather with the distributed optimizer
    and the MXFP8 recipe (Megatron-Bridge's bf16_with_mxfp8_mixed: --fp8-param-gather with
    reuse_grad_buf_for_mxfp8_param_ag)."""
    return par.fp8_param_gather and par.zero_stage == 1 and par.precision == "fp8" and par.fp8_recipe == "mxfp8"


FP8_RECIPES = ("delayed", "current", "mxfp8", "blockwise", "rowwise")
"""FP8 recipes: Transformer Engine's per-tensor 'delayed' and 'current' (workloads/fp8.py), block-scaled 'mxfp8'
and 'blockwise', and torchao's 'rowwise' (a scale per row along each GEMM's reduction: workloads/block_scaling.py)."""
BLOCK_FP8_RECIPES = ("mxfp8", "blockwise", "rowwise")
"""The FP8 recipes with block scales (no amax history, no amax all-reduce)."""
ZERO_STAGES = (0, 1, 2, 3)
"""0 replicated (DDP), 1 distributed optimizer, 2 and 3 FSDP2 (workloads/fully_sharded.py)."""
CP_COMM_TYPES = ("p2p", "all_gather")
MOE_DISPATCHERS = ("alltoall", "allgather")

# model
FAMILIES = ("gpt", "llama")
ATTENTION_KERNELS = ("fused", "unfused")
TP_OVERLAP_BACKWARDS = ("bulk", "none")
"""model.tp_overlap_backward: Transformer Engine's bulk overlap, or none (torch's micro-pipelined async TP)."""
HYBRID_LAYER_KINDS = {"M": "Mamba-2 mixer", "*": "self-attention", "-": "MLP", "E": "MoE"}
"""Characters of model.hybrid_layer_pattern (Megatron-Core's --hybrid-override-pattern) and the layer each is."""
WINDOW_KINDS = ("sliding", "chunked")
"""model.window_kind: a sliding window behind each query, or Llama 4's fixed chunks."""
MOE_ROUTERS = ("softmax", "sigmoid")
MOE_ROUTINGS = ("balanced", "zipf:<s>", "dirichlet:<alpha>")
"""model.moe_routing: these forms, or a routing histogram file (workloads/routing.py)."""

# hardware
DEVICE_KINDS = ("cpu", "cuda")
COMM_BACKENDS = ("gloo", "nccl")
PROFILE_BACKENDS = ("auto", "measure", "analytical")
MEASURED_BACKENDS = ("cpu", "cuda")
"""Profile backends that time kernels on a device (the others model them)."""
SLOWDOWN_SOURCES = ("measure", "import")
SLOWDOWN_USES = ("auto", "model", "none")
"""hardware.slowdown.use: the learned overlap slowdown only where it beats none on unseen kernel groups (auto),
always (model), or never (none); slowdown/choice.py."""

# kernels
FLOAT_DTYPES = ("fp32", "bf16", "fp16", "fp64", "fp8", "fp4")
"""Compute dtypes with a rate in hardware.peak_flops_per_s; 'fp8' is the rate of FP8 GEMMs (_scaled_mm, and the
MXFP8 / blockwise block-scaled GEMMs), 'fp4' that of NVFP4 GEMMs (dense, Blackwell)."""
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8, "fp8": 1, "fp4": 0.5}
"""Bytes per element of each compute dtype."""
MATMUL_KINDS = ("matmul", "attention")
"""Op kinds timed against a dtype's peak FLOP rate."""
OP_KINDS = (*MATMUL_KINDS, "optimizer", "normalization", "softmax_loss", "reduction", "indexing", "copy",
            "elementwise")
"""What profile/analytical.op_kind calls an op (hardware.kernel_model.kind_efficiency keys)."""

# communication
ALGORITHMS = {"all_reduce": ("ring", "tree", "nvls"), "all_gather": ("ring",), "reduce_scatter": ("ring",),
              "all_to_all": ("p2p", "ring"), "broadcast": ("ring",), "reduce": ("ring",), "send_recv": ("ring",)}
"""Algorithms each collective can run with (NCCL's tree and NVLS exist for all-reduce only here; an all-to-all is
NCCL's grouped send/recv, "p2p", or gloo's pairwise rounds, priced as a "ring")."""
COLLECTIVES = tuple(ALGORITHMS)
NCCL_ALGORITHMS = tuple(dict.fromkeys(a for names in ALGORITHMS.values() for a in names))
PROTOCOLS = ("LL", "LL128", "Simple")
TRANSPORTS = ("infiniband", "roce", "efa", "tcp")
"""Inter-node transports (hardware.network.transport); '' means unknown."""
PLACEMENTS = ("balanced", "packed")
"""How a scheduler lays a job's nodes (trays) over NVLink domains (hardware.network.placement, comm/placement.py)."""
OLDEST_NCCL_RELEASE = "2.12"
"""The first NCCL release comm/nccl_constants.yaml has tuning constants for (checked where the file loads)."""
