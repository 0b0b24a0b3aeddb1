"""Ex-situ tracing: what the execution graph says about a step, checked against hand counts."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainsim.config import compose_run
from trainsim.errors import TraceError
from trainsim.trace import trace_layout
from trainsim.trace.expand import rename_for_rank
from trainsim.trace.tracer import trace_rank
from trainsim.workloads.model import padded_vocab_size
from trainsim.workloads.train_step import layout_of


def _trace(*overrides):
    run = compose_run(list(overrides), check="layout")
    return run, trace_layout(run.model, run.parallelism)


def _comm(graph: pd.DataFrame) -> pd.DataFrame:
    return graph[graph["kind"].isin(["collective", "p2p"])]


def test_dp_gradients_are_all_reduced_in_buckets_once_per_step():
    run, result = _trace("parallelism=dp2", "parallelism.dp_bucket_size_bytes=300000")
    graph = result.graph.to_pandas()
    dp = _comm(graph)
    assert set(dp["collective"]) == {"all_reduce"} and set(dp["group_kind"]) == {"dp"}
    assert not dp["per_microbatch"].any()  # only in the last micro-batch's backward
    assert (dp["phase"] == "backward").all()  # overlapped with backward, not after it
    parameter_bytes = result.memory.to_pandas()["parameter_bytes"].iloc[0]
    assert dp["message_bytes"].sum() == parameter_bytes  # every gradient exactly once
    assert len(dp) >= 3  # 1.08 MB of fp32 gradients in ~300 kB buckets
    assert dp["group_ranks"].map(list).tolist() == [[0, 1]] * len(dp)


def test_tp_collectives_follow_megatron():
    run, result = _trace("parallelism=tp2")
    comm = _comm(result.graph.to_pandas())
    layers = run.model.num_layers
    forward = comm[comm["phase"] == "forward"]
    backward = comm[comm["phase"] == "backward"]
    # forward: embedding + 2 per layer (attention, MLP) + 3 for the vocab-parallel loss
    assert len(forward) == 1 + 2 * layers + 3
    # backward: 2 per layer (f of attention and MLP) + 1 for the output layer's input
    assert len(backward) == 2 * layers + 1
    activation_bytes = run.parallelism.micro_batch_size * run.model.seq_length * run.model.hidden_size * 4
    assert (forward["message_bytes"].iloc[1:1 + 2 * layers] == activation_bytes).all()
    assert set(comm["group_kind"]) == {"tp"}


def test_sequence_parallel_embeddings_reduce_scatter_unless_positions_are_added_after_the_lookup():
    """Megatron-Core's reduce_scatter_embeddings (torchtitan's Shard(1) embedding output): a Llama embedding's
    partial sums go straight to the token shards; GPT adds learned positions to the whole sequence first."""
    for model, first in (("llama3-8b", "reduce_scatter"), ("gpt-small", "all_reduce")):
        _, result = _trace(f"model={model}", "model.num_layers=1", "model.hidden_size=128",
                           "model.num_attention_heads=8", "model.num_kv_heads=4", "model.ffn_hidden_size=256",
                           "model.seq_length=64", "model.vocab_size=512", "parallelism=tp2",
                           "parallelism.sequence_parallel=true")
        comm = _comm(result.graph.to_pandas())
        assert comm[comm["phase"] == "forward"]["collective"].iloc[0] == first


def test_overlapped_tensor_parallel_reduce_scatters_note_their_communication_kernels():
    import json

    run, result = _trace("parallelism=tp2", "parallelism.sequence_parallel=true", "parallelism.tp_comm_overlap=true")
    graph = result.graph.to_pandas()
    notes = graph["op_args"].map(lambda a: {k: v for k, v in json.loads(a).items() if k not in ("args", "kwargs")})
    mm = graph["op"].str.startswith("aten::mm") & (graph["phase"] != "optimizer")
    layers = run.model.num_layers
    # the row-parallel linears' forward GEMMs (2 per layer, tp blocks) feed a reduce-scatter, whose
    # communication kernels hold SMs and do its additions; the column-parallel ones' input gradients are whole
    # GEMMs reduce-scattered in bulk behind the weight gradient (Transformer Engine's defaults)
    assert (notes[mm].map(lambda n: n.get("comm_sms", 0)) == 16).sum() == 2 * layers * 2
    adds = notes[notes.map(lambda n: "comm_kernel" in n)]
    assert (graph.loc[adds.index, "op"] == "aten::add_.Tensor").all() and len(adds) == 2 * layers * (2 - 1)
    assert notes[graph["kind"] != "compute"].map(len).eq(0).all()


def test_fused_attention_notes_the_dropout_its_cpu_kernel_leaves_out_forward_and_backward():
    import json

    from trainsim.profile.analytical import kernel_notes

    _, result = _trace("model.attention=fused", "model.attention_dropout=0.1")
    graph = result.graph.to_pandas()
    attention = graph[graph["op"].str.contains("scaled_dot_product")]
    assert set(attention["phase"]) == {"forward", "backward"}
    assert (attention["op_args"].map(lambda a: kernel_notes(a).get("dropout_p")) == 0.1).all()
    # the kernel traced on the CPU ran without it
    assert (attention["op_args"].map(lambda a: [x for x in json.loads(a)["args"] if isinstance(x, float)][0])
            == 0.0).all()
    # no other kernel carries the note (the backward's hooks put the notes back; its views have no kernel)
    others = graph.drop(attention.index)
    assert others.loc[~others["no_kernel"], "op_args"].map(lambda a: "dropout_p" not in a).all()
    _, plain = _trace("model.attention=fused", "model.attention_dropout=0.0")
    assert plain.graph.to_pandas()["op_args"].map(lambda a: "dropout_p" not in a).all()


def test_pp_stages_exchange_activations_and_gradients():
    run, result = _trace("parallelism=pp2")
    comm = _comm(result.graph.to_pandas())
    first, last = comm[comm["rank_class"] == 0], comm[comm["rank_class"] == 1]
    def calls(events):
        return list(zip(events["phase"], events["collective"], events["peer"]))

    # and the gradient norm summed over the model-parallel group (the pipeline group here)
    assert calls(first) == [("forward", "send", 1), ("backward", "recv", 1), ("optimizer", "all_reduce", -1)]
    assert calls(last) == [("forward", "recv", 0), ("backward", "send", 0), ("optimizer", "all_reduce", -1)]
    assert result.rank_classes.num_rows == 2


def test_matmul_flops_and_no_kernel_views():
    run, result = _trace("parallelism=single")
    graph = result.graph.to_pandas()
    mm = graph[graph["op"] == "aten::addmm"].iloc[0]
    shapes = eval(mm["input_shapes"])  # [bias, input, weight^T]
    m, k = shapes[1]
    n = shapes[2][1]
    assert mm["flops"] == 2 * m * n * k
    views = graph[graph["op"].isin(["aten::view", "aten::t", "aten::transpose.int", "aten::detach"])]
    assert len(views) > 0 and views["no_kernel"].all() and (views["flops"] == 0).all()
    compute = graph[(graph["kind"] == "compute") & ~graph["no_kernel"]]
    assert (compute["bytes_moved"] > 0).all()


def test_forward_matmul_flops_match_the_6nd_rule():
    # training FLOPs ~ 6 * params * tokens (Kaplan et al. 2020) for the matmul part, without attention
    run, result = _trace("model=gpt-small", "parallelism=single", "parallelism.global_batch_size=2")
    graph = result.graph.to_pandas()
    m = run.model
    block_params = 12 * m.hidden_size**2 * m.num_layers
    head_params = padded_vocab_size(m.vocab_size, 1) * m.hidden_size
    tokens = run.parallelism.micro_batch_size * m.seq_length
    matmul = graph["op"].isin(["aten::addmm", "aten::mm", "aten::bmm"])
    total = graph.loc[matmul & (graph["phase"] != "optimizer"), "flops"].sum()
    assert total == pytest.approx(6 * (block_params + head_params) * tokens, rel=0.01)


def test_collectives_depend_on_their_producers():
    _, result = _trace("parallelism=tp2")
    graph = result.graph.to_pandas().set_index("id")
    for event_id, event in _comm(graph.reset_index()).set_index("id").iterrows():
        assert len(event["deps"]) > 0 and all(d < event_id for d in event["deps"])
        consumers = graph[graph["deps"].map(lambda deps, e=event_id: e in deps)]
        assert len(consumers) > 0, f"nothing reads the result of collective {event_id}"


def test_a_ring_step_waits_for_the_block_it_multiplies_and_no_other():
    """c10d's recv_ declares no write: the GEMM on a received block must still depend on that recv, or an
    overlap ring hides its communication whatever it costs. Dependencies are by byte range: the GEMM on the block
    a rank holds does not wait for the block arriving in another slice of the same buffer."""
    _, result = _trace("parallelism=tp2", "parallelism.sequence_parallel=true", "parallelism.tp_comm_overlap=true",
                       "model.num_layers=1")
    graph = result.graph.to_pandas()
    forward = graph[graph["phase"] == "forward"].reset_index(drop=True)
    recv = forward.index[forward["collective"] == "recv"][0]  # the first ring's only hop (tp 2)
    gemms = forward.index[(forward["op"] == "aten::mm.out") & (forward.index > recv)][:2]
    held, received = forward.loc[gemms, "deps"]
    recv_id = forward.loc[recv, "id"]
    assert recv_id not in held and recv_id in received

def test_a_freed_storage_leaves_no_writer_to_one_allocated_where_it_was():
    """Storages are keyed by address, which a later one may reuse: a constant or an empty buffer there was
    written by nobody. (Before, such ops inherited the freed storage's writer, so traces depended on the
    process's allocation history and differed between processes.)"""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainsim.trace.recorder import ExecutionRecorder

    run = compose_run([], check="layout")
    recorder = ExecutionRecorder(layout_of(run.parallelism), 0)
    freed, reallocated = set(), set()
    with FakeTensorMode(), recorder:
        x = torch.zeros(4)
        for _ in range(200):
            y = x + 1
            freed.add(y.untyped_storage()._cdata)
            del y
            for fresh in (torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.empty(4)):
                reallocated.add(fresh.untyped_storage()._cdata)
    events = pd.DataFrame(recorder.events)
    assert freed & reallocated, "no address was reused: the check below would prove nothing"
    fresh_ops = events[events["op"].isin(["aten::lift_fresh", "aten::empty.memory_format"])]
    assert len(fresh_ops) >= 200 and all(len(deps) == 0 for deps in fresh_ops["deps"])


def test_optimizer_is_one_fused_adam_kernel_not_per_parameter_host_reads():
    _, result = _trace("parallelism.precision=bf16")
    optimizer = result.graph.to_pandas().query("phase == 'optimizer'")
    ops = optimizer["op"].value_counts()
    assert ops.get("aten::_fused_adamw_") == 1 and "aten::_local_scalar_dense" not in ops
    # the bf16 -> fp32 grad copy and the copy back are one multi-tensor op each, as in Megatron and
    # DeepSpeed: no op per parameter for the host to dispatch
    # gradient clipping adds one multi-tensor norm and one multi-tensor scale, and scalar ops between them
    assert ops.get("aten::_foreach_norm.Scalar") == 1 and ops.get("aten::_foreach_mul_.Tensor") == 1
    assert ops.get("aten::_foreach_copy_") == 2 and len(optimizer) <= 14, ops.to_dict()


def test_memory_accounts_mixed_precision_and_schedule():
    run, result = _trace("model=gpt-small", "parallelism=pp2", "parallelism.precision=bf16",
                         "parallelism.schedule=gpipe")
    mem = result.memory.to_pandas().set_index("rank_class")
    params = mem["parameter_bytes"] // 2  # bf16
    assert (mem["gradient_bytes"] == mem["parameter_bytes"]).all()
    assert (mem["optimizer_state_bytes"] == 16 * params).all()  # fp32 master weights, grads, two Adam moments
    assert (mem["max_inflight_microbatches"] == run.parallelism.num_microbatches).all()  # GPipe keeps all
    one_f1b = _trace("model=gpt-small", "parallelism=pp2", "parallelism.precision=bf16")[1].memory.to_pandas()
    assert one_f1b["max_inflight_microbatches"].tolist() == [2, 1]
    assert (one_f1b["peak_bytes"] < mem["peak_bytes"].values).all()


def test_recompute_trades_activation_memory_for_recomputed_ops():
    base = _trace("model=gpt-small", "parallelism=single")[1]
    full = _trace("model=gpt-small", "parallelism=single", "parallelism.recompute=full")[1]
    selective = _trace("model=gpt-small", "parallelism=single", "parallelism.recompute=selective")[1]
    act = {name: r.memory.to_pandas()["activation_bytes_per_microbatch"].iloc[0]
           for name, r in (("none", base), ("full", full), ("selective", selective))}
    assert act["full"] < act["selective"] <= act["none"]
    flops = {name: r.graph.to_pandas()["flops"].sum() for name, r in (("none", base), ("full", full))}
    assert flops["full"] > flops["none"] * 1.1  # the blocks' forward runs again in backward


def test_llama_uses_grouped_query_attention_and_swiglu():
    run, result = _trace("model=llama3-8b", "model.num_layers=2", "model.seq_length=128", "parallelism=tp2")
    graph = result.graph.to_pandas()
    assert graph["op"].str.contains("swiglu").any()
    assert graph["op"].str.contains("rms_norm").any() or graph["op"].str.contains("rsqrt").any()
    qkv = graph[(graph["op"] == "aten::mm") & (graph["phase"] == "forward")].iloc[0]
    # local q + 2 kv heads: (32 + 2 * 8) / tp2 heads of 128
    assert eval(qkv["input_shapes"])[1][1] == (32 + 16) // 2 * 128


def test_middle_stages_reuse_one_trace_with_renamed_peers():
    run, result = _trace("parallelism=pp2", "parallelism.pp=4", "parallelism.global_batch_size=8")
    graph = result.graph.to_pandas()
    layout = layout_of(run.parallelism)
    direct = pd.DataFrame(trace_rank(run.model, run.parallelism, layout.stage_representative(2)).events)
    copied = graph[graph["rank_class"] == 2].reset_index(drop=True)
    assert copied["op"].tolist() == direct["op"].tolist()
    assert copied["peer"].tolist() == direct["peer"].tolist()
    assert copied["group_ranks"].map(lambda g: None if g is None else list(g)).tolist() == \
        direct["group_ranks"].map(lambda g: None if g is None else list(g)).tolist()


def test_rename_for_rank_uses_that_ranks_groups():
    run, result = _trace("parallelism=tp2")
    layout = layout_of(run.parallelism)
    graph = result.graph.to_pandas()
    renamed = rename_for_rank(graph, layout, representative=0, rank=1)
    comm = _comm(renamed)
    assert comm["group_ranks"].map(list).tolist() == [[0, 1]] * len(comm)


def test_trace_speed_scales_to_thousands_of_ranks():
    run = compose_run(["model=gpt-tiny", "parallelism=pp2", "parallelism.dp=512", "parallelism.tp=4",
                       "parallelism.global_batch_size=2048"], check="layout")
    result = trace_layout(run.model, run.parallelism)
    assert result.rank_classes.num_rows == 4096
    assert result.rank_classes.to_pandas()["rank_class"].nunique() == 2


def test_tracing_refuses_an_initialised_process_group():
    run = compose_run([], check="layout")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(TraceError, match="not initialised"):
            trace_layout(run.model, run.parallelism)
    finally:
        dist.destroy_process_group()


def test_a_rank_that_cannot_be_built_or_stepped_is_named():
    run = compose_run(["parallelism=pp2"], check="layout")
    from dataclasses import replace

    # rotary embeddings need an even head dimension; 60 / 4 = 15 (not caught by validation)
    broken = replace(run.model, family="llama", hidden_size=60)
    with pytest.raises(TraceError, match=r"rank 0 .*gpt-tiny"):
        trace_layout(broken, run.parallelism)


def test_op_checkpointing_recomputes_every_second_matmul_and_keeps_the_attention():
    """torchtitan's op-level selective checkpointing (recompute=op) on its separate projections: per block the
    backward recomputes wk, wo and w3 (every second of wq, wk, wv, wo, w1, w3, w2) and the elementwise ops, not
    the attention; it keeps less than no recomputation and more than full recomputation."""
    common = ("framework=torchtitan", "model=llama3-8b", "model.num_layers=2", "model.seq_length=128",
              "parallelism=single")
    graphs, kept = {}, {}
    for mode in ("none", "op", "full"):
        result = _trace(*common, f"parallelism.recompute={mode}")[1]
        graph = result.graph.to_pandas()
        graphs[mode] = graph[~graph["no_kernel"]]
        kept[mode] = result.memory.to_pandas()["activation_bytes_per_microbatch"].iloc[0]

    def ops(mode: str, phase: str, op: str) -> pd.DataFrame:
        graph = graphs[mode]
        return graph[(graph["phase"] == phase) & (graph["op"] == op)]

    assert len(ops("none", "forward", "aten::mm")) == 2 * 7 + 1  # seven linears a block, and the output layer
    def layouts(mode: str, phase: str) -> list[tuple[str, str]]:
        return list(ops(mode, phase, "aten::mm")[["input_shapes", "input_strides"]].itertuples(index=False))

    forward = set(layouts("op", "forward"))  # a backward GEMM with a forward GEMM's shapes and strides recomputes it
    recomputed = sorted(json.loads(shapes)[1][1] for shapes, strides in layouts("op", "backward")
                        if (shapes, strides) in forward)  # the weight's width
    assert not [layout for layout in layouts("none", "backward") if layout in set(layouts("none", "forward"))]
    h, kv, ffn = 4096, 8 * 128, 14336
    assert recomputed == sorted([kv, h, ffn] * 2)
    attention = "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert ops("op", "backward", attention).empty and len(ops("full", "backward", attention)) == 2
    def elementwise(mode: str) -> int:  # backward kernels other than GEMMs and attention
        graph = graphs[mode]
        return int(((graph["phase"] == "backward") & ~graph["op"].str.contains("mm|scaled_dot_product")).sum())

    assert elementwise("op") == elementwise("full") > elementwise("none")  # norms, rotary, SwiGLU all recomputed
    assert kept["full"] < kept["op"] < kept["none"]
