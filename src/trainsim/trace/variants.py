"""Rank classes that differ only in their token counts: one traced step, the others' events derived from it.

With a skewed routing plan every expert-parallel rank of a stage is a class of its own (tracer.expert_classes),
yet their steps run the same ops in the same order: the counts set only the sizes of the expert exchange (the
all-to-alls' splits, the experts' GEMM rows, the storages those ops make). So one class of a stage is traced in
full, and for each other class only the token exchanges of the stage's MoE layers run again, alone (forward
and backward, no step around them), once with the traced class's counts and once with the other's. The events
whose values differ between those two runs are looked up in the traced step by what they are (op, shapes,
strides, dtypes, arguments) and given the other class's values, the storages they make its sizes, from which
its saved activations and its peak follow. Where the two runs do not line up (the counts change the ops, one
op would take two different values, or the step holds an op a different number of times than the exchanges
alone do), the class is not derived (None) and the tracer traces it in full.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from trainsim.trace.recorder import ExecutionRecorder
from trainsim.workloads.moe import MoE
from trainsim.workloads.observe import observing

VALUE_FIELDS = ("input_shapes", "input_strides", "op_args", "signature", "flops", "bytes_moved", "message_bytes")
"""What token counts change in an event (everything else of it is the step's structure)."""


def event_key(event: dict) -> tuple:
    """What an event is, up to its place in the step."""
    return event["op"], event["input_shapes"], event["input_strides"], event["input_dtypes"], event["op_args"]


@dataclass
class Substitution:
    """Values of the events the counts change: event key -> (VALUE_FIELDS values, bytes of each storage the op
    makes, by output index), and how often each such event occurs in the MoE layers run alone."""

    values: dict[tuple, tuple[tuple, dict[int, int]]]
    occurrences: collections.Counter


def moe_layers(chunks) -> list[tuple[object, list[MoE]]]:
    """(chunk, its MoE layers in order) of a rank model's chunks."""
    return [(chunk, [block.mlp for block in chunk.layers if isinstance(block.mlp, MoE)]) for chunk in chunks]


@contextlib.contextmanager
def _alone(module: nn.Module) -> Iterator[None]:
    """`module` without the step around it: weights of its shapes without the gradient buckets' hooks (whose
    state a second run would find changed), no forward hooks."""
    params, hooks = [], []
    for inner in module.modules():
        hooks.append((inner, dict(inner._forward_pre_hooks), dict(inner._forward_hooks)))
        inner._forward_pre_hooks.clear()
        inner._forward_hooks.clear()
        for name, p in list(inner.named_parameters(recurse=False)):
            params.append((inner, name, p))
            setattr(inner, name, nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad))
    try:
        yield
    finally:
        for inner, name, p in params:
            setattr(inner, name, p)
        for inner, pre, post in hooks:
            inner._forward_pre_hooks.update(pre)
            inner._forward_hooks.update(post)


def run_alone(layers: list[tuple[object, list[MoE]]], layout, rank: int, tokens: int) -> ExecutionRecorder:
    """Record the token exchange of each MoE layer (all-to-all, experts, all-to-all back; forward and backward)
    alone, for `tokens` tokens of the routing its counts source plans (fake tensors)."""
    recorder = ExecutionRecorder(layout, rank)
    for chunk, moes in layers:
        region = chunk.fp8.autocast() if chunk.fp8 is not None else contextlib.nullcontext()
        for moe in moes:
            plan = moe.ep.counts.plan
            counts = plan.of_layer(moe.layer)[moe.ep.counts.source].tolist()
            exchange = moe.token_exchange(torch.empty(tokens * moe.top_k, dtype=torch.long), counts,
                                          plan.of_layer(moe.layer))
            copies = torch.empty((exchange.order.shape[0], moe.router.shape[1]), dtype=moe.router.dtype,
                                 requires_grad=True)
            with _alone(moe.experts), observing(recorder), recorder, region:
                with recorder.section("forward", 0, 0):
                    out = moe.dispatch(moe.experts_on(moe.dispatch(copies, exchange), exchange), exchange.reverse())
                with recorder.section("backward", 0, 0):
                    out.backward(torch.empty_like(out))
    return recorder


def _made(recorder: ExecutionRecorder) -> dict[int, dict[int, int]]:
    """event id -> {output index: bytes} of the storages each recorded op made."""
    sizes = recorder.allocations.sizes()
    made: dict[int, dict[int, int]] = collections.defaultdict(dict)
    for allocation, (event, index) in recorder.allocations.origin.items():
        made[event][index] = sizes[allocation]
    return made


def substitution(base: ExecutionRecorder, other: ExecutionRecorder) -> Substitution | None:
    """What changes from `base` to `other` (the same layers run alone with two classes' counts); None where
    the two runs differ in more than values."""
    if len(base.events) != len(other.events):
        return None
    base_sizes, other_sizes = base.allocations.sizes(), other.allocations.sizes()
    if len(base_sizes) != len(other_sizes) or any(
            base_sizes[a] != other_sizes[a] for a in base_sizes if a not in base.allocations.origin):
        return None  # a storage an unrecorded op made changed size: nothing to find it by
    base_made, other_made = _made(base), _made(other)
    outcome: dict[tuple, tuple | None] = {}
    occurrences: collections.Counter = collections.Counter()
    for a, b in zip(base.events, other.events):
        if a["op"] != b["op"] or a["deps"] != b["deps"] or base_made.get(a["id"], {}).keys() != \
                other_made.get(b["id"], {}).keys():
            return None
        values = tuple(b[field] for field in VALUE_FIELDS)
        made = other_made.get(b["id"], {})
        changed = values != tuple(a[field] for field in VALUE_FIELDS) or made != base_made.get(a["id"], {})
        key = event_key(a)
        entry = (values, made) if changed else None
        if outcome.setdefault(key, entry) != entry:
            return None  # one op of the base, two different ones of the other
        if changed:
            occurrences[key] += 1
    return Substitution({key: entry for key, entry in outcome.items() if entry is not None}, occurrences)


@dataclass
class Derived:
    """Another class's step: the traced step's events with its values (those of `changed_rows` replaced), its
    saved and its peak bytes."""

    events: list[dict]
    changed_rows: list[int]
    saved_bytes_per_chunk: dict[int, int]
    peak_transient_bytes: int


def derive(recorder: ExecutionRecorder, change: Substitution) -> Derived | None:
    """The traced step of `recorder` with `change` applied; None where the step holds a changed op a different
    number of times than the layers alone do."""
    seen: collections.Counter = collections.Counter()
    events, made, changed_rows = [], {}, []
    for row, event in enumerate(recorder.events):
        key = event_key(event)
        entry = change.values.get(key)
        if entry is None:
            events.append(event)
            continue
        seen[key] += 1
        values, made[event["id"]] = entry
        changed_rows.append(row)
        events.append({**event, **dict(zip(VALUE_FIELDS, values))})
    if seen != change.occurrences:
        return None
    traced_sizes = recorder.allocations.sizes()
    sizes = dict(traced_sizes)
    for allocation, (event, index) in recorder.allocations.origin.items():
        if event in made:
            if index not in made[event]:
                return None
            sizes[allocation] = made[event][index]
    saved: dict[int, int] = {}
    for chunk, allocation, nbytes in recorder.saved_allocations:  # (nbytes: the share of it kept, 0 if freed)
        if allocation is not None and traced_sizes[allocation]:
            nbytes = nbytes * sizes[allocation] // traced_sizes[allocation]
        saved[chunk] = saved.get(chunk, 0) + nbytes
    return Derived(events, changed_rows, saved, recorder.allocations.peak_transient_bytes(sizes))
