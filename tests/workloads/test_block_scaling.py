"""Block-scaled precisions as Transformer Engine runs them: MXFP8, FP8 blockwise and NVFP4 (workloads/block_scaling.py):
their numerics, the traced kernels and bytes, the weight copies' memory and the GEMMs' rates."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from trainsim.config import compose_run
from trainsim.errors import ConfigError
from trainsim.profile.analytical import gemm_dims, op_dtype, predict_rows, rates_for
from trainsim.profile.replay import build_call
from trainsim.trace import trace_layout
from trainsim.workloads import block_scaling
from trainsim.workloads.block_scaling import BLOCK_FORMATS, E2M1_GRID, dequantize, quantize
from trainsim.workloads.fp8 import Fp8Linear, Fp8Settings, fp8_weight_bytes
from trainsim.workloads.model import TransformerChunk

LINEARS_PER_LAYER = 4  # QKV, attention output projection, MLP up, MLP down
RECIPES = {"mxfp8": ("parallelism.precision=fp8", "parallelism.fp8_recipe=mxfp8"),
           "blockwise": ("parallelism.precision=fp8", "parallelism.fp8_recipe=blockwise"),
           "nvfp4": ("parallelism.precision=fp4",)}
WIDE = ("model.hidden_size=256", "model.seq_length=128")  # blockwise needs widths and tokens of 128


def _graph(*overrides: str) -> pd.DataFrame:
    run = compose_run(list(overrides), check="layout")
    graph = trace_layout(run.model, run.parallelism).graph.to_pandas()
    return graph[graph["rank_class"] == 0]


def _hadamard16() -> torch.Tensor:
    h = torch.ones(1, 1)
    while len(h) < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / 4


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@pytest.mark.parametrize("recipe", list(BLOCK_FORMATS))
def test_block_quantisation_keeps_values_and_the_gemm_matches_bf16(recipe):
    torch.manual_seed(0)
    fmt = BLOCK_FORMATS[recipe]
    x = torch.randn(128, 256, dtype=torch.bfloat16) * torch.logspace(-3, 3, 256).to(torch.bfloat16)  # wide range
    w, g = torch.randn(128, 256, dtype=torch.bfloat16), torch.randn(128, 128, dtype=torch.bfloat16)
    amax = block_scaling.nvfp4_amax if recipe == "nvfp4" else (lambda t: None)
    qx = quantize(x, fmt, "activation", global_amax=amax(x))
    qw = quantize(w, fmt, "weight", global_amax=amax(w))
    qg = quantize(g, fmt, "gradient", global_amax=amax(g))
    # the column-wise copy (wgrad's operand, reduced over the tokens) has its 1 x b blocks along the tokens
    assert qx.scale_t.shape == (256, 128 // (fmt.activation_block[1] or 128))  # rowwise: one scale per row
    # per-block scales follow a column's range across 6 decades (one per-tensor scale could not)
    tolerance = 0.15 if recipe == "nvfp4" else 0.04
    assert _relative_error(dequantize(*qx.rowwise), x) < tolerance
    # NVFP4's column-wise copies (wgrad's operands) pass a 16-point Hadamard transform first
    rotate = _hadamard16() if recipe == "nvfp4" else torch.eye(16)
    x_t = (x.t().float().reshape(256, -1, 16) @ rotate).reshape(256, 128)
    assert _relative_error(dequantize(*qx.columnwise), x_t) < tolerance
    assert _relative_error(block_scaling.gemm(qx.rowwise, qw.rowwise), x.float() @ w.float().t()) < tolerance
    assert _relative_error(block_scaling.gemm(qg.rowwise, qw.columnwise), g.float() @ w.float()) < 2 * tolerance
    assert _relative_error(block_scaling.gemm(qg.columnwise, qx.columnwise), g.float().t() @ x.float()) < 2 * tolerance
    if recipe == "nvfp4":  # E2M1 values, two per byte, on the grid once the scales are divided out
        assert qx.data.dtype == torch.float4_e2m1fn_x2 and qx.data.shape == (128, 128)
        values = dequantize(qx.data, torch.ones_like(qx.scale, dtype=torch.float32), torch.ones(()))
        assert set(values.abs().unique().tolist()) <= set(E2M1_GRID)


def test_rowwise_fp8_under_fsdp_casts_the_gathered_weights_at_every_use_with_a_scale_per_row():
    """torchtitan's float8 rowwise with FSDP2: the weights arrive in bf16 and are quantised at each use (forward,
    and again in backward: none kept), every tensor with one scale per row along the GEMM's reduction."""
    graph = _graph("parallelism.dp=2", "parallelism.zero_stage=3", "parallelism.global_batch_size=4",
                   "parallelism.precision=fp8", "parallelism.fp8_recipe=rowwise")
    linears = LINEARS_PER_LAYER * 4  # gpt-tiny
    gemms = graph[graph["op"] == "trainsim::block_scaled_mm"]
    assert (gemms["phase"] == "forward").sum() == linears and (gemms["phase"] == "backward").sum() == 2 * linears
    quants = graph[graph["op"] == "trainsim::quantize_blocks"]
    assert quants["per_microbatch"].all()  # no weight cast once per step: FSDP frees the gathered weights
    assert (quants["phase"] == "forward").sum() == 2 * linears  # inputs and weights
    assert (quants["phase"] == "backward").sum() == 2 * linears  # output gradients and weights again
    # torchao runs dgrad and wgrad (no fast accumulation) unscaled, then rescales each output in a pass of its own
    rescales = graph[graph["op"] == "trainsim::scale_rows_columns"]
    assert (rescales["phase"] == "backward").all() and len(rescales) == 2 * linears
    backward = gemms[gemms["phase"] == "backward"]
    assert sorted(json.loads(s)[0] for s in rescales["input_shapes"]) == \
        sorted([json.loads(s)[0][0], json.loads(s)[1][0]] for s in backward["input_shapes"])
    assert (rescales["bytes_moved"] >= 4 * rescales["input_shapes"].map(
        lambda s: json.loads(s)[0][0] * json.loads(s)[0][1])).all()  # bf16 output read and written
    x = torch.randn(64, 96, dtype=torch.bfloat16) * torch.logspace(-3, 3, 64).to(torch.bfloat16)[:, None]
    q = quantize(x, BLOCK_FORMATS["rowwise"], "activation")
    assert q.scale.shape == (64, 1) and q.scale_t.shape == (96, 1)
    assert _relative_error(dequantize(*q.rowwise), x) < 0.04  # rows six decades apart, each with its own scale
    w = quantize(torch.randn(32, 96, dtype=torch.bfloat16), BLOCK_FORMATS["rowwise"], "weight")
    # power-of-two scales: rescaling afterwards rounds exactly as scaling inside the GEMM
    assert torch.equal(block_scaling.gemm(q.rowwise, w.rowwise, rescale_output=True),
                       block_scaling.gemm(q.rowwise, w.rowwise))


