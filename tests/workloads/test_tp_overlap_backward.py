"""What parallelism.tp_comm_overlap overlaps in a column-parallel linear's backward (model.tp_overlap_backward):
Transformer Engine's bulk overlap, or nothing (torch's micro-pipelined async TP, torchtitan)."""

from __future__ import annotations

import pytest
from conftest import squared_gradient_norms

from trainsim.config import compose_run
from trainsim.errors import ConfigError
from trainsim.trace import trace_layout
from trainsim.workloads.launch import spawn_ranks

OVERLAP = ["parallelism=tp2", "parallelism.sequence_parallel=true", "parallelism.tp_comm_overlap=true"]


def _backward_collectives(*overrides):
    run = compose_run([*OVERLAP, *overrides], check="layout")
    graph = trace_layout(run.model, run.parallelism).graph.to_pandas()
    backward = graph[(graph["phase"] == "backward") & (graph["kind"] == "collective")]
    return run, backward


def test_micro_pipelined_tp_reduce_scatters_the_input_gradient_exposed_and_gathers_nothing_again():
    run, bulk = _backward_collectives()
    _, none = _backward_collectives("model.tp_overlap_backward=none")
    layers = run.model.num_layers

    def exposed_reduce_scatters(backward):
        return ((backward["collective"] == "reduce_scatter") & ~backward["async_op"]).sum()

    def all_gathers(backward):
        return (backward["collective"] == "all_gather").sum()

    # two column-parallel linears per layer (qkv, fc1): only Transformer Engine's bulk overlap reduce-scatters their
    # input gradients behind the weight-gradient GEMM (async), and only it gathers the token shard again (the
    # micro-pipeline keeps the gathered input from forward)
    assert len(none) == len(bulk) - 2 * layers
    assert exposed_reduce_scatters(none) - exposed_reduce_scatters(bulk) == 2 * layers
    assert all_gathers(bulk) - all_gathers(none) == 2 * layers

def test_torchtitan_runs_the_micro_pipeline_and_a_bad_value_is_named():
    assert compose_run(["framework=torchtitan", *OVERLAP], check="layout").model.tp_overlap_backward == "none"
    assert compose_run(OVERLAP, check="layout").model.tp_overlap_backward == "bulk"
    with pytest.raises(ConfigError, match="model.tp_overlap_backward='ring'.*bulk"):
        compose_run([*OVERLAP, "model.tp_overlap_backward=ring"], check="layout")


@pytest.mark.slow
@pytest.mark.parametrize("precision", [["parallelism.precision=fp32"],
                                       ["parallelism.precision=fp8", "parallelism.fp8_recipe=current"]],
                         ids=["fp32", "fp8"])
def test_both_backwards_give_the_same_gradients_over_gloo(precision):
    """The bulk backward gathers the kept shard again (FP8: its bytes), the micro-pipeline keeps the gathered input:
    the same gradients either way."""
    norms = {}
    for backward in ("bulk", "none"):
        run = compose_run(["model=llama3-8b", "model.num_layers=2", "model.hidden_size=128",
                           "model.num_attention_heads=8", "model.num_kv_heads=4", "model.ffn_hidden_size=256",
                           "model.seq_length=64", "model.vocab_size=512", *OVERLAP, *precision,
                           "parallelism.clip_grad=1.0", f"model.tp_overlap_backward={backward}"])
        norms[backward] = spawn_ranks(squared_gradient_norms, run.parallelism, run.model, run.parallelism)
    assert norms["none"] == pytest.approx(norms["bulk"], rel=1e-6)


def test_transformer_engines_bulk_backward_keeps_the_fp8_shard_not_the_gathered_input():
    def activation_bytes(backward):
        run = compose_run([*OVERLAP, "parallelism.precision=fp8", "parallelism.fp8_recipe=current",
                           f"model.tp_overlap_backward={backward}"], check="layout")
        memory = trace_layout(run.model, run.parallelism).memory.to_pandas()
        return run, int(memory["activation_bytes_per_microbatch"].iloc[0])

    run, bulk = activation_bytes("bulk")
    _, none = activation_bytes("none")
    tokens = run.parallelism.micro_batch_size * run.model.seq_length
    # qkv and fc1 per layer: the gathered FP8 input (1 byte per token and hidden element) in place of its shard
    assert none - bulk == 2 * run.model.num_layers * tokens * run.model.hidden_size * (1 - 1 / 2)
