"""One training step of one rank: pipeline schedule, tensor/data parallelism and the optimizer.

This is the code that runs for real (gloo, 2+ processes) and the code that is traced ex-situ on
fake tensors and a fake process group; nothing in it knows which of the two is happening.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from trainsim.config.schema import ModelConfig, ParallelismConfig
from trainsim.errors import TraceError
from trainsim.parallel.layout import EXPERT_GROUP_KINDS, GROUP_KINDS, Layout, layout_of
from trainsim.parallel.phases import COMBINED
from trainsim.parallel.pipeline_split import split_of
from trainsim.parallel.schedules import (
    Action,
    combined_chunk,
    first_forward_microbatch,
    last_backward_microbatch,
    passes,
)
from trainsim.workloads.combined_passes import ChunkPass, interleave, run_alone
from trainsim.workloads.context_parallel import ContextParallel
from trainsim.workloads.data_parallel import GradientBuckets, gradient
from trainsim.workloads.fp8 import fp8_settings
from trainsim.workloads.fully_sharded import Fp8GatherScales, local, shard_chunk
from trainsim.workloads.model import DTYPES, TransformerChunk
from trainsim.workloads.moe import ExpertParallel
from trainsim.workloads.observe import observer
from trainsim.workloads.optimizer import MixedPrecisionAdamW
from trainsim.workloads.routing import PlannedCounts, RouterCounts
from trainsim.workloads.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def create_groups(layout: Layout, rank: int, every_group: bool, experts: bool = False) -> dict[str, object]:
    """Process groups of `rank` by kind (GROUP_KINDS, and EXPERT_GROUP_KINDS for a model with experts).

    A real run must create every group on every rank in the same order (every_group=True);
    a traced rank only creates its own (the fake store needs no agreement). A kind whose group has the
    ranks of an earlier kind's (mp = pp when tp = 1, amax = tp when dp = 1, ...) reuses that group.
    """
    mine: dict[str, object] = {}
    for kind in GROUP_KINDS + (EXPERT_GROUP_KINDS if experts else ()):
        own = layout.group_ranks(rank, kind)
        same = next((k for k in mine if layout.group_ranks(rank, k) == own), None)
        if same is not None:  # (for every rank at once: the degrees decide it)
            mine[kind] = mine[same]
            continue
        candidates = layout.all_groups(kind) if every_group else [own]
        for ranks in candidates:
            group = dist.new_group(ranks, use_local_synchronization=not every_group)
            if ranks == own:
                mine[kind] = group
    return mine


@dataclass
class RankModel:
    """Everything one rank holds: its model chunks, gradient buckets and optimizer."""

    layout: Layout
    rank: int
    model_cfg: ModelConfig
    par: ParallelismConfig
    groups: dict[str, object]
    chunks: list[TransformerChunk]
    buckets: list[GradientBuckets]
    optimizer: MixedPrecisionAdamW
    cp: ContextParallel | None = None
    expert_buckets: dict[int, GradientBuckets] = field(default_factory=dict)
    """chunk -> the gradient buckets of its experts, for the chunks that hold experts (a pipeline layout can give
    a chunk dense layers only: DeepSeek-V3's first dense layers)."""
    pending_sends: list = field(default_factory=list)
    fp8_gather_scales: Fp8GatherScales | None = None
    """FSDP with parallelism.fp8_param_gather: the units' FP8 scales, recomputed after each optimizer step."""

    def chunk_buckets(self, chunk: int) -> list[GradientBuckets]:
        return [self.buckets[chunk]] + ([self.expert_buckets[chunk]] if chunk in self.expert_buckets else [])

    def all_buckets(self) -> list[GradientBuckets]:
        return self.buckets + list(self.expert_buckets.values())

    @property
    def pp_rank(self) -> int:
        return self.layout.position(self.rank).pp_rank

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.parameters()]