def test_nvfp4_rounds_gradients_stochastically_and_inputs_to_nearest():
    torch.manual_seed(0)
    fmt = BLOCK_FORMATS["nvfp4"]
    g = torch.full((16, 16), 2.2)
    g[:, 0] = 15.0  # each block's scale maps 15 to E2M1's 6: 2.2 lands at 0.88, between the values 0.5 and 1
    amax = block_scaling.nvfp4_amax(g)
    nearest = {tuple(dequantize(*quantize(g, fmt, "activation", False, amax).rowwise).flatten().tolist())
               for _ in range(3)}
    assert len(nearest) == 1
    draws = dequantize(*quantize(g.repeat(1000, 1), fmt, "gradient", False, amax).rowwise)  # 1000 independent
    mean = draws.reshape(1000, 16, 16).mean(0)
    assert _relative_error(mean, g) < 0.02  # unbiased on average, where nearest rounding is off by one step
    assert _relative_error(dequantize(*quantize(g, fmt, "activation", False, amax).rowwise), g) > 0.05


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_block_recipes_trace_one_quantisation_kernel_per_tensor_and_no_amax_all_reduce(recipe):
    graph = _graph("parallelism=tp2", "parallelism.dp=2", "parallelism.global_batch_size=8", *WIDE, *RECIPES[recipe])
    layers, linears = 4, LINEARS_PER_LAYER * 4  # gpt-tiny
    assert not (graph["op"] == "aten::_scaled_mm").any()
    gemms = graph[graph["op"] == "trainsim::block_scaled_mm"]
    assert (gemms["phase"] == "forward").sum() == linears and (gemms["phase"] == "backward").sum() == 2 * linears
    dtype = "fp4" if recipe == "nvfp4" else "fp8"
    assert {op_dtype(d, op) for d, op in zip(gemms["input_dtypes"], gemms["op"])} == {dtype}
    quants = graph[graph["op"] == "trainsim::quantize_blocks"]
    forward = quants[quants["phase"] == "forward"]
    assert forward["per_microbatch"].sum() == linears  # inputs: every micro-batch
    assert (~forward["per_microbatch"]).sum() == linears  # weights: once per step, kept
    assert (quants["phase"] == "backward").sum() == linears  # output gradients
    # one kernel reads the tensor and writes both copies with their scales
    shapes = json.loads(forward[forward["per_microbatch"]].iloc[0]["input_shapes"])
    elements = shapes[0][0] * shapes[0][1]
    block = BLOCK_FORMATS[recipe].activation_block[1]
    value_bytes = 0.5 if recipe == "nvfp4" else 1.0
    scale_bytes = 4 if recipe == "blockwise" else 1
    expected = elements * (2 + 2 * (value_bytes + scale_bytes / block))
    assert forward[forward["per_microbatch"]].iloc[0]["bytes_moved"] == pytest.approx(expected, abs=64)
    collectives = graph[graph["kind"] == "collective"]
    assert not ((collectives["phase"] != "optimizer") & (collectives["comm_dtype"] == "fp32")
                & (collectives["message_bytes"] < 256)).any()  # no amax all-reduce
    norms = (graph["op"].str.startswith("aten::linalg_vector_norm") & (graph["phase"] != "optimizer")).sum()
    assert norms == 0
    amaxes = (graph["op"] == "trainsim::nvfp4_amax").sum()
    assert amaxes == (3 * linears if recipe == "nvfp4" else 0)  # NVFP4's per-tensor amaxes only
    del layers


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_block_scaled_weight_copies_hold_values_and_scales(recipe):
    overrides = [*WIDE, *RECIPES[recipe]]
    run = compose_run(overrides, check="layout")
    torch.manual_seed(0)
    settings = Fp8Settings(recipe)
    chunk = TransformerChunk(run.model, layers=range(1), first=True, last=True, tp=1, tp_rank=0, tp_group=None,
                             dtype=torch.bfloat16, recompute="none", loss_scale=0.5, fp8=settings)
    tokens = torch.randint(run.model.vocab_size, (1, run.model.seq_length))
    loss = chunk(tokens, tokens)
    loss.backward()
    weights = [m.weight for m in chunk.modules() if isinstance(getattr(m, "fp8", None), Fp8Linear)]
    assert torch.isfinite(loss) and all(torch.isfinite(w.grad).all() for w in weights)
    fmt = BLOCK_FORMATS[recipe]
    value_bytes = 0.5 if recipe == "nvfp4" else 1.0
    scale_bytes = 4 if recipe == "blockwise" else 1
    per_element = 2 * (value_bytes + scale_bytes / (fmt.weight_block[0] * fmt.weight_block[1]))
    assert fp8_weight_bytes(chunk) == pytest.approx(sum(per_element * w.numel() for w in weights), rel=1e-6)
    reference = TransformerChunk(run.model, layers=range(1), first=True, last=True, tp=1, tp_rank=0,
                                 tp_group=None, dtype=torch.bfloat16, recompute="none", loss_scale=0.5)
    reference.load_state_dict(chunk.state_dict())
    assert loss.item() == pytest.approx(reference(tokens, tokens).item(), rel=0.05)


