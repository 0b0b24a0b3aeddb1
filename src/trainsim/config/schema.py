"""Typed configuration of a simulation: hardware, model and parallel layout.

These dataclasses are Hydra structured configs (registered in `register_configs`); the YAML files
in conf/ fill them with concrete machines, models and layouts. Every field is documented where it
is declared, with its unit in the name. Cross-field rules live in `validate.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NcclConfig:
    """Collective-library settings that change communication time (NCCL on GPUs, gloo on CPUs).

    Values the collective model (trainsim/comm/model.py) does not model are rejected at composition
    (config/validate_nccl.py) rather than replaced by something else: CollNet and PAT are not
    modelled yet. The channel count sets how many channels a message is split over and the per-channel
    bandwidth the calibration fits; with max_channels 0 the fit picks the count (1..32) that matches the
    measurements best and the uncalibrated model uses 16. NCCL_MIN_NCHANNELS has no field: above the
    topology's count NCCL only duplicates channels over the same links (init.cc copyChannels), which the
    fitted count already stands for.
    """

    version: str = ""
    """Library version, e.g. '2.20.5' (2.12 or later): selects that release's tuning constants; '' = newest."""
    algorithms: list[str] = field(default_factory=lambda: ["ring", "tree"])
    """Algorithms NCCL may choose from (NCCL_ALGO): 'ring', 'tree' (all-reduce only, across nodes),
    and 'nvls' (all-reduce with NVLink SHARP, NVLSTree across NVLink domains; needs network.nvls)."""
    protocols: list[str] = field(default_factory=lambda: ["LL", "LL128", "Simple"])
    """Protocols NCCL may choose from (NCCL_PROTO): 'LL', 'LL128', 'Simple'."""
    max_channels: int = 0
    """NCCL_MAX_NCHANNELS of the measured and simulated runs, taken as their channel count; 0 = unknown."""
    buffer_size_bytes: int = 4 * 1024 * 1024
    """NCCL_BUFFSIZE: bytes of the per-channel staging buffer (NCCL default 4 MiB)."""


@dataclass
class NetworkConfig:
    """The fabric between nodes, as data: what the collective model needs to predict a cluster it has no
    measurement of (comm/network.py). Empty fields keep the older description: hardware.inter_node_*.

    A rail-optimised fat tree is assumed (each GPU's NIC on its own rail switch, as DGX SuperPODs and the
    clouds' GPU clusters are built); traffic of a group that spans more than `nodes_per_leaf` nodes
    crosses the spine, whose bandwidth is the leaf's over `oversubscription`.
    """

    transport: str = ""
    """'infiniband', 'roce', 'efa' (AWS Elastic Fabric Adapter, SRD) or 'tcp'; '' = unknown (the network
    hop keeps NCCL's NET constants and the nominal bandwidth, no learned transport prior)."""
    link_generation: str = ""
    """Generation of the transport's links, e.g. 'hdr', 'ndr' (InfiniBand), 'efa-v1', 'efa-v2'; parameters
    learned for the generation are used when known, else the transport's (comm/transport_priors.yaml)."""
    nics_per_node: int = 0
    """NICs per node used for GPU traffic; 0 = unknown (hardware.inter_node_bandwidth_bytes_per_s is the total)."""
    nic_bandwidth_bytes_per_s: float = 0.0
    """Per-NIC, per-direction line rate (100 Gb/s = 12.5e9); with nics_per_node gives the node's network
    bandwidth, which hardware.inter_node_bandwidth_bytes_per_s must then equal or leave 0."""
    nvlink_domain_size: int = 0
    """GPUs joined by NVLink/NVSwitch (8 in a DGX, 72 in a GB200 NVL72 rack); collectives inside one domain
    run at NVLink speed even across nodes. 0 = devices_per_node (the domain is the node)."""
    placement: str = "balanced"
    """How the scheduler lays a job over NVLink domains when it is smaller than one or not a multiple of one
    (comm/placement.py): 'balanced' spreads the job's nodes (trays) evenly over the fewest domains that hold it,
    as Slurm's topology/block plugin does with equal segments and as NVL72 jobs are run (256 GPUs: 4 racks of
    64); 'packed' fills one domain before the next (72 + 72 + 72 + 40)."""
    nvls: bool = False
    """NVLink SHARP in the NVSwitches (H100 and later): NCCL's NVLS all-reduce inside an NVLink domain (NVLSTree
    across domains, where a tuner plugin picks it), when hardware.nccl.algorithms lists 'nvls'. InfiniBand
    SHARP (NCCL's CollNet) has no field: no measurement here separates its gain (the one SHARP cluster in
    data/nccl-tests reaches ring-level bus bandwidth)."""
    nodes_per_leaf: int = 0
    """Nodes under one leaf (rail) switch; 0 = every node under one non-blocking switch level."""
    oversubscription: float = 1.0
    """Leaf-to-spine oversubscription (2.0 = 2:1): traffic of groups spanning leaves gets 1/this of it."""


@dataclass
class CalibrationFile:
    """One measured collective sweep: an nccl-tests log, an author-compiled busbw table (comm/busbw_tables.py,
    docs/comm.md) or a `python -m trainsim.comm.sweep` Parquet."""

    path: str = "???"
    """File path, relative to the project root (or absolute)."""
    num_ranks: int = 0
    """Ranks of the run; 0 = read from the file (rank lines, -np/-g flags, '<N>gpu' in its name). A table states
    each curve's ranks: there it selects the curves."""
    num_nodes: int = 0
    """Nodes of the run; 0 = read from the file (host names, 'N nodes', '<N>node' in its name); selects a
    table's curves."""
    collective: str = ""
    """Collective measured; '' = read from the file (the *_perf command, or its name); selects a table's curves."""


@dataclass
class CalibrationConfig:
    """Where the collective model's measurements come from (stage 3, trainsim/comm/calibration.py)."""

    local_sweep: bool = False
    """Measure collectives on this machine (gloo over loopback; NCCL when GPUs are present)."""
    sweep_ranks: list[int] = field(default_factory=lambda: [2, 3, 4])
    """Process counts of the local sweep."""
    sweep_collectives: list[str] = field(default_factory=lambda: ["all_reduce", "all_gather", "reduce_scatter",
                                                                  "broadcast", "all_to_all", "send_recv"])
    """Collectives of the local sweep."""
    sweep_min_bytes: int = 1024
    """Smallest message of the local sweep (sizes double up to sweep_max_bytes)."""
    sweep_max_bytes: int = 4 * 1024 * 1024
    """Largest message of the local sweep."""
    sweep_iters: int = 5
    """Calls per timed batch."""
    sweep_repeats: int = 3
    """Timed batches per size; the median is kept."""
    system_noise: bool = True
    """With the local sweep on a CPU: also measure how far two ranks running the same work drift apart
    (trainsim/comm/noise.py), which every blocking collective waits for."""
    files: list[CalibrationFile] = field(default_factory=list)
    """Measurements made elsewhere (nccl-tests logs, cluster sweeps) on this hardware."""


