"""Where a mixture-of-experts layer's tokens go: the router's choice in a real run, a given plan in a trace.

How many tokens each expert receives is decided by the data, so fake tensors cannot know it. Token counts
are the only data-dependent part of an MoE step (they set the all-to-all split sizes and the shapes of the
expert GEMMs), and the MoE layer asks for them through one of two sources:

* `RouterCounts` (real runs): the counts of the router's top-k choice, and the other ranks' counts by an
  all-gather over the ranks that exchange tokens (the tep group: expert-parallel times expert-tensor-parallel
  ranks), as Megatron-Core's all-to-all dispatcher gets them;
* `PlannedCounts` (traces): the same all-gather is issued, and the counts come from a `RoutingPlan`.

A plan holds, per MoE layer, the tokens each token source sends to each expert in one micro-batch; the sources are
the ranks of a tep group, by position (`Layout.token_source`: the ep rank when etp = 1). It is
made from `model.moe_routing`: 'balanced' (every expert the same share), 'zipf:<s>' (expert shares ~ 1 / i^s in
an order drawn per layer, so the hot expert differs from layer to layer), 'dirichlet:<alpha>' (shares drawn per
layer from a symmetric Dirichlet; small alpha = skewed), or a routing histogram file. Shares are the same for
every source rank except in a histogram that has one row per source (the layout it was exported from had the
same ep * etp); each source's token copies are split over experts by largest remainders, so counts are exact integers,
and no expert gets more copies than the source has tokens (a token picks each expert at most once).

Histogram file (CSV, `#` lines are comments; written by `RoutingHistogram.write`): columns layer (index among
the model's layers), ep_rank (the token source: its position in its expert-parallel group, or in the tep group
with expert tensor parallelism; summed over the replicas of that group), expert (global index) and tokens
(token-expert assignments counted, over any number of micro-batches and steps). A model layer missing from the
file, or a file layer the model has no experts in, is an error; shares are what is used.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainsim.config.schema import ModelConfig, ParallelismConfig
from trainsim.errors import ConfigError
from trainsim.workloads.collectives import all_gather_flat
from trainsim.workloads.observe import observer

HISTOGRAM_COLUMNS = ("layer", "ep_rank", "expert", "tokens")
PARAMETRIC = ("balanced", "zipf", "dirichlet")


def split_by_shares(total: int, shares: np.ndarray) -> np.ndarray:
    """Integers summing to `total`, proportional to `shares` (largest remainders; ties to the lower index)."""
    exact = total * shares / shares.sum()
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:total - int(counts.sum())]] += 1
    return counts


def token_counts(tokens: int, top_k: int, shares: np.ndarray) -> np.ndarray:
    """Copies per expert of `tokens` tokens that each pick top_k distinct experts: proportional to `shares`, but no
    expert above `tokens` (a token picks an expert once); what a full expert cannot take goes to the others by
    their shares (evenly where those are all zero)."""
    capped = np.zeros(len(shares), dtype=bool)
    while True:
        free = tokens * (top_k - int(capped.sum()))
        open_shares = np.where(capped, 0.0, shares.astype(float))
        if open_shares.sum() <= 0:
            open_shares = (~capped).astype(float)
        over = ~capped & (free * open_shares / open_shares.sum() > tokens)
        if not over.any():
            break
        capped |= over
    counts = split_by_shares(free, open_shares)
    counts[capped] = tokens
    return counts


def parametric_shares(spec: str, layers: list[int], num_experts: int) -> np.ndarray:
    """[len(layers), num_experts] expert shares of a 'balanced', 'zipf:<s>' or 'dirichlet:<alpha>' spec (seeded
    by the layer index, so a layer's routing does not depend on the layout)."""
    kind, _, value = spec.partition(":")
    shares = np.ones((len(layers), num_experts))
    if kind == "balanced":
        return shares
    parameter = float(value)
    for row, layer in enumerate(layers):
        rng = np.random.default_rng(1000 + layer)
        if kind == "zipf":
            shares[row, rng.permutation(num_experts)] = 1.0 / np.arange(1, num_experts + 1) ** parameter
        else:
            shares[row] = rng.dirichlet(np.full(num_experts, parameter))
    return shares


def read_histogram(path: Path, layers: list[int], num_experts: int) -> np.ndarray:
    """[len(layers), sources, num_experts] token counts of a histogram file (sources: its ep ranks)."""
    if not path.is_file():
        raise ConfigError(f"model.moe_routing={str(path)!r}: no such routing histogram file; accepted: "
                          "balanced, zipf:<s>, dirichlet:<alpha> or a histogram CSV path")
    rows = [line for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    reader = csv.DictReader(rows)
    if tuple(reader.fieldnames or ()) != HISTOGRAM_COLUMNS:
        raise ConfigError(f"{path}: routing histogram columns are {reader.fieldnames}; expected "
                          f"{','.join(HISTOGRAM_COLUMNS)}")
    entries = []
    for line, row in enumerate(reader, start=2):
        try:
            entry = tuple(int(row[c]) for c in HISTOGRAM_COLUMNS)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: data row {line - 1} {dict(row)}: every field must be an integer") from None
        if not 0 <= entry[2] < num_experts or entry[1] < 0 or entry[3] < 0:
            raise ConfigError(f"{path}: data row {line - 1} {dict(row)}: expert must be in [0, {num_experts}), "
                              "ep_rank and tokens >= 0")
        entries.append(entry)
    table = np.asarray(entries, dtype=np.int64).reshape(-1, 4)
    foreign = sorted(set(table[:, 0].tolist()) - set(layers))
    if foreign:  # (nothing in the file is dropped silently: a histogram of another model is a mistake)
        raise ConfigError(f"{path}: layers {foreign} are not MoE layers of this model (its MoE layers: {layers})")
    sources = int(table[:, 1].max()) + 1 if len(table) else 1
    counts = np.zeros((len(layers), sources, num_experts), dtype=np.int64)
    for row, layer in enumerate(layers):
        mine = table[table[:, 0] == layer]
        if not len(mine) or not mine[:, 3].sum():
            raise ConfigError(f"{path}: no tokens for MoE layer {layer}; the histogram must cover layers {layers}")
        np.add.at(counts[row], (mine[:, 1], mine[:, 2]), mine[:, 3])
    return counts


@dataclass(frozen=True)
class RoutingPlan:
    """counts[i, j, e]: tokens (token-expert assignments) the token source j sends to expert e in MoE layer
    `layers[i]`, per micro-batch; each row sums to the source's tokens times top-k."""

    layers: tuple[int, ...]
    counts: np.ndarray

    def of_layer(self, layer: int) -> np.ndarray:
        return self.counts[self.layers.index(layer)]

    def rank_signature(self, source: int, ep: int, etp: int = 1) -> bytes:
        """What makes one token source's trace differ from another's: what it sends, and what its experts
        (those of ep rank source // etp) receive from every source."""
        experts = self.counts.shape[2] // ep
        ep_rank = source // etp
        mine = self.counts[:, :, ep_rank * experts:(ep_rank + 1) * experts]
        return self.counts[:, source].tobytes() + mine.tobytes()


def moe_layers(model_cfg: ModelConfig) -> list[int]:
    """Indices of the model's layers that have experts (ModelConfig.has_experts)."""
    return [layer for layer in range(model_cfg.num_layers) if model_cfg.has_experts(layer)]


def routing_plan(spec: str, layers: list[int], num_experts: int, sources: int, tokens_per_rank: int,
                 top_k: int) -> RoutingPlan:
    """The plan of `spec` (model.moe_routing) for `sources` token sources of `tokens_per_rank` tokens each."""
    kind = spec.partition(":")[0]
    if kind in PARAMETRIC:
        shares = np.broadcast_to(parametric_shares(spec, layers, num_experts)[:, None, :],
                                 (len(layers), sources, num_experts))
    else:
        counts = read_histogram(Path(spec), layers, num_experts).astype(float)
        shares = counts if counts.shape[1] == sources else np.broadcast_to(counts.sum(axis=1, keepdims=True),
                                                                           (len(layers), sources, num_experts))
    counts = np.asarray([[token_counts(tokens_per_rank, top_k, shares[i, j]) for j in range(sources)]
                         for i in range(len(layers))], dtype=np.int64).reshape(len(layers), sources, num_experts)
    return RoutingPlan(tuple(layers), counts)


def model_routing_plan(model_cfg: ModelConfig, par: ParallelismConfig) -> RoutingPlan | None:
    """The token counts of model.moe_routing for this layout (None for a dense model)."""
    if not model_cfg.num_experts:
        return None
    tokens = par.micro_batch_size * model_cfg.seq_length // par.cp // (par.tp if par.sequence_parallel else 1)
    layers = moe_layers(model_cfg)
    return routing_plan(model_cfg.moe_routing, layers, model_cfg.num_experts, par.ep * par.etp, tokens,
                        model_cfg.moe_top_k)


def forced_choices(counts: np.ndarray, tokens: int, top_k: int) -> torch.Tensor:
    """[tokens, top_k] expert indices with exactly `counts` copies per expert, each token's k experts distinct:
    the experts' copies laid end to end, copy i going to token i mod tokens (no run is longer than `tokens`)."""
    copies = np.repeat(np.arange(len(counts)), counts)
    return torch.tensor(copies.reshape(top_k, tokens).T.copy(), dtype=torch.long)


class _Forcing:
    """Routing forced to a plan (model.moe_force_routing): the router's scores of the planned experts are used."""

    force: RoutingPlan | None
    """the plan routing is forced to (None: the router chooses)"""
    source: int
    """this rank's token source index (Layout.token_source)"""

    def forced(self, layer: int, tokens: int, top_k: int) -> torch.Tensor | None:
        if self.force is None:
            return None
        return forced_choices(self.force.of_layer(layer)[self.source], tokens, top_k)


class RouterCounts(_Forcing):
    """Real runs: the router decides (or `force`, a plan, does). Optionally records what was decided.
    group: the tep group (of `sources` ranks), of kind `group_kind` ('ep' where it is the ep group, etp = 1)."""

    def __init__(self, num_experts: int, group, source: int, histogram: RoutingHistogram | None = None,
                 force: RoutingPlan | None = None, group_kind: str = "ep"):
        self.num_experts, self.group, self.source, self.histogram = num_experts, group, source, histogram
        self.force, self.group_kind = force, group_kind

    def local(self, layer: int, counts: torch.Tensor) -> list[int]:
        """counts: this rank's tokens per expert, as the router computed them."""
        values = counts.tolist()  # (no op of the step: the recorder sees none)
        if self.histogram is not None:
            self.histogram.add(layer, self.source, values)
        return values

    def everyone(self, layer: int, counts: torch.Tensor, sources: int) -> np.ndarray:
        """[sources, experts]: every token source's tokens per expert."""
        return np.asarray(_gather_counts(counts, self.group, sources, self.group_kind).tolist(), dtype=np.int64)


class PlannedCounts(_Forcing):
    """Traces: the plan decides (the router's counts are fake); the same ops and all-gather are issued."""

    def __init__(self, plan: RoutingPlan, group, source: int, force: bool = False, group_kind: str = "ep"):
        self.plan, self.group, self.source, self.group_kind = plan, group, source, group_kind
        self.force = plan if force else None

    def local(self, layer: int, counts: torch.Tensor) -> list[int]:
        return self.plan.of_layer(layer)[self.source].tolist()

    def everyone(self, layer: int, counts: torch.Tensor, sources: int) -> np.ndarray:
        _gather_counts(counts, self.group, sources, self.group_kind)
        return self.plan.of_layer(layer)


def _gather_counts(counts: torch.Tensor, group, sources: int, group_kind: str) -> torch.Tensor:
    """[sources, experts] tokens per (source rank, expert): Megatron-Core all-gathers the ranks' counts over the
    ranks that exchange tokens (its tp-ep group), then reads them on the host to size the exchanges."""
    if sources == 1:
        return counts.unsqueeze(0)
    out = counts.new_empty(sources * counts.numel())
    with observer().communication(group_kind=group_kind):
        all_gather_flat(out, counts, group=group)
    return out.view(sources, -1)


class RoutingHistogram:
    """Tokens per (MoE layer, source ep rank, expert) counted over a run: the exporter hook.

    trainsim's own real runs fill it through `RouterCounts`; a user's PyTorch MoE layer calls
    `add_choices(layer, ep_rank, indices, num_experts)` from its router's forward (a forward hook will do) and
    `write` at the end; the file is a `model.moe_routing` input."""

    def __init__(self):
        self.tokens: dict[tuple[int, int], np.ndarray] = {}

    def add(self, layer: int, ep_rank: int, counts) -> None:
        """counts: tokens per expert (a 1-D tensor or sequence)."""
        counts = np.asarray(counts.tolist() if isinstance(counts, torch.Tensor) else counts, dtype=np.int64)
        key = (int(layer), int(ep_rank))
        old = self.tokens.get(key, np.zeros(0, dtype=np.int64))
        size = max(len(old), len(counts))
        self.tokens[key] = np.pad(old, (0, size - len(old))) + np.pad(counts, (0, size - len(counts)))

    def add_choices(self, layer: int, ep_rank: int, experts: torch.Tensor, num_experts: int) -> None:
        """experts: the router's chosen expert indices (any shape), e.g. the top-k indices."""
        self.add(layer, ep_rank, torch.bincount(experts.flatten(), minlength=num_experts))

    def clear(self) -> None:
        self.tokens.clear()

    def merge(self, other: RoutingHistogram) -> None:
        for (layer, ep_rank), counts in other.tokens.items():
            self.add(layer, ep_rank, counts)

    def rows(self) -> list[tuple[int, int, int, int]]:
        return [(layer, ep_rank, expert, int(n)) for (layer, ep_rank), counts in sorted(self.tokens.items())
                for expert, n in enumerate(counts)]

    def write(self, path: Path, source: str) -> None:
        """Write atomically, with a header naming the run it came from."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        lines = [f"# routing histogram: {source}", ",".join(HISTOGRAM_COLUMNS)]
        lines += [",".join(map(str, row)) for row in self.rows()]
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(path)
