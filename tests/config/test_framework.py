"""The software stack as configuration (conf/framework/, config/framework.py)."""

from __future__ import annotations

import pytest

from trainsim.config import compose_run
from trainsim.config.compose import default_config_dir
from trainsim.config.framework import megatron_core_bucket_bytes
from trainsim.errors import ConfigError

H100 = ["hardware=h100-sxm-dgx", "model=gpt-small", "parallelism=dp2", "parallelism.dp=16",
        "parallelism.precision=bf16", "parallelism.global_batch_size=32"]


@pytest.mark.parametrize("name", sorted(p.stem for p in (default_config_dir() / "framework").glob("*.yaml")))
def test_every_framework_composes_and_names_itself(name):
    run = compose_run([*H100, f"framework={name}"])
    assert run.framework.name == name and run.framework.description


def test_megatron_core_decides_buckets_and_fusion_and_a_command_line_value_wins():
    plain = compose_run(H100)  # default: plain PyTorch, the layout's own values
    assert plain.parallelism.dp_bucket_size_bytes == 25 * 2**20 and not plain.parallelism.gradient_accumulation_fusion
    mcore = compose_run([*H100, "framework=megatron-core"])
    assert mcore.parallelism.dp_bucket_size_bytes == megatron_core_bucket_bytes(16, 2) == 2 * 40_000_000
    assert mcore.parallelism.gradient_accumulation_fusion
    assert mcore.keys["parallelism"] != plain.keys["parallelism"]  # the framework's values key the artifacts
    wider = compose_run([*H100, "framework=megatron-core", "parallelism.dp=64", "parallelism.global_batch_size=128"])
    assert wider.parallelism.dp_bucket_size_bytes == 2 * 64_000_000  # max(40M, 1M x dp) parameters
    mine = compose_run([*H100, "framework=megatron-core", "parallelism.gradient_accumulation_fusion=false",
                        "parallelism.dp_bucket_size_bytes=1000000"])
    assert not mine.parallelism.gradient_accumulation_fusion and mine.parallelism.dp_bucket_size_bytes == 1_000_000


def test_a_stack_without_tp_overlap_refuses_it_naming_the_framework():
    overlap = ["parallelism=tp2", "parallelism.sequence_parallel=true", "parallelism.tp_comm_overlap=true"]
    compose_run([*overlap, "framework=megatron-core"])
    with pytest.raises(ConfigError, match="framework 'megatron-lm-2021'.*tp_comm_overlap"):
        compose_run([*overlap, "framework=megatron-lm-2021"])


def test_megatron_lm_2021_runs_unfused_attention_and_flash_attention_2_is_timed_on_hopper_only():
    assert compose_run(["framework=megatron-lm-2021"]).model.attention == "unfused"
    hw = compose_run(["hardware=h100-sxm-dgx"]).hardware
    nemo = compose_run(["hardware=h100-sxm-dgx", "framework=nemo-24.07"]).hardware
    long_sequence = 1 + hw.kernel_model.attention_tile_keys / 8192  # the rates were measured at seq 8192
    assert nemo.kernel_model.attention_forward_efficiency == pytest.approx(284.1 / 989 * long_sequence)
    h200 = compose_run(["hardware=h200-sxm-dgx", "framework=torchtitan"]).hardware  # torch SDPA's flash backend
    assert h200.kernel_model.attention_forward_efficiency == pytest.approx(284.1 / 989 * long_sequence)
    # the 500 W Grand Teton H100 runs them as the same fraction of its lower, power-limited peak
    teton = compose_run(["hardware=h100-grand-teton", "framework=torchtitan"]).hardware
    assert teton.kernel_model.attention_forward_efficiency == pytest.approx(284.1 / 989 * long_sequence)
    assert teton.peak_flops_per_s["bf16"] < hw.peak_flops_per_s["bf16"]
    a100 = compose_run(["hardware=a100-80g-dgx"]).hardware  # Ampere's own rates are FlashAttention-2's
    assert compose_run(["hardware=a100-80g-dgx", "framework=nemo-24.07"]).hardware.kernel_model == a100.kernel_model


def test_a_bad_framework_field_names_what_is_accepted():
    with pytest.raises(ConfigError, match="framework.dp_bucket='ddp'.*'megatron-core'"):
        compose_run(["framework=megatron-core", "framework.dp_bucket=ddp"])


def test_imported_megatron_arguments_name_their_framework():
    from trainsim.config.megatron_layout import import_megatron

    layout = import_megatron("--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1 "
                             "--global-batch-size 16", 16)
    assert layout.overrides()[0] == "framework=megatron-core"
    assert "framework=megatron-core" in layout.yaml_text()


def test_a_value_an_option_file_states_wins_over_the_framework():
    """tp8-sp-pp8-dp4 states gradient_accumulation_fusion: true; torchtitan would leave it off."""
    run = compose_run(["parallelism=tp8-sp-pp8-dp4", "model=llama3-70b", "framework=torchtitan"], check="layout")
    assert run.parallelism.gradient_accumulation_fusion
    assert "parallelism.gradient_accumulation_fusion" in run.explicit_fields
    plain = compose_run(["parallelism=dp2", "framework=torchtitan"], check="layout")
    assert "parallelism.gradient_accumulation_fusion" not in plain.explicit_fields


def test_torchtitan_reduces_gradients_in_fp32_and_megatron_bridge_in_the_weights_dtype():
    """torchtitan's training.mixed_precision_reduce is float32; Bridge's performance recipes reduce in bf16."""
    titan = compose_run([*H100, "framework=torchtitan", "parallelism.zero_stage=3"])
    bridge = compose_run([*H100, "framework=megatron-bridge", "parallelism.zero_stage=3"])
    assert titan.parallelism.grad_reduce_in_fp32 and not bridge.parallelism.grad_reduce_in_fp32
