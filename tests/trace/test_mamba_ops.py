"""A Mamba-2 layer's traced work against a hand count (Dao & Gu 2024's chunked SSD), and how the kernel model prices
its convolution."""

from __future__ import annotations

import pytest

from trainsim.config import compose_run
from trainsim.profile.analytical import op_kind, predict_rows
from trainsim.report.efficiency import forward_flops_per_token
from trainsim.trace import trace_layout
from trainsim.workloads import mamba

# hidden 64 -> 2 * 64 / 16 = 8 heads of 16 channels (inner width 128), 2 groups of state 8; 256 tokens = 2 chunks
MAMBA_LAYER = ["model=gpt-tiny", "model.num_layers=1", "model.hybrid_layer_pattern=M", "model.seq_length=256",
               "model.mamba_head_dim=16", "model.mamba_num_groups=2", "model.mamba_state_dim=8",
               "parallelism=single", "hardware=h100-sxm-dgx"]


def test_one_mamba_layer_forward_matmul_flops_match_the_hand_count():
    run = compose_run(MAMBA_LAYER, check="layout")
    graph = trace_layout(run.model, run.parallelism).graph.to_pandas()
    forward = graph[(graph["phase"] == "forward") & (graph["kind"] == "compute")]
    matmul = forward[forward["op"].map(op_kind) == "matmul"]
    tokens, hidden, vocab = 2 * 256, 64, 512  # micro-batches of 2 sequences
    heads, p, groups, n, chunk = 8, 16, 2, 8, 128
    inner = heads * p
    expected = (2 * tokens * hidden * (2 * inner + 2 * groups * n + heads)  # in_proj: z, x, B, C, dt
                + 2 * tokens * chunk * groups * n  # C B^T inside each chunk, once per group
                + 2 * tokens * chunk * heads * p  # its masked product with x
                + 2 * tokens * heads * p * n  # each chunk's final state
                + 2 * 2 * heads * 2 * 3 * p * n  # states passed between each sequence's 2 chunks: [2, 3] decays
                + 2 * tokens * heads * p * n  # outputs from the entering states
                + 2 * tokens * inner * hidden  # out_proj
                + 2 * tokens * hidden * vocab)  # the output layer
    assert int(matmul["flops"].sum()) == expected
    # MFU's model FLOPs count the same work (all but the tiny state passing between chunks)
    model = forward_flops_per_token(vars(run.model))
    assert (model["layers"] + model["logits"]) * tokens == pytest.approx(expected, rel=1e-3)


def test_causal_convolution_and_gated_norm_are_one_memory_bound_pass_each():
    """Its bytes are its input, output, weight and bias once (causal-conv1d's kernel), and its time does not
    change when its recorded arithmetic (one per output) becomes the real one (2 per kernel tap and the SiLU)."""
    run = compose_run(MAMBA_LAYER)
    graph = trace_layout(run.model, run.parallelism).graph.to_pandas()
    conv = graph[graph["op"] == "trainsim::causal_conv1d_silu"]
    assert len(conv) == 1 and op_kind(conv["op"].iloc[0]) == "elementwise"
    channels, kernel = 128 + 2 * 2 * 8, 4
    assert int(conv["bytes_moved"].iloc[0]) == 4 * (2 * 2 * 256 * channels + channels * kernel + channels)  # fp32
    norm = graph[graph["op"] == "trainsim::gated_rms_norm"]  # one pass too: y and the gate z in, the output out
    assert len(norm) == 1 and int(norm["bytes_moved"].iloc[0]) == 4 * (3 * 2 * 256 * 128 + 128)
    seconds = predict_rows(conv, run.hardware)
    more_arithmetic = conv.assign(flops=conv["flops"] * (2 * kernel + 4))
    assert predict_rows(more_arithmetic, run.hardware)[0] == seconds[0] > 0


def test_the_scan_keeps_its_inputs_and_is_redone_inside_the_fused_backward(monkeypatch):
    """mamba_ssm's chunked-scan kernels keep the scan's inputs and recompute the [chunk, chunk] decays and the chunk
    states inside their backward: the traced scan is checkpointed, its recomputed forward noted fused (no time of
    its own), and no [chunk, chunk] tensor is kept."""
    run = compose_run(MAMBA_LAYER)
    trace = trace_layout(run.model, run.parallelism)
    graph = trace.graph.to_pandas()
    forward_exps = graph[(graph["phase"] == "forward") & (graph["op"] == "aten::exp")]
    again = graph[(graph["phase"] == "backward") & (graph["op"] == "aten::exp")]
    assert again["op_args"].str.contains('"fused":1').sum() == 4  # the scan's: two decay matrices, to end, from start
    assert not forward_exps["op_args"].str.contains('"fused":1').any()
    saved = int(trace.memory.to_pandas()["activation_bytes_per_microbatch"].iloc[0])
    monkeypatch.setattr(mamba, "checkpoint", lambda scan, *args, **_: scan(*args))  # the eager scan keeps it all
    eager = int(trace_layout(run.model, run.parallelism).memory.to_pandas()["activation_bytes_per_microbatch"].iloc[0])
    sequences, heads, chunks, chunk = 2, 8, 2, 128
    assert eager - saved >= sequences * heads * chunks * chunk * chunk * 4  # at least its fp32 [chunk, chunk] decays
