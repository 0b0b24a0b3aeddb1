"""FP8 linear layers as NVIDIA Transformer Engine (TE) runs them under `fp8_autocast`.

What TE does (transformer_engine/pytorch: module/linear.py, quantization.py / fp8.py, common/recipe),
and what this module reproduces with plain torch ops, so the tracer records every kernel it adds:

* Weights and activations stay bf16 (fp32 master weights in the optimizer). Only the GEMMs of the
  transformer's linear layers run in FP8: forward casts the input and the weight to E4M3 with one fp32
  scale per tensor and multiplies them with an FP8 GEMM (bf16 output); backward casts the output
  gradient to E5M2 (the HYBRID format) and computes dgrad and wgrad with FP8 GEMMs. Embedding, output
  layer / loss, attention core and norms stay bf16. Here the GEMM is `torch._scaled_mm` (cuBLASLt's FP8
  GEMM on CUDA, a reference kernel on CPU). Hopper's FP8 GEMM wants both operands K-major, so TE keeps a
  transposed FP8 copy where the backward needs one (the input for wgrad, the weight for dgrad, the
  gradient for wgrad); each is one `clone` of an FP8 tensor here (TE fuses cast and transpose).
* Weight copies: with `is_first_microbatch` (Megatron-Core sets it on each step's first micro-batch) TE
  casts each weight, and its transpose, once per step and keeps them for the step's other micro-batches.
  Here the cache is refreshed when the weight's version counter changes (the optimizer wrote it); the
  cast is marked once-per-step for the recorder. The copies are 2 bytes per weight element
  (`fp8_weight_bytes`). With MXFP8 and parallelism.fp8_param_gather under the distributed optimizer the copies
  are the weights (Megatron's --fp8-param-gather with reuse_grad_buf_for_mxfp8_param_ag: the updated weights are
  all-gathered in bf16 through the gradient buffer, then quantised into the MXFP8 parameters): the same casts and
  bytes on the wire, but no bf16 weight held between steps (`cast_weight_bytes`).
* DelayedScaling ('delayed', TE's default recipe: amax_history_len=1024, amax_compute_algo='max',
  margin=0): a tensor is cast with a scale computed from the amax history of earlier casts; the cast
  kernel records the tensor's amax as it reads it. The amaxes of all FP8 tensors of a forward pass are
  all-reduced (MAX) in one message when the outermost `fp8_autocast` exits
  (FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True)), those of a backward pass at the
  end of the backward of the pass's first FP8 module (`reduce_and_update_bwd_fp8_tensors`); then every
  scale is updated from its history (scale = fp8_max / max(history) / 2^margin, unchanged where the amax
  is 0) and the history rolls by one. The group is `fp8_group`: Megatron-LM passes its amax-reduction
  group, the data-parallel x tensor-parallel ranks of one pipeline stage (parallel_state.py, "Build the
  amax-reduction groups"). So there is one amax all-reduce per forward and per backward pass of every
  model chunk and micro-batch, not one per step. Here the amax is one `linalg_vector_norm(ord=inf)` op
  writing into the history (TE fuses it into the cast: one extra read of the tensor here).
* Float8CurrentScaling ('current'): each cast first computes its tensor's amax (a separate kernel in TE
  too), derives the scale from it (no history, no amax all-reduce), then casts. Tensors that are
  all-gathered in FP8 (sequence-parallel inputs under tp_comm_overlap) reduce their amax over the tp
  group first, so every shard has the same scale, as TE's quantizers with amax reduction do.

Megatron-Core's TE layer spec runs the input norms inside linear_qkv and linear_fc1 (TE's LayerNormLinear), whose
norm kernel writes its output in FP8 under delayed scaling: those two casts are noted fused with the norm.

Sequence parallelism all-gathers the column-parallel linears' input in FP8 under the per-tensor recipes: each
shard is cast with one scale over the tp group, then the FP8 bytes travel (half of bf16's), as TE's
gather_along_first_dim with a quantizer and torchao's Float8ColwiseParallel / PrepareFloat8ModuleInput do; with
tp_comm_overlap the ring exchange carries the FP8 blocks, as TE's userbuffers do. The block-scaled recipes gather
bf16 and cast after (torchtitan's rowwise recipe does; TE's MXFP8 gather is not built). The row-parallel linears'
backward gathers the output gradient in FP8 under TE (grad_output_preprocess with a quantizer), in bf16 under
torchao (Fp8Settings.gathers_gradients). FP8 tensors travel over c10d as uint8 views (NCCL and gloo have no FP8
type; TE does the same).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainsim.config.choices import FP8_RECIPES
from trainsim.workloads import block_scaling
from trainsim.workloads.block_overlap import BlockOverlappedColumnLinear, BlockOverlappedRowLinear
from trainsim.workloads.block_scaling import BLOCK_FORMATS, BlockQuantized
from trainsim.workloads.collectives import reduce_scatter_flat
from trainsim.workloads.grouped_gemm import fp8_grouped_mm, fp8_grouped_mm_weight_grad
from trainsim.workloads.observe import observer
from trainsim.workloads.rings import (
    gather_tokens,
    ring_all_gather_matmul,
    ring_matmul_reduce_scatter,
    start_all_gather_tokens,
    start_reduce_scatter_tokens,
    wait_all,
)

FORWARD_DTYPE = torch.float8_e4m3fn
"""Inputs and weights (HYBRID format: E4M3 forward, more mantissa)."""
BACKWARD_DTYPE = torch.float8_e5m2
"""Output gradients (HYBRID format: E5M2 backward, more range)."""
# cite: OCP 8-bit floating point specification (E4M3 max 448, E5M2 max 57,344)
FP8_MAX = {FORWARD_DTYPE: 448.0, BACKWARD_DTYPE: 57344.0}
# cite: Transformer Engine DelayedScaling's default amax_history_len
AMAX_HISTORY_LEN = 1024
"""TE DelayedScaling's default amax_history_len."""


