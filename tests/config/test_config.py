"""Composition and validation: users get a usable config or a message that says what to change."""

from __future__ import annotations

import pytest

from trainsim.comm.network import node_bandwidth
from trainsim.config import compose_run, group_from_plain
from trainsim.config.sweep import expand_sweep
from trainsim.errors import ConfigError


def test_default_run_is_local_cpu_gpt_tiny_dp2():
    run = compose_run([])
    assert run.keys == {"hardware": "local-cpu", "model": "gpt-tiny", "parallelism": "dp2"}
    assert run.hardware.devices_per_node >= 1  # detected from this machine
    assert run.hardware.memory_capacity_bytes > 0
    assert run.parallelism.num_microbatches == 2


@pytest.mark.parametrize("hardware", ["a100-80g-dgx", "a100-80g-p4de", "h100-sxm-dgx", "h800-dgx"])
def test_gpu_clusters_have_published_specs(hardware):
    hw = compose_run([f"hardware={hardware}"]).hardware
    assert hw.device_kind == "cuda" and hw.devices_per_node == 8
    assert hw.peak_flops_per_s["bf16"] >= 300e12
    assert hw.memory_capacity_bytes == 80 * 1024**3
    assert hw.intra_node_bandwidth_bytes_per_s > hw.inter_node_bandwidth_bytes_per_s / 8
    assert hw.nccl.version


def test_a100_on_efa_extends_the_dgx_with_its_own_network_measurements():
    """Calibration files describe the configured network: the 2-node EFA sweep calibrates p4de only, the
    DGX (InfiniBand) keeps its inter-node hop at the priors; everything else is inherited."""
    dgx = compose_run(["hardware=a100-80g-dgx"]).hardware
    p4de = compose_run(["hardware=a100-80g-p4de"]).hardware
    assert p4de.name == "a100-80g-p4de" and node_bandwidth(p4de) == 50e9 and p4de.network.transport == "efa"
    assert dgx.network.transport == "infiniband"
    assert (p4de.kernel_model, p4de.host_dispatch_s, p4de.peak_flops_per_s) == (
        dgx.kernel_model, dgx.host_dispatch_s, dgx.peak_flops_per_s)
    two_node = [f.path for f in p4de.calibration.files if "2node" in f.path]
    assert len(two_node) == 1 and "efa" in two_node[0]
    assert not [f.path for f in dgx.calibration.files if "node" in f.path]
    assert {f.path for f in dgx.calibration.files} == {f.path for f in p4de.calibration.files} - set(two_node)


def test_echo_models_match_the_paper():
    # heads / layers / hidden / seq from Echo (method.md section 3)
    expected = {"gpt-13b": (32, 40, 5120), "gpt-30b": (48, 40, 7680), "gpt-40b": (72, 40, 9216),
                "gpt-70b": (64, 80, 8192), "gpt-175b": (96, 96, 12288), "gpt-485b": (160, 96, 20480)}
    for name, (heads, layers, hidden) in expected.items():
        m = compose_run([f"model={name}"], check="layout").model
        assert (m.num_attention_heads, m.num_layers, m.hidden_size, m.seq_length) == (heads, layers, hidden, 2048)


def test_unknown_option_lists_available_ones():
    with pytest.raises(ConfigError) as err:
        compose_run(["model=gpt-9000"])
    assert "gpt-9000" in str(err.value) and "gpt-small" in str(err.value) and "llama3-8b" in str(err.value)


def test_wrongly_typed_field_names_field_and_value():
    with pytest.raises(ConfigError, match=r"parallelism.tp.*abc"):
        compose_run(["parallelism.tp=abc"])


