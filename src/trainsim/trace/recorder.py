"""Record every aten op and every collective of one rank's training step as execution-graph events.

A TorchDispatchMode sees each op after autograd (so backward and recomputed forward ops appear as
they run) and each c10d collective or P2P op with its process group. It works the same on fake
tensors with a fake process group (ex-situ tracing) and on real tensors over gloo (the
faithfulness check). Dependencies come from storage: an op depends on the last op that wrote to
any storage it reads, so views and in-place accumulation into gradient buckets are followed.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from trainsim.parallel.layout import EXPERT_GROUP_KINDS, GROUP_KINDS, Layout
from trainsim.parallel.phases import direction_of
from trainsim.workloads.observe import StepObserver

# c10d op name -> (collective name, index of the tensor arg whose bytes are the message size).
# Message size follows nccl-tests: all-gather counts the gathered output, reduce-scatter its input.
C10D_OPS: dict[str, tuple[str, int]] = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "reduce_": ("reduce", 0),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "barrier": ("barrier", -1),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "recv_any_source_": ("recv", 0),
}
# Ops that allocate or reinterpret memory but launch no kernel on a GPU.
NO_KERNEL_OPS = {
    "aten::empty", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided", "aten::empty_like",
    "aten::lift_fresh", "aten::detach", "aten::alias", "aten::_unsafe_view", "aten::set_",
    "aten::resize_", "aten::record_stream",
}
SKIPPED_NAMESPACES = {"prim", "profiler"}
DTYPE_NAMES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.int64: "int64", torch.int32: "int32", torch.bool: "bool", torch.uint8: "uint8", torch.int8: "int8",
}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes of its storage that `t` spans (an empty tensor: one byte at its offset, so it still
    orders against the storage's writers)."""
    start = t.storage_offset() * t.element_size()
    if t.numel() == 0:
        return start, start + 1
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return start, start + span * t.element_size()


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _encode_arg(a: Any, tensors: list[torch.Tensor]) -> Any:
    """JSON form of one op argument; tensors become {'$t': index} into the op's tensor list.

    Markers start with '$' so they cannot be confused with keyword-argument names.
    """
    if isinstance(a, torch.Tensor):
        tensors.append(a)
        return {"$t": len(tensors) - 1}
    if isinstance(a, (list, tuple)):
        return [_encode_arg(x, tensors) for x in a]
    if isinstance(a, dict):
        return {str(k): _encode_arg(x, tensors) for k, x in a.items()}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, torch.dtype):
        return {"$dtype": dtype_name(a)}
    if isinstance(a, (torch.device, torch.layout, torch.memory_format)):
        return str(a)
    return {"$obj": type(a).__name__}


def sdpa_flops(func_name: str, q: torch.Tensor, k: torch.Tensor) -> int:
    """Two matmuls of [s_q x d] by [d x s_k] per head forward; the backward does 2.5x (5 matmuls)."""
    b, h, s_q, d = q.shape
    forward = 4 * b * h * s_q * k.shape[-2] * d
    return int(forward * 2.5) if "backward" in func_name else forward


