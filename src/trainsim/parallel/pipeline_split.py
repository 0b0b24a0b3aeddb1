"""Which transformer layers, and the embedding and the loss, each model chunk of each pipeline rank holds.

The one place that answers it, with Megatron-Core's rules (transformer_block.get_num_layers_to_build,
transformer_layer.get_transformer_layer_offset, TransformerConfig.__post_init__, PipelineParallelLayerLayout):
* even: num_layers / (pp * virtual_stages) layers per chunk;
* uneven first/last stages (--decoder-first/last-pipeline-num-layers), also with virtual stages: the first
  (last) rank holds `first` (`last`) layers, `first / virtual_stages` per chunk, the middle ranks split the rest;
* embedding and loss counted as a layer (--account-for-embedding/loss-in-pipeline-split): the split is of
  num_layers + 1 (+ 1), and the chunk holding the embedding (loss) builds one transformer layer fewer;
* an explicit layout (--pipeline-model-parallel-layout, e.g. "Et*3|(tt|)*29,m|L"): one string per virtual stage,
  in virtual-stage order (chunk c of rank r is stage c * pp + r).
Layers are numbered in virtual-stage order (Megatron's layer offsets). The embedding is built on virtual stage 0 and
the output layer with the loss on the last one, whatever the split (Megatron's pre_process / post_process).
A split Megatron-Core refuses raises PipelineSplitError with its reason.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

LAYOUT_SYMBOLS = {"E": "embedding", "L": "loss", "t": "transformer layer", "m": "multi-token prediction layer"}
"""Characters of a --pipeline-model-parallel-layout stage; '|' separates stages, ',' is cosmetic, '(...)*n' and
'x*n' repeat."""


class PipelineSplitError(ValueError):
    """A pipeline split Megatron-Core refuses; the message is its reason."""


@dataclass(frozen=True)
class PipelineSplit:
    """Transformer layers of every model chunk: counts[pp_rank][chunk]."""

    counts: tuple[tuple[int, ...], ...]

    @property
    def pp(self) -> int:
        return len(self.counts)

    @property
    def virtual_stages(self) -> int:
        return len(self.counts[0])

    def layers(self, pp_rank: int, chunk: int) -> range:
        """Global indices of the transformer layers of chunk `chunk` of rank `pp_rank` (virtual stage
        chunk * pp + pp_rank): every earlier virtual stage's layers come before them."""
        start = sum(self.counts[r][c] for c in range(chunk + 1) for r in range(self.pp if c < chunk else pp_rank))
        return range(start, start + self.counts[pp_rank][chunk])

    def holds_embedding(self, pp_rank: int, chunk: int) -> bool:
        return pp_rank == 0 and chunk == 0

    def holds_loss(self, pp_rank: int, chunk: int) -> bool:
        """The output layer, its norm and the loss."""
        return pp_rank == self.pp - 1 and chunk == self.virtual_stages - 1

    def stage_layer_counts(self) -> list[int]:
        """Transformer layers per pipeline rank, all its chunks together."""
        return [sum(row) for row in self.counts]


def split_of(model, par) -> PipelineSplit:
    """The pipeline split of a ModelConfig under a ParallelismConfig."""
    return pipeline_split(model.num_layers, par.pp, par.virtual_stages, par.first_stage_layers,
                          par.last_stage_layers, par.account_for_embedding_in_pipeline_split,
                          par.account_for_loss_in_pipeline_split, par.pipeline_layout)