@dataclass(frozen=True)
class Fp8Settings:
    """What one rank's FP8 layers need: the recipe and the amax reduction group (None: no reduction)."""

    recipe: str
    amax_group: object | None = None
    history_len: int = AMAX_HISTORY_LEN
    cache_weights: bool = True
    """Keep each weight's FP8 copy from the step's first micro-batch (TE's is_first_microbatch); False under
    FSDP, where a weight exists only while its unit is gathered: it is cast at every use, as torchao's
    Float8Linear does under torchtitan's FSDP."""
    gathers_gradients: bool = True
    """A sequence-parallel row-parallel linear's backward all-gathers its output gradient in FP8 (TE's
    grad_output_preprocess with a quantizer); False: in bf16, cast after (torchao's Float8RowwiseParallel casts the
    gradient below the gather)."""


def fp8_settings(par, amax_group, transformer_engine: bool = True) -> Fp8Settings | None:
    """The FP8 settings of a rank (None unless parallelism.precision is 'fp8' or 'fp4', whose recipe is 'nvfp4');
    amax_group: its group of kind 'amax' (parallel/layout.py), used by the delayed recipe when it has more than
    one rank; transformer_engine: the stack runs TE's linears (False: torchao's, torchtitan)."""
    if par.precision == "fp4":
        return Fp8Settings("nvfp4", gathers_gradients=transformer_engine)
    if par.precision != "fp8":
        return None
    if par.fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"parallelism.fp8_recipe={par.fp8_recipe!r}; accepted: {', '.join(FP8_RECIPES)}")
    reduce = par.fp8_recipe == "delayed" and par.dp * par.cp * par.tp > 1
    return Fp8Settings(par.fp8_recipe, amax_group if reduce else None, cache_weights=par.zero_stage < 2,
                       gathers_gradients=transformer_engine)


def _amax(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """max |x| in fp32, one read of x."""
    return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32, out=out)