class StepAllocations:
    """The storages a traced step creates and when each is freed: the step's live bytes over time.

    A storage is new when an op returns a tensor on it that none of the op's inputs shares; views and
    in-place results on it keep it alive too. Python frees a (fake) tensor when its last reference goes
    (autograd's saved tensors keep theirs until backward), and a storage goes with the last tensor on it.
    Storages still alive when the step has ended are model states (gradients, FP8 weight copies), counted
    apart, so they are left out of the transient peak.
    """

    def __init__(self) -> None:
        self._alive: dict[int, list[int]] = {}  # storage key -> [allocation id, tensors on it]
        self._log: list[tuple[int, int]] = []  # (allocation id, +bytes when allocated / -bytes when freed)
        self._bytes: dict[int, int] = {}
        self._ids = itertools.count()
        self._watched: dict[int, weakref.ref] = {}  # the weak references (a dropped one would never call back)
        self.origin: dict[int, tuple[int, int]] = {}
        """allocation id -> (event id of the recorded op that made it, index among the op's tensor outputs)"""

    def note(self, outputs: list[torch.Tensor], input_keys, event: int | None = None) -> None:
        """`input_keys()`: the storage keys of the op's inputs (asked for only when an output's storage is new
        to the step: views and in-place results on tracked storages, the common case, need no look). `event`:
        the id the op's event will have, if it is recorded."""
        inputs = None
        for index, t in enumerate(outputs):
            key = t.untyped_storage()._cdata
            entry = self._alive.get(key)
            if entry is None:
                inputs = input_keys() if inputs is None else inputs
                if key in inputs:  # an input's storage the step did not create (a weight, a buffer)
                    continue
                entry = self._alive[key] = [next(self._ids), 0]
                self._bytes[entry[0]] = t.untyped_storage().nbytes()
                if event is not None:
                    self.origin[entry[0]] = (event, index)
                self._log.append((entry[0], self._bytes[entry[0]]))
            entry[1] += 1
            ref = weakref.ref(t, lambda ref, key=key, allocation=entry[0]: self._release(ref, key, allocation))
            self._watched[id(ref)] = ref

    def _release(self, ref: weakref.ref, key: int, allocation: int) -> None:
        self._watched.pop(id(ref), None)
        entry = self._alive.get(key)
        if entry is None or entry[0] != allocation:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._alive[key]
            self._log.append((allocation, -self._bytes[allocation]))

    def release(self, t: torch.Tensor) -> None:
        """`t`'s storage was resized to nothing: its bytes are free, whatever still refers to it."""
        entry = self._alive.pop(t.untyped_storage()._cdata, None)
        if entry is not None:
            self._log.append((entry[0], -self._bytes[entry[0]]))

    def shrink(self, t: torch.Tensor, nbytes: int) -> None:
        """`t`'s storage counts `nbytes` (a padded copy the GPU's kernel does not make: observer.padded)."""
        entry = self._alive.get(t.untyped_storage()._cdata)
        if entry is not None:
            self._bytes[entry[0]] = nbytes

    def allocation_of(self, t: torch.Tensor) -> int | None:
        """The allocation id of `t`'s storage, if the step made it and it is alive."""
        entry = self._alive.get(t.untyped_storage()._cdata)
        return entry[0] if entry is not None else None

    def sizes(self) -> dict[int, int]:
        """allocation id -> bytes."""
        return dict(self._bytes)

    def peak_transient_bytes(self, sizes: dict[int, int] | None = None) -> int:
        """Most bytes alive at once of the storages freed within the step; `sizes` (allocation id -> bytes) in
        place of the allocations' own (another rank class's, of the same step structure)."""
        persistent = {entry[0] for entry in self._alive.values()}
        sizes = self._bytes if sizes is None else sizes
        live = peak = 0
        for allocation, delta in self._log:
            if allocation not in persistent:
                live += sizes[allocation] if delta > 0 else -sizes[allocation]
                peak = max(peak, live)
        return peak