MAMBA_CHUNK_TOKENS = 128  # set: Megatron-Core MambaMixer's chunk_size default (mamba_chunk_scan_combined)
"""Tokens per chunk of the Mamba-2 SSD scan: its quadratic part works on [chunk, chunk] blocks."""

RANGE_SETTINGS = {"hidden_size": "model", "seq_length": "model", "num_layers": "model", "tp": "parallelism",
                  "micro_batch_size": "parallelism"}
"""Run settings KernelModelConfig.fitted_range may bound, and their config group."""


@dataclass
class KernelModelConfig:
    """Analytical kernel-time model (roofline with efficiency curves), used where kernels are not measured.

    time = launch_overhead_s + max(flops / (peak * matmul_efficiency * sat(flops, matmul_half_flops)),
                                   bytes / (bandwidth * memory_efficiency * e_kind * sat(bytes, memory_half_bytes)))
    with sat(x, h) = x / (x + h); non-matmul ops use the bandwidth term (and vector_flops_per_s).
    See trainsim/profile/analytical.py.
    Fitted to measured kernels by `trainsim profile-fit`.
    """

    matmul_efficiency: float = 0.75
    """Fraction of peak FLOP/s that large matrix multiplies reach."""
    fp8_matmul_efficiency: float = 0.0
    """Fraction of the FP8 peak that large FP8 GEMMs reach (their scaling and the wider peak leave them further
    from it than bf16 GEMMs: 0.71 against 0.80 at best on H100, data/kernels/matmul_max-achievable-tflops);
    0 = matmul_efficiency."""
    matmul_half_flops: float = 2.0e9
    """FLOPs at which a matrix multiply reaches half of that efficiency (small GEMMs are inefficient)."""
    memory_efficiency: float = 0.8
    """Fraction of memory bandwidth that large memory-bound kernels reach."""
    memory_half_bytes: float = 4.0e6
    """Bytes at which a memory-bound kernel reaches half of that efficiency."""
    vector_flops_per_s: float = 0.0
    """Throughput of non-matmul arithmetic; 0 = fp32 peak (CUDA cores) / 2."""
    launch_overhead_s: float = 4.0e-6
    """Floor per kernel: launch and tail effects."""
    grouped_gemm_setup_s: float = 0.0
    """Floor of one grouped GEMM (all local experts in one kernel, which first reads the groups' sizes and
    builds their tile lists); 0 = launch_overhead_s."""
    grouped_gemm_memory_efficiency: float = 0.0
    """Fraction of memory bandwidth a grouped GEMM reads and writes its operands at (the experts' weights, at
    few tokens per expert); 0 = memory_efficiency."""
    kind_efficiency: dict[str, float] = field(default_factory=dict)
    """Bandwidth efficiency per op kind (normalization, softmax_loss, optimizer, ...) relative to
    elementwise kernels; kinds not listed have 1."""
    attention_forward_efficiency: float = 0.0
    """Fraction of the dtype's peak FLOP/s that fused (flash) attention's forward reaches, counting the FLOPs a
    causal kernel computes (half the square); 0 = matmul_efficiency. FlashAttention-2/3 measurements in
    data/kernels set it per GPU."""
    attention_backward_efficiency: float = 0.0
    """The same for its backward pass (5 matmuls and recomputed softmax; lower than the forward)."""
    attention_tile_keys: float = 0.0
    """A query tile's fixed work (loading it, rescaling and writing its output) as a number of keys visited: the
    attention efficiencies are reached at long sequences, times keys / (keys + attention_tile_keys) at shorter
    ones. 0 = none."""
    attention_dropout_forward_s_per_score: float = 0.0
    """Seconds per attention score that dropout inside the fused kernel adds to its forward (a random number
    per score); 0 = free."""
    attention_dropout_backward_s_per_score: float = 0.0
    """The same for the backward (it regenerates the mask)."""
    attention_setup_forward_s: float = 0.0
    """Fixed device time of one fused-attention forward call (its kernels' launches and the last wave's tail,
    what a short sequence cannot amortise); 0 = launch_overhead_s."""
    attention_setup_backward_s: float = 0.0
    """The same for the backward (several kernels: the output-gradient dot product, the main kernel, the query
    gradient's conversion)."""
    fitted_range: dict[str, list[int]] = field(default_factory=dict)
    """[low, high] of the run settings the fit saw (keys: hidden_size, seq_length, num_layers of the model;
    tp, micro_batch_size of the layout); a prediction outside any of them is flagged as extrapolated in
    its inputs and warnings. Empty = not stated."""
    fitted_on: str = ""
    """What these parameters were fitted to (data, split, held-out error), stated with every prediction;
    empty = the defaults above, not fitted to this hardware (predictions then carry a warning)."""
    fitted_frameworks: list[str] = field(default_factory=list)
    """The frameworks (conf/framework/) of the step-time tables these parameters were fitted to; empty = fitted
    to no step time of this GPU. A run of another framework gets the wider interval measured leave-one-table-out,
    one on a GPU without any the interval measured leave-one-GPU-out (uncertainty/interval.py)."""


@dataclass
class SlowdownTuningConfig:
    """Hyperparameter grid chosen by an inner cross-validation inside each training set (nested CV).

    Every non-empty list is a grid axis (the other parameters keep the model's value); all lists empty
    = no tuning. Each outer fold, and the final model, picks the candidate with the most kernels within
    10 % in an `inner_folds`-fold cross-validation of its own training part only, among candidates whose
    inner summed-duration error is within `summed_error_limit_pct` (if none is, the smallest such error)."""

    learning_rate: list[float] = field(default_factory=list)
    """Candidate shrinkages per round."""
    n_estimators: list[int] = field(default_factory=list)
    """Candidate boosting round counts."""
    max_depth: list[int] = field(default_factory=list)
    """Candidate maximum tree depths."""
    min_child_weight: list[float] = field(default_factory=list)
    """Candidate minimum summed hessians per leaf."""
    inner_folds: int = 4
    """Folds of the inner cross-validation."""
    summed_error_limit_pct: float = 2.0
    """Largest inner summed-duration error (%) a candidate may have to be chosen."""