def build_rank_model(model_cfg: ModelConfig, par: ParallelismConfig, rank: int, groups: dict[str, object],
                     routing: RouterCounts | PlannedCounts | None = None) -> RankModel:
    """Build rank `rank`'s sub-model: the layers of its pipeline chunks, sharded for its tp rank.

    routing: where MoE layers get their token counts (workloads/routing.py); default: the router decides."""
    layout = layout_of(par)
    pos = layout.position(rank)
    v = par.virtual_stages
    dtype = DTYPES[par.precision]
    fp8 = fp8_settings(par, groups["amax"], transformer_engine=model_cfg.tp_overlap_backward == "bulk")
    cp = ContextParallel(par.cp, pos.cp_rank, groups["cp"], par.cp_comm_type) if par.cp > 1 else None
    ep = None
    if model_cfg.num_experts:
        kind = layout.token_group_kind
        routing = routing or RouterCounts(model_cfg.num_experts, groups[kind], layout.token_source(rank),
                                          group_kind=kind)
        ep = ExpertParallel(par.ep, layout.ep_rank(rank), groups["ep"], routing, par.moe_token_dispatcher,
                            par.moe_grouped_gemm, par.etp, layout.etp_rank(rank), groups["etp"])
    chunks = []
    split = split_of(model_cfg, par)
    try:
        for c in range(v):
            chunks.append(TransformerChunk(
                model_cfg,
                layers=split.layers(pos.pp_rank, c),
                first=split.holds_embedding(pos.pp_rank, c),
                last=split.holds_loss(pos.pp_rank, c),
                tp=par.tp, tp_rank=pos.tp_rank, tp_group=groups["tp"],
                dtype=dtype, recompute=par.recompute, loss_scale=1.0 / par.num_microbatches,
                sequence_parallel=par.sequence_parallel, tp_comm_overlap=par.tp_comm_overlap, fp8=fp8, cp=cp, ep=ep,
                offload_layers=par.cpu_offload_layers, recompute_modules=tuple(par.recompute_modules),
            ))
    except (RuntimeError, ValueError) as exc:
        raise TraceError(f"cannot build the sub-model of rank {rank} (pp_rank={pos.pp_rank}, "
                         f"tp_rank={pos.tp_rank}, cp_rank={pos.cp_rank}) for {model_cfg.name}: {exc}") from exc
    hsdp = par.shard_replicas > 1
    shard_group = groups["dp_shard"] if hsdp else groups["dp"]
    if par.zero_stage >= 2:  # FSDP2: sharded weights, gradients and states; the norm over every rank
        scales = Fp8GatherScales(shard_group, par.shard_ranks) if par.fp8_param_gather else None
        for chunk in chunks:
            tagged = [(name, tag) for name, p in chunk.named_parameters() for tag in ("sequence_parallel", "expert")
                      if getattr(p, tag, False)]
            shard_chunk(chunk, shard_group, par.zero_stage, dtype, groups.get("edp"), par.weight_replicas,
                        groups["dp_replicate"] if hsdp else None, scales,
                        reduce_dtype=torch.float32 if par.grad_reduce_in_fp32 else dtype)
            for name, tag in tagged:  # fully_shard replaces the parameters: tag the new ones
                setattr(chunk.get_parameter(name), tag, True)
        params = [p for chunk in chunks for p in chunk.parameters()]
        optimizer = MixedPrecisionAdamW([local(p) for p in params], [local(p.grad) for p in params],
                                        clip_grad=par.clip_grad, norm_group=None, reduce_norm=layout.world_size > 1,
                                        norm_copies=par.shard_replicas)
        return RankModel(layout, rank, model_cfg, par, groups, chunks, [], optimizer, cp, fp8_gather_scales=scales)
    shard = par.zero_stage == 1
    grad_dtype = torch.float32 if par.grad_reduce_in_fp32 else None
    buckets, expert_buckets = [], {}
    for index, chunk in enumerate(chunks):  # experts' gradients are reduced over the ranks holding the same
        # experts (Megatron's expert data-parallel group), averaged like the dense ones over every replica
        dense = [p for p in chunk.parameters() if not getattr(p, "expert", False)]
        experts = [p for p in chunk.parameters() if getattr(p, "expert", False)]
        modules = list(chunk.modules())
        fused = frozenset(m.weight for m in modules if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
                          ) if par.gradient_accumulation_fusion else frozenset()
        buckets.append(GradientBuckets(dense, par.dp_bucket_size_bytes, shard_group, par.shard_ranks,
                                       shard=shard, modules=modules, average_over=par.weight_replicas,
                                       grad_dtype=grad_dtype, fused_accumulation=fused,
                                       replicate_group=groups["dp_replicate"] if hsdp else None))
        if experts:
            expert_buckets[index] = GradientBuckets(experts, par.dp_bucket_size_bytes, groups["edp"],
                                                    layout.expert_replicas, shard=shard, modules=modules,
                                                    average_over=par.weight_replicas, grad_dtype=grad_dtype)
    if shard:  # the distributed optimizer: this rank's slices of the flat buffers, the norm over every rank
        every = buckets + list(expert_buckets.values())
        weights = [w for b in every for w in b.param_shards()]
        grads = [g for b in every for g in b.grad_shards()]
        optimizer = MixedPrecisionAdamW(weights, grads, clip_grad=par.clip_grad, norm_group=None,
                                        reduce_norm=layout.world_size > 1, norm_copies=par.shard_replicas)
    else:  # the experts' norm is summed over the ranks of one expert replica, the rest over the model's ranks
        params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
        params.sort(key=lambda p: getattr(p, "expert", False))
        num_expert = sum(getattr(p, "expert", False) for p in params)
        optimizer = MixedPrecisionAdamW(params, [gradient(p) for p in params], clip_grad=par.clip_grad,
                                        norm_group=groups["mp"], reduce_norm=layout.tp * layout.pp > 1,
                                        expert_tensors=num_expert, expert_norm_group=groups.get("emp"),
                                        reduce_expert_norm=par.ep * par.etp * par.pp > 1)
    return RankModel(layout, rank, model_cfg, par, groups, chunks, buckets, optimizer, cp, expert_buckets)


