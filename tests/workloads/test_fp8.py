"""FP8 training as Transformer Engine runs it: validation, the traced kernels, memory and their times."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from trainsim.config import compose_run
from trainsim.errors import ConfigError
from trainsim.profile.analytical import gemm_dims, kernel_notes, op_kind, predict_ops, predict_rows, rates_for
from trainsim.profile.replay import build_call
from trainsim.report.efficiency import efficiency
from trainsim.trace import trace_layout
from trainsim.workloads.fp8 import Fp8Linear, Fp8Settings, fp8_weight_bytes
from trainsim.workloads.model import TransformerChunk

LINEARS_PER_LAYER = 4  # QKV, attention output projection, MLP up (or gate+up), MLP down


def _graph(*overrides: str) -> pd.DataFrame:
    run = compose_run(list(overrides), check="layout")
    return trace_layout(run.model, run.parallelism).graph.to_pandas()


def _dtypes(events: pd.DataFrame) -> list[list[str]]:
    return [d.split(",") for d in events["input_dtypes"]]


def test_fp8_needs_an_fp8_peak_on_gpus_but_not_on_cpu_devices():
    with pytest.raises(ConfigError, match=r"parallelism.precision='fp8'.*hardware.peak_flops_per_s.fp8"):
        compose_run(["hardware=a100-80g-dgx", "parallelism.precision=fp8"])
    for hardware in ("h100-sxm-dgx", "h100-80g-p5", "h800-dgx", "gb200-nvl72"):
        run = compose_run([f"hardware={hardware}", "parallelism.precision=fp8"])
        peaks = run.hardware.peak_flops_per_s
        assert peaks["fp8"] == pytest.approx(2 * peaks["bf16"], rel=0.001)  # datasheets: FP8 twice bf16, dense
    assert compose_run(["hardware=local-cpu", "parallelism.precision=fp8"]).parallelism.fp8_recipe == "delayed"
    with pytest.raises(ConfigError, match=r"parallelism.fp8_recipe='tensorwise'.*delayed, current"):
        compose_run(["parallelism.precision=fp8", "parallelism.fp8_recipe=tensorwise"])


def test_delayed_scaling_trace_has_fp8_gemms_casts_and_amax_all_reduces():
    graph = _graph("parallelism=tp2", "parallelism.precision=fp8", "parallelism.dp=2",
                   "parallelism.global_batch_size=8")
    graph = graph[graph["rank_class"] == 0]
    layers = 4  # gpt-tiny
    gemms = graph[graph["op"] == "aten::_scaled_mm"]
    forward, backward = gemms[gemms["phase"] == "forward"], gemms[gemms["phase"] == "backward"]
    assert len(forward) == LINEARS_PER_LAYER * layers
    assert len(backward) == 2 * LINEARS_PER_LAYER * layers  # dgrad and wgrad
    assert all(d[:2] == ["float8_e4m3fn", "float8_e4m3fn"] for d in _dtypes(forward))
    assert all(d[0] == "float8_e5m2" and d[1] in ("float8_e4m3fn", "float8_e5m2") for d in _dtypes(backward))
    assert {op_kind(op) for op in gemms["op"]} == {"matmul"}
    # the output layer stays bf16
    assert (graph["op"].isin(["aten::mm", "aten::addmm"]) & (graph["phase"] == "forward")).sum() == 1

    casts = graph[graph["op"] == "aten::mul.out"]
    forward_casts = casts[casts["phase"] == "forward"]
    # every input per micro-batch; every weight once per step (first micro-batch), kept for the others
    assert forward_casts["per_microbatch"].sum() == LINEARS_PER_LAYER * layers
    assert (~forward_casts["per_microbatch"]).sum() == LINEARS_PER_LAYER * layers
    assert (casts["phase"] == "backward").sum() == LINEARS_PER_LAYER * layers  # output gradients, E5M2
    assert (graph["op"] == "aten::linalg_vector_norm.out").sum() == 3 * LINEARS_PER_LAYER * layers  # amaxes
    # TE's cast kernel records the amax and writes the transposed copy in the same pass, and the norm kernel of
    # LayerNormLinear (qkv, first MLP linear) writes its output in FP8: noted as fused, so the kernel model gives
    # them no time of their own (a measured profile still times them as they run here)
    notes = graph["op_args"].map(kernel_notes)
    fused = graph[notes.map(lambda n: n.get("fused") == 1) & ~graph["no_kernel"]]  # (views carry it too)
    transposes = LINEARS_PER_LAYER * layers * 3  # the weight (once per step), the input, the output gradient
    assert sorted(fused["op"].value_counts().items()) == [
        ("aten::clone", transposes), ("aten::linalg_vector_norm.out", 3 * LINEARS_PER_LAYER * layers),
        ("aten::mul.out", 2 * layers)]
    norm_casts = fused[fused["op"] == "aten::mul.out"]
    assert (norm_casts["phase"] == "forward").all() and norm_casts["per_microbatch"].all()
    rates = rates_for(compose_run(["hardware=h100-sxm-dgx"]).hardware, "bf16")
    assert (predict_ops(rates, fused) == 0).all()
    assert (predict_ops(rates, casts.drop(norm_casts.index)) > 0).all()

    amax = graph[(graph["kind"] == "collective") & (graph["comm_dtype"] == "fp32")
                 & graph["message_bytes"].isin([4 * 2 * LINEARS_PER_LAYER * layers, 4 * LINEARS_PER_LAYER * layers])
                 & (graph["phase"] != "optimizer")]
    # one all-reduce of every amax of the pass, after each forward and each backward, over dp x tp
    assert amax[["phase", "message_bytes"]].values.tolist() == [
        ["forward", 4 * 2 * LINEARS_PER_LAYER * layers], ["backward", 4 * LINEARS_PER_LAYER * layers]]
    assert all(list(r) == [0, 1, 2, 3] for r in amax["group_ranks"])
    assert amax["per_microbatch"].all()


def test_current_scaling_llama_has_no_amax_history_or_reduction():
    graph = _graph("model=llama3-8b", "model.num_layers=2", "model.hidden_size=256", "model.num_attention_heads=4",
                   "model.num_kv_heads=2", "model.ffn_hidden_size=512", "model.seq_length=64", "model.vocab_size=512",
                   "parallelism=tp2", "parallelism.precision=fp8", "parallelism.fp8_recipe=current")
    gemms = graph[graph["op"] == "aten::_scaled_mm"]
    assert len(gemms) == 3 * LINEARS_PER_LAYER * 2
    shapes = [json.loads(s) for s in gemms[gemms["phase"] == "forward"]["input_shapes"]]
    assert [256, 512] in [s[1] for s in shapes]  # SwiGLU gate+up: [h, 2 ffn / tp] as the second operand
    # amax computed from each tensor right before its cast, no history: no all-reduce of fp32 amaxes
    collectives = graph[graph["kind"] == "collective"]
    assert not ((collectives["phase"] != "optimizer") & (collectives["comm_dtype"] == "fp32")
                & (collectives["message_bytes"] < 256)).any()
    assert not (graph["op"] == "aten::roll").any()
    assert (graph["op"] == "aten::linalg_vector_norm").sum() == 3 * LINEARS_PER_LAYER * 2


def test_fp8_weight_copies_are_cast_once_and_kept_between_micro_batches():
    run = compose_run(["parallelism.precision=fp8"], check="layout")
    torch.manual_seed(0)
    chunk = TransformerChunk(run.model, layers=range(2), first=True, last=True, tp=1, tp_rank=0, tp_group=None,
                             dtype=torch.bfloat16, recompute="none", loss_scale=0.5, fp8=Fp8Settings("delayed"))
    tokens = torch.randint(run.model.vocab_size, (2, run.model.seq_length))
    linears = [m for m in chunk.modules() if isinstance(getattr(m, "fp8", None), Fp8Linear)]
    fp8_weights = [m.weight for m in linears]
    assert len(fp8_weights) == 2 * LINEARS_PER_LAYER
    chunk(tokens, tokens).backward()
    cached = [m.fp8._weight[0] for m in linears]
    # W and W^T in FP8 (2 bytes per weight element) and an fp32 inverse scale, held between micro-batches
    assert fp8_weight_bytes(chunk) == sum(2 * w.numel() + 4 for w in fp8_weights)
    loss = chunk(tokens, tokens)  # second micro-batch: the same FP8 weights
    loss.backward()
    assert torch.isfinite(loss) and all(w.grad is not None and torch.isfinite(w.grad).all() for w in fp8_weights)
    assert all(a is m.fp8._weight[0] for a, m in zip(cached, linears))
    with torch.no_grad():
        torch._foreach_copy_(fp8_weights, [w * 2 for w in fp8_weights])  # the optimizer writes the weights
    chunk(tokens, tokens)
    assert all(a is not m.fp8._weight[0] for a, m in zip(cached, linears))
    # delayed scaling learnt scales from the amaxes of the first passes
    assert (chunk.fp8.scale[True] != 1).all() and (chunk.fp8.scale[False] != 1).all()


def test_fp8_gemms_are_faster_than_bf16_on_h100_and_replay_on_cpu():
    wide = ("model.hidden_size=2048", "model.num_attention_heads=16", "model.seq_length=1024", "model.num_layers=1")
    hw = compose_run(["hardware=h100-sxm-dgx"]).hardware
    times = {}
    for precision in ("bf16", "fp8"):
        graph = _graph(*wide, f"parallelism.precision={precision}", "parallelism=single")
        gemms = graph[graph["op"].map(op_kind) == "matmul"].copy()
        if precision == "fp8":  # the output layer's GEMM stays bf16
            gemms = gemms[gemms["op"] == "aten::_scaled_mm"]
        gemms["seconds"] = predict_rows(gemms, hw)
        for op, shapes, seconds in zip(gemms["op"], gemms["input_shapes"], gemms["seconds"]):
            times.setdefault(precision, {}).setdefault(gemm_dims(op, json.loads(shapes))[1:], []).append(seconds)
    shared = set(times["bf16"]) & set(times["fp8"])
    assert len(shared) >= 3
    for dims in shared:
        assert max(times["fp8"][dims]) < min(times["bf16"][dims]), dims

    graph = _graph("parallelism.precision=fp8", "parallelism=single")
    for op in ("aten::_scaled_mm", "aten::mul.out", "aten::clone"):
        row = graph[(graph["op"] == op) & graph["input_dtypes"].str.contains("float8|bf16")].iloc[0]
        build_call(row.to_dict())()  # the measure backend rebuilds FP8 operands and scales on the CPU


def test_fp8_gemms_run_at_their_own_efficiency_of_the_fp8_peak():
    hw = compose_run(["hardware=h100-sxm-dgx"]).hardware
    km = hw.kernel_model
    assert 0 < km.fp8_matmul_efficiency != km.matmul_efficiency
    assert rates_for(hw, "fp8").matmul_flops_per_s == pytest.approx(1979e12 * km.fp8_matmul_efficiency)
    assert rates_for(hw, "bf16").matmul_flops_per_s == pytest.approx(989e12 * km.matmul_efficiency)
    unset = compose_run(["hardware=h100-sxm-dgx", "hardware.kernel_model.fp8_matmul_efficiency=0"]).hardware
    assert rates_for(unset, "fp8").matmul_flops_per_s == pytest.approx(1979e12 * km.matmul_efficiency)


def test_mfu_of_fp8_is_against_the_bf16_peak():
    hardware = {"peak_flops_per_s": {"bf16": 989e12, "fp8": 1979e12}}
    model = {"hidden_size": 4096, "num_layers": 32, "seq_length": 4096, "num_attention_heads": 32,
             "vocab_size": 32000, "family": "gpt"}
    par = {"dp": 8, "tp": 1, "pp": 1, "global_batch_size": 64, "precision": "bf16"}
    assert efficiency(5.0, hardware, model, {**par, "precision": "fp8"})["mfu_pct"] == \
        efficiency(5.0, hardware, model, par)["mfu_pct"]