def test_nvfp4_gemms_run_at_the_fp4_peak_faster_than_mxfp8_and_bf16_on_gb200():
    hw = compose_run(["hardware=gb200-nvl72"]).hardware
    assert rates_for(hw, "fp4").matmul_flops_per_s == pytest.approx(
        2 * rates_for(hw, "fp8").matmul_flops_per_s)  # datasheet: FP4 twice FP8, same efficiency
    wide = ("model.hidden_size=2048", "model.num_attention_heads=16", "model.seq_length=1024", "model.num_layers=1",
            "parallelism=single")
    times = {}
    for name, overrides in (("bf16", ()), ("mxfp8", RECIPES["mxfp8"]), ("nvfp4", RECIPES["nvfp4"])):
        graph = _graph(*wide, *overrides)
        ops = ["aten::mm", "aten::addmm"] if name == "bf16" else ["trainsim::block_scaled_mm"]  # (output layer: bf16)
        gemms = graph[graph["op"].isin(ops)].copy()
        gemms["seconds"] = predict_rows(gemms, hw)
        for op, shapes, dtypes, seconds in zip(gemms["op"], gemms["input_shapes"], gemms["input_dtypes"],
                                               gemms["seconds"]):
            batch, m, n, k = gemm_dims(op, json.loads(shapes))
            k = 2 * k if dtypes.startswith("float4") else k
            times.setdefault(name, {}).setdefault((m, n, k), []).append(seconds)
    shared = set(times["bf16"]) & set(times["mxfp8"]) & set(times["nvfp4"])
    assert len(shared) >= 3
    for dims in shared:
        assert max(times["nvfp4"][dims]) < min(times["mxfp8"][dims]) < min(times["bf16"][dims]), dims