def _p2p_tag(microbatch: int, sender_chunk: int, virtual_stages: int, backward: bool) -> int:
    return ((microbatch * virtual_stages + sender_chunk) << 1) | int(backward)


def _neighbour(rm: RankModel, chunk: int, step: int) -> tuple[int, int]:
    """(global rank, chunk) of the virtual stage `step` (+1 next, -1 previous) from ours."""
    pp, v = rm.par.pp, rm.par.virtual_stages
    virtual_stage = chunk * pp + rm.pp_rank + step
    assert 0 <= virtual_stage < pp * v, "no neighbour beyond the ends of the pipeline"
    pos = rm.layout.position(rm.rank)
    return rm.layout.rank_of(pos.dp_rank, pos.tp_rank, virtual_stage % pp, pos.cp_rank), virtual_stage // pp


def _activation_shape(rm: RankModel) -> tuple[int, ...]:
    b, s, h = rm.par.micro_batch_size, rm.model_cfg.seq_length // rm.par.cp, rm.model_cfg.hidden_size
    if rm.par.sequence_parallel and rm.par.tp > 1:  # stages exchange their token shards
        return (b * s // rm.par.tp, h)
    return (b, s, h)


def _recv(rm: RankModel, src: int, tag: int) -> torch.Tensor:
    buffer = torch.empty(_activation_shape(rm), dtype=DTYPES[rm.par.precision])
    with observer().communication():
        dist.recv(buffer, src=src, group=rm.groups["pp"], tag=tag)
    return buffer


def _send(rm: RankModel, tensor: torch.Tensor, dst: int, tag: int) -> None:
    tensor = tensor.contiguous()
    with observer().communication():
        rm.pending_sends.append(dist.isend(tensor, dst=dst, group=rm.groups["pp"], tag=tag))


def _forward_pass(rm: RankModel, action: Action, batch, saved: dict) -> Iterator[None]:
    """One chunk's forward for one micro-batch; with moe_a2a_overlap step by step, yielding where a combined
    pass's backward may run (combined_passes.py)."""
    chunk = rm.chunks[action.chunk]
    v = rm.par.virtual_stages
    tokens, targets = batch(action.microbatch)
    if rm.cp is not None:  # this context-parallel rank's chunks of the sequences it uses
        tokens = rm.cp.split(tokens) if chunk.first else None
        targets = rm.cp.split(targets) if chunk.last else None
    if chunk.first:
        inputs = tokens
    else:
        src, src_chunk = _neighbour(rm, action.chunk, -1)
        inputs = _recv(rm, src, _p2p_tag(action.microbatch, src_chunk, v, backward=False)).requires_grad_()
    if rm.par.moe_a2a_overlap:
        kept = ChunkPass(chunk.steps(targets if chunk.last else None),
                         chunk.fp8.autocast if chunk.fp8 is not None else None)
        yield from kept.forward({"x": inputs})
        output = kept.output["loss" if chunk.last else "x"]
    else:
        output = kept = chunk(inputs, targets if chunk.last else None)
    if not chunk.last:
        dst, _ = _neighbour(rm, action.chunk, +1)
        _send(rm, output.detach(), dst, _p2p_tag(action.microbatch, action.chunk, v, backward=False))
    saved[(action.microbatch, action.chunk)] = (inputs, kept)


def _backward_pass(rm: RankModel, action: Action, saved: dict, sync_grads: bool) -> Iterator[None]:
    chunk = rm.chunks[action.chunk]
    v = rm.par.virtual_stages
    inputs, kept = saved.pop((action.microbatch, action.chunk))
    if rm.buckets:  # (FSDP reduce-scatters every micro-batch's gradients itself)
        for buckets in rm.chunk_buckets(action.chunk):
            buckets.start_backward(sync=sync_grads)
    grad = None
    if not chunk.last:
        src, src_chunk = _neighbour(rm, action.chunk, +1)
        grad = _recv(rm, src, _p2p_tag(action.microbatch, src_chunk, v, backward=True))
    if isinstance(kept, ChunkPass):
        yield from kept.backward({"loss": None} if chunk.last else {"x": grad})
        input_grad = kept.input_grads.get("x")
    else:
        if chunk.last:
            kept.backward()
        else:
            torch.autograd.backward(kept, grad)
        input_grad = inputs.grad
    if not chunk.first:
        dst, _ = _neighbour(rm, action.chunk, -1)
        _send(rm, input_grad, dst, _p2p_tag(action.microbatch, action.chunk, v, backward=True))


def allreduce_sequence_parallel_grads(rm: RankModel) -> None:
    """Sum the partial gradients of parameters applied to token shards (norms, row-parallel biases) over
    the tp group: one flat all-reduce, as Megatron-Core's finalize_model_grads does after the DP sync."""
    grads = [local(gradient(p)) for p in rm.parameters()
             if getattr(p, "sequence_parallel", False) and gradient(p) is not None]
    if not grads or rm.par.tp == 1:
        return
    flat = torch.cat([g.flatten() for g in grads])
    with observer().communication():
        dist.all_reduce(flat, group=rm.groups["tp"])
    torch._foreach_copy_(grads, [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads)])


