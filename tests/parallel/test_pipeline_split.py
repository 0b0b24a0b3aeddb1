"""Pipeline splits as Megatron-Core builds them: uneven end stages with virtual stages, the embedding and loss counted
as layers, explicit layouts; the splits it refuses are refused with its reason."""

from __future__ import annotations

import pytest

from trainsim.config import compose_run
from trainsim.errors import ConfigError
from trainsim.parallel.pipeline_split import PipelineSplitError, parse_pipeline_layout, pipeline_split


def _chunks(split):
    """Per virtual stage (c * pp + r, in that order), its layers."""
    return [list(split.layers(r, c)) for c in range(split.virtual_stages) for r in range(split.pp)]


@pytest.mark.parametrize("pp, v", [(8, 8), (16, 4), (8, 2)])
def test_llama405b_with_embedding_and_loss_counted_as_megatron_bridge_writes_it(pp, v):
    """126 layers + embedding + loss = 128 slots: every chunk 128 / (pp * v) layers, one fewer on the first
    and the last virtual stage (Megatron-Bridge's Llama 3.1 405B recipes)."""
    split = pipeline_split(126, pp, v, account_for_embedding=True, account_for_loss=True)
    per_chunk = 128 // (pp * v)
    chunks = _chunks(split)
    assert [len(c) for c in chunks] == [per_chunk - 1] + [per_chunk] * (pp * v - 2) + [per_chunk - 1]
    assert sum(chunks, []) == list(range(126))  # in virtual-stage order, as Megatron's layer offsets
    assert split.holds_embedding(0, 0) and split.holds_loss(pp - 1, v - 1)


@pytest.mark.parametrize("pp, v, layout", [(4, 4, "Et*4|(tttt|)*14tL"), (8, 4, "Et|(tt|)*30L"),
                                           (8, 2, "Et*4|(t*4|)*14,tL")])
def test_deepseek_v3_explicit_layouts(pp, v, layout):
    """Megatron-Bridge's DeepSeek-V3 layouts (its MTP layer left out): 61 layers over pp * v stages."""
    split = pipeline_split(61, pp, v, layout=layout)
    stages = parse_pipeline_layout(layout)
    assert len(stages) == pp * v
    assert [len(c) for c in _chunks(split)] == [s.count("t") for s in stages]
    assert sum(_chunks(split), []) == list(range(61))


def test_uneven_first_and_last_stages_with_virtual_stages():
    """first / last layers split over the chunks of the first / last rank; layers numbered by virtual stage."""
    split = pipeline_split(20, 4, 2, first=2, last=2)  # middle ranks: (20 - 4) / 2 = 8 layers, 4 per chunk
    assert split.counts == ((1, 1), (4, 4), (4, 4), (1, 1))
    assert _chunks(split) == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9], [10], [11, 12, 13, 14], [15, 16, 17, 18], [19]]


@pytest.mark.parametrize("kwargs, reason", [
    ({"num_layers": 126, "pp": 16, "virtual_stages": 4, "first": 7, "last": 7}, "first stage, 7, must be divisible"),
    ({"num_layers": 20, "pp": 4, "virtual_stages": 4, "first": 4, "last": 4}, "middle pipeline rank, 6, must be "),
    ({"num_layers": 126, "pp": 16, "virtual_stages": 4, "first": 4, "account_for_loss": True},
     "cannot be set together"),
    ({"num_layers": 126, "pp": 16, "virtual_stages": 16, "account_for_embedding": True, "account_for_loss": True},
     "8 layers of pipeline rank 0 are not divisible by the virtual pipeline parallel degree 16"),
    ({"num_layers": 126, "pp": 16, "account_for_embedding": True}, "127 layers .*not divisible by the pipeline"),
    ({"num_layers": 4, "pp": 2, "layout": "Ett|ttL", "account_for_loss": True}, "cannot be set with other"),
    ({"num_layers": 4, "pp": 2, "layout": "Ett|tt|L"}, "3 stages are not divisible by the pipeline parallel size 2"),
    ({"num_layers": 4, "pp": 2, "layout": "Ett|t|t|L"}, "virtual_stages=1 conflicts .*set parallelism.virtual_stag"),
    ({"num_layers": 4, "pp": 2, "layout": "tEt|ttL"}, "first layer must be the embedding"),
    ({"num_layers": 4, "pp": 2, "layout": "Ett|tLt"}, "last layer must be the loss"),
    ({"num_layers": 4, "pp": 2, "layout": "Ett|t|Et|L", "virtual_stages": 2},
     "embedding 'E' must be specified exactly once"),
    ({"num_layers": 4, "pp": 2, "layout": "Et|tL"}, "number of transformer layers 't', 2, must match num_layers 4"),
    ({"num_layers": 4, "pp": 2, "layout": "Ett|ttmL"}, "multi-token prediction .* not built"),
    ({"num_layers": 4, "pp": 2, "layout": "Ett|tx*1L"}, "invalid layer character 'x'"),
    ({"num_layers": 8, "pp": 2, "layout": "E((tt)*2)*2|tttt,L"}, "invalid layer character '\\('"),
])
def test_splits_megatron_refuses_are_refused_with_its_reason(kwargs, reason):
    with pytest.raises(PipelineSplitError, match=reason):
        pipeline_split(**kwargs)


def test_layout_repeats_and_empty_stages():
    """'(...)*n' and 'x*n' unroll, commas are cosmetic; a stage may hold no layers (a standalone loss stage)."""
    assert parse_pipeline_layout("Et*3|(tt|)*2,t,L") == ["Ettt", "tt", "tt", "tL"]
    split = pipeline_split(4, 2, 2, layout="Et|tt|t|L")
    assert split.counts == ((1, 1), (2, 0))


