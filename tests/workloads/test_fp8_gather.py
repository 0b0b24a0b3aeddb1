"""Sequence parallelism all-gathers the column-parallel linears' input in FP8 under the per-tensor recipes (TE's
gather_along_first_dim with a quantizer, torchao's Float8ColwiseParallel): half the bytes of bf16, one cast of the
shard with the tp group's amax, the same gradients as casting the gathered input. TE also gathers the row-parallel
linears' output gradients in FP8."""

from __future__ import annotations

import pandas as pd
import pytest
from conftest import squared_gradient_norms

from trainsim.config import compose_run
from trainsim.trace import trace_layout
from trainsim.workloads.launch import spawn_ranks

SMALL = ["model=llama3-8b", "model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=8",
         "model.num_kv_heads=4", "model.ffn_hidden_size=256", "model.seq_length=64", "model.vocab_size=512",
         "parallelism=tp2"]
SP = ["parallelism.sequence_parallel=true"]


def _collectives(*overrides: str) -> tuple[object, pd.DataFrame]:
    run = compose_run([*SMALL, *SP, "parallelism.precision=fp8", *overrides], check="layout")
    graph = trace_layout(run.model, run.parallelism).graph.to_pandas()
    graph = graph[(graph["rank_class"] == 0) & (graph["kind"] == "collective")]
    return run, graph


def _gathers(graph: pd.DataFrame, phase: str) -> pd.DataFrame:
    return graph[(graph["phase"] == phase) & (graph["collective"] == "all_gather")]


@pytest.mark.parametrize("framework", ["megatron-core", "torchtitan"])
def test_per_tensor_fp8_gathers_each_column_linear_input_in_one_byte(framework):
    run, graph = _collectives(f"framework={framework}", "parallelism.fp8_recipe=current")
    tokens = run.parallelism.micro_batch_size * run.model.seq_length
    fp8_bytes = tokens * run.model.hidden_size  # the whole gathered input, one byte per element
    forward = _gathers(graph, "forward")
    # qkv (torchtitan: wq, wk, wv on one gathered input) and the MLP's first linear(s), per layer
    gathered_in_fp8 = forward[forward["comm_dtype"] == "uint8"]
    assert len(gathered_in_fp8) == 2 * run.model.num_layers
    assert set(gathered_in_fp8["message_bytes"]) == {fp8_bytes}
    # their shards share one scale: the current-scaling amax is all-reduced over tp before each cast
    forward_reductions = graph[(graph["phase"] == "forward") & (graph["collective"] == "all_reduce")]
    amaxes = forward_reductions[forward_reductions["message_bytes"] == 4]
    assert len(amaxes) == 2 * run.model.num_layers
    backward = _gathers(graph, "backward")
    # TE gathers the kept FP8 shard again behind dgrad, and the row-parallel linears' (proj, fc2) output gradients in
    # FP8; torch's DTensor keeps the gathered input and torchao gathers the output gradients in bf16
    in_fp8 = backward[backward["comm_dtype"] == "uint8"]
    if framework == "megatron-core":
        assert len(in_fp8) == 4 * run.model.num_layers and set(in_fp8["message_bytes"]) == {fp8_bytes}
    else:
        assert in_fp8.empty


def test_block_recipes_gather_bf16_and_cast_after():
    run, graph = _collectives("parallelism.fp8_recipe=mxfp8")
    assert not (graph["comm_dtype"] == "uint8").any()
    tokens = run.parallelism.micro_batch_size * run.model.seq_length
    forward = _gathers(graph, "forward")
    assert (forward["message_bytes"] == 2 * tokens * run.model.hidden_size).sum() == 2 * run.model.num_layers + 1


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["megatron-core", "torchtitan"])
def test_fp8_gathered_shards_give_the_gradients_of_the_replicated_input(framework):
    """With tp 2, casting each shard with the reduced amax and gathering the FP8 bytes gives the FP8 input that
    casting the whole replicated input gives (no sequence parallelism): the same gradients."""
    norms = {}
    for name, extra in (("sequence-parallel", SP), ("replicated", [])):
        run = compose_run([*SMALL, *extra, f"framework={framework}", "parallelism.precision=fp8",
                           "parallelism.fp8_recipe=current", "parallelism.clip_grad=1.0"])
        norms[name] = spawn_ranks(squared_gradient_norms, run.parallelism, run.model, run.parallelism)
    assert norms["sequence-parallel"] == pytest.approx(norms["replicated"], rel=1e-5)