@pytest.mark.parametrize("overrides, message", [
    (["parallelism.tp=3"], r"tp=3 does not divide model.num_attention_heads=4.*choose tp among 1, 2, 4"),
    (["parallelism=pp2", "parallelism.pp=3"], r"num_layers=4 .* cannot be split evenly .* pp \* virtual_stages"),
    (["parallelism=pp2", "parallelism.pp=3", "parallelism.last_stage_layers=1"],
     r"last_stage_layers=1 .*middle stages, 3, must be divisible by the 2 middle"),
    (["parallelism=pp2", "parallelism.first_stage_layers=4"],
     r"first_stage_layers=4 .*0 middle layers remaining but 1 middle"),
    (["parallelism=pp2-interleaved", "parallelism.last_stage_layers=1"],
     r"last_stage_layers=1 .*last stage, 1, must be divisible by the virtual pipeline parallel degree 2"),
    (["parallelism.global_batch_size=7"],
     r"global_batch_size=7 is not a multiple of micro_batch_size \* dp.*set parallelism.global_batch_size=8"),
    (["parallelism.dp=4", "parallelism.global_batch_size=8"], r"4 devices, but hardware 'local-cpu' has"),
    (["parallelism=pp2", "parallelism.virtual_stages=2"],
     r"virtual_stages=2 needs schedule='interleaved-1f1b'.*or parallelism.virtual_stages=1"),
    (["parallelism=pp2-interleaved", "parallelism.global_batch_size=6", "parallelism.pp=1"],
     r"needs pp >= 2 and virtual_stages >= 2"),
    (["parallelism.schedule=zigzag"], r"schedule='zigzag' is not supported; accepted: gpipe, 1f1b"),
    (["parallelism.precision=fp6"], r"precision='fp6' is not supported"),
    (["model.num_kv_heads=3"], r"num_kv_heads=3 must divide.*choose num_kv_heads among 1, 2, 4"),
    (["parallelism.tp=2", "model.ffn_hidden_size=33"], r"MLP width 33 .*choose tp among 1, 3, 11, 33"),
    (["parallelism=cp2", "model.seq_length=66"], r"seq_length=66 is not divisible by 4; choose cp among 1, 3, 11"),
    (["model.family=llama", "model.hidden_size=60"], r"must be even for rotary"),
])
def test_impossible_layouts_fail_at_composition(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_run(overrides)


def test_layout_check_ignores_hardware_size():
    run = compose_run(["model=gpt-175b", "parallelism=pp16-tp8-dp64"], check="layout")
    assert run.parallelism.world_size == 8192
    with pytest.raises(ConfigError, match=r"raise hardware.num_nodes to 1024"):
        compose_run(["hardware=a100-80g-dgx", "model=gpt-175b", "parallelism=pp16-tp8-dp64"])
    compose_run(["hardware=a100-80g-dgx", "hardware.num_nodes=1024", "model=gpt-175b",
                 "parallelism=pp16-tp8-dp64"])


def test_field_override_changes_only_that_groups_key():
    base = compose_run(["parallelism=tp2"])
    changed = compose_run(["parallelism=tp2", "parallelism.recompute=full"])
    assert changed.key("parallelism").startswith("tp2-") and changed.key("parallelism") != "tp2"
    assert changed.key("model") == base.key("model") and changed.key("hardware") == base.key("hardware")
    assert compose_run(["parallelism=tp2", "parallelism.recompute=full"]).keys == changed.keys  # stable


def test_group_from_plain_round_trip_and_unknown_field():
    run = compose_run(["model=llama3-8b"], check="layout")
    assert group_from_plain("model", run.group("model")) == run.model
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['heads'\]"):
        group_from_plain("model", {**run.group("model"), "heads": 3})


def test_sweep_expands_cartesian_product():
    points = expand_sweep({"model": "gpt-tiny,gpt-small", "parallelism": ["dp2", "tp2"],
                           "parallelism.recompute": "full"})
    assert len(points) == 4
    assert ["model=gpt-small", "parallelism=tp2", "parallelism.recompute=full"] in points
    assert expand_sweep({}) == [[]]
    assert expand_sweep({"overrides": ["parallelism.tp=1,2", "hardware.num_nodes=4"]}) == [
        ["parallelism.tp=1", "hardware.num_nodes=4"], ["parallelism.tp=2", "hardware.num_nodes=4"]]
    assert expand_sweep({"overrides": "parallelism.tp=2"}) == [["parallelism.tp=2"]]


def test_an_override_to_the_option_value_keeps_the_key():
    same = compose_run(["hardware=a100-80g-dgx", "hardware.what_if.inter_node_bandwidth_scale=1",
                        "hardware.num_nodes=16"])
    assert same.keys["hardware"] == "a100-80g-dgx"  # nothing changed: nothing re-runs
    changed = compose_run(["hardware=a100-80g-dgx", "hardware.num_nodes=4"])
    assert changed.keys["hardware"].startswith("a100-80g-dgx-") and changed.hardware.num_nodes == 4