@functools.lru_cache(maxsize=256)
def pipeline_split(num_layers: int, pp: int, virtual_stages: int = 1, first: int = 0, last: int = 0,
                   account_for_embedding: bool = False, account_for_loss: bool = False,
                   layout: str = "") -> PipelineSplit:
    """The split Megatron-Core builds; first / last 0 = not set (Megatron's None). Raises PipelineSplitError."""
    v = virtual_stages
    if layout:
        if first or last or account_for_embedding or account_for_loss:
            raise PipelineSplitError(
                "pipeline_layout cannot be set with other pipeline layout arguments (first_stage_layers="
                f"{first}, last_stage_layers={last}, account_for_embedding_in_pipeline_split={account_for_embedding}"
                f", account_for_loss_in_pipeline_split={account_for_loss})")
        return _explicit_split(num_layers, pp, v, layout)
    if (first or last) and (account_for_embedding or account_for_loss):
        raise PipelineSplitError("first_stage_layers / last_stage_layers cannot be set together with "
                                 "account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split")
    if first or last:
        per_rank = _uneven_rank_layers(num_layers, pp, v, first, last)
    else:
        slots = num_layers + account_for_embedding + account_for_loss
        if slots % pp:
            counted = " (with the embedding and/or loss counted as layers)" if slots != num_layers else ""
            raise PipelineSplitError(f"{slots} layers{counted} are not divisible by the pipeline parallel size {pp}")
        per_rank = [slots // pp] * pp
    if v > 1 and pp > 1:
        for rank, n in enumerate(per_rank):
            if n % v:
                raise PipelineSplitError(f"the {n} layers of pipeline rank {rank} are not divisible by the virtual "
                                         f"pipeline parallel degree {v}")
        counts = [[n // v] * v for n in per_rank]
    else:
        counts = [[n] + [0] * (v - 1) for n in per_rank] if v > 1 else [[n] for n in per_rank]
    if account_for_embedding:
        counts[0][0] -= 1
    if account_for_loss:
        counts[-1][-1] -= 1
    for name, rank, chunk in (("first", 0, 0), ("last", pp - 1, v - 1)):
        if counts[rank][chunk] < 0:
            raise PipelineSplitError(f"not enough layers in the {name} virtual pipeline stage for the embedding "
                                     "and the loss counted as layers")
    return PipelineSplit(tuple(tuple(row) for row in counts))


def _uneven_rank_layers(num_layers: int, pp: int, v: int, first: int, last: int) -> list[int]:
    """Layers per pipeline rank with --decoder-first/last-pipeline-num-layers (TransformerConfig's checks)."""
    if pp < 2:
        raise PipelineSplitError(f"first_stage_layers / last_stage_layers need pipeline parallelism (pp={pp})")
    middle_layers, middle_ranks = num_layers, pp
    for name, n in (("first", first), ("last", last)):
        if n < 0:
            raise PipelineSplitError(f"the number of layers at the {name} stage, {n}, must be larger than 0 "
                                     "(0: not set, as the middle stages)")
        if n:
            if v > 1 and n % v:
                raise PipelineSplitError(f"the number of layers at the {name} stage, {n}, must be divisible by the "
                                         f"virtual pipeline parallel degree {v}")
            middle_layers -= n
            middle_ranks -= 1
    if bool(middle_layers) != bool(middle_ranks) or middle_layers < 0:
        raise PipelineSplitError(f"mismatch: {middle_layers} middle layers remaining but {middle_ranks} middle "
                                 "pipeline stages available")
    if middle_ranks and middle_layers % middle_ranks:
        raise PipelineSplitError(f"the number of layers at the middle stages, {middle_layers}, must be divisible by "
                                 f"the {middle_ranks} middle pipeline stages")
    middle = middle_layers // middle_ranks if middle_ranks else 0
    if middle_ranks and v > 1 and middle % v:
        raise PipelineSplitError(f"the number of layers on each middle pipeline rank, {middle}, must be divisible by "
                                 f"the virtual pipeline parallel degree {v}")
    return [first or middle] + [middle] * (pp - 2) + [last or middle]


def parse_pipeline_layout(layout: str) -> list[str]:
    """The stages of a layout string, each a string of LAYOUT_SYMBOLS, in virtual-stage order: commas dropped,
    '(...)*n' then 'x*n' unrolled (one level of parentheses, as Megatron-Core). Raises PipelineSplitError on an
    unknown character (a nested or unmatched parenthesis is one)."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    for stage in stages:
        for char in stage:
            if char not in LAYOUT_SYMBOLS:
                raise PipelineSplitError(f"invalid layer character {char!r} in stage {stage!r} of the layout "
                                         f"{layout!r}; known layer characters: {', '.join(LAYOUT_SYMBOLS)}, "
                                         "stages separated by '|'")
    return stages


def _explicit_split(num_layers: int, pp: int, v: int, layout: str) -> PipelineSplit:
    """PipelineParallelLayerLayout's checks, with the virtual stages the config states."""
    stages = parse_pipeline_layout(layout)
    if len(stages) % pp:
        raise PipelineSplitError(f"the layout's {len(stages)} stages are not divisible by the pipeline parallel "
                                 f"size {pp}")
    if len(stages) // pp != v:
        raise PipelineSplitError(f"virtual_stages={v} conflicts with the layout's {len(stages)} stages on {pp} "
                                 f"pipeline ranks ({len(stages) // pp} virtual stages per rank): set "
                                 f"parallelism.virtual_stages={len(stages) // pp}"
                                 + (" and schedule=interleaved-1f1b" if len(stages) // pp > 1 else ""))
    flat = "".join(stages)
    if not flat or flat[0] != "E":
        raise PipelineSplitError(f"the first layer must be the embedding 'E', but got {flat[:1]!r}")
    if flat[-1] != "L":
        raise PipelineSplitError(f"the last layer must be the loss 'L', but got {flat[-1]!r}")
    if flat.count("E") != 1:
        raise PipelineSplitError("the embedding 'E' must be specified exactly once")
    if flat.count("L") != 1:
        raise PipelineSplitError("the loss 'L' must be specified exactly once")
    if flat.count("t") != num_layers:
        raise PipelineSplitError(f"the number of transformer layers 't', {flat.count('t')}, must match num_layers "
                                 f"{num_layers}")
    if "m" in flat:
        raise PipelineSplitError("multi-token prediction layers 'm' are not built in trainsim (the number of MTP "
                                 "layers in a layout must match the model's, and its models have none)")
    return PipelineSplit(tuple(tuple(stages[c * pp + r].count("t") for c in range(v)) for r in range(pp)))


def lighter_end_stages(num_layers: int, pp: int) -> tuple[int, int] | None:
    """(first_stage_layers, last_stage_layers) for `pp` stages when `num_layers` does not split evenly: the other
    stages take ceil(num_layers / pp) and the shortfall comes off the last stage (which also holds the output
    layer and the loss), then the first (the embedding), each keeping a layer (0: as the other stages); None
    when the split is even or cannot be made so. DeepSeek-V3's 61 layers on 16 stages: 4 each, 1 on the last."""
    if pp < 2 or num_layers % pp == 0:
        return None
    per_stage = -(-num_layers // pp)
    shortfall = pp * per_stage - num_layers
    off_last = min(shortfall, per_stage - 1)
    first, last = per_stage - (shortfall - off_last), per_stage - off_last
    return (0 if first == per_stage else first, last) if first >= 1 else None
