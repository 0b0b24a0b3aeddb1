"""Block-scaled low-precision GEMMs as Transformer Engine (TE) runs them on Hopper and Blackwell: MXFP8, FP8 blockwise
(DeepSeek-V3) and NVFP4. workloads/fp8.py drives them per linear layer; this module holds the formats, the
quantisation kernel and the GEMM, each one recorded op with its real bytes.

Formats (TE transformer_engine/common/recipe, pytorch/tensor/{mxfp8,float8_blockwise,nvfp4}_tensor.py):

* 'mxfp8' (MXFP8BlockScaling, Blackwell only): E4M3 values, one E8M0 (power-of-two, 1 byte) scale per 32
  consecutive elements along the GEMM's reduction dimension, for inputs, weights and gradients alike. A block
  runs along one dimension only, so the copy a backward GEMM reduces over the other dimension cannot be a
  transpose of the forward copy: TE's quantisation kernel reads the tensor once and writes both a row-wise and a
  column-wise quantisation, each with its scales.
* 'blockwise' (Float8BlockScaling, Hopper and later): E4M3 values, fp32 power-of-two scales per 1 x 128 tile
  for inputs and gradients (again a row-wise and a column-wise quantisation) and per 128 x 128 block for
  weights (the column-wise copy is the transpose: the same blocks).
* 'rowwise' (torchao's Float8 rowwise recipe, torchtitan's `float8.recipe_name = "rowwise"`; Hopper and later):
  E4M3 values, one power-of-two fp32 scale per row along the GEMM's reduction dimension for inputs, weights and
  gradients (a block as long as the reduction: block length 0 below), row-wise and column-wise copies as above.
* 'nvfp4' (NVFP4BlockScaling, Blackwell only; parallelism.precision 'fp4'): E2M1 values, two per byte, one E4M3
  scale per 16 elements along the reduction dimension (per 16 x 16 block for weights) times one fp32 scale per
  tensor, from the tensor's amax (a separate amax kernel first, as TE's current scaling). Gradients are rounded
  stochastically; the two operands of the weight-gradient GEMM (the column-wise copies of input and gradient)
  pass a 16-point random Hadamard transform first, which leaves their product unchanged. fprop, dgrad and wgrad
  all run in NVFP4.

No block recipe keeps an amax history, so none all-reduces amaxes after a pass. Torch has no block-scaled GEMM
on the CPU: `block_scaled_mm` dequantises and multiplies in fp32 (the numbers TE's GEMM computes, up to
accumulation order), and is one recorded matmul whose first input's dtype (float8_e4m3fn, float4_e2m1fn_x2)
sets the rate it is priced at (profile/analytical.op_dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import register_flop_formula

# cite: OCP Microscaling Formats (MX) v1.0 (E4M3 max 448; E2M1 values 0, 0.5, 1, 1.5, 2, 3, 4, 6)
E4M3_MAX = 448.0
# cite: OCP Microscaling Formats (MX) v1.0, E2M1 largest magnitude
E2M1_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # cite: OCP Microscaling Formats (MX) v1.0, E2M1 values
FP4_DTYPE = torch.float4_e2m1fn_x2
"""Two E2M1 values per byte (the recorder names it float4_e2m1fn_x2)."""


@dataclass(frozen=True)
class BlockFormat:
    """One recipe's element format and block shapes (rows, columns; columns run along the GEMM's reduction)."""

    name: str
    activation_block: tuple[int, int]
    weight_block: tuple[int, int]
    gradient_block: tuple[int, int]
    stochastic_gradients: bool = False
    hadamard_wgrad: bool = False
    rescaled_backward: bool = False
    """The backward GEMMs (dgrad, wgrad) run unscaled and their output is rescaled in a pass of its own
    (torchao's rowwise recipe: `gemm`'s rescale_output)."""

    @property
    def largest_block(self) -> int:
        return max(*self.activation_block, *self.weight_block, *self.gradient_block)


BLOCK_FORMATS = {
    # cite: TE MXFP8BlockScaling (common/recipe/__init__.py): 1 x 32 blocks, E8M0 scales
    "mxfp8": BlockFormat("mxfp8", (1, 32), (1, 32), (1, 32)),
    # cite: TE Float8BlockScaling defaults x_block_scaling_dim=1, w_block_scaling_dim=2, grad_block_scaling_dim=1
    "blockwise": BlockFormat("blockwise", (1, 128), (128, 128), (1, 128)),
    # cite: TE NVFP4BlockScaling: 1 x 16 blocks, 2D 16 x 16 for weights, stochastic rounding of gradients, RHT on wgrad
    # cite: torchao float8 Float8LinearRecipeName.ROWWISE: axiswise scales along the reduction dim, power of 2
    # cite: torchao float8_ops.addmm_float8_unwrapped: without fast accumulation (Float8LinearConfig's default for
    # grad_input and grad_weight) axiswise scales take the per-tensor cuBLAS kernel and a separate rescale
    "rowwise": BlockFormat("rowwise", (1, 0), (1, 0), (1, 0), rescaled_backward=True),
    "nvfp4": BlockFormat("nvfp4", (1, 16), (16, 16), (1, 16), stochastic_gradients=True, hadamard_wgrad=True),
}
"""The block-scaled recipes (parallelism.fp8_recipe 'mxfp8' / 'blockwise' / 'rowwise', parallelism.precision
'fp4'). A block length of 0 spans the whole dimension (rowwise: one scale per row)."""


def _hadamard16(device: torch.device) -> torch.Tensor:
    """The 16 x 16 Hadamard matrix / 4 (orthonormal), Sylvester's construction (TE also flips the signs of its
    columns at random each step: the same cost, left out)."""
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / 4.0


def _rotated(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] with each run of 16 elements along C times the Hadamard matrix (the random Hadamard transform)."""
    return (x.reshape(*x.shape[:-1], -1, 16) @ _hadamard16(x.device)).reshape(x.shape)