@dataclass
class SlowdownModelConfig:
    """XGBoost regressor of the overlap slowdown (Echo's settings by default; see trainsim/slowdown/train.py)."""

    objective: str = "reg:squarederror"
    """XGBoost objective (Echo: reg:squarederror; reg:absoluteerror is robust to single-run noise)."""
    max_depth: int = 12
    """Maximum tree depth (Echo: 12)."""
    random_state: int = 42
    """Seed of XGBoost and of the hold-out / fold split (Echo: 42)."""
    n_estimators: int = 100
    """Boosting rounds (XGBRegressor default)."""
    learning_rate: float = 0.3
    """Shrinkage per round (XGBRegressor default)."""
    min_child_weight: float = 1.0
    """Minimum summed hessian (here: duration weight) per leaf (XGBRegressor default)."""
    nthread: int = 0
    """XGBoost threads; 0 = XGBoost's default (all cores)."""
    tuning: SlowdownTuningConfig = field(default_factory=SlowdownTuningConfig)
    """Nested-CV grid over learning_rate / n_estimators / max_depth / min_child_weight (empty = Echo's fixed values)."""
    cv_folds: int = 5
    """Folds of the cross-validation on the training part."""
    holdout_fraction: float = 0.2
    """Share of overlapped kernels held out for the final test (Echo: 80/20)."""
    duration_weighting: bool = True
    """Weight each kernel so that the loss on slowdown equals the loss on relative overlapped duration
    (weight (r * solo / overlapped)^p, p = 2 for squared, 1 for absolute error)."""
    features: list[str] = field(default_factory=list)
    """Feature columns the model uses; empty = all of trainsim.slowdown.features.FEATURES."""


@dataclass
class SlowdownConfig:
    """Overlap-slowdown dataset (stage 4) and its XGBoost model (stage 5); see trainsim/slowdown/."""

    use: str = "auto"
    """Whether a compose applies the learned slowdown: 'auto' (only when it beats no slowdown on kernel groups
    it never saw, scored when the model is trained), 'model' (always) or 'none' (never); docs/slowdown.md."""
    source: str = "measure"
    """'measure' (compute ops solo and overlapped with collectives on this machine's device) or
    'import' (Echo-format CSVs listed in import_files)."""
    import_files: list[str] = field(default_factory=list)
    """Echo-format slowdown CSVs (paths relative to the project root) read when source='import'."""
    device_type: str = ""
    """Device-type feature of this hardware ('A100', 'H100', 'cpu', ...); '' = derived from device_name."""
    collectives: list[str] = field(default_factory=lambda: ["all_reduce", "all_gather", "reduce_scatter"])
    """Collectives run concurrently with the compute ops."""
    message_bytes: list[int] = field(default_factory=lambda: [4 << 20, 16 << 20])
    """Message sizes of those collectives (nccl-tests semantics)."""
    repeats: int = 1
    """Times every (op, collective, size) window is measured (each window times the op many times)."""
    matmul_sizes: list[int] = field(default_factory=lambda: [128, 256, 512])
    """n of the n x n x n fp32 matrix multiplies in the sweep."""
    memory_bound_ops: list[str] = field(default_factory=lambda: ["add", "gelu", "softmax", "layer_norm", "sum",
                                                                  "clone"])
    """Memory-bound ops in the sweep (see trainsim.slowdown.dataset.MEMORY_BOUND_OPS)."""
    memory_bound_elements: list[int] = field(default_factory=lambda: [1 << 18, 1 << 20, 1 << 22])
    """fp32 elements of the memory-bound ops' inputs."""
    profile_signatures: int = 0
    """Up to this many compute-op signatures drawn from the hardware's profile database, when it exists."""
    solo_calls: int = 20
    """Back-to-back solo calls per window (after one warm-up); their median is the solo time."""
    max_calls_per_window: int = 40
    """Cap on compute calls while one collective runs."""
    model: SlowdownModelConfig = field(default_factory=SlowdownModelConfig)
    """Hyperparameters and evaluation of the slowdown model."""


@dataclass
class WhatIfConfig:
    """Hypothetical hardware changes applied when composing (measurements and fits stay as they are):
    "what if the inter-node links were twice as fast?". 1.0 everywhere = the hardware as configured;
    the node count is hardware.num_nodes itself."""

    intra_node_bandwidth_scale: float = 1.0
    """Multiplier on the intra-node link bandwidth the communication model uses (2.0 = twice as fast)."""
    inter_node_bandwidth_scale: float = 1.0
    """Multiplier on the inter-node (network) bandwidth."""
    latency_scale: float = 1.0
    """Multiplier on every communication latency and launch cost (0.5 = half the latency)."""
    peak_flops_scale: float = 1.0
    """Multiplier on the device's peak FLOP/s; kernel times scale by their roofline bound."""
    memory_bandwidth_scale: float = 1.0
    """Multiplier on the device's memory bandwidth; kernel times scale by their roofline bound."""


@dataclass
class StragglerConfig:
    """Ranks whose compute is slower than the rest (a throttled GPU, a noisy node); the composer gives
    them, and every rank that waits for them differently, their own rank classes."""

    ranks: list[int] = field(default_factory=list)
    """Global ranks that are slow."""
    node: int = -1
    """A slow node: all its devices_per_node ranks (-1 = none)."""
    factor: float = 1.0
    """Multiplier on those ranks' kernel times (1.2 = 20% slower; products when entries overlap)."""


