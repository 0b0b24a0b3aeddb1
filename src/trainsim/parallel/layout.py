"""Where every rank sits in the dp x cp x tp x pp grid, and which ranks form its process groups.

Rank order follows Megatron-Core's default ('tp-cp-ep-dp-pp' without experts): tp varies fastest, then cp,
then dp, then pp, so tensor-parallel peers share a node, context-parallel peers are next, and pipeline
stages are the outermost split.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP_KINDS = ("tp", "cp", "dp", "pp", "mp", "amax", "dp_shard", "dp_replicate")
"""tp, cp, pp; dp: the ranks that hold the same weights (every dp and cp rank of one model shard: Megatron's
data-parallel group with context parallelism, where gradients are reduced and the distributed optimizer
shards); mp: the model-parallel group (every tp and pp rank of one replica; Megatron's
get_model_parallel_group, where the gradient norm is summed); amax: every dp, cp and tp rank of one
pipeline stage (Megatron's amax-reduction group, over which FP8 delayed scaling reduces its amaxes);
dp_shard, dp_replicate: the dp group cut for HSDP (parallelism.dp_shard_size): dp_shard, dp_shard_size
consecutive members of the dp group (in its order, cp varying fastest), over which the training state is
sharded (torchtitan's flattened dp_shard x cp mesh dimension; Megatron-Core's intra distributed-optimizer
instance group); dp_replicate, the members at the same place of every dp_shard group (torchtitan's
dp_replicate dimension, Megatron's inter-instance group), over which the shards are all-reduced. Without HSDP
dp_shard is dp and dp_replicate the rank alone."""

EXPERT_GROUP_KINDS = ("ep", "etp", "tep", "edp", "emp")
"""Groups of MoE models (Megatron-Core's parallel folding, expert rank order 'tp-ep-dp-pp'): the dp * cp * tp ranks of
a stage, in that rank order, are re-cut into etp x ep x edp, etp varying fastest: etp, the ranks that split each
expert's weights (expert tensor parallelism); ep, the ranks that split the experts and exchange tokens by all-to-all;
tep, the etp x ep ranks of both (Megatron's tp-ep group: where the token counts are gathered, and the all-gather
dispatcher gathers tokens); edp, the ranks holding the same expert shards (where their gradients are reduced); emp,
the tep ranks of every stage of one expert replica (where the experts' gradient norm is summed)."""


@dataclass(frozen=True)
class RankPosition:
    rank: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    cp_rank: int = 0


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dp_shard: int = 0
    """Members of a dp_shard group (parallelism.dp_shard_size); 0: the whole dp group."""

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage."""
        return self.dp * self.cp * self.tp

    @property
    def expert_replicas(self) -> int:
        """Ranks of a stage holding the same expert shards (the edp group)."""
        return self.stage_size // (self.ep * self.etp)

    def token_source(self, rank: int) -> int:
        """Position of `rank` in its tep group: the index of the tokens it routes among the ranks that exchange
        them (= its ep rank with expert tensor parallelism 1)."""
        return rank % self.stage_size % (self.ep * self.etp)

    @property
    def token_group_kind(self) -> str:
        """Kind of the group whose ranks exchange tokens: 'ep', or 'tep' with expert tensor parallelism."""
        return "ep" if self.etp == 1 else "tep"

    def ep_rank(self, rank: int) -> int:
        """Position of `rank` in its expert-parallel group (which experts it holds)."""
        return self.token_source(rank) // self.etp

    def etp_rank(self, rank: int) -> int:
        """Position of `rank` in its expert-tensor-parallel group (which slice of its experts' weights it holds)."""
        return rank % self.etp

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def rank_of(self, dp_rank: int, tp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def position(self, rank: int) -> RankPosition:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size} ranks")
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return RankPosition(rank, dp_rank, tp_rank, pp_rank, cp_rank)

    def group_ranks(self, rank: int, kind: str) -> list[int]:
        """Members of `rank`'s group of the given kind (GROUP_KINDS), in group-rank order."""
        p = self.position(rank)
        d, t, s, c = p.dp_rank, p.tp_rank, p.pp_rank, p.cp_rank
        if kind == "tp":
            return [self.rank_of(d, i, s, c) for i in range(self.tp)]
        if kind == "cp":
            return [self.rank_of(d, t, s, i) for i in range(self.cp)]
        if kind == "dp":
            return [self.rank_of(i, t, s, j) for i in range(self.dp) for j in range(self.cp)]
        if kind == "pp":
            return [self.rank_of(d, t, i, c) for i in range(self.pp)]
        if kind == "mp":
            return [self.rank_of(d, i, j, c) for j in range(self.pp) for i in range(self.tp)]
        if kind in ("dp_shard", "dp_replicate"):
            members = self.group_ranks(rank, "dp")
            shard = self.dp_shard or len(members)
            start, place = divmod(members.index(rank), shard)
            if kind == "dp_shard":
                return members[start * shard:(start + 1) * shard]
            return members[place::shard]
        if kind == "amax":
            return [self.rank_of(i, k, s, j) for i in range(self.dp) for j in range(self.cp) for k in range(self.tp)]
        base, local = divmod(rank, self.stage_size)
        base *= self.stage_size
        tep = self.ep * self.etp
        edp_rank, source = divmod(local, tep)
        ep_rank, etp_rank = divmod(source, self.etp)
        replica = base + edp_rank * tep
        if kind == "etp":
            return [replica + ep_rank * self.etp + i for i in range(self.etp)]
        if kind == "ep":
            return [replica + i * self.etp + etp_rank for i in range(self.ep)]
        if kind == "tep":
            return [replica + i for i in range(tep)]
        if kind == "edp":
            return [base + j * tep + source for j in range(self.expert_replicas)]
        if kind == "emp":
            return [j * self.stage_size + edp_rank * tep + i for j in range(self.pp) for i in range(tep)]
        raise ValueError(f"group kind {kind!r}; accepted: {', '.join(GROUP_KINDS + EXPERT_GROUP_KINDS)}")

    def all_groups(self, kind: str) -> list[list[int]]:
        """Every group of one kind, each once (what a real run must create on all ranks)."""
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(tuple(self.group_ranks(rank, kind)), None)
        return [list(g) for g in seen]

    def stage_representative(self, pp_rank: int) -> int:
        """The rank traced for pipeline stage `pp_rank` (dp_rank = tp_rank = 0)."""
        return self.rank_of(0, 0, pp_rank)


def layout_of(par) -> Layout:
    """The layout of a ParallelismConfig."""
    return Layout(dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, etp=par.etp, dp_shard=par.dp_shard_size)