def test_block_scaled_kernels_replay_on_cpu():
    graph = _graph("parallelism=single", *RECIPES["nvfp4"])
    for op in ("trainsim::quantize_blocks", "trainsim::block_scaled_mm"):
        build_call(graph[graph["op"] == op].iloc[0].to_dict())()


def test_mxfp8_experts_run_block_scaled_grouped_gemms_close_to_bf16():
    from trainsim.workloads.fp8 import Fp8Region
    from trainsim.workloads.moe import ExpertParallel, MoE
    from trainsim.workloads.routing import RouterCounts

    run = compose_run(["model.num_experts=4", "model.moe_top_k=2", *RECIPES["mxfp8"]], check="layout")
    outputs, grads = [], []
    for fp8 in (None, Fp8Region(Fp8Settings("mxfp8"))):
        torch.manual_seed(0)
        layer = MoE(run.model, 0, ExpertParallel(1, 0, None, RouterCounts(4, None, 0)), torch.bfloat16, 1.0,
                    False, None, fp8)
        x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
        outputs.append(layer(x).float())
        outputs[-1].square().sum().backward()
        grads.append(layer.experts.w1.grad.float())
    assert _relative_error(outputs[1], outputs[0]) < 0.1
    assert _relative_error(grads[1], grads[0]) < 0.1  # wgrad from the column-wise (token-blocked) copies
    w1, w2 = layer.experts.w1.numel(), layer.experts.w2.numel()
    assert fp8_weight_bytes(layer) == 2 * (w1 + w2) * (1 + 1 / 32)  # both copies, an E8M0 scale per 32