@dataclass
class HardwareConfig:
    """One cluster: identical devices, `devices_per_node` per node, `num_nodes` nodes."""

    name: str = "???"
    """Identifier used in artifact paths (the YAML file name)."""
    device_kind: str = "cpu"
    """'cpu' (torch on host cores, gloo) or 'cuda' (NVIDIA GPUs, NCCL)."""
    device_name: str = ""
    """Marketing name of the device, e.g. 'NVIDIA A100-SXM4-80GB'."""
    peak_flops_per_s: dict[str, float] = field(default_factory=dict)
    """Dense peak FLOP/s per op dtype ('fp32', 'bf16', 'fp16', 'fp64'; 'fp8' for FP8 GEMMs, per-tensor or
    block-scaled; 'fp4' for NVFP4 GEMMs, Blackwell only: precision 'fp4' needs it); empty = unknown (measured)."""
    memory_bandwidth_bytes_per_s: float = 0.0
    """Device memory bandwidth; 0 = unknown (measured by the profile stage)."""
    sm_count: int = 0
    """Streaming multiprocessors per GPU (A100 108, H100 SXM 132): GEMM tiles run on them in waves, and a
    partly filled last wave costs a full one (profile/analytical.py); 0 = not modelled (CPUs)."""
    memory_capacity_bytes: float = 0.0
    """Device memory usable for training; 0 = detect (host RAM divided among the devices)."""
    host_link_bandwidth_bytes_per_s: float = 0.0
    """Per-device, per-direction bandwidth between a GPU and its host's memory (PCIe, NVLink-C2C): what CPU
    activation offloading (parallelism.cpu_offload_layers) copies over; 0 = not stated (offloading refused)."""
    devices_per_node: int = 0
    """Devices (GPUs, or CPU cores used as devices) per node; 0 = detect (cores of this machine)."""
    num_nodes: int = 1
    """Nodes in the cluster."""
    threads_per_device: int = 1
    """Host threads per device (torch intra-op threads when the device is a CPU core)."""
    intra_node_bandwidth_bytes_per_s: float = 0.0
    """Per-device, per-direction bandwidth between devices of one node (NVLink, or loopback); 0 = measure."""
    intra_node_latency_s: float = 0.0
    """Per-step latency of a hop inside a node with NCCL's Simple protocol (the others keep NCCL's ratio to
    it), the prior the calibration fits from; 0 = NCCL's hwLatencies (NVLink on GPUs, PCI on CPUs)."""
    inter_node_bandwidth_bytes_per_s: float = 0.0
    """Per-node, per-direction network bandwidth (sum of the node's NICs used for compute traffic)."""
    inter_node_latency_s: float = 0.0
    """Per-step latency of a network hop between nodes, as intra_node_latency_s; 0 = NCCL's (NET)."""
    comm_backend: str = "gloo"
    """torch.distributed backend: 'gloo' (CPU) or 'nccl' (CUDA)."""
    nccl: NcclConfig = field(default_factory=NcclConfig)
    """Collective-library version and settings."""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    """Topology and transport of the network between nodes (and the NVLink domain)."""
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    """Measurements the collective model is fitted to."""
    profile_backend: str = "auto"
    """Kernel timing: 'measure' (this machine's device), 'analytical' (kernel_model), or 'auto'
    (measure when the device kind is present here, else analytical)."""
    kernel_model: KernelModelConfig = field(default_factory=KernelModelConfig)
    """Parameters of the analytical backend."""
    colocated_profiling: bool = False
    """Time each op while all devices_per_node devices run it (CPU cores share caches and memory
    bandwidth, and in SPMD training all ranks of a node run the same op at once)."""
    cold_cache_profiling: bool = True
    """Evict the device's last-level cache before every timed call (as nvbench and triton do for L2):
    in a training step the other layers evict an op's weights between two of its uses."""
    host_dispatch_s: float = 0.0
    """Host (CPU) time the framework takes to issue one op to the device (eager PyTorch dispatch and the
    Python around it: microseconds per op). A kernel cannot start before the host has issued it, so a
    step whose per-device kernels are short is host-bound (timeline/engine.py). 0 = the host never limits;
    on a CPU device the dispatch is part of each measured op time, so keep 0 there."""
    price_per_device_hour: float = 0.0
    """Cost of one device for one hour in USD (for cost-per-step figures); 0 = unknown."""
    power_per_device_w: float = 0.0
    """Electrical power of one device in W for the energy of a training run (the datasheet's maximum, an
    upper bound: the node's CPUs, NICs and cooling are not in it); 0 = unknown."""
    slowdown: SlowdownConfig = field(default_factory=SlowdownConfig)
    """How the overlap-slowdown dataset is obtained and its model trained."""
    stragglers: list[StragglerConfig] = field(default_factory=list)
    """Slow ranks or nodes for what-if studies (timeline compose only); empty = all devices equal."""
    what_if: WhatIfConfig = field(default_factory=WhatIfConfig)
    """Hypothetical bandwidth, latency and peak-rate changes (compose and search only)."""