def cast_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FORWARD_DTYPE) -> torch.Tensor:
    """x * scale rounded to `dtype` (saturating), one kernel."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    return torch.mul(x, scale, out=out)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """t's last two dimensions transposed, contiguous: the copy the backward's GEMMs need K-major. TE's
    cast_transpose writes it in the same pass as the cast that produced `t` (one read of the input for both),
    so the kernel model is told its work is fused into that cast."""
    with observer().kernel_notes(fused=1):
        return t.transpose(-2, -1).contiguous()


class Fp8Region:
    """The FP8 state of one model chunk: TE's fp8_meta of its linears and its `fp8_autocast` region.

    Delayed scaling keeps one amax history and one scale per FP8 tensor, stacked per direction (forward:
    input and weight of each linear; backward: output gradient), so a reduction is one all-reduce of the
    history's current row, as TE's concatenated global amax buffer.
    """

    def __init__(self, settings: Fp8Settings):
        self.settings = settings
        self.delayed = settings.recipe == "delayed"
        self.block = BLOCK_FORMATS.get(settings.recipe)
        """The block-scaled format (workloads/block_scaling.py), None for the per-tensor recipes."""
        self.num_linears = 0
        self._first_pending = False
        self.history: dict[bool, torch.Tensor] = {}  # forward? -> [history_len, tensors] fp32
        self.scale: dict[bool, torch.Tensor] = {}
        self.fp8_max: dict[bool, torch.Tensor] = {}

    def register(self) -> int:
        """A new linear's index (call while building, before `allocate`)."""
        self.num_linears += 1
        return self.num_linears - 1

    def allocate(self) -> None:
        """Amax histories and scales (delayed scaling: start at amax 0, scale 1, as TE)."""
        if not self.delayed or not self.num_linears:
            return
        for forward, tensors in ((True, 2 * self.num_linears), (False, self.num_linears)):
            self.history[forward] = torch.zeros(self.settings.history_len, tensors, dtype=torch.float32)
            self.scale[forward] = torch.ones(tensors, dtype=torch.float32)
            self.fp8_max[forward] = torch.full((tensors,), FP8_MAX[FORWARD_DTYPE if forward else BACKWARD_DTYPE])

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """TE's fp8_autocast around a chunk's forward: the first FP8 linear run inside it triggers the backward
        amax reduction at the end of its backward; leaving it reduces the forward amaxes."""
        self._first_pending = True
        try:
            yield
        finally:
            self._first_pending = False
        self.reduce_and_update(forward=True)

    def claim_first(self) -> bool:
        first, self._first_pending = self._first_pending, False
        return first

    def quantize(self, x: torch.Tensor, forward: bool, slot: int, tp_group=None,
                 from_norm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(x in FP8, the inverse scale for the GEMM). `slot`: the tensor's row in this direction's history;
        `tp_group`: reduce a current-scaling amax over it (shards gathered in FP8 must share one scale);
        `from_norm`: x is a norm's output, which TE's LayerNormLinear writes in FP8 from the norm kernel itself
        under delayed scaling (the scale is known beforehand), so the cast is noted fused."""
        dtype = FORWARD_DTYPE if forward else BACKWARD_DTYPE
        if self.delayed:
            with observer().kernel_notes(fused=1):  # recorded for the next scale (TE: inside the cast kernel)
                _amax(x, out=self.history[forward][0, slot])
            scale = self.scale[forward][slot]
        else:
            amax = _amax(x)
            if tp_group is not None:
                with observer().communication():
                    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp_group)
            scale = amax.clamp(min=1e-12).reciprocal().mul(FP8_MAX[dtype])
        with observer().kernel_notes(fused=1) if from_norm and self.delayed else contextlib.nullcontext():
            x_fp8 = cast_fp8(x, scale, dtype)
        return x_fp8, scale.reciprocal()

    def quantize_blocks(self, x: torch.Tensor, role: str, tp_group=None, columnwise: bool = True,
                        rowwise: bool = True) -> BlockQuantized:
        """x in the block recipe's format, the copies asked for (both by default) from one quantisation kernel.
        NVFP4 first reads the tensor's amax for its per-tensor scale (a separate kernel in TE), reduced over
        `tp_group` where shards are gathered quantised."""
        amax = None
        if self.block.name == "nvfp4":
            amax = block_scaling.nvfp4_amax(x)
            if tp_group is not None:
                with observer().communication():
                    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp_group)
        return block_scaling.quantize(x, self.block, role, columnwise, amax, rowwise)

    def backward_gemm(self, a: tuple, b_t: tuple) -> torch.Tensor:
        """A backward (dgrad or wgrad) block-scaled GEMM, with the output rescale pass where the recipe has one."""
        return block_scaling.gemm(a, b_t, rescale_output=self.block.rescaled_backward)

    def reduce_and_update(self, forward: bool) -> None:
        """Delayed scaling: all-reduce (MAX) this direction's current amaxes over the amax group, then new
        scales from the histories and roll them (TE's reduce_and_update_fp8_tensors)."""
        if not self.delayed or not self.num_linears:
            return
        history, scale = self.history[forward], self.scale[forward]
        if self.settings.amax_group is not None:
            with observer().communication():
                dist.all_reduce(history[0], op=dist.ReduceOp.MAX, group=self.settings.amax_group)
        amax = history.amax(dim=0)
        scale.copy_(torch.where(amax > 0, self.fp8_max[forward] / amax, scale))  # margin 0
        history.copy_(history.roll(-1, 0))
        history[0].zero_()


class Fp8Linear:
    """The FP8 state of one linear layer: its slots in the chunk's region and its cached FP8 weight."""

    def __init__(self, region: Fp8Region, tp_group=None):
        self.region = region
        self.index = region.register()
        self.tp_group = tp_group
        self.input_from_norm = False
        """Set by the layer when its input is a norm's output (TE's LayerNormLinear: qkv and the first MLP linear)."""
        self._weight_version: int | None = None
        self._weight: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._source_bytes = 0  # the high-precision weight the cached copies were cast from
        self.gathered_scale = None
        """With FP8 all-gathers (fully_sharded.Fp8GatherScales): () -> the scale the weight was gathered in FP8
        with; the weight then arrives in FP8 and needs no cast kernel."""

    def quantize_input(self, x: torch.Tensor, gathered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return self.region.quantize(x, True, 2 * self.index, self.tp_group if gathered else None,
                                    self.input_from_norm)

    def quantize_grad(self, g: torch.Tensor, gathered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return self.region.quantize(g, False, self.index, self.tp_group if gathered else None)

    def block_weight(self, weight: torch.Tensor) -> BlockQuantized:
        """The weight in the block recipe's format, both copies (fprop and dgrad), cast once per step; at every use
        without the cache (FSDP gathers the high-precision weight for each use)."""
        if not self.region.settings.cache_weights:
            with torch.no_grad():
                return self.region.quantize_blocks(weight.detach(), "weight")
        if self._weight is None or self._weight_version != weight._version:
            with observer().once_per_step(), torch.no_grad():
                self._weight = self.region.quantize_blocks(weight.detach(), "weight")
            self._weight_version, self._source_bytes = weight._version, weight.numel() * weight.element_size()
        return self._weight

    def weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(W, W^T contiguous, inverse scale) in FP8, cast when the weight changed since the last cast: once
        per step, on its first micro-batch (TE with is_first_microbatch); at every use without the cache (FSDP);
        never where the weight was all-gathered in FP8 (its bytes are the FP8 weight: the cast here is noted
        fused, only the transposed copy the backward's GEMM needs K-major is a kernel of its own)."""
        if self.gathered_scale is not None:
            scale = self.gathered_scale()
            with torch.no_grad():
                with observer().kernel_notes(fused=1):
                    w_fp8 = cast_fp8(weight.detach(), scale, FORWARD_DTYPE)
                return w_fp8, w_fp8.transpose(-2, -1).contiguous(), scale.reciprocal()
        if not self.region.settings.cache_weights:
            with torch.no_grad():
                w_fp8, scale_inv = self.region.quantize(weight.detach(), True, 2 * self.index + 1)
                return w_fp8, _transposed(w_fp8), scale_inv
        if self._weight is None or self._weight_version != weight._version:
            with observer().once_per_step(), torch.no_grad():
                w_fp8, scale_inv = self.region.quantize(weight.detach(), True, 2 * self.index + 1)
                self._weight = w_fp8, _transposed(w_fp8), scale_inv
            self._weight_version, self._source_bytes = weight._version, weight.numel() * weight.element_size()
        return self._weight

    def kept_for_backward(self, weight: torch.Tensor, cast: tuple) -> tuple | torch.Tensor:
        """What the backward's GEMMs take their FP8 weight from: the step's cached copies, or, without the cache
        (FSDP), the weight itself, cast again in backward (torchao saves the high-precision weight: FSDP frees the
        gathered weights after forward and gathers them again, so no FP8 copy is held in between)."""
        return cast if self.region.settings.cache_weights else weight

    def for_backward(self, kept: tuple | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(W, W^T, inverse scale) in FP8 for the backward, from what kept_for_backward returned."""
        return kept if isinstance(kept, tuple) else self.weight(kept)

    def block_for_backward(self, kept: BlockQuantized | torch.Tensor) -> BlockQuantized:
        """The block-scaled weight for the backward, from what kept_for_backward returned (block_weight's copies,
        or without the cache the weight itself, quantised again)."""
        return kept if isinstance(kept, BlockQuantized) else self.block_weight(kept)

    def cached_bytes(self) -> int:
        if isinstance(self._weight, BlockQuantized):
            return self._weight.nbytes()
        return sum(t.numel() * t.element_size() for t in self._weight) if self._weight else 0


def _fp8_linears(module: torch.nn.Module) -> list[Fp8Linear]:
    return [v for m in module.modules() for v in vars(m).values() if isinstance(v, Fp8Linear)]


def fp8_weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the FP8 weight copies (and transposes) the linears and experts of `module` hold between
    micro-batches."""
    return sum(linear.cached_bytes() for linear in _fp8_linears(module))


def cast_weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the high-precision weights the FP8 copies of `module` were cast from (not held where the FP8 copies
    are the parameters: MXFP8 with parallelism.fp8_param_gather)."""
    return sum(linear._source_bytes for linear in _fp8_linears(module) if linear.cached_bytes())


def _gemm(a: torch.Tensor, b_t: torch.Tensor, scale_a, scale_b, out_dtype, bias=None, out=None) -> torch.Tensor:
    """a @ b_t.t() in FP8: `a` row-major [m, k], `b_t` row-major [n, k] (so the second operand is K-major)."""
    return torch._scaled_mm(a, b_t.t(), scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype, out=out)


class _Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with FP8 GEMMs in forward (fprop) and backward (dgrad, wgrad), as TE's _Linear."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8: Fp8Linear):
        shape = x.shape
        x_fp8, x_inv = fp8.quantize_input(x.reshape(-1, shape[-1]))
        w_fp8, w_t_fp8, w_inv = fp8.weight(weight)
        y = _gemm(x_fp8, w_fp8, x_inv, w_inv, x.dtype, bias=bias)
        ctx.save_for_backward(_transposed(x_fp8), x_inv)  # the FP8 input, K-major for wgrad
        ctx.fp8, ctx.weights = fp8, fp8.kept_for_backward(weight, (w_fp8, w_t_fp8, w_inv))  # not an activation
        ctx.shape, ctx.has_bias = shape, bias is not None
        ctx.reduce_backward = fp8.region.claim_first()
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x_t_fp8, x_inv = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        g_fp8, g_inv = ctx.fp8.quantize_grad(g)
        _, weight_t, weight_inv = ctx.fp8.for_backward(ctx.weights)
        dgrad = _gemm(g_fp8, weight_t, g_inv, weight_inv, grad.dtype)
        wgrad = _gemm(_transposed(g_fp8), x_t_fp8, g_inv, x_inv, grad.dtype)
        dbias = g.sum(0) if ctx.has_bias else None
        if ctx.reduce_backward:
            ctx.fp8.region.reduce_and_update(forward=False)
        return dgrad.view(*ctx.shape), wgrad, dbias, None


class _BlockLinearFunction(torch.autograd.Function):
    """y = x W^T + b with block-scaled GEMMs (workloads/block_scaling.py): fprop on the row-wise copies of x and
    W, dgrad on the gradient's row-wise and W's column-wise copy, wgrad on the column-wise copies of gradient and
    x. The column-wise copy of x is what is saved for the backward (TE saves no high-precision input)."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8: Fp8Linear):
        shape = x.shape
        q = fp8.region.quantize_blocks(x.reshape(-1, shape[-1]), "activation")
        w = fp8.block_weight(weight)
        y = block_scaling.gemm(q.rowwise, w.rowwise, bias)
        ctx.save_for_backward(*q.columnwise)
        ctx.fp8, ctx.weight_q, ctx.shape, ctx.has_bias = fp8, fp8.kept_for_backward(weight, w), shape, bias is not None
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x_t = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gq = ctx.fp8.region.quantize_blocks(g, "gradient")
        w = ctx.fp8.block_for_backward(ctx.weight_q)
        dgrad = ctx.fp8.region.backward_gemm(gq.rowwise, w.columnwise)
        wgrad = ctx.fp8.region.backward_gemm(gq.columnwise, x_t)
        dbias = g.sum(0) if ctx.has_bias else None
        return dgrad.view(*ctx.shape), wgrad, dbias, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: Fp8Linear) -> torch.Tensor:
    if fp8.region.block is not None:
        return _BlockLinearFunction.apply(x, weight, bias, fp8)
    return _Fp8LinearFunction.apply(x, weight, bias, fp8)


class _Fp8ExpertsFunction(torch.autograd.Function):
    """x [T, k] times each local expert's weight ([E, k, n], expert e on its counts[e] rows) with FP8 grouped
    GEMMs in forward, dgrad and wgrad, as TE's GroupedLinear. The tokens are cast once with one scale (TE keeps
    one per expert, cast by one multi-tensor kernel: the same bytes), the weights once per step with their
    transposes (Fp8Linear.weight), the output gradient once in backward."""

    @staticmethod
    def forward(ctx, x, weight, counts, fp8: Fp8Linear):
        x_fp8, x_inv = fp8.quantize_input(x)
        w_fp8, w_t_fp8, w_inv = fp8.weight(weight)
        y = fp8_grouped_mm(x_fp8, w_t_fp8, x_inv, w_inv, counts)
        ctx.save_for_backward(_transposed(x_fp8), x_inv)  # the FP8 tokens, K-major for wgrad
        ctx.fp8, ctx.weights, ctx.counts = fp8, fp8.kept_for_backward(weight, (w_fp8, w_t_fp8, w_inv)), counts
        ctx.reduce_backward = fp8.region.claim_first()
        return y

    @staticmethod
    def backward(ctx, grad):
        x_t_fp8, x_inv = ctx.saved_tensors
        g_fp8, g_inv = ctx.fp8.quantize_grad(grad.contiguous())
        weight, _, weight_inv = ctx.fp8.for_backward(ctx.weights)
        dgrad = fp8_grouped_mm(g_fp8, weight, g_inv, weight_inv, ctx.counts)
        wgrad = fp8_grouped_mm_weight_grad(x_t_fp8, _transposed(g_fp8), x_inv, g_inv, ctx.counts)
        if ctx.reduce_backward:
            ctx.fp8.region.reduce_and_update(forward=False)
        return dgrad, wgrad, None, None


class _BlockExpertsFunction(torch.autograd.Function):
    """_Fp8ExpertsFunction with block-scaled operands (MXFP8, blockwise): the grouped GEMMs take block scales.
    The experts' weights [E, k, n]: fprop reduces over k (the column-wise copy, [E, n, k]), dgrad over n (the
    row-wise copy)."""

    @staticmethod
    def forward(ctx, x, weight, counts, fp8: Fp8Linear):
        q = fp8.region.quantize_blocks(x, "activation")
        w = fp8.block_weight(weight)
        y = fp8_grouped_mm(q.data, w.data_t, q.scale, w.scale_t, counts)
        ctx.save_for_backward(q.data_t, q.scale_t)
        ctx.fp8, ctx.weight_q, ctx.counts = fp8, w, counts
        return y

    @staticmethod
    def backward(ctx, grad):
        x_t, x_scale_t = ctx.saved_tensors
        gq = ctx.fp8.region.quantize_blocks(grad.contiguous(), "gradient")
        dgrad = fp8_grouped_mm(gq.data, ctx.weight_q.data, gq.scale, ctx.weight_q.scale, ctx.counts)
        wgrad = fp8_grouped_mm_weight_grad(x_t, gq.data_t, x_scale_t, gq.scale_t, ctx.counts)
        return dgrad, wgrad, None, None


def fp8_experts(x: torch.Tensor, weight: torch.Tensor, counts: list[int], fp8: Fp8Linear) -> torch.Tensor:
    if fp8.region.block is not None:
        return _BlockExpertsFunction.apply(x, weight, counts, fp8)
    return _Fp8ExpertsFunction.apply(x, weight, counts, fp8)


class _Fp8OverlappedColumnLinear(torch.autograd.Function):
    """FP8 twin of tensor_parallel._OverlappedColumnLinear: the token shard is cast to FP8 and the ring
    carries FP8 blocks (TE userbuffers' all-gather overlap); backward casts the output gradient once, runs
    dgrad whole while the FP8 shard kept from forward is all-gathered again (TE's bulk dgrad overlap: it keeps the
    shard, not the gathered input), then reduce-scatters dgrad (bf16) in bulk behind wgrad on the gathered input.
    Without `bulk_backward` (model.tp_overlap_backward 'none': torch's micro-pipelined async TP) the gathered
    input is kept from the ring and dgrad is reduce-scattered before wgrad runs."""

    @staticmethod
    def forward(ctx, x, weight, fp8: Fp8Linear, group, tp, bulk_backward=True):
        x_fp8, x_inv = fp8.quantize_input(x.contiguous(), gathered=True)
        w_fp8, w_t_fp8, w_inv = fp8.weight(weight)
        out, gathered = ring_all_gather_matmul(
            x_fp8, w_fp8, group, tp, out_dtype=x.dtype,
            mm=lambda block, out: _gemm(block, w_fp8, x_inv, w_inv, x.dtype, out=out))
        ctx.save_for_backward(x_fp8 if bulk_backward else gathered.t().contiguous(), x_inv)
        ctx.fp8, ctx.group, ctx.tp, ctx.bulk_backward = fp8, group, tp, bulk_backward
        ctx.weights = fp8.kept_for_backward(weight, (w_fp8, w_t_fp8, w_inv))
        ctx.reduce_backward = fp8.region.claim_first()
        return out

    @staticmethod
    def backward(ctx, grad):
        kept, x_inv = ctx.saved_tensors
        if ctx.bulk_backward:
            gathered, gathering = start_all_gather_tokens(kept, ctx.group, ctx.tp)
        g_fp8, g_inv = ctx.fp8.quantize_grad(grad.contiguous())
        _, weight_t, weight_inv = ctx.fp8.for_backward(ctx.weights)
        grad_input = _gemm(g_fp8, weight_t, g_inv, weight_inv, grad.dtype)
        if ctx.bulk_backward:
            wait_all(gathering)
            kept = gathered.t().contiguous()  # K-major for wgrad
        grad_x, scattering = start_reduce_scatter_tokens(grad_input, ctx.group, ctx.tp, ctx.bulk_backward)
        wgrad = _gemm(g_fp8.t().contiguous(), kept, g_inv, x_inv, grad.dtype)
        wait_all(scattering)
        if ctx.reduce_backward:
            ctx.fp8.region.reduce_and_update(forward=False)
        return grad_x, wgrad, None, None, None, None


class _Fp8OverlappedRowLinear(torch.autograd.Function):
    """FP8 twin of tensor_parallel._OverlappedRowLinear: FP8 GEMM per token block into the ring
    reduce-scatter (bf16 partial sums); backward all-gathers the FP8 output gradient around the ring."""

    @staticmethod
    def forward(ctx, x, weight, fp8: Fp8Linear, group, tp):
        x_fp8, x_inv = fp8.quantize_input(x.contiguous())
        w_fp8, w_t_fp8, w_inv = fp8.weight(weight)
        y = ring_matmul_reduce_scatter(x_fp8, w_fp8, group, tp,
                                       mm=lambda block: _gemm(block, w_fp8, x_inv, w_inv, x.dtype))
        ctx.save_for_backward(x_fp8.t().contiguous(), x_inv)
        ctx.fp8, ctx.group, ctx.tp = fp8, group, tp
        ctx.weights = fp8.kept_for_backward(weight, (w_fp8, w_t_fp8, w_inv))
        ctx.reduce_backward = fp8.region.claim_first()
        return y

    @staticmethod
    def backward(ctx, grad):
        x_t_fp8, x_inv = ctx.saved_tensors
        g_fp8, g_inv = ctx.fp8.quantize_grad(grad.contiguous(), gathered=True)
        _, weight_t, weight_inv = ctx.fp8.for_backward(ctx.weights)
        grad_x, gathered = ring_all_gather_matmul(
            g_fp8, weight_t, ctx.group, ctx.tp, out_dtype=grad.dtype,
            mm=lambda block, out: _gemm(block, weight_t, g_inv, weight_inv, grad.dtype, out=out))
        wgrad = _gemm(gathered.t().contiguous(), x_t_fp8, g_inv, x_inv, grad.dtype)
        if ctx.reduce_backward:
            ctx.fp8.region.reduce_and_update(forward=False)
        return grad_x, wgrad, None, None, None


class _Fp8GatheredColumnLinears(torch.autograd.Function):
    """Sequence-parallel column-parallel linears over one input, FP8 per-tensor recipes, without the overlap rings:
    the token shard is cast to FP8 with the tp group's amax and all-gathered in FP8, then each weight's GEMM reads the
    one gathered input (torchtitan's separate wq, wk, wv share it; Megatron's fused qkv is one weight). Backward: each
    weight's output-gradient slice is cast (the last weight first, as autograd runs them), the dgrads summed and
    reduce-scattered (bf16), the wgrads run on the gathered input. With `bulk_backward` (TE, Megatron-LM) the FP8
    shard is kept and all-gathered again behind the dgrad GEMMs, and the reduce-scatter runs behind the wgrad GEMMs;
    without it (torch's DTensor) the gathered input is kept, each linear runs its dgrad and wgrad in turn, and the
    reduce-scatter is waited for."""

    @staticmethod
    def forward(ctx, x, fp8s: list[Fp8Linear], group, tp, bulk_backward, *weights):
        lead = fp8s[0]  # the one cast of the shared input
        x_fp8, x_inv = lead.quantize_input(x.contiguous(), gathered=True)
        gathered = gather_tokens(x_fp8, group, tp)
        casts = [fp8.weight(w) for fp8, w in zip(fp8s, weights)]
        outputs = [_gemm(gathered, w_fp8, x_inv, w_inv, x.dtype) for w_fp8, _, w_inv in casts]
        ctx.save_for_backward(x_fp8 if bulk_backward else gathered.t().contiguous(), x_inv)
        ctx.fp8s, ctx.group, ctx.tp, ctx.bulk_backward = fp8s, group, tp, bulk_backward
        ctx.weights = [fp8.kept_for_backward(w, cast) for fp8, w, cast in zip(fp8s, weights, casts)]
        ctx.widths = [w.shape[0] for w in weights]
        ctx.reduce_backward = lead.region.claim_first()
        if len(outputs) == 1:
            return outputs[0]
        with observer().kernel_notes(fused=1):  # each GEMM writes its slice of one output (as SeparateColumnLinears)
            return torch.cat(outputs, -1)

    @staticmethod
    def backward(ctx, grad):
        kept, x_inv = ctx.saved_tensors
        if ctx.bulk_backward:
            gathered, gathering = start_all_gather_tokens(kept, ctx.group, ctx.tp)
        grad_input, wgrads, cast = None, {}, []
        # the last projection's backward first, each input gradient added to the sum (as autograd orders them)
        for j in reversed(range(len(ctx.fp8s))):
            g_fp8, g_inv = ctx.fp8s[j].quantize_grad(grad.narrow(-1, sum(ctx.widths[:j]), ctx.widths[j]))
            _, weight_t, weight_inv = ctx.fp8s[j].for_backward(ctx.weights[j])
            dgrad = _gemm(g_fp8, weight_t, g_inv, weight_inv, grad.dtype)
            grad_input = dgrad if grad_input is None else grad_input.add_(dgrad)
            cast.append((j, g_fp8.t().contiguous(), g_inv))
            if not ctx.bulk_backward:  # each linear's own backward: dgrad then wgrad
                wgrads[j] = _gemm(cast[-1][1], kept, g_inv, x_inv, grad.dtype)
        if ctx.bulk_backward:
            wait_all(gathering)
            kept = gathered.t().contiguous()  # K-major for wgrad
        grad_x, scattering = start_reduce_scatter_tokens(grad_input, ctx.group, ctx.tp, ctx.bulk_backward)
        for j, g_t, g_inv in cast if ctx.bulk_backward else ():
            wgrads[j] = _gemm(g_t, kept, g_inv, x_inv, grad.dtype)
        wait_all(scattering)
        if ctx.reduce_backward:
            ctx.fp8s[0].region.reduce_and_update(forward=False)
        return grad_x, None, None, None, None, *(wgrads[j] for j in range(len(ctx.fp8s)))


class _Fp8GatheredGradientRowLinear(torch.autograd.Function):
    """Sequence-parallel row-parallel linear in FP8 (per-tensor recipes) without the overlap rings, as TE runs it:
    forward GEMM, its partial sums reduce-scattered (bf16); backward casts this rank's output-gradient shard with the
    tp group's amax and all-gathers it in FP8 (grad_output_preprocess), then dgrad and wgrad on the gathered copy."""

    @staticmethod
    def forward(ctx, x, weight, fp8: Fp8Linear, group, tp):
        x_fp8, x_inv = fp8.quantize_input(x.contiguous())
        w_fp8, w_t_fp8, w_inv = fp8.weight(weight)
        partial = _gemm(x_fp8, w_fp8, x_inv, w_inv, x.dtype)
        out = partial.new_empty((partial.shape[0] // tp, partial.shape[1]))
        with observer().communication():
            reduce_scatter_flat(out, partial, group=group)
        ctx.save_for_backward(_transposed(x_fp8), x_inv)
        ctx.fp8, ctx.group, ctx.tp = fp8, group, tp
        ctx.weights = fp8.kept_for_backward(weight, (w_fp8, w_t_fp8, w_inv))
        ctx.reduce_backward = fp8.region.claim_first()
        return out

    @staticmethod
    def backward(ctx, grad):
        x_t_fp8, x_inv = ctx.saved_tensors
        g_fp8, g_inv = ctx.fp8.quantize_grad(grad.contiguous(), gathered=True)
        gathered = gather_tokens(g_fp8, ctx.group, ctx.tp)
        _, weight_t, weight_inv = ctx.fp8.for_backward(ctx.weights)
        dgrad = _gemm(gathered, weight_t, g_inv, weight_inv, grad.dtype)
        wgrad = _gemm(gathered.t().contiguous(), x_t_fp8, g_inv, x_inv, grad.dtype)  # TE transposes after the gather
        if ctx.reduce_backward:
            ctx.fp8.region.reduce_and_update(forward=False)
        return dgrad, wgrad, None, None, None


def fp8_gradient_gathered_row_linear(x: torch.Tensor, weight: torch.Tensor, fp8: Fp8Linear, group, tp: int
                                     ) -> torch.Tensor:
    """x [tp t, k] times the row-parallel weight, reduce-scattered to this rank's [t, n]; its gradient gathered in
    FP8 in backward."""
    return _Fp8GatheredGradientRowLinear.apply(x, weight, fp8, group, tp)


def gathers_fp8(fp8: Fp8Linear | None) -> bool:
    """Whether a sequence-parallel column-parallel linear with these FP8 settings all-gathers its input in FP8 (the
    per-tensor recipes; the block-scaled ones gather bf16)."""
    return fp8 is not None and fp8.region.block is None


def fp8_gathered_column_linears(x: torch.Tensor, weights: list[torch.Tensor], fp8s: list[Fp8Linear], group, tp: int,
                                bulk_backward: bool) -> torch.Tensor:
    """The token shard x [t, k] all-gathered in FP8 and multiplied by each weight: [tp t, sum of widths]."""
    return _Fp8GatheredColumnLinears.apply(x, fp8s, group, tp, bulk_backward, *weights)


def fp8_overlapped_column_linear(x, weight, fp8: Fp8Linear, group, tp: int, bulk_backward: bool = True
                                 ) -> torch.Tensor:
    if fp8.region.block is not None:
        return BlockOverlappedColumnLinear.apply(x, weight, fp8, group, tp, bulk_backward)
    return _Fp8OverlappedColumnLinear.apply(x, weight, fp8, group, tp, bulk_backward)


def fp8_overlapped_row_linear(x, weight, fp8: Fp8Linear, group, tp: int) -> torch.Tensor:
    if fp8.region.block is not None:
        return BlockOverlappedRowLinear.apply(x, weight, fp8, group, tp)
    return _Fp8OverlappedRowLinear.apply(x, weight, fp8, group, tp)
