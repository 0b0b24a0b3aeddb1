"""Rebuild one traced op as a runnable call: real tensors of the traced shapes, strides and dtypes.

Floating-point inputs are filled with values in [0.5, 1) (no NaN from log/sqrt/div), integer and
boolean inputs with zeros (all-false masks), except the indices of the ops that index a tensor (embedding,
gather, scatter, index_select, index_add, index, index_put), which are spread over the rows they address:
all-zero indices would read one row and, worse on a GPU, pile every atomic add of a scatter onto it.
Ops that cannot be rebuilt raise ReplayError with the reason; the stage falls back to the
analytical backend for them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

import trainsim.workloads.fully_sharded  # noqa: F401  (registers FSDP2's fsdp:: ops, replayed here)
import trainsim.workloads.fused  # noqa: F401  (registers the trainsim:: ops)
import trainsim.workloads.grouped_gemm  # noqa: F401  (registers the grouped GEMM ops, bf16 and FP8)
from trainsim.errors import ReplayError
from trainsim.profile.analytical import kernel_notes
from trainsim.trace.recorder import DTYPE_NAMES

DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}  # the recorder's names, reversed
FP8_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float8_e4m3fn, torch.float8_e5m2,
                                                          torch.float8_e8m0fnu)}
"""8-bit floats (workloads/fp8.py's values, block_scaling.py's E8M0 scales), recorded under torch's own names
(recorder.dtype_name's fallback)."""
FP4_DTYPE = torch.float4_e2m1fn_x2
"""NVFP4 values, two per byte (workloads/block_scaling.py)."""
DTYPES.update(FP8_DTYPES)
DTYPES[str(FP4_DTYPE).removeprefix("torch.")] = FP4_DTYPE
# Kernels only the CPU build has: on a GPU they are timed analytically (the reason is recorded), unless the
# GPU has its own kernel for the same work (DEVICE_ATTENTION).
CPU_ONLY_OPS = ("_for_cpu",)
DEVICE_ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu",
                    "aten::_scaled_dot_product_flash_attention_for_cpu_backward")
"""Traces are made on the CPU, where scaled_dot_product_attention dispatches to the CPU's flash kernel; on a
GPU the same shapes run through scaled_dot_product_attention there (_device_flash_attention)."""
# cite: aten's native_layer_norm_backward signature (arguments 3, 4: mean, rstd)
STATISTICS_IN_FP32 = {"aten::native_layer_norm_backward": (3, 4)}
"""Arguments that are the input's dtype on the CPU and fp32 on a GPU (LayerNorm's saved mean and rstd)."""


def _device_flash_attention(name: str, args: list, kwargs: dict, noted_dropout_p: float = 0.0
                            ) -> Callable[[], Any]:
    """The GPU's attention for a traced CPU flash-attention call of the same shapes: through
    scaled_dot_product_attention, so the dispatcher picks the kernel a real step would run (cuDNN's on H100
    with torch 2.11, faster than the flash-attention-2 op); the backward is timed through autograd. The CPU's
    kernel runs without dropout: the workload notes what the step asks for (kernel_notes' dropout_p)."""
    if kwargs.get("attn_mask") is not None:
        raise ReplayError(f"{name} with an attention mask has no flash kernel on the GPU")
    backward = name.endswith("_backward")
    first = 6 if backward else 3  # where dropout_p and is_causal sit among the positional arguments
    dropout_p = max(args[first] if len(args) > first else kwargs.get("dropout_p", 0.0), noted_dropout_p)
    is_causal = args[first + 1] if len(args) > first + 1 else kwargs.get("is_causal", False)
    # inputs that need gradients, as in a training step (the forward then keeps what its backward needs)
    q, k, v = (t.detach().requires_grad_() for t in (args[1:4] if backward else args[:3]))

    def forward():
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=kwargs.get("scale"),
            enable_gqa=k.shape[1] != q.shape[1])

    if not backward:
        return forward
    out, grad_out = forward(), args[0]
    return lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)


def resolve_op(name: str):
    """'aten::add.Tensor' -> torch.ops.aten.add.Tensor ('aten::mm' -> .default)."""
    namespace, _, rest = name.partition("::")
    op_name, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op_name), overload or "default")
    except (AttributeError, RuntimeError) as exc:
        raise ReplayError(f"op {name} is not available in this torch build") from exc


def _make_tensor(shape: list[int], stride: list[int], dtype_name: str, device: torch.device) -> torch.Tensor:
    if dtype_name not in DTYPES:
        raise ReplayError(f"dtype {dtype_name!r} cannot be materialised; supported: {', '.join(DTYPES)}")
    dtype = DTYPES[dtype_name]
    # fill the underlying storage, then view it with the traced strides (expanded inputs share memory)
    size = 0 if 0 in shape else 1 + sum((n - 1) * st for n, st in zip(shape, stride))
    flat = torch.empty(size, dtype=dtype, device=device)
    if dtype == FP4_DTYPE:  # no fill kernel either: random codes as bytes
        flat = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device).view(dtype)
    elif dtype in FP8_DTYPES.values():  # no random fill kernel for FP8: draw in fp32 and round
        flat = torch.empty(size, device=device).uniform_(0.5, 1.0).to(dtype)
    elif dtype.is_floating_point:
        flat.uniform_(0.5, 1.0)
    else:
        flat.zero_()
    return flat.as_strided(shape, stride)