@dataclass
class ModelConfig:
    """A decoder-only transformer (GPT-2/Megatron GPT or Llama family)."""

    name: str = "???"
    """Identifier used in artifact paths (the YAML file name)."""
    family: str = "gpt"
    """'gpt' (LayerNorm, GELU MLP, learned positions) or 'llama' (RMSNorm, SwiGLU, rotary, GQA)."""
    num_layers: int = 2
    """Transformer blocks."""
    hidden_size: int = 64
    """Model width (d_model)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None = num_attention_heads (multi-head attention)."""
    head_dim: int | None = None
    """Width of one attention head; None = hidden_size / num_attention_heads (Qwen3: 128 with 2048 / 32)."""
    ffn_hidden_size: int | None = None
    """MLP inner width; None = 4 * hidden_size."""
    seq_length: int = 64
    """Tokens per sample."""
    vocab_size: int = 512
    """Vocabulary; padded at build time to a multiple of 128 * tp as Megatron-LM does."""
    dropout: float = 0.0
    """Dropout probability after attention and MLP (0 disables the dropout ops)."""
    attention: str = "fused"
    """Core attention kernel: 'fused' (flash-attention style, torch's scaled_dot_product_attention: scores
    never in memory) or 'unfused' (Megatron before flash attention: scaled-masked scores GEMM, softmax,
    dropout and a second GEMM, with the [s, s] scores in memory)."""
    fused_elementwise: bool = True
    """Whether RMSNorm, rotary embedding and SwiGLU run as one fused kernel each way (Transformer Engine's kernels,
    torch.compile's fusions) or, false, as eager PyTorch's separate ops and autograd's backward kernels, each a
    pass over the activations (torchtitan and plain PyTorch without torch.compile; workloads/fused.py)."""
    fused_cross_entropy: bool = False
    """Megatron-Core's cross-entropy loss fusion (--cross-entropy-loss-fusion; Megatron-Bridge's default, with
    Transformer Engine's kernel): one kernel writes the loss and the fp32 gradient of the logits, which backward
    scales in place, instead of the fp32 max / exp / sum path's temporaries (workloads/tensor_parallel.py)."""
    moe_probs_in_experts: bool = False
    """Where each token copy's router probability weights it: false, on the expert's output in the combine
    (Megatron-Core before 0.13, torchtitan; the product's input is kept for the probability's gradient); true,
    inside the experts' activation, the probabilities travelling with the tokens through the all-to-all
    (Megatron-Core 0.13+: weighted_bias_swiglu keeps the activation's input, which it keeps anyway)."""
    separate_projections: bool = False
    """Whether the query, key and value projections (and SwiGLU's gate and up projections) are separate linears,
    one GEMM each over the same input (torchtitan's wq, wk, wv and w1, w3), rather than one fused GEMM each
    (Megatron's linear_qkv and linear_fc1). With parallelism.tp_comm_overlap the rings run them as one GEMM."""
    tp_overlap_backward: str = "bulk"
    """What parallelism.tp_comm_overlap overlaps in a column-parallel linear's backward: 'bulk' (Transformer Engine's
    defaults: the input all-gathered behind the input-gradient GEMM, the input gradient reduce-scattered behind the
    weight-gradient GEMM) or 'none' (torch's micro-pipelined async TP, torchtitan: it fuses an all-gather into the
    matmuls that read it and one matmul into the reduce-scatter of its output, and the input gradient of q, k, v or
    of the gate and up projections is a sum of several matmuls, so it is reduce-scattered after them, exposed; the
    gathered input is kept from forward, no all-gather in backward)."""
    attention_dropout: float = 0.0
    """Dropout probability on the attention probabilities (Megatron's --attention-dropout)."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    rope_theta: float = 10000.0
    """Rotary base frequency (llama family only)."""
    num_experts: int = 0
    """Routed experts per MoE layer (0 = a dense model; workloads/moe.py)."""
    moe_top_k: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """Inner width of each routed expert; None = ffn_hidden_size (fine-grained experts, DeepSeek/Qwen3: smaller)."""
    moe_shared_expert_ffn_hidden_size: int = 0
    """Inner width of the shared expert every token also goes through (DeepSeek, Qwen2-MoE); 0 = none."""
    moe_router: str = "softmax"
    """Gating: 'softmax' (Mixtral, Qwen3: softmax over the top-k logits) or 'sigmoid' (DeepSeek-V3: sigmoid
    scores, the top-k of them normalised to sum 1)."""
    moe_capacity_factor: float = 0.0
    """Tokens an expert takes per micro-batch, as a multiple of its balanced share (GShard / Switch); the rest
    are dropped. 0 = dropless (every routed token is computed, Megatron-Core's default)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (Switch Transformer eq. 4, Megatron's --moe-aux-loss-coeff); 0 = none."""
    moe_first_dense_layers: int = 0
    """Leading layers with a dense MLP instead of experts (DeepSeek-V3: 3)."""
    moe_routing: str = "balanced"
    """How tokens spread over experts in the trace (real runs route with the router): 'balanced', 'zipf:<s>'
    (expert i gets a share ~ 1 / i^s, hot experts differing by layer), 'dirichlet:<alpha>' (shares drawn per
    layer; small alpha = skewed), or the path of a routing histogram exported from a real run
    (workloads/routing.py)."""
    moe_force_routing: bool = False
    """Real runs route by model.moe_routing too (each token's experts assigned from the plan, weighted by the
    router's scores for them) instead of by the router's top-k: a controlled imbalance for benchmarks, as
    Megatron-Core's --moe-router-force-load-balancing forces a balanced one."""
    moe_layer_freq: int = 1  # set: 1 = every layer after moe_first_dense_layers has experts (Megatron default)
    """With experts: layers i (after moe_first_dense_layers) with (i + 1) % moe_layer_freq == 0 are MoE layers, the
    others dense MLPs of ffn_hidden_size (Megatron-Core --moe-layer-freq; Llama 4 Maverick: 2)."""
    moe_router_bias: bool = False
    """The router's linear layer has a bias (GPT-OSS); routing work is the same, one more parameter per expert."""
    q_lora_rank: int = 0  # set: 0 = queries projected at full rank (DeepSeek-V2-Lite), > 0 as DeepSeek-V3's 1536
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2; workloads/latent_attention.py): rank of the query's
    down projection (normalised, then projected up per head); 0 = one query projection of full rank. Needs
    kv_lora_rank > 0."""
    kv_lora_rank: int = 0  # set: 0 = no latent attention (plain MHA/GQA)
    """Rank of the compressed keys and values of multi-head latent attention (> 0 turns MLA on; DeepSeek-V3: 512):
    hidden -> kv_lora_rank + qk_rope_head_dim, normalised, then projected up to every head's keys and values.
    head_dim is then the width of the query/key part without rotary embedding (qk_nope_head_dim)."""
    qk_rope_head_dim: int = 0  # set: 0 = no decoupled rotary part (only meaningful with kv_lora_rank > 0)
    """MLA: width of the decoupled rotary part of each query head and of the one rotary key shared by all heads
    (DeepSeek-V3: 64). Needs kv_lora_rank > 0."""
    v_head_dim: int | None = None
    """MLA: width of each value head (DeepSeek-V3: 128); None = head_dim."""
    window_size: int = 0  # set: 0 = full causal attention
    """Tokens a query attends to, itself included (Mistral / GPT-OSS sliding_window, Llama 4 attention_chunk_size);
    0 = full causal attention. Flash attention skips the masked blocks: the kernel's work follows the window."""
    window_kind: str = "sliding"
    """'sliding' (a query sees itself and the window_size - 1 tokens before it) or 'chunked' (Llama 4: the
    sequence is cut into chunks of window_size tokens, a query sees the earlier tokens of its own chunk)."""
    global_attention_every: int = 0  # set: 0 = every layer windowed when window_size > 0
    """With window_size > 0: layers i with (i + 1) % global_attention_every == 0 keep full causal attention (GPT-OSS
    2: sliding and full layers alternate; Llama 4 4: every 4th layer global); 0 = every layer windowed."""
    attention_sinks: bool = False
    """A learned logit per attention head joins every query's softmax without a value (GPT-OSS): attention can
    put weight on nothing."""
    approximations: list[str] = field(default_factory=list)
    """What this config asks that trainsim approximates (e.g. 'squared ReLU run as GELU'), one sentence each;
    every prediction's warnings repeat them."""

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention (kv_lora_rank > 0)."""
        return self.kv_lora_rank > 0

    def has_experts(self, layer: int) -> bool:
        """Layer `layer` (0-based) is an MoE layer: an 'E' of a hybrid pattern; else after the first dense ones,
        every moe_layer_freq-th."""
        if self.hybrid_layer_pattern:
            return self.hybrid_layer_pattern[layer] == "E"
        return bool(self.num_experts) and layer >= self.moe_first_dense_layers and \
            (layer + 1) % max(self.moe_layer_freq, 1) == 0

    def window_of(self, layer: int) -> int:
        """Attention window of layer `layer` (0-based) in tokens; 0 = full causal attention."""
        if not self.window_size:
            return 0
        every = self.global_attention_every
        return 0 if every and (layer + 1) % every == 0 else self.window_size

    hybrid_layer_pattern: str = ""
    """Layer kinds of a hybrid Mamba model, one character per layer (Megatron's --hybrid-override-pattern):
    'M' a Mamba-2 mixer, '*' self-attention, '-' an MLP, 'E' an MoE layer, each with its own pre-norm and residual
    (workloads/mamba.py); num_layers must equal its length, and pipeline splits count its characters. '' = every
    layer a transformer block (attention and MLP or MoE)."""
    mamba_state_dim: int = 128  # set: Megatron-Core's --mamba-state-dim default (Nemotron-H uses it)
    """SSM state size N of each Mamba-2 head (the width of B and C per group)."""
    mamba_head_dim: int = 64  # set: Megatron-Core's --mamba-head-dim default (Nemotron-H uses it)
    """Channels P of one Mamba-2 head."""
    mamba_num_heads: int = 0
    """Mamba-2 heads; 0 = 2 * hidden_size / mamba_head_dim (expand 2, Megatron-Core's default). The mixer's inner
    width is mamba_num_heads * mamba_head_dim."""
    mamba_num_groups: int = 8  # set: Megatron-Core's --mamba-num-groups default (Nemotron-H uses it)
    """Groups of heads sharing one B and C (Mamba-2's multi-value grouping, like GQA's key-value groups); split over
    tensor-parallel ranks with the heads."""
    mamba_conv_kernel: int = 4  # set: Mamba-2's d_conv default (Megatron-Core MambaMixer, Nemotron-H)
    """Width of the causal depthwise convolution over x, B and C."""

    @property
    def mamba_heads(self) -> int:
        """Mamba-2 heads (mamba_num_heads, else 2 * hidden_size / mamba_head_dim)."""
        return self.mamba_num_heads or 2 * self.hidden_size // self.mamba_head_dim

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Inner width of a routed expert (moe_ffn_hidden_size, else the dense MLP's)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size or 4 * self.hidden_size


@dataclass
class ParallelismConfig:
    """How one training step is laid out on dp * cp * tp * pp devices (Megatron-LM terminology)."""

    name: str = "???"
    """Identifier used in artifact paths (the YAML file name)."""
    dp: int = 1
    """Data-parallel degree (model replicas)."""
    tp: int = 1
    """Tensor-parallel degree (Megatron column/row sharding of every layer)."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    cp: int = 1
    """Context-parallel degree (Megatron-Core/Transformer Engine): each sequence is split over cp ranks, which
    hold the same weights and run attention as a ring exchanging keys and values (workloads/context_parallel.py);
    the gradients are reduced over the dp * cp ranks of a model shard."""
    ep: int = 1
    """Expert-parallel degree (MoE models): each MoE layer's experts are split over ep ranks, which exchange
    tokens by all-to-all. Folded over the dp * cp * tp ranks of a pipeline stage as Megatron-Core's parallel
    folding does (parallel/layout.py): etp * ep consecutive ranks in that order, and the ranks holding the same
    expert shards (dp * cp * tp / (ep * etp) of them) reduce the experts' gradients."""
    etp: int = 1
    """Expert tensor parallelism (Megatron-Core --expert-tensor-parallel-size): each expert's weights are split
    over etp ranks (column-parallel up, row-parallel down projection), independently of tp. The tokens an ep rank
    receives are all-gathered over its etp group before the experts and the partial outputs reduce-scattered
    after (workloads/moe.py). 1 (the default of Megatron-Core's MoE recipes) keeps experts whole."""
    moe_token_dispatcher: str = "alltoall"
    """How MoE layers move tokens to the expert-parallel ranks (Megatron-Core --moe-token-dispatcher-type):
    'alltoall' (each token copy sent to its expert's rank) or 'allgather' (every rank gathers all ranks' tokens,
    computes those routed to its experts, and the results are reduce-scattered back)."""
    moe_grouped_gemm: bool = True
    """MoE experts as one grouped GEMM per projection (Megatron-Core --moe-grouped-gemm, which its MoE recipes
    use; workloads/grouped_gemm.py) or, false, one GEMM per local expert (Megatron-Core's SequentialMLP)."""
    moe_a2a_overlap: bool = False
    """Hide the expert all-to-alls under another micro-batch's compute (Megatron-Core
    --overlap-moe-expert-parallel-comm, the batch-level overlap DeepSeek-V3's DualPipe also uses): in the steady
    state each forward runs interleaved layer by layer with the backward of an earlier micro-batch, one's
    dispatch/combine on a communication stream while the other computes (workloads/combined_passes.py); the
    schedule warms up one micro-batch more, so one more micro-batch of activations is held."""
    cp_comm_type: str = "p2p"
    """How context-parallel attention gets the other ranks' keys and values: 'p2p' (ring attention: cp steps,
    each overlapping one block's attention with the next block's send/receive; Megatron-Core's default) or
    'all_gather' (one all-gather of K and V before attention, a reduce-scatter of their gradients after)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B); 1 for gpipe and 1f1b."""
    first_stage_layers: int = 0
    """Layers on the first pipeline stage, the rest split evenly (Megatron's --decoder-first-pipeline-num-layers:
    DeepSeek-V3's 61 layers on 16 stages); 0: every stage the same number."""
    last_stage_layers: int = 0
    """Layers on the last pipeline stage (Megatron's --decoder-last-pipeline-num-layers); 0: as the middle ones.
    With virtual stages each chunk of the first (last) stage holds first (last) / virtual_stages layers, and the
    middle stages' share must also divide by virtual_stages (parallel/pipeline_split.py)."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as a layer when splitting the layers over the stages (Megatron's
    --account-for-embedding-in-pipeline-split): the split is of num_layers + 1, and the first virtual stage
    builds one transformer layer fewer. Llama 3.1 405B's 126 layers as 128 slots: PP8 x VP8, PP16 x VP4."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer and loss as a layer in the split (Megatron's --account-for-loss-in-pipeline-split):
    the last virtual stage builds one transformer layer fewer."""
    pipeline_layout: str = ""
    """Explicit split (Megatron-Core's --pipeline-model-parallel-layout): one stage per virtual stage in virtual-
    stage order (chunk c of rank r is stage c * pp + r), separated by '|'; 'E' embedding, 't' transformer layer,
    'L' loss, 'x*n' and '(...)*n' repeat, commas are cosmetic; e.g. DeepSeek-V3 on PP8 x VP2 without its MTP
    layer: "Et*4|(t*4|)*14,tL". It must hold pp * virtual_stages stages, 'E' first, 'L' last, num_layers 't'.
    Empty: the split the other fields give. Quote it in a command-line override:
    parallelism.pipeline_layout='Et*4|(tttt|)*14tL'."""
    micro_batch_size: int = 1
    """Samples per micro-batch."""
    global_batch_size: int = 1
    """Samples per optimizer step over all replicas; num_microbatches = global / (micro * dp)."""
    schedule: str = "1f1b"
    """Pipeline schedule: 'gpipe', '1f1b' or 'interleaved-1f1b'."""
    recompute: str = "none"
    """Activation recomputation: 'none', 'full' (every block), 'selective' (Megatron's: the recompute_modules) or
    'op' (torchtitan's op-level selective checkpointing: all but the matmuls, every second matmul and the fused
    attention)."""
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])
    """With recompute 'selective': the modules recomputed, as Megatron-Core's --recompute-modules (its default
    core_attn): 'core_attn', 'mla_up_proj' (multi-head latent attention's up projections and rotary embedding:
    their outputs are freed once the core attention has kept them, and made again before its backward), 'mlp'
    (dense MLPs; not MoE layers, as Megatron), 'shared_experts'; [] recomputes nothing
    (workloads/module_recompute.py)."""
    dp_bucket_size_bytes: int = 25 * 1024 * 1024
    """Gradient bucket size of the data-parallel all-reduce (PyTorch DDP default 25 MiB). Each bucket is
    all-reduced as soon as its gradients are ready, during the last backward; a size above the stage's
    gradients gives one all-reduce after the backward, without overlap (Megatron without gradient
    buckets, e.g. vTrain's `use_gradient_bucket: false`)."""
    zero_stage: int = 0
    """Sharding of the training state over the data-parallel replicas (ZeRO, Rajbhandari et al. 2020):
    0 = every replica holds all of it (DDP: gradient buckets all-reduced); 1 = fp32 master weights and Adam
    moments sharded over dp (Megatron-Core's distributed optimizer, DeepSpeed ZeRO-1): gradient buckets are
    reduce-scattered, each rank updates its 1/dp slice, the updated weights are all-gathered; 2 and 3 = FSDP
    (PyTorch's FSDP2 `fully_shard` per block, as torchtitan): weights, gradients and states all sharded, each
    block's weights all-gathered (bf16) before its forward and gradients reduce-scattered (fp32) after every
    micro-batch's backward; 2 keeps the gathered weights until the backward (SHARD_GRAD_OP), 3 frees them
    after the forward and gathers them again for the backward (FULL_SHARD, ZeRO-3)."""
    dp_shard_size: int = 0
    """Ranks the sharded state of zero_stage >= 1 is split over: 0 = all dp * cp ranks (plain FSDP / one
    distributed optimizer); a proper divisor of dp * cp = HSDP (torchtitan's data_parallel_shard_degree, with
    dp * cp / dp_shard_size replicas: data_parallel_replicate_degree) or, with zero_stage 1, Megatron-Core's
    --num-distributed-optimizer-instances = dp * cp / dp_shard_size. Gradients are reduce-scattered within a
    shard group and the shards all-reduced across the replicas; weights are all-gathered within the shard
    group (parallel/layout.py: groups 'dp_shard' and 'dp_replicate')."""
    fp8_param_gather: bool = False
    """With precision 'fp8' and FSDP (zero_stage 2, 3): the weights are cast to FP8 per shard before they are
    all-gathered, so the all-gather carries 1 byte per weight instead of 2 and the gathered weights are held in
    FP8 (torchtitan's enable_fsdp_float8_all_gather with precompute_float8_dynamic_scale_for_fsdp: one
    all-reduce (MAX) of every unit's amax per step over the shard group; Megatron --fp8-param-gather).
    workloads/fully_sharded.py."""
    grad_reduce_in_fp32: bool = False
    """With low-precision weights (bf16, fp16, fp8 runs): accumulate gradients in an fp32 buffer (each weight's
    `main_grad`: a micro-batch's gradient is added into it and freed) and reduce them over data parallelism in
    fp32, as Megatron-LM does for bf16 (`--accumulate-allreduce-grads-in-fp32`, forced on for bf16) and NeMo's
    bf16-mixed; the optimizer reads them as its master gradients. False (default): gradients kept and reduced in
    the weights' dtype, copied to fp32 for the optimizer; the published H100 runs fit it (docs/validation.md,
    "Gradient dtype"). FSDP (zero_stage 2, 3) reduce-scatters in fp32 with it (torchtitan's
    training.mixed_precision_reduce 'float32') and in the weights' dtype without it (FSDP2's own default
    reduce_dtype; Megatron-FSDP's main gradients as Megatron-Bridge's performance recipes run them)."""
    gradient_accumulation_fusion: bool = False
    """Megatron's --gradient-accumulation-fusion (Megatron-Core's and NeMo's default; Transformer Engine's
    fuse_wgrad_accumulation): the weight-gradient GEMM of each tensor-parallel linear accumulates into the
    gradient buffer itself (beta = 1), so a micro-batch's weight gradient is never written apart and added.
    False (plain PyTorch): autograd adds it into the buffer, one extra read and write per weight and
    micro-batch. Norms, biases, embeddings and experts accumulate as before; FSDP (zero_stage 2, 3) ignores it."""
    cpu_offload_layers: int = 0
    """Megatron-Core's CPU activation offloading (--cpu-offloading-num-layers with activations only: Transformer
    Engine's CPU offload): the tensors the model's first N transformer layers save for backward are copied to host
    memory in forward and back in backward, over hardware.host_link_bandwidth_bytes_per_s on copy streams beside
    the compute, so their device memory is free meanwhile (workloads/activation_offload.py). Megatron refuses it
    with pipeline parallelism and with recomputation; 0 = off."""
    overlap_param_gather: bool = False
    """With zero_stage 1: all-gather the updated weights during the next step's first forward, each layer
    waiting only for its own bucket (Megatron-Core --overlap-param-gather), instead of after the optimizer."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism with tp > 1 (Korthikanti et al. 2022): norms, dropout and residual
    adds run on each tp rank's 1/tp of the tokens; the tp all-reduces become an all-gather before and a
    reduce-scatter after each tensor-parallel block (same bytes), and pipeline stages exchange shards."""
    tp_comm_overlap: bool = False
    """Overlap the sequence-parallel all-gathers and reduce-scatters of the attention and MLP linears with
    their GEMMs (Megatron-Core --tp-comm-overlap, Transformer Engine's ring exchange): each GEMM runs in tp
    token blocks while the next block travels one hop; needs sequence_parallel."""
    clip_grad: float = 1.0
    """Gradient clipping by global L2 norm (Megatron's --clip-grad, default 1.0): a norm over each rank's
    gradients, summed over the model-parallel group, and a scale of every gradient; 0 = no clipping."""
    precision: str = "bf16"
    """'fp32', or 'bf16' / 'fp16' mixed precision with fp32 master weights and Adam states; 'fp8': bf16 as
    above, with the transformer linears' GEMMs in FP8 as Transformer Engine runs them (workloads/fp8.py);
    'fp4': the same with NVFP4 GEMMs (TE NVFP4BlockScaling, Megatron --fp4-format e2m1 --fp4-recipe nvfp4: E2M1
    values, an E4M3 scale per 16 elements and an fp32 scale per tensor; fprop, dgrad and wgrad in FP4, stochastic
    rounding of gradients, Hadamard transform of wgrad's operands; workloads/block_scaling.py), Blackwell only."""
    fp8_recipe: str = "delayed"
    """With precision 'fp8': 'delayed' (TE DelayedScaling: scales from an amax history, amaxes all-reduced
    over the dp x tp group after each forward and backward pass), 'current' (per-tensor current scaling),
    'mxfp8' (TE MXFP8BlockScaling, Blackwell only: an E8M0 scale per 32 elements) or 'blockwise' (TE
    Float8BlockScaling, DeepSeek-V3's recipe, Hopper or later: fp32 scales per 1 x 128 tile of inputs and gradients
    and per 128 x 128 block of weights). The block recipes have no amax all-reduce and quantise each input and
    gradient twice (row-wise and column-wise, workloads/block_scaling.py)."""

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def weight_replicas(self) -> int:
        """Ranks holding the same weights (every dp and cp rank of a model shard): where gradients are averaged
        and the distributed optimizer shards."""
        return self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        """Ranks the sharded state (zero_stage >= 1) is split over: dp_shard_size, or every weight replica."""
        return self.dp_shard_size or self.weight_replicas

    @property
    def shard_replicas(self) -> int:
        """Copies of the sharded state (HSDP replicas, distributed-optimizer instances); 1 without HSDP."""
        return self.weight_replicas // self.shard_ranks

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)


