"""CPU activation offloading (parallelism.cpu_offload_layers, Megatron-Core's --cpu-offloading-num-layers): what it
copies, when, what it frees, what it costs, and that it trains like the step without it."""

from __future__ import annotations

import pandas as pd
import pytest
from conftest import squared_gradient_norms

from trainsim.config import compose_run
from trainsim.errors import ConfigError
from trainsim.profile.analytical import predict_rows
from trainsim.trace import trace_layout
from trainsim.workloads.launch import spawn_ranks

SMALL = ["hardware=h100-sxm-dgx", "model=llama3-8b", "model.num_layers=4", "model.seq_length=2048",
         "parallelism=single", "parallelism.micro_batch_size=1", "parallelism.global_batch_size=2",
         "parallelism.precision=bf16"]


def _trace(layers: int):
    run = compose_run([*SMALL, f"parallelism.cpu_offload_layers={layers}"], check="layout")
    result = trace_layout(run.model, run.parallelism)
    return run, result.graph.to_pandas(), result.memory.to_pandas().iloc[0]


def test_the_first_layers_copy_their_activations_to_the_host_and_back_and_free_them():
    _, plain, plain_memory = _trace(0)
    run, graph, memory = _trace(2)
    copies = graph[graph["kind"] == "memcpy"]
    out, back = copies[copies["stream"] == "memcpy.d2h"], copies[copies["stream"] == "memcpy.h2d"]
    assert plain[plain["kind"] == "memcpy"].empty
    assert len(out) and (out["phase"] == "forward").all() and (back["phase"] == "backward").all()
    # the traced micro-batch's tensors go out and come back whole
    assert len(out) == len(back) and out["bytes_moved"].sum() == back["bytes_moved"].sum()
    offloaded = out["bytes_moved"].sum() / 2  # a copy reads and writes its bytes
    saved = plain_memory["activation_bytes_per_microbatch"] - memory["activation_bytes_per_microbatch"]
    assert saved == pytest.approx(offloaded, rel=0.02)
    # what a layer's backward reads of them waits for the copy back, which starts before that backward: with the
    # backward of the layer after it
    readers = graph[graph["deps"].map(lambda deps: bool(set(deps) & set(back["id"])))]
    assert len(readers) and (readers["stream"] == "compute").all()
    assert back["id"].min() < readers["id"].min()
    first_reload = graph.loc[graph["id"] < back["id"].min()]
    assert (first_reload["phase"] == "backward").any()  # not all at once before backward: with the layers'


def test_copies_cross_the_host_link_once():
    run, graph, _ = _trace(1)
    copies = graph[graph["kind"] == "memcpy"].drop_duplicates("signature")
    seconds = predict_rows(copies, run.hardware)
    link = run.hardware.host_link_bandwidth_bytes_per_s
    expected = run.hardware.kernel_model.launch_overhead_s + copies["bytes_moved"].to_numpy() / 2 / link
    assert seconds == pytest.approx(expected)


@pytest.mark.parametrize("setting, words", [
    ("parallelism.cpu_offload_layers=4", "model.num_layers=4"),
    ("parallelism.recompute=full", "parallelism.recompute='full'"),
])
def test_megatron_cores_bounds_are_enforced(setting, words):
    overrides = [*SMALL, "parallelism.cpu_offload_layers=2", setting]
    with pytest.raises(ConfigError, match="cpu_offload_layers") as error:
        compose_run(overrides, check="layout")
    assert words in str(error.value)


def test_pipeline_parallelism_and_an_unstated_host_link_are_refused():
    with pytest.raises(ConfigError, match="parallelism.pp=2"):
        compose_run([*SMALL, "model.num_layers=8", "parallelism.pp=2", "parallelism.global_batch_size=4",
                     "parallelism.cpu_offload_layers=2"], check="layout")
    with pytest.raises(ConfigError, match="host_link_bandwidth_bytes_per_s"):
        compose_run([*SMALL, "hardware=dgx-b300", "parallelism.cpu_offload_layers=2"])


def test_it_trains_like_the_step_without_it_over_gloo():
    """On the CPU the copies are real copies: the gradients are the same."""
    norms = {}
    for layers in (0, 2):
        run = compose_run(["model=llama3-8b", "model.num_layers=3", "model.hidden_size=512",
                           "model.num_attention_heads=8", "model.num_kv_heads=4", "model.ffn_hidden_size=1024",
                           "model.seq_length=512", "model.vocab_size=512", "parallelism=single",
                           "parallelism.global_batch_size=2", "parallelism.precision=fp32",
                           "parallelism.clip_grad=1.0", f"parallelism.cpu_offload_layers={layers}"])
        norms[layers] = spawn_ranks(squared_gradient_norms, run.parallelism, run.model, run.parallelism)
    assert norms[2] == pytest.approx(norms[0], rel=1e-6) and norms[0][0] > 0


def test_the_breakdown_names_the_wait_for_copies(tmp_path):
    """A reload slower than the layer it runs beside shows as exposed host-copy time, not as a pipeline bubble."""
    import trainsim

    result = trainsim.predict(*SMALL, "hardware.num_nodes=1", "parallelism.cpu_offload_layers=2",
                              output=tmp_path / "point")
    row = result.breakdown.iloc[0]
    assert row["exposed_host_copy_s"] > 0 and row["pipeline_bubble_s"] == pytest.approx(0.0, abs=1e-9)
    parts = [c for c in result.breakdown.columns if c.endswith("_s") and c not in
             ("optimizer_step_s", "contention_added_s", "end_s")]
    assert float(pd.to_numeric(row[parts]).sum()) == pytest.approx(result.step_time_s, rel=1e-6)


def test_a_copy_on_the_critical_path_is_named_as_one(tmp_path):
    import trainsim

    result = trainsim.predict(*SMALL, "hardware.num_nodes=1", "parallelism.cpu_offload_layers=2",
                              output=tmp_path / "point")
    categories = result.summary["critical_path"]["by_category"]
    assert categories.get("host_copy", 0.0) > 0 and not any(c == "comm.None" for c in categories)