@torch.library.custom_op("trainsim::nvfp4_amax", mutates_args=())
def nvfp4_amax(x: torch.Tensor) -> torch.Tensor:
    """[max |x|, max |Hadamard-transformed x^T|]: the amaxes NVFP4's per-tensor scales come from, of the row-wise
    copy and of the column-wise (wgrad) copy, read in one pass as TE's amax kernel does."""
    x = x.float()
    return torch.stack([x.abs().amax(), _rotated(x.transpose(-2, -1)).abs().amax()])


@nvfp4_amax.register_fake
def _(x):
    return x.new_empty((2,), dtype=torch.float32)


def _whole(block: tuple[int, int], rows: int, cols: int) -> tuple[int, int]:
    """A block's (rows, columns), a length of 0 standing for the whole dimension."""
    return block[0] or rows, block[1] or cols


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [..., R, C] viewed as [..., R/br, br, C/bc, bc]."""
    *lead, rows, cols = x.shape
    br, bc = _whole(block, rows, cols)
    return x.reshape(*lead, rows // br, br, cols // bc, bc)


def _expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Block scales [..., R/br, C/bc] repeated to [..., R, C]."""
    return scale.repeat_interleave(rows // scale.shape[-2], -2).repeat_interleave(cols // scale.shape[-1], -1)


def _e2m1_codes(v: torch.Tensor, stochastic: bool) -> torch.Tensor:
    """|v| <= 6 to E2M1 codes (sign in bit 3), nearest (ties to the lower) or stochastic rounding."""
    grid = torch.tensor(E2M1_GRID, device=v.device)
    mag = v.abs().clamp(max=E2M1_MAX).contiguous()
    upper = torch.bucketize(mag, grid).clamp(max=len(E2M1_GRID) - 1)
    lower = (upper - 1).clamp(min=0)
    lo, hi = grid[lower], grid[upper]
    frac = torch.where(hi > lo, (mag - lo) / (hi - lo).clamp(min=1e-12), torch.zeros_like(mag))
    take_upper = torch.rand_like(mag) < frac if stochastic else frac > 0.5
    codes = torch.where(take_upper, upper, lower).to(torch.uint8)
    return codes | ((v < 0).to(torch.uint8) << 3)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Two E2M1 codes per byte (the first in the low nibble), as float4_e2m1fn_x2."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(FP4_DTYPE)


def _unpack(data: torch.Tensor) -> torch.Tensor:
    """float4_e2m1fn_x2 [..., C/2] -> fp32 values [..., C]."""
    raw = data.view(torch.uint8)
    codes = torch.stack([raw & 0xF, raw >> 4], -1).flatten(-2).long()
    magnitude = torch.tensor(E2M1_GRID, device=data.device)[codes & 7]
    return torch.where(codes >= 8, -magnitude, magnitude)


def _quantize(x: torch.Tensor, fmt: str, block: tuple[int, int], global_amax: torch.Tensor, stochastic: bool,
              hadamard: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, block scales, per-tensor dequantisation factor) of x [..., R, C], blocks along its last dims."""
    x = x.float()
    if hadamard:
        x = _rotated(x)
    blocks = _blocks(x, block)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., R/br, C/bc]
    if fmt == "nvfp4":
        encode = E4M3_MAX * E2M1_MAX / global_amax.float().clamp(min=1e-12)  # TE's s_global
        scale = (amax / E2M1_MAX * encode).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        decode = scale.float() / encode  # value = code * decode
        scaled = blocks / decode.clamp(min=1e-30)[..., :, None, :, None]
        codes = _e2m1_codes(scaled.reshape(x.shape), stochastic)
        return _pack(codes), scale, encode.reciprocal().reshape(())
    # power-of-two scales (MXFP8's E8M0; Float8BlockScaling's default power_2_scale)
    exponent = torch.ceil(torch.log2(amax.clamp(min=1e-30) / E4M3_MAX))
    decode = torch.exp2(exponent)
    data = (blocks / decode[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).reshape(x.shape)
    scale = decode.to(torch.float8_e8m0fnu) if fmt == "mxfp8" else decode
    return data.to(torch.float8_e4m3fn), scale, torch.ones((), device=x.device)


def dequantize(data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of a block-scaled tensor (data [..., R, C] or packed FP4 [..., R, C/2])."""
    values = _unpack(data) if data.dtype == FP4_DTYPE else data.float()
    return values * _expand(scale.float(), *values.shape[-2:]) * global_scale.float()


@torch.library.custom_op("trainsim::quantize_blocks", mutates_args=())
def quantize_blocks(x: torch.Tensor, fmt: str, block_rows: int, block_cols: int, rowwise: bool, columnwise: bool,
                    global_amax: torch.Tensor, stochastic: bool, hadamard_columnwise: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TE's block quantisation kernel: reads x [..., R, C] once and writes the requested copies, each (data,
    block scales, per-tensor factor): row-wise, blocks (block_rows, block_cols) along C; column-wise, x^T
    [..., C, R] with the same blocks, now along R (1D blocks run along the other dimension; square 2D blocks are
    the row-wise ones transposed). A copy not requested is empty (no bytes). global_amax: NVFP4's two amaxes
    (nvfp4_amax), unused by the FP8 formats."""
    empty = (x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=torch.uint8), x.new_ones((), dtype=torch.float32))
    row = _quantize(x, fmt, (block_rows, block_cols), global_amax[0], stochastic, False) if rowwise else empty
    col = (_quantize(x.transpose(-2, -1), fmt, (block_rows, block_cols), global_amax[int(hadamard_columnwise)],
                     stochastic, hadamard_columnwise) if columnwise else empty)
    return tuple(t.contiguous() for t in (*row, *col))  # the layouts register_fake gives (tracing)


SCALE_DTYPES = {"mxfp8": torch.float8_e8m0fnu, "blockwise": torch.float32, "rowwise": torch.float32,
                "nvfp4": torch.float8_e4m3fn}
"""The block scales' storage: E8M0 (1 byte), fp32, E4M3."""


def _copy_like(x: torch.Tensor, fmt: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (data, scales, per-tensor factor) of the shapes `_quantize` returns for x (tracing: fake tensors)."""
    *lead, rows, cols = x.shape
    fp4 = fmt == "nvfp4"
    data = (x.new_empty((*lead, rows, cols // 2), dtype=torch.uint8).view(FP4_DTYPE) if fp4
            else x.new_empty((*lead, rows, cols), dtype=torch.float8_e4m3fn))
    br, bc = _whole(block, rows, cols)
    scale = x.new_empty((*lead, rows // br, cols // bc), dtype=SCALE_DTYPES[fmt])
    return data, scale, x.new_empty((), dtype=torch.float32)


@quantize_blocks.register_fake
def _(x, fmt, block_rows, block_cols, rowwise, columnwise, global_amax, stochastic, hadamard_columnwise):
    empty = (x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=torch.uint8), x.new_empty((), dtype=torch.float32))
    row = _copy_like(x, fmt, (block_rows, block_cols)) if rowwise else empty
    col = _copy_like(x.transpose(-2, -1), fmt, (block_rows, block_cols)) if columnwise else empty
    return (*row, *col)


@torch.library.custom_op("trainsim::block_scaled_mm", mutates_args=())
def block_scaled_mm(a: torch.Tensor, b_t: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                    global_a: torch.Tensor, global_b: torch.Tensor, k: int) -> torch.Tensor:
    """a [m, k] @ b_t [n, k]^T, both block-scaled (packed FP4: [m, k/2], [n, k/2]) -> bf16 [m, n]: cuBLASLt's
    block-scaled GEMM on Hopper / Blackwell, here dequantised and multiplied in fp32."""
    return (dequantize(a, scale_a, global_a) @ dequantize(b_t, scale_b, global_b).t()).to(torch.bfloat16)


@block_scaled_mm.register_fake
def _(a, b_t, scale_a, scale_b, global_a, global_b, k):
    return a.new_empty((a.shape[0], b_t.shape[0]), dtype=torch.bfloat16)


@register_flop_formula([torch.ops.trainsim.block_scaled_mm])
def _block_scaled_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """2 m n k, k the logical reduction length (the op's last argument: FP4 packs two values per byte)."""
    return 2 * a_shape[0] * b_shape[0] * args[-1]


@dataclass(frozen=True)
class BlockQuantized:
    """A tensor as a block recipe keeps it: row-wise copy (for the GEMM reducing over its last dimension) and,
    where a backward GEMM needs it, the column-wise copy (of its transpose)."""

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    data_t: torch.Tensor
    scale_t: torch.Tensor
    global_scale_t: torch.Tensor

    @property
    def rowwise(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.data, self.scale, self.global_scale

    @property
    def columnwise(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.data_t, self.scale_t, self.global_scale_t

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.data_t, self.scale_t))


def quantize(x: torch.Tensor, fmt: BlockFormat, role: str, columnwise: bool = True,
             global_amax: torch.Tensor | None = None, rowwise: bool = True) -> BlockQuantized:
    """x in `fmt` for `role` ('activation', 'weight', 'gradient'): the requested copies (both by default) in one
    kernel. NVFP4 needs the tensor's amaxes (`global_amax`: nvfp4_amax, or its reduction over the ranks that
    gather the tensor)."""
    block = getattr(fmt, f"{role}_block")
    stochastic = fmt.stochastic_gradients and role == "gradient"
    hadamard = fmt.hadamard_wgrad and role != "weight"
    amax = global_amax if global_amax is not None else torch.ones(2, device=x.device)
    return BlockQuantized(*quantize_blocks(x, fmt.name, *block, rowwise, columnwise, amax, stochastic, hadamard))


@torch.library.custom_op("trainsim::scale_rows_columns", mutates_args=())
def scale_rows_columns(y: torch.Tensor, row_scale: torch.Tensor, column_scale: torch.Tensor) -> torch.Tensor:
    """y [m, n] times row_scale [m, 1] times column_scale [n, 1] transposed, in y's dtype: the one kernel
    Inductor makes of torchao's `output *= a_scale * b_scale` after an unscaled GEMM (pytorch/ao#2184)."""
    return (y.float() * row_scale.reshape(-1, 1) * column_scale.reshape(1, -1)).to(y.dtype)


@scale_rows_columns.register_fake
def _(y, row_scale, column_scale):
    return torch.empty_like(y)


def gemm(a: tuple[torch.Tensor, torch.Tensor, torch.Tensor], b_t: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
         bias: torch.Tensor | None = None, rescale_output: bool = False) -> torch.Tensor:
    """a @ b_t^T for two (data, scale, global scale) copies, bf16 out (plus `bias`).

    rescale_output (one scale per row of both operands, BlockFormat.rescaled_backward): torchao finds PyTorch's
    rowwise-scaled CUTLASS kernel too slow without fast accumulation, so it runs the per-tensor cuBLAS kernel
    with unit scales and multiplies the output by the two operands' scales afterwards, one more pass over it."""
    k = a[0].shape[-1] * (2 if a[0].dtype == FP4_DTYPE else 1)
    if rescale_output:
        one = a[1].new_ones(())
        y = block_scaled_mm(a[0], b_t[0], one.expand_as(a[1]), one.expand_as(b_t[1]), a[2], b_t[2], k)
        y = scale_rows_columns(y, a[1], b_t[1])
    else:
        y = block_scaled_mm(a[0], b_t[0], a[1], b_t[1], a[2], b_t[2], k)
    return y + bias if bias is not None else y
