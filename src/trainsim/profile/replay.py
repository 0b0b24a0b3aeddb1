"""Rebuild one traced op as a runnable call: real tensors of the traced shapes, strides and dtypes.

Floating-point inputs are filled with values in [0.5, 1) (no NaN from log/sqrt/div), integer and
boolean inputs with zeros (valid indices for embedding/gather/scatter, all-false masks).
Ops that cannot be rebuilt raise ReplayError with the reason; the stage falls back to the
analytical backend for them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from trainsim.errors import ReplayError
from trainsim.trace.recorder import DTYPE_NAMES

DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}  # the recorder's names, reversed
# Kernels only the CPU build has: on a GPU they are timed analytically (the reason is recorded).
CPU_ONLY_OPS = ("_for_cpu",)


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
    if dtype.is_floating_point:
        flat.uniform_(0.5, 1.0)
    else:
        flat.zero_()
    return flat.as_strided(shape, stride)


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


def build_call(row: dict, device: torch.device | str = "cpu") -> Callable[[], Any]:
    """A zero-argument callable that runs the op of one execution-graph/profile row once."""
    device = torch.device(device)
    name = row["op"]
    if not name.startswith("aten::"):
        raise ReplayError(f"{name} is not an aten op (custom or communication op)")
    if device.type != "cpu" and any(tag in name for tag in CPU_ONLY_OPS):
        raise ReplayError(f"{name} is a CPU-only kernel; timed analytically on {device.type}")
    op = resolve_op(name)
    try:
        shapes = json.loads(row["input_shapes"])
        strides = json.loads(row["input_strides"])
        dtypes = row["input_dtypes"].split(",") if row["input_dtypes"] else []
        tensors = [_make_tensor(s, st, d, device) for s, st, d in zip(shapes, strides, dtypes)]
        encoded = json.loads(row["op_args"])
        args = _decode(encoded["args"], tensors, device)
        kwargs = _decode(encoded["kwargs"], tensors, device)

        def call():
            return op(*args, **kwargs)

        call()  # fail here, with the reason, rather than inside the timing loop
    except ReplayError:
        raise
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError) as exc:
        raise ReplayError(f"{name} failed on rebuilt inputs: {str(exc).splitlines()[0]}") from exc
    return call