@dataclass
class TrainConfig:
    """A whole training run, for totals beyond one step (steps, days, GPU-hours, cost, energy). It keys no
    artifact: a new budget only re-renders the pages, it re-simulates nothing."""

    tokens: float = 0.0
    """Tokens the run trains on (e.g. 3.0e11 for GPT-3's 300 billion); 0 = no totals."""


@dataclass
class FrameworkConfig:
    """The software stack a run trains with (conf/framework/): settings that a framework decides for its
    users, which published tables and recipes leave unstated. config/framework.py resolves them into the
    parallelism, model and hardware groups when a run is composed, so every stage sees concrete values. The
    framework decides a field only where the user left it: a value on the command line (e.g.
    parallelism.gradient_accumulation_fusion=false) or in a chosen option file (other than the schema's
    default) wins. None / '' = leave the groups' value."""

    name: str = "pytorch"
    """The option's name (conf/framework/<name>.yaml)."""
    description: str = ""
    """What the stack is and which releases it stands for."""
    dp_bucket: str = ""
    """Gradient buckets of its data-parallel reduction: 'pytorch-ddp' (torch DDP's 25 MiB), 'megatron-core'
    (Megatron-Core DDP's max(40M, 1M x dp x cp) parameters in the gradients' dtype); '' = the layout's
    parallelism.dp_bucket_size_bytes."""
    gradient_accumulation_fusion: bool | None = None
    """Its default for parallelism.gradient_accumulation_fusion (Megatron-Core on, plain PyTorch off)."""
    grad_reduce_in_fp32: bool | None = None
    """Its default for parallelism.grad_reduce_in_fp32 (torchtitan: true, FSDP2 reduces in fp32; Megatron-Bridge's
    performance recipes: false)."""
    attention: str = ""
    """Its core attention kernel for model.attention: 'unfused' (Megatron-LM before flash attention), 'fused'."""
    flash_attention: str = ""
    """A flash-attention release whose measured rates replace the hardware config's attention efficiencies:
    'Fav2' / 'Fav3' = FlashAttention-2 / -3's causal forward/backward measured on H100 (data/kernels/
    h100_flash-attn2-vs-3_fwd-bwd_pr1791.csv; NeMo 24.07 ran Fav2: Transformer Engine before its FlashAttention-3
    support, with NVTE_FUSED_ATTN=0); applied on Hopper GPUs, elsewhere the hardware's rates stand;
    '' = the hardware's."""
    fused_elementwise: bool | None = None
    """Its default for model.fused_elementwise: fused norm, rotary and SwiGLU kernels (Transformer Engine: true),
    or eager PyTorch ops (torchtitan, whose training.compile is off unless set: false; set it true for a run
    with torch.compile)."""
    separate_projections: bool | None = None
    """Its default for model.separate_projections (torchtitan: true; Megatron: false, fused GEMMs)."""
    fused_cross_entropy: bool | None = None
    """Its default for model.fused_cross_entropy (Megatron-Bridge: true)."""
    moe_probs_in_experts: bool | None = None
    """Its default for model.moe_probs_in_experts (Megatron-Bridge: true)."""
    tp_overlap_backward: str = ""
    """Its default for model.tp_overlap_backward ('bulk': Transformer Engine; 'none': torch's micro-pipelined async
    TP); '' = the model's."""
    tp_comm_overlap: bool = True
    """Whether the stack can overlap tensor-parallel communication with GEMMs (Transformer Engine's userbuffers,
    torchtitan's async TP); False refuses parallelism.tp_comm_overlap=true."""
    host_dispatch_s: float | None = None
    """Host seconds per dispatched op in this stack (hardware.host_dispatch_s); None = the hardware's."""


@dataclass
class RunConfig:
    """The composed root config: one simulation point."""

    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    """The cluster (conf/hardware/)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The transformer trained (conf/model/)."""
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """The layout of one training step on the cluster (conf/parallelism/)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The whole run a step belongs to (`train.tokens=3e11`)."""
    framework: FrameworkConfig = field(default_factory=FrameworkConfig)
    """The software stack (conf/framework/), resolved into the groups above (config/framework.py)."""


CONFIG_GROUPS: dict[str, type] = {
    "hardware": HardwareConfig,
    "model": ModelConfig,
    "parallelism": ParallelismConfig,
}


def register_configs() -> None:
    """Register the schemas so YAML files can extend them with `defaults: [<group>_schema, _self_]`."""
    from hydra.core.config_store import ConfigStore  # composing only: a cached compose does not import Hydra

    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for group, schema in {**CONFIG_GROUPS, "framework": FrameworkConfig}.items():
        store.store(group=group, name=f"{group}_schema", node=schema)
