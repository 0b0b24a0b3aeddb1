"""From a class's one-micro-batch trace to the full op sequence of any rank in a step.

The trace holds one forward and one backward per chunk; a step runs them once per micro-batch in
the order of the pipeline schedule, with the once-per-step events only in each chunk's first forward
(the overlapped parameter all-gather) and last backward (the gradient sync), and the optimizer at
the end. Ranks of a class differ only in the members of their groups and their P2P peers, which are
renamed here.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainsim.parallel.layout import EXPERT_GROUP_KINDS, GROUP_KINDS, Layout
from trainsim.parallel.phases import COMBINED, direction_of, pass_of
from trainsim.parallel.schedules import (
    Action,
    combined_chunk,
    first_forward_microbatch,
    last_backward_microbatch,
    num_chunks,
    passes,
)


def expand_step(class_events: pd.DataFrame, actions: list[Action]) -> pd.DataFrame:
    """Events of one rank class repeated along `actions`, with the micro-batch of each occurrence (a combined
    pass's: its forward's for the forward half, its backward's for the other)."""
    last_mb = last_backward_microbatch(actions)
    first_mb = first_forward_microbatch(actions)
    passes_of = class_events["phase"].map(pass_of)
    by_pass = {(name, chunk): group for (name, chunk), group in class_events.groupby([passes_of, "chunk"], sort=False)}
    pieces = []
    v = num_chunks(actions)
    for group in passes(actions):
        if len(group) == 2:  # (combined passes hold no once-per-step work: see schedules.pipeline_actions)
            f, b = group
            events = by_pass[(COMBINED, combined_chunk(f, b, v))]
            backward = events["phase"].map(direction_of).to_numpy() == "backward"
            pieces.append(events.assign(microbatch=np.where(backward, b.microbatch, f.microbatch)))
            continue
        (action,) = group
        phase = "forward" if action.kind == "F" else "backward"
        events = by_pass.get((phase, action.chunk))
        if events is None:
            continue
        once = (first_mb if action.kind == "F" else last_mb)[action.chunk]
        if action.microbatch != once:
            events = events[events["per_microbatch"]]
        pieces.append(events.assign(microbatch=action.microbatch))
    optimizer = class_events[class_events["phase"] == "optimizer"]
    pieces.append(optimizer)
    return pd.concat(pieces, ignore_index=True)


def rename_for_rank(events: pd.DataFrame, layout: Layout, representative: int, rank: int) -> pd.DataFrame:
    """Rewrite the group members and P2P peers of `representative`'s events as seen from `rank`.

    Groups of a kind in GROUP_KINDS become `rank`'s own; a peer keeps its offset inside the P2P's group
    (next pipeline stage stays next stage, wrapping around for interleaved schedules; next rank of a
    tensor-parallel ring stays next).
    """
    kinds = set(GROUP_KINDS + EXPERT_GROUP_KINDS) & set(events["group_kind"].dropna()) | {"pp"}
    groups = {kind: layout.group_ranks(rank, kind) for kind in kinds}
    own = {kind: layout.group_ranks(representative, kind) for kind in kinds}

    def peer(p: int, kind) -> int:
        if p < 0:
            return -1
        members, mine = own[kind], groups[kind]
        offset = members.index(int(p)) - members.index(representative)
        return mine[(mine.index(rank) + offset) % len(mine)]

    out = events.copy()
    out["group_ranks"] = [groups.get(kind, members) if kind is not None else None
                          for kind, members in zip(out["group_kind"], out["group_ranks"])]
    out["peer"] = [peer(p, kind if kind in groups else "pp") for p, kind in zip(out["peer"], out["group_kind"])]
    return out