def test_config_accepts_the_split_and_names_the_fields_it_refuses():
    """Through compose_run: the fields a refusal comes from are named with their values."""
    run = compose_run(["parallelism=pp2-interleaved", "model.num_layers=6",
                       "parallelism.account_for_embedding_in_pipeline_split=true",
                       "parallelism.account_for_loss_in_pipeline_split=true"], check="layout")
    assert run.parallelism.account_for_loss_in_pipeline_split
    with pytest.raises(ConfigError, match=r"parallelism.pipeline_layout='Ett\|tt\|L' with parallelism.pp=2, "
                                          r"virtual_stages=2 .*not divisible by the pipeline parallel size 2"):
        compose_run(["parallelism=pp2-interleaved", "parallelism.pipeline_layout=Ett|tt|L"], check="layout")


def test_traced_stages_hold_the_layers_the_layout_gives_them():
    """Memory follows the split: a middle stage with two layers holds more weights than one with one (they are
    traced apart, not as one middle stage), and the last stage, holding only the output layer and the loss,
    holds the head alone."""
    from trainsim.trace import trace_layout

    run = compose_run(["parallelism=pp2", "parallelism.pp=4", "parallelism.pipeline_layout=Et|tt|t|L"],
                      check="layout")
    memory = trace_layout(run.model, run.parallelism).memory.to_pandas().set_index("rank_class")
    weights = memory["parameter_bytes"]
    layer = weights[1] - weights[2]
    assert layer > 0
    even = compose_run(["parallelism=pp2", "parallelism.pp=4"], check="layout")
    even_weights = trace_layout(even.model, even.parallelism).memory.to_pandas().set_index("rank_class")
    assert weights[0] == even_weights["parameter_bytes"][0]  # embedding and one layer, as the even split
    assert weights[3] == even_weights["parameter_bytes"][3] - layer  # the head, without its layer


def test_step_time_and_memory_follow_the_split():
    """All four layers on the first stage and the last holding only the head: the first stage holds more, the last
    less, and the step takes longer than with the even split (the first stage's work sets the pace)."""
    from trainsim.profile.analytical import predict_rows
    from trainsim.profile.stage import distinct_ops
    from trainsim.timeline import compose_step
    from trainsim.timeline.costs import ConstantSlowdown
    from trainsim.timeline.stage import comm_model
    from trainsim.trace import trace_layout

    def step(*overrides):
        run = compose_run(["hardware=h100-sxm-dgx", "parallelism=pp2", "parallelism.global_batch_size=8", *overrides])
        result = trace_layout(run.model, run.parallelism)
        graph, rank_classes = result.graph.to_pandas(), result.rank_classes.to_pandas()
        ops = distinct_ops(graph)
        times = dict(zip(ops["signature"], predict_rows(ops, run.hardware)))
        timeline = compose_step(graph, rank_classes, run.parallelism, run.hardware, times,
                                comm_model(run.hardware, None), ConstantSlowdown(0.2, name="constant"))
        return timeline.step_time_s, list(result.memory.to_pandas().sort_values("rank_class")["peak_bytes"])

    even_s, even_peak = step()
    skewed_s, skewed_peak = step("parallelism.pipeline_layout=Etttt|L")
    assert skewed_s > 1.2 * even_s
    assert skewed_peak[0] > even_peak[0] and skewed_peak[1] < even_peak[1]


@pytest.mark.parametrize("overrides", [
    ["model=llama3.1-405b", "parallelism=tp8-sp-pp16-vp4-dp128", "parallelism.pp=8", "parallelism.virtual_stages=8",
     "parallelism.dp=256", "parallelism.global_batch_size=2048"],
    ["model=llama3.1-405b", "parallelism=tp8-sp-pp16-vp4-dp128"],
    ["model=deepseek-v3", "parallelism=ep64-pp16-dp128", "parallelism.last_stage_layers=0", "parallelism.pp=4",
     "parallelism.dp=512", "parallelism.global_batch_size=8192", "parallelism.schedule=interleaved-1f1b",
     "parallelism.virtual_stages=4",
     "parallelism.pipeline_layout='Et*4|(tttt|)*14tL'"],
    ["model=deepseek-v3", "parallelism=ep64-pp16-dp128", "parallelism.last_stage_layers=0", "parallelism.pp=8",
     "parallelism.dp=256", "parallelism.global_batch_size=8192", "parallelism.schedule=interleaved-1f1b",
     "parallelism.virtual_stages=4",
     "parallelism.pipeline_layout='Et|(tt|)*30L'"],
], ids=["llama405b-pp8-vp8", "llama405b-pp16-vp4", "deepseek-v3-pp4-vp4", "deepseek-v3-pp8-vp4"])
def test_megatron_bridge_layouts_compose_as_written(overrides):
    run = compose_run(overrides, check="layout")
    assert run.parallelism.pp * run.parallelism.virtual_stages in (16, 32, 64)


def test_a_virtual_stage_of_dense_layers_only_in_a_mixture_of_experts_traces():
    """DeepSeek-V3's layout puts its first (dense) layer alone on the first virtual stage: that chunk has no
    experts, the others do, and the step's gradient buckets follow the chunks that hold them."""
    from trainsim.trace import trace_layout

    run = compose_run(["model.num_experts=4", "model.moe_top_k=2", "model.moe_first_dense_layers=1",
                       "parallelism=pp2-interleaved", "parallelism.pipeline_layout=Et|t|t|tL",
                       "parallelism.zero_stage=1"], check="layout")
    memory = trace_layout(run.model, run.parallelism).memory.to_pandas()
    assert len(memory) == 2 and (memory["parameter_bytes"] > 0).all()
