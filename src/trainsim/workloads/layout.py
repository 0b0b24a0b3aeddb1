"""Where every rank sits in the dp x tp x pp grid, and which ranks form its process groups.

Rank order follows Megatron-LM's default ('tp-dp-pp'): tp varies fastest, then dp, then pp,
so tensor-parallel peers share a node and pipeline stages are the outermost split.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP_KINDS = ("tp", "dp", "pp", "mp", "amax")
"""tp, dp, pp; mp: the model-parallel group (every tp and pp rank of one replica; Megatron's
get_model_parallel_group, where the gradient norm is summed); amax: every dp and tp rank of one pipeline
stage (Megatron's amax-reduction group, over which FP8 delayed scaling reduces its amaxes)."""


@dataclass(frozen=True)
class RankPosition:
    rank: int
    dp_rank: int
    tp_rank: int
    pp_rank: int


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def rank_of(self, dp_rank: int, tp_rank: int, pp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def position(self, rank: int) -> RankPosition:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size} ranks")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return RankPosition(rank, dp_rank, tp_rank, pp_rank)

    def group_ranks(self, rank: int, kind: str) -> list[int]:
        """Members of `rank`'s group of the given kind (GROUP_KINDS), in group-rank order."""
        p = self.position(rank)
        if kind == "tp":
            return [self.rank_of(p.dp_rank, t, p.pp_rank) for t in range(self.tp)]
        if kind == "dp":
            return [self.rank_of(d, p.tp_rank, p.pp_rank) for d in range(self.dp)]
        if kind == "pp":
            return [self.rank_of(p.dp_rank, p.tp_rank, s) for s in range(self.pp)]
        if kind == "mp":
            return [self.rank_of(p.dp_rank, t, s) for s in range(self.pp) for t in range(self.tp)]
        if kind == "amax":
            return [self.rank_of(d, t, p.pp_rank) for d in range(self.dp) for t in range(self.tp)]
        raise ValueError(f"group kind {kind!r}; accepted: {', '.join(GROUP_KINDS)}")

    def all_groups(self, kind: str) -> list[list[int]]:
        """Every group of one kind, each once (what a real run must create on all ranks)."""
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(tuple(self.group_ranks(rank, kind)), None)
        return [list(g) for g in seen]

    def stage_representative(self, pp_rank: int) -> int:
        """The rank traced for pipeline stage `pp_rank` (dp_rank = tp_rank = 0)."""
        return self.rank_of(0, 0, pp_rank)