class ExecutionRecorder(TorchDispatchMode, StepObserver):
    """Collects the events of one rank; install with `observing(recorder)` and `with recorder:`."""

    def __init__(self, layout: Layout, rank: int, time_ops: bool = False):
        super().__init__()
        self.layout, self.rank = layout, rank
        # keep each op's wall time (`wall_s`) in real runs: the in-situ side of a comparison with the
        # kernel profile (benchmarks/compute_accuracy.py); meaningless while tracing
        self.time_ops = time_ops
        self.events: list[dict[str, Any]] = []
        # storage key -> [(first byte, end byte, event id)]: the writes whose bytes no later write has covered
        self._last_writer: dict[int, list[tuple[int, int, int]]] = {}
        self._phase, self._chunk, self._microbatch = "setup", 0, 0
        self._once_per_step = False
        self._in_communication = False
        self._async_op = False
        # the model-parallel and amax groups have the ranks of another kind's group when some degrees are 1
        # (mp = tp when pp = 1, amax = dp when tp = 1, ...): those names win (later entries overwrite)
        # (expert groups first: where one has a dense group's ranks, the dense name wins; MoE code names its own)
        # (HSDP's dp_shard is dp without HSDP: dp wins)
        first = ("dp_replicate", "dp_shard", "amax", "mp")
        kinds = (*EXPERT_GROUP_KINDS, *first, *(k for k in GROUP_KINDS if k not in first))
        self._group_kind = {tuple(layout.group_ranks(rank, k)): k for k in kinds}
        self._named_kind: str | None = None  # the kind the step says it communicates in (observer.communication)
        self._stands_for: tuple | None = None
        self._kernel_notes: dict[str, float] = {}  # observer.kernel_notes: recorded in op_args
        self._group_ranks_cache: dict[int, list[int]] = {}
        self.saved_activation_bytes: dict[int, int] = {}  # chunk -> bytes saved for backward
        # (chunk, allocation id or None if the step did not make it, bytes) of each storage counted there
        self.saved_allocations: list[tuple[int, int | None, int]] = []
        self.allocations = StepAllocations()
        self._saved_storages: dict[int, int] = {}  # storages of micro-batch 0 counted: their saved_allocations entry
        self._real_bytes: dict[int, int] = {}  # padded storages: the bytes the GPU's kernel holds (observer.padded)
        self._storage_refs: dict[int, weakref.ref] = {}  # the storages _last_writer and _saved_storages name

    # -- StepObserver -------------------------------------------------------------------------
    @contextlib.contextmanager
    def section(self, phase: str, chunk: int, microbatch: int) -> Iterator[None]:
        previous = self._phase, self._chunk, self._microbatch
        self._phase, self._chunk, self._microbatch = phase, chunk, microbatch
        # every forward under the hooks, a combined pass's too: a backward unpacks its saved tensors with a detach
        # each where they were packed by a hook, so its ops would depend on how its forward ran
        hooks = (torch.autograd.graph.saved_tensors_hooks(self._on_save, lambda t: t)
                 if direction_of(phase) == "forward" else contextlib.nullcontext())
        try:
            with hooks:
                yield
        finally:
            self._phase, self._chunk, self._microbatch = previous

    @contextlib.contextmanager
    def once_per_step(self) -> Iterator[None]:
        previous, self._once_per_step = self._once_per_step, True
        try:
            yield
        finally:
            self._once_per_step = previous

    def released(self, tensor: torch.Tensor) -> None:
        self.allocations.release(tensor)
        key = tensor.untyped_storage()._cdata
        if key in self._saved_storages:  # kept for backward, then freed (and made again before it is needed)
            self._recount(self._saved_storages.pop(key), 0)

    @contextlib.contextmanager
    def communication(self, async_op: bool = False, group_kind: str | None = None,
                      stands_for: tuple | None = None) -> Iterator[None]:
        """Inside a communication call only the c10d ops are the workload's: other ops dispatched there are
        the backend's own implementation of the collective (gloo's reduce-scatter splits and copies its
        input; NCCL does it in its kernel), not kernels the training step launches. The c10d ops are
        marked async_op when the step waits for them only where it reads their results; with `stands_for`,
        recorded with those (outputs, inputs) as their first two arguments."""
        previous = self._in_communication, self._async_op, self._named_kind, self._stands_for
        self._in_communication, self._async_op, self._named_kind = True, async_op, group_kind
        self._stands_for = stands_for
        try:
            yield
        finally:
            self._in_communication, self._async_op, self._named_kind, self._stands_for = previous

    @contextlib.contextmanager
    def kernel_notes(self, **notes: float) -> Iterator[None]:
        previous, self._kernel_notes = self._kernel_notes, {**self._kernel_notes, **notes}
        try:
            yield
        finally:
            self._kernel_notes = previous

    def kernel_notes_for_backward(self, output: torch.Tensor, **notes: float) -> None:
        """Notes held while autograd runs output.grad_fn: set by a pre-hook, put back by a hook after it."""
        node = output.grad_fn
        if node is None:
            return
        saved: list[dict[str, float]] = []

        def enter(grad_outputs):
            saved.append(self._kernel_notes)
            self._kernel_notes = {**self._kernel_notes, **notes}

        def leave(grad_inputs, grad_outputs):
            self._kernel_notes = saved.pop()

        node.register_prehook(enter)
        node.register_hook(leave)

    def _watch(self, t: torch.Tensor) -> int:
        """The key of `t`'s storage, whose entries in _last_writer and _saved_storages go when it is freed.

        The key is the storage's address, which a storage allocated later may reuse: a stale entry would give
        it a writer it never had (how often depends on the process's allocation history, so traces would
        differ between processes). torch keeps a storage's Python object as long as the storage lives, so a
        weak reference to it is told of the free."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._storage_refs:
            self._storage_refs[key] = weakref.ref(storage, lambda _, key=key: self._forget_storage(key))
        return key

    def _forget_storage(self, key: int) -> None:
        self._storage_refs.pop(key, None)
        self._last_writer.pop(key, None)
        self._saved_storages.pop(key, None)
        self._real_bytes.pop(key, None)

    def padded(self, tensor, real_bytes: int) -> None:
        self.allocations.shrink(tensor, real_bytes)
        key = self._watch(tensor)
        self._real_bytes[key] = real_bytes
        if key in self._saved_storages:  # kept by the op that made it: counted already
            self._recount(self._saved_storages[key], real_bytes)

    def _recount(self, index: int, nbytes: int) -> None:
        """Entry `index` of saved_allocations counts `nbytes` from now on (its chunk's total follows)."""
        chunk, allocation, counted = self.saved_allocations[index]
        self.saved_allocations[index] = (chunk, allocation, nbytes)
        self.saved_activation_bytes[chunk] += nbytes - counted

    def kept_for_backward(self, tensor) -> None:
        self._on_save(tensor)

    def _on_save(self, t: torch.Tensor) -> torch.Tensor:
        """Count each storage kept for backward once (micro-batch 0 stands for all); parameters and views of them
        (a linear's transposed weight) excluded: they are model states, counted once."""
        base = t._base if t._base is not None else t
        if self._microbatch == 0 and not isinstance(base, torch.nn.Parameter):
            key = self._watch(t)
            if key not in self._saved_storages:
                self._saved_storages[key] = len(self.saved_allocations)
                nbytes = self._real_bytes.get(key, t.untyped_storage().nbytes())
                self.saved_allocations.append((self._chunk, self.allocations.allocation_of(t), nbytes))
                self.saved_activation_bytes[self._chunk] = self.saved_activation_bytes.get(self._chunk, 0) + nbytes
        return t

    # -- dispatch -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start = time.perf_counter()  # ~100 ns; recording the op (JSON of its arguments) costs far more
        out = func(*args, **kwargs)
        elapsed = time.perf_counter() - start
        recorded = func.namespace not in SKIPPED_NAMESPACES and (func.namespace == "c10d"
                                                                 or not self._in_communication)
        if "to_host" not in self._kernel_notes:  # a copy to host memory takes no device memory
            self.allocations.note([t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)],
                                  lambda: {_storage_key(t) for t in tree_flatten((args, kwargs))[0]
                                           if isinstance(t, torch.Tensor)},
                                  len(self.events) if recorded else None)
        if recorded:
            if func.namespace == "c10d" and self._stands_for is not None:
                args = (*self._stands_for, *args[2:])
            self._record(func, args, kwargs, out)
            if self.time_ops:
                self.events[-1]["wall_s"] = elapsed
        return out

    def _group_ranks(self, boxed) -> list[int]:
        pg = ProcessGroup.unbox(boxed)
        key = id(pg)
        if key not in self._group_ranks_cache:
            self._group_ranks_cache[key] = dist.get_process_group_ranks(pg)
        return self._group_ranks_cache[key]

    def _record(self, func, args, kwargs, out) -> None:
        tensors: list[torch.Tensor] = []
        encoded_args = _encode_arg(list(args), tensors)
        encoded_kwargs = _encode_arg(kwargs, tensors)
        name = func.name()
        is_view = func.is_view or name.split(".")[0] in NO_KERNEL_OPS
        event_id = len(self.events)
        deps = sorted(self._writers_of(tensors))
        shapes = [list(t.shape) for t in tensors]
        strides = [list(t.stride()) for t in tensors]
        dtypes = [dtype_name(t.dtype) for t in tensors]
        encoded = {"args": encoded_args, "kwargs": encoded_kwargs}
        if self._kernel_notes and func.namespace != "c10d":
            encoded.update(self._kernel_notes)
        args_json = json.dumps(encoded, separators=(",", ":"))
        signature_text = json.dumps([name, shapes, strides, dtypes, args_json], separators=(",", ":"))
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]

        event: dict[str, Any] = {
            "id": event_id,
            "phase": self._phase,
            "chunk": self._chunk,
            "microbatch": self._microbatch,
            "per_microbatch": not (self._once_per_step or self._phase == "optimizer"),
            "kind": "compute",
            "stream": "compute",
            "op": name,
            "input_shapes": json.dumps(shapes, separators=(",", ":")),
            "input_strides": json.dumps(strides, separators=(",", ":")),
            "input_dtypes": ",".join(dtypes),
            "op_args": args_json,
            "signature": hashlib.sha1(signature_text.encode()).hexdigest()[:16],
            "no_kernel": is_view,
            "flops": 0,
            "bytes_moved": 0,
            "collective": None,
            "group_kind": None,
            "group_ranks": None,
            "message_bytes": 0,
            "comm_dtype": None,
            "peer": -1,
            "async_op": func.namespace == "c10d" and self._async_op,
            "deps": deps,
        }
        if func.namespace == "c10d":
            self._fill_communication(event, func, args, tensors)
        elif name == "fsdp::all_gather_copy_in":  # copies the shards into their slice of the gather buffer
            event["bytes_moved"] = 2 * sum(map(tensor_bytes, args[0]))
        elif not is_view:
            event["bytes_moved"] = sum(map(tensor_bytes, tensors)) + sum(map(tensor_bytes, outputs))
            packet = func._overloadpacket
            if packet in flop_registry:
                event["flops"] = int(flop_registry[packet](*args, **kwargs, out_val=out))
            elif "scaled_dot_product" in name:  # the backward's inputs start with the output's gradient
                q, k = tensors[1:3] if "backward" in name else tensors[:2]
                event["flops"] = sdpa_flops(name, q, k)
            else:  # elementwise / reduction: one operation per output element
                event["flops"] = sum(t.numel() for t in outputs)
            if name in ("aten::_to_copy", "aten::copy_") and len({t.device for t in tensors + outputs}) > 1:
                event["kind"], event["stream"] = "memcpy", "memcpy"
            for note, stream in (("to_host", "memcpy.d2h"), ("from_host", "memcpy.h2d")):
                if note in self._kernel_notes:  # activation offloading's copies (workloads/activation_offload.py)
                    event["kind"], event["stream"] = "memcpy", stream
        self.events.append(event)

        if not is_view:
            written = list(outputs)
            for i, arg_schema in enumerate(func._schema.arguments):
                if arg_schema.alias_info is not None and arg_schema.alias_info.is_write and i < len(args):
                    written += [t for t in tree_flatten(args[i])[0] if isinstance(t, torch.Tensor)]
            if func.namespace == "c10d" and name != "c10d::send":
                # c10d's schemas declare no writes: every op but send fills its first argument (recv_ and
                # alltoall_base_ return only a Work), and what reads that argument must wait for it
                written += [t for t in tree_flatten(args[0])[0] if isinstance(t, torch.Tensor)]
            for t in written:
                self._wrote(t, event_id)

    def _writers_of(self, tensors: list[torch.Tensor]) -> set[int]:
        """The events that wrote the bytes `tensors` read: by byte range, so a ring step's GEMM on the block it
        holds does not wait for the block arriving in another slice of the same buffer."""
        writers = set()
        for t in tensors:
            entries = self._last_writer.get(_storage_key(t))
            if entries:
                start, end = byte_extent(t)
                writers.update(event for first, last, event in entries if first < end and start < last)
        return writers

    def _wrote(self, t: torch.Tensor, event_id: int) -> None:
        key = self._watch(t)
        start, end = byte_extent(t)
        kept = [w for w in self._last_writer.get(key, ()) if not (start <= w[0] and w[1] <= end)]
        kept.append((start, end, event_id))
        self._last_writer[key] = kept

    def _fill_communication(self, event: dict, func, args, tensors: list[torch.Tensor]) -> None:
        op_name = func._overloadpacket.__name__
        collective, size_arg = C10D_OPS.get(op_name, (op_name, 0))
        boxed = next(a for a in args if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()))
        ranks = self._group_ranks(boxed)
        kind = self._group_kind.get(tuple(ranks), "world" if len(ranks) == self.layout.world_size else "other")
        if self._named_kind is not None and ranks == self.layout.group_ranks(self.rank, self._named_kind):
            kind = self._named_kind
        size_tensors = tree_flatten(args[size_arg])[0] if size_arg >= 0 else []
        event["kind"] = "p2p" if collective in ("send", "recv") else "collective"
        event["stream"] = f"comm.{kind}"
        event["collective"] = collective
        event["group_kind"] = kind
        event["group_ranks"] = ranks
        event["message_bytes"] = sum(tensor_bytes(t) for t in size_tensors if isinstance(t, torch.Tensor))
        if collective == "all_to_all":  # uneven splits (MoE): the busier direction bounds the rank's time
            event["message_bytes"] = max(event["message_bytes"],
                                         sum(tensor_bytes(t) for t in tree_flatten(args[0])[0]
                                             if isinstance(t, torch.Tensor)))
        event["comm_dtype"] = dtype_name(tensors[0].dtype) if tensors else None
        if event["kind"] == "p2p":
            group_peer = next(a for a in args[2:] if isinstance(a, int))
            event["peer"] = ranks[group_peer]