@pytest.mark.parametrize("recipe", [r for r in BLOCK_FORMATS if r != "rowwise"])  # rowwise: the ring carries bf16
def test_tp_overlap_rings_carry_whole_blocks_that_unpack_to_the_gathered_tensor(recipe):
    from trainsim.workloads.block_overlap import pack, unpack

    torch.manual_seed(0)
    fmt = BLOCK_FORMATS[recipe]
    shards = torch.randn(2, 256, 128, dtype=torch.bfloat16)  # two tp ranks' tokens
    amax = torch.stack([block_scaling.nvfp4_amax(s) for s in shards]).amax(0)  # reduced over the ranks
    quantized = [quantize(s, fmt, "activation", global_amax=amax) for s in shards]
    groups = 256 // fmt.activation_block[1]
    gathered = unpack(torch.cat([pack(q, groups, columnwise=True) for q in quantized]), quantized[0], groups, True)
    whole = torch.cat(list(shards))
    assert torch.equal(dequantize(*gathered.rowwise), torch.cat([dequantize(*q.rowwise) for q in quantized]))
    assert torch.equal(dequantize(*gathered.columnwise), torch.cat([dequantize(*q.columnwise) for q in quantized], 1))
    rotate = _hadamard16() if recipe == "nvfp4" else torch.eye(16)
    whole_t = (whole.t().float().reshape(128, -1, 16) @ rotate).reshape(128, 512)
    assert _relative_error(dequantize(*gathered.columnwise), whole_t) < (0.15 if recipe == "nvfp4" else 0.04)
    one = unpack(pack(quantized[1], groups, columnwise=False)[:groups], quantized[1], groups, False)
    assert torch.equal(dequantize(*one.rowwise), dequantize(*quantized[1].rowwise))


@pytest.mark.slow
def test_rowwise_fp8_under_async_tp_trains_as_without_the_overlap():
    """torchtitan's float8 rowwise with async TP: the ring carries bf16 shards, each block quantised row-wise as
    it arrives, the gathered tensor column-wise after the ring; two gloo ranks end a step where the plain
    (gather, then quantise) tensor-parallel run ends, up to the ring's order of partial sums."""
    from test_attention_variants import parameters_after_a_step

    from trainsim.workloads.launch import spawn_ranks

    base = ["parallelism=tp2", "parallelism.sequence_parallel=true", "parallelism.precision=fp8",
            "parallelism.fp8_recipe=rowwise", "parallelism.global_batch_size=2", "hardware=h100-sxm-dgx",
            "hardware.device_kind=cpu"]
    got = {}
    for overlap in (False, True):
        run = compose_run([*base, f"parallelism.tp_comm_overlap={str(overlap).lower()}"], check="layout")
        got[overlap] = spawn_ranks(parameters_after_a_step, run.parallelism, run.model, run.parallelism)
    for rank in range(2):
        for name, value in got[False][rank].items():
            assert _relative_error(got[True][rank][name], value) < 1e-2, name


def test_mxfp8_parameters_under_the_distributed_optimizer_hold_no_bf16_weight():
    """Megatron's --fp8-param-gather with MXFP8 (reuse_grad_buf_for_mxfp8_param_ag): the linears' weights live in
    MXFP8 alone, so the rank's parameter bytes drop by exactly the bf16 bytes the cached copies were cast from; the
    traced step (casts, all-gathers) is unchanged. Per-tensor FP8 weights under the distributed optimizer are
    refused, naming the field."""
    base = ["model=gpt-tiny", "parallelism=dp2", "parallelism.zero_stage=1", *RECIPES["mxfp8"]]
    runs = {gather: compose_run([*base, f"parallelism.fp8_param_gather={str(gather).lower()}"], check="layout")
            for gather in (False, True)}
    traces = {gather: trace_layout(run.model, run.parallelism) for gather, run in runs.items()}
    memory = {gather: trace.memory.to_pandas().iloc[0] for gather, trace in traces.items()}
    model = compose_run(base, check="layout").model
    linear_weights = 2 * 12 * model.hidden_size ** 2 * model.num_layers  # bf16 qkv 3h^2, proj h^2, MLP 2 x 4h^2
    assert memory[False]["parameter_bytes"] - memory[True]["parameter_bytes"] == linear_weights
    graphs = [trace.graph.to_pandas()[["op", "flops", "bytes_moved"]] for trace in traces.values()]
    pd.testing.assert_frame_equal(graphs[0], graphs[1])
    with pytest.raises(ConfigError, match="fp8_param_gather=true with parallelism.zero_stage=1 and fp8_recipe"):
        compose_run([*base, "parallelism.fp8_recipe=current", "parallelism.fp8_param_gather=true"], check="layout")