INDEXED_DIMENSION = ("aten::index_select", "aten::index_add", "aten::index_copy", "aten::gather", "aten::scatter",
                     "aten::scatter_add", "aten::scatter_reduce")
"""Ops whose third argument indexes dimension args[1] of args[0]."""
INDEX_LISTS = ("aten::index", "aten::index_put", "aten::_index_put_impl")
"""Ops whose second argument is a list of indices, the i-th for dimension i of args[0]."""


def _spread(index: Any, bound: int, generator: torch.Generator) -> Any:
    """Integer indices in [0, bound), each value about equally often, in a fixed random order (the rows a step's
    tokens address: embedding rows, experts' token copies). Anything else is left as it is."""
    if not isinstance(index, torch.Tensor) or index.dtype.is_floating_point or index.dtype == torch.bool:
        return index
    values = torch.randperm(index.numel(), generator=generator) % max(int(bound), 1)
    return values.view(index.shape).to(device=index.device, dtype=index.dtype)


def _spread_indices(name: str, args: list) -> list:
    base = name.split(".")[0].rstrip("_")
    generator = torch.Generator().manual_seed(0)
    args = list(args)
    if base in INDEXED_DIMENSION and len(args) > 2:
        args[2] = _spread(args[2], args[0].shape[args[1]], generator)
    elif base == "aten::embedding":
        args[1] = _spread(args[1], args[0].shape[0], generator)
    elif base == "aten::embedding_dense_backward":
        args[1] = _spread(args[1], args[2], generator)
    elif base in INDEX_LISTS:
        args[1] = [_spread(index, args[0].shape[i], generator) for i, index in enumerate(args[1])]
    return args


def _decode(value: Any, tensors: list[torch.Tensor], device: torch.device, key: str = "") -> Any:
    if isinstance(value, dict):
        if "$t" in value:
            return tensors[value["$t"]]
        if "$dtype" in value:
            return DTYPES[value["$dtype"]]
        if "$obj" in value:
            raise ReplayError(f"argument of type {value['$obj']} cannot be materialised")
        return {k: _decode(v, tensors, device, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, tensors, device, key) for v in value]
    if isinstance(value, str):
        if key == "device":
            return device
        if value.startswith("torch."):
            return getattr(torch, value.removeprefix("torch."))
    return value


REPLAYABLE_NAMESPACES = ("aten", "trainsim", "fsdp")
"""torch's ops, the fused ops of workloads/fused.py and FSDP2's copy-in/copy-out ops (not c10d: communication)."""


def rebuild_arguments(row: dict, device: torch.device) -> tuple[list, dict]:
    """The positional and keyword arguments of one traced op, with real tensors on `device`."""
    shapes = json.loads(row["input_shapes"])
    strides = json.loads(row["input_strides"])
    dtypes = row["input_dtypes"].split(",") if row["input_dtypes"] else []
    tensors = [_make_tensor(s, st, d, device) for s, st, d in zip(shapes, strides, dtypes)]
    encoded = json.loads(row["op_args"])
    args = _spread_indices(row["op"], _decode(encoded["args"], tensors, device))
    kwargs = _decode(encoded["kwargs"], tensors, device)
    if device.type != "cpu" and row["op"] in STATISTICS_IN_FP32:
        args = [a.float() if i in STATISTICS_IN_FP32[row["op"]] else a for i, a in enumerate(args)]
    return args, kwargs


def build_call(row: dict, device: torch.device | str = "cpu") -> Callable[[], Any]:
    """A zero-argument callable that runs the op of one execution-graph/profile row once."""
    device = torch.device(device)
    name = row["op"]
    if name.partition("::")[0] not in REPLAYABLE_NAMESPACES:
        raise ReplayError(f"{name} is not a compute op this replay can run (namespaces: "
                          f"{', '.join(REPLAYABLE_NAMESPACES)})")
    on_device = device.type != "cpu"
    if on_device and any(tag in name for tag in CPU_ONLY_OPS) and name not in DEVICE_ATTENTION:
        raise ReplayError(f"{name} is a CPU-only kernel; timed analytically on {device.type}")
    try:
        args, kwargs = rebuild_arguments(row, device)
        if on_device and name in DEVICE_ATTENTION:
            noted = kernel_notes(row.get("op_args", "")).get("dropout_p", 0.0)
            call = _device_flash_attention(name, args, kwargs, noted)
        else:
            op = resolve_op(name)

            def call():
                return op(*args, **kwargs)

        call()  # fail here, with the reason, rather than inside the timing loop
    except ReplayError:
        raise
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError) as exc:
        raise ReplayError(f"{name} failed on rebuilt inputs: {str(exc).splitlines()[0]}") from exc
    return call
