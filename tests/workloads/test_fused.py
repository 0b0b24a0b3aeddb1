"""Llama's fused ops compute what the unfused PyTorch ops compute, forward and backward, and trace as one op."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainsim.workloads.fused import RMSNorm, rotary, swiglu


def _grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return out, [t.grad for t in inputs]


def test_rms_norm_matches_torch():
    x, w = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    results = [_grads(lambda x, w, norm=norm: torch.func.functional_call(norm, {"weight": w}, (x,)), x, w)
               for norm in (RMSNorm(16, 1e-5, torch.float64), nn.RMSNorm(16, eps=1e-5, dtype=torch.float64))]
    (y1, g1), (y2, g2) = results
    torch.testing.assert_close(y1, y2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def _unfused_rotary(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def test_rotary_matches_the_unfused_rotation_and_its_gradient():
    x = torch.randn(2, 3, 6, 8, dtype=torch.float64).transpose(1, 2)  # strided, as q after the transpose
    angles = torch.rand(3, 4, dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()
    (y1, g1), (y2, g2) = (_grads(lambda t: rotary(t, cos, sin, False), x),
                          _grads(lambda t: _unfused_rotary(t, cos, sin), x))
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(g1[0], g2[0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_swiglu_matches_silu_times_up(dtype):
    h = torch.randn(2, 5, 12, dtype=dtype)

    def unfused(h):
        gate, up = h.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up

    (y1, g1), (y2, g2) = _grads(swiglu, h), _grads(unfused, h)
    tolerance = {} if dtype == torch.float64 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(y1, y2, **tolerance)
    torch.testing.assert_close(g1[0], g2[0], **tolerance)


SMALL_LLAMA = ["model=llama3-8b", "model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=8",
               "model.num_kv_heads=4", "model.ffn_hidden_size=256", "model.seq_length=64", "model.vocab_size=512",
               "parallelism=single", "hardware.devices_per_node=1"]


def _graph(*overrides):
    from trainsim.config import compose_run
    from trainsim.trace import trace_layout

    run = compose_run([*SMALL_LLAMA, *overrides], check="layout")
    return run, trace_layout(run.model, run.parallelism).graph.to_pandas()


def test_a_llama_layer_traces_one_op_per_fused_kernel():
    run, graph = _graph()
    counts = graph.groupby(["phase", "op"]).size()
    layers = run.model.num_layers
    assert counts[("forward", "trainsim::rms_norm")] == 2 * layers + 1  # two per layer, the final norm
    assert counts[("backward", "trainsim::rms_norm_backward")] == 2 * layers + 1
    assert counts[("forward", "trainsim::rotary")] == counts[("backward", "trainsim::rotary")] == 2 * layers
    assert counts[("forward", "trainsim::swiglu")] == counts[("backward", "trainsim::swiglu_backward")] == layers
    passes = graph[graph["phase"].isin(["forward", "backward"])]  # (the optimizer's clipping has a stack, rsqrt)
    leftover = passes[passes["op"].isin(["aten::pow.Tensor_Scalar", "aten::rsqrt", "aten::silu", "aten::stack"])]
    assert leftover.empty, leftover[["phase", "op"]]


def test_without_fused_kernels_a_llama_layer_traces_eager_ops_that_move_more_bytes():
    """torchtitan without torch.compile: each norm, rotation and SwiGLU is several eager kernels and passes."""
    _, fused = _graph()
    run, eager = _graph("framework=torchtitan")
    assert not run.model.fused_elementwise
    layers = run.model.num_layers
    forward = eager[eager["phase"] == "forward"]["op"].value_counts()
    assert not eager["op"].str.startswith("trainsim::").any()
    assert forward["aten::rsqrt"] == 2 * layers + 1 and forward["aten::silu"] == layers
    assert forward["aten::stack"] == 2 * layers  # q and k rotated
    passes = {name: g[g["phase"].isin(["forward", "backward"])] for name, g in (("fused", fused), ("eager", eager))}
    assert passes["eager"]["bytes_moved"].sum() > 1.3 * passes["fused"]["bytes_moved"].sum()
    assert passes["eager"]["flops"].sum() == pytest.approx(passes["fused"]["flops"].sum(), rel=0.02)
    _, compiled = _graph("framework=torchtitan", "framework.fused_elementwise=true")
    assert compiled["op"].eq("trainsim::rms_norm").any()