def train_step(rm: RankModel, actions: list[Action], batch) -> None:
    """Run `actions` (a pipeline schedule), synchronise gradients, and step the optimizer.

    batch(microbatch) -> (tokens [b, s], targets [b, s]).
    """
    obs = observer()
    last_mb = last_backward_microbatch(actions)
    first_mb = first_forward_microbatch(actions)
    overlap_gather = rm.par.zero_stage == 1 and rm.par.overlap_param_gather
    saved: dict = {}
    for group in passes(actions):
        if len(group) == 2:  # a forward and a backward combined (moe_a2a_overlap; never the first or last ones)
            f, b = group
            chunk = combined_chunk(f, b, rm.par.virtual_stages)
            interleave([
                (partial(obs.section, f"{COMBINED}.backward", chunk, b.microbatch),
                 _backward_pass(rm, b, saved, sync_grads=False)),
                (partial(obs.section, f"{COMBINED}.forward", chunk, f.microbatch),
                 _forward_pass(rm, f, batch, saved)),
            ])
            continue
        (action,) = group
        phase = "forward" if action.kind == "F" else "backward"
        with obs.section(phase, action.chunk, action.microbatch):
            if action.kind == "F":
                if overlap_gather and action.microbatch == first_mb[action.chunk]:
                    for buckets in rm.chunk_buckets(action.chunk):  # the last step's update, layer by layer
                        buckets.gather_params(wait=False)
                run_alone(_forward_pass(rm, action, batch, saved))
            else:
                run_alone(_backward_pass(rm, action, saved, sync_grads=action.microbatch == last_mb[action.chunk]))
    with obs.section("optimizer", 0, 0):
        for buckets in rm.all_buckets():
            buckets.finish()
        allreduce_sequence_parallel_grads(rm)
        rm.optimizer.step()
        if rm.fp8_gather_scales is not None:  # the next step's FP8 all-gathers use the updated weights' amaxes
            rm.fp8_gather_scales.precompute()
        if not rm.buckets:  # FSDP: the sharded gradients (FSDP adds each micro-batch's into them)
            rm.optimizer.zero_grad()
        for buckets in rm.all_buckets():  # zero after the step (buffers start at zero), as torch's idiom
            buckets.zero_grad()
            if not overlap_gather:
                buckets.gather_params(wait=True)
    with obs.communication():
        for work in rm.pending_sends:
            work.wait()
    rm.pending_sends.clear()


def synthetic_batch(model_cfg: ModelConfig, par: ParallelismConfig, seed: int = 0):
    """Deterministic random tokens: batch(microbatch) -> (tokens, targets)."""

    def batch(microbatch: int):
        gen = torch.Generator().manual_seed(seed * 100003 + microbatch)
        shape = (par.micro_batch_size, model_cfg.seq_length + 1)
        # drawn on the CPU (the same tokens on any device), then moved to the default device
        ids = torch.randint(model_cfg.vocab_size, shape, generator=gen, device="cpu").to(torch.get_default_device())
        # clone: .contiguous() keeps the (seq + 1) row stride when micro_batch_size is 1, and the ops
        # would then differ from the traced ones (the tracer's tokens are fresh tensors)
        dense = torch.contiguous_format
        return ids[:, :-1].clone(memory_format=dense), ids[:, 1:].clone(memory_format=dense)

    return batch
