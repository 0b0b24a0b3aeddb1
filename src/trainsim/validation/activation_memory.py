"""Traced activation memory per transformer layer against the closed form of Korthikanti et al. (2022).

Source: V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023,
arXiv 2205.05198), sec. 4 and Table 2. For a GPT layer (LayerNorm, 4h GELU MLP, multi-head attention with the
[s, s] scores in memory, dropout on the attention probabilities and after attention and MLP, 16-bit activations,
1-byte dropout masks) the bytes kept for the backward pass per layer and micro-batch are

    no parallelism                      s b h (34 + 5 a s / h)
    tensor parallel (t)                 s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence parallel          s b h / t (34 + 5 a s / h)
    tensor parallel + selective         s b h (10 + 24 / t)
    tensor + sequence + selective       s b h 34 / t
    full recomputation                  2 s b h                       (the layer input only)

The paper's breakdown (sec. 4.1): attention 11 sbh + 5 a s^2 b (QKV input 2, Q and K 4, V 2, projection input 2,
dropout mask 1; softmax output 2 a s^2 b, its dropout mask a s^2 b, the dropped probabilities 2 a s^2 b), MLP
19 sbh (input 2, GELU input 8, GELU output 8, dropout mask 1), two LayerNorm inputs 4 sbh. Small terms (LayerNorm
statistics, biases) are left out by the paper; they stay in the trace, so the comparison shows them.

The traced side is what the memory estimate uses: `trace_layout`'s activation bytes per micro-batch (every
storage saved for backward, trace/recorder.py), for a model of 1 and of 2 layers; the difference is one layer,
embedding and loss cancel. Use realistic ratios (a s / h and h relative to s b): the formula's terms weigh
differently at each.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainsim.config.choices import RECOMPUTE_MODES
from trainsim.config.schema import ModelConfig, ParallelismConfig


@dataclass(frozen=True)
class LayerShape:
    """A GPT layer and micro-batch as the formula sees them: s sequence, b micro-batch, h hidden, a heads."""

    s: int = 256
    b: int = 1
    h: int = 256
    a: int = 4


@dataclass(frozen=True)
class Case:
    """One row of the comparison: a tensor-parallel degree, sequence parallelism and a recomputation mode."""

    label: str
    tp: int
    sequence_parallel: bool
    recompute: str


# Table 2's six rows; tensor parallelism at two degrees where the paper's t matters.
TABLE2_CASES = (
    Case("no parallelism", 1, False, "none"),
    Case("tensor parallel t=2", 2, False, "none"),
    Case("tensor parallel t=4", 4, False, "none"),
    Case("tensor + sequence parallel t=2", 2, True, "none"),
    Case("tensor + sequence parallel t=4", 4, True, "none"),
    Case("tensor parallel + selective t=4", 4, False, "selective"),
    Case("tensor + sequence parallel + selective t=4", 4, True, "selective"),
    Case("full recompute", 1, False, "full"),
)


def korthikanti_bytes_per_layer(shape: LayerShape, tp: int, sequence_parallel: bool, recompute: str) -> float:
    """Bytes of activations one layer keeps per micro-batch, Table 2 of arXiv 2205.05198.

    Full recomputation keeps the layer input: 2 sbh, and its sequence shard 2 sbh / t with sequence
    parallelism (Megatron checkpoints the sharded hidden states; not a row of Table 2)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r}; accepted: {', '.join(RECOMPUTE_MODES)}")
    s, b, h, a, t = shape.s, shape.b, shape.h, shape.a, tp
    sbh = s * b * h
    sp = sequence_parallel and t > 1
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    scores = 5 * a * s / h if recompute == "none" else 0.0  # softmax output, its dropout mask, dropped probs
    if sp:
        return sbh / t * (34 + scores)
    return sbh * (10 + 24 / t + scores / t)


def gpt_layer_model(shape: LayerShape, num_layers: int) -> ModelConfig:
    """The GPT the paper assumes: unfused attention with its dropout, dropout after attention and MLP."""
    return ModelConfig(name=f"korthikanti-gpt-{num_layers}l", family="gpt", num_layers=num_layers,
                       hidden_size=shape.h, num_attention_heads=shape.a, seq_length=shape.s, vocab_size=512,
                       dropout=0.1, attention_dropout=0.1, attention="unfused")


def case_parallelism(case: Case, micro_batch_size: int) -> ParallelismConfig:
    """One micro-batch on tp ranks in bf16 (16-bit activations, as the paper counts)."""
    return ParallelismConfig(name=f"korthikanti-tp{case.tp}{'-sp' if case.sequence_parallel else ''}-{case.recompute}",
                             tp=case.tp, sequence_parallel=case.sequence_parallel and case.tp > 1,
                             recompute=case.recompute, precision="bf16", micro_batch_size=micro_batch_size,
                             global_batch_size=micro_batch_size)


def traced_bytes_per_layer(shape: LayerShape, case: Case) -> int:
    """Activation bytes of one layer as the trace stage counts them: a 2-layer minus a 1-layer trace of rank 0."""
    from trainsim.trace.tracer import trace_layout  # torch: only when tracing

    par = case_parallelism(case, shape.b)
    saved = []
    for layers in (1, 2):
        memory = trace_layout(gpt_layer_model(shape, layers), par).memory
        saved.append(memory.column("activation_bytes_per_microbatch")[0].as_py())
    return saved[1] - saved[0]


def compare(shape: LayerShape = LayerShape(), cases: tuple[Case, ...] = TABLE2_CASES) -> list[dict]:
    """Per case: traced and closed-form bytes per layer, both in units of sbh, and the error in %."""
    sbh = shape.s * shape.b * shape.h
    rows = []
    for case in cases:
        traced = traced_bytes_per_layer(shape, case)
        formula = korthikanti_bytes_per_layer(shape, case.tp, case.sequence_parallel, case.recompute)
        rows.append({"case": case.label, "tp": case.tp, "sequence_parallel": case.sequence_parallel,
                     "recompute": case.recompute, "traced_bytes": traced, "formula_bytes": formula,
                     "traced_sbh": traced / sbh, "formula_sbh": formula / sbh,
                     "error_pct": 100 * (traced - formula) / formula})
    return rows
