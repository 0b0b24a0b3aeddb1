"""Rank classes of the timeline: the trace's classes, split where stragglers break the symmetry.

The trace groups ranks whose graphs are identical up to renaming (a pipeline stage). Timing is
symmetric too, until one rank or node is slower. Then the slow ranks get their own class, and so does
every rank that now waits differently: the refinement repeats "same class, and the members of my
tp / dp / ep groups and my pipeline neighbours are in the same classes" until nothing splits (colour
refinement). One slow rank in a pp x dp x tp grid yields at most 4 classes per stage (the rank, its tp
peers, its dp peers, everyone else), so an 8192-GPU straggler study stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from trainsim.config.schema import HardwareConfig
from trainsim.errors import ConfigError
from trainsim.parallel.layout import Layout


@dataclass(frozen=True)
class TimelineClasses:
    class_of_rank: np.ndarray
    """rank -> timeline class id."""
    base_class: np.ndarray
    """class -> trace rank class (whose graph it runs)."""
    representative: np.ndarray
    """class -> lowest rank in it (whose groups and peers its graph is written for)."""
    compute_factor: np.ndarray
    """class -> multiplier on compute time (stragglers > 1)."""
    size: np.ndarray
    """class -> number of ranks."""

    @property
    def count(self) -> int:
        return len(self.base_class)


def straggler_factors(hw: HardwareConfig, world_size: int) -> np.ndarray:
    """Compute-time multiplier per rank from hardware.stragglers (1 everywhere if none)."""
    factors = np.ones(world_size)
    per_node = hw.devices_per_node or 1
    for i, straggler in enumerate(getattr(hw, "stragglers", []) or []):
        field = f"hardware.stragglers[{i}]"
        if straggler.factor <= 0:
            raise ConfigError(f"{field}.factor={straggler.factor} must be > 0 (1.5 = compute 50% slower)")
        ranks = list(straggler.ranks)
        if straggler.node >= 0:
            if straggler.node * per_node >= world_size:
                raise ConfigError(f"{field}.node={straggler.node} is outside the {world_size} ranks "
                                  f"({per_node} per node); choose 0..{(world_size - 1) // per_node}")
            ranks += range(straggler.node * per_node, min((straggler.node + 1) * per_node, world_size))
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise ConfigError(f"{field}.ranks={bad} outside the world of {world_size} ranks")
        factors[ranks] *= straggler.factor
    return factors


def _grid(layout: Layout, labels: np.ndarray) -> np.ndarray:
    """Labels as a (pp, dp * cp, tp) array (rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank): the
    middle axis is the gradient group, which holds the context-parallel ring too."""
    return labels.reshape(layout.pp, layout.dp * layout.cp, layout.tp)


def _refine_once(layout: Layout, labels: np.ndarray) -> np.ndarray:
    grid = _grid(layout, labels)
    pp, dp, tp = grid.shape
    tp_sig = np.broadcast_to(np.sort(grid, axis=2)[:, :, None, :], (pp, dp, tp, tp))
    dp_sig = np.broadcast_to(np.sort(grid, axis=1).transpose(0, 2, 1)[:, None, :, :], (pp, dp, tp, dp))
    pp_sig = np.broadcast_to(grid.transpose(1, 2, 0)[None, :, :, :], (pp, dp, tp, pp))
    parts = [grid[..., None], tp_sig, dp_sig, pp_sig]
    tep = layout.ep * layout.etp
    if tep > 1:  # the ranks that exchange tokens (etp x ep): consecutive ranks of a stage
        stage = grid.reshape(pp, -1, tep)
        ep_sig = np.broadcast_to(np.sort(stage, axis=2)[:, :, None, :], (*stage.shape, tep))
        parts.append(ep_sig.reshape(pp, dp, tp, tep))
    sig = np.concatenate(parts, axis=3).reshape(pp * dp * tp, -1)
    _, inverse = np.unique(sig, axis=0, return_inverse=True)
    return inverse.reshape(-1)


def _canonical(labels: np.ndarray) -> np.ndarray:
    """Renumber classes by their lowest rank, so ids are stable and class 0 holds rank 0."""
    _, first = np.unique(labels, return_index=True)
    order = np.argsort(first)
    remap = np.empty(len(order), dtype=np.int64)
    remap[order] = np.arange(len(order))
    _, inverse = np.unique(labels, return_inverse=True)
    return remap[inverse]


def timeline_classes(rank_classes: pd.DataFrame, layout: Layout, factors: np.ndarray) -> TimelineClasses:
    """Classes of the step: the trace's, refined until every class is symmetric in timing too."""
    ranks = rank_classes.sort_values("rank")
    if len(ranks) != layout.world_size:
        raise ValueError(f"rank_classes has {len(ranks)} ranks but the layout has {layout.world_size}")
    base_of_rank = ranks["rank_class"].to_numpy()
    _, factor_id = np.unique(factors, return_inverse=True)
    labels = _canonical(base_of_rank * (factor_id.max() + 1) + factor_id)
    if np.any(factors != 1.0):
        while True:
            refined = _canonical(_refine_once(layout, labels))
            if refined.max() == labels.max():
                break
            labels = refined
    count = int(labels.max()) + 1
    representative = np.full(count, np.iinfo(np.int64).max)
    np.minimum.at(representative, labels, np.arange(len(labels)))
    return TimelineClasses(
        class_of_rank=labels,
        base_class=base_of_rank[representative],
        representative=representative,
        compute_factor=factors[representative],
        size=np.bincount(labels, minlength=count),
    )
