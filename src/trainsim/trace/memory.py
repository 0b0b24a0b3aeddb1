"""Memory of one rank class: model states from the built sub-model, activations from the trace.

Peak = weights + gradients + optimizer states + activations kept for in-flight micro-batches
+ the transient bytes above them. In-flight activations follow the schedule: walk the rank's actions
and keep the maximum of the activations saved by forwards whose backward has not run yet
(GPipe keeps all m micro-batches, 1F1B at most pp - stage; Narayanan et al. 2021, sec. 2.2). The
transient part is what the traced step (one micro-batch through every chunk and back) holds at its worst
moment beyond that micro-batch's saved activations: temporaries (the loss's logits-sized tensors, a
layer's intermediate results), gradients on their way through backward, communication buffers
(trace/recorder.py's StepAllocations follows every storage the step creates until it is freed).
Parameters include the FP8 copies of the weights under precision fp8 (workloads/fp8.py).
Allocator fragmentation and framework workspaces are not modelled.
"""

from __future__ import annotations

import pyarrow as pa

from trainsim.parallel.schedules import Action, passes

MEMORY_SCHEMA = pa.schema([
    ("rank_class", pa.int32()),
    ("parameter_bytes", pa.int64()),
    ("gradient_bytes", pa.int64()),
    ("optimizer_state_bytes", pa.int64()),
    ("activation_bytes_per_microbatch", pa.int64()),
    ("max_inflight_microbatches", pa.int32()),
    ("peak_activation_bytes", pa.int64()),
    ("transient_bytes", pa.int64()),
    ("peak_bytes", pa.int64()),
])
MEMORY_COLUMNS = MEMORY_SCHEMA.names


def peak_inflight_activation_bytes(actions: list[Action], saved_bytes_per_chunk: dict[int, int]) -> tuple[int, int]:
    """(max bytes, max count) of activations of forwards whose backward has not run yet. A combined pass (a forward
    with a paired backward) builds one micro-batch's activations layer by layer while it frees the other's in the
    opposite order, so it never holds both whole: it holds what it held before, then the forward's instead of the
    backward's."""
    live = peak = count = peak_count = 0
    for group in passes(actions):
        if len(group) == 2:
            f, b = group
            live += saved_bytes_per_chunk.get(f.chunk, 0) - saved_bytes_per_chunk.get(b.chunk, 0)
            peak = max(peak, live)
            continue
        (a,) = group
        delta = saved_bytes_per_chunk.get(a.chunk, 0)
        if a.kind == "F":
            live, count = live + delta, count + 1
            peak, peak_count = max(peak, live), max(peak_count, count)
        else:
            live, count = live - delta, count - 1
    return peak, peak_count


def memory_row(rank_class: int, *, parameter_bytes: int, gradient_bytes: int, optimizer_state_bytes: int,
               saved_bytes_per_chunk: dict[int, int], actions: list[Action], transient_bytes: int) -> dict:
    peak_activation, inflight = peak_inflight_activation_bytes(actions, saved_bytes_per_chunk)
    row = {
        "rank_class": rank_class,
        "parameter_bytes": parameter_bytes,
        "gradient_bytes": gradient_bytes,
        "optimizer_state_bytes": optimizer_state_bytes,
        "activation_bytes_per_microbatch": sum(saved_bytes_per_chunk.values()),
        "max_inflight_microbatches": inflight,
        "peak_activation_bytes": peak_activation,
        "transient_bytes": transient_bytes,
    }
    row["peak_bytes"] = (parameter_bytes + gradient_bytes + optimizer_state_bytes + peak_activation
                         + transient_bytes)
    return row


def oom_verdict(peak_bytes: int, capacity_bytes: float) -> bool:
    """True when the class does not fit in one device's memory."""
    return peak_bytes > capacity_bytes
