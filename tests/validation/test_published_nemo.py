"""The NeMo 24.07 DGX-H100 FP8 table of the scale benchmark: every row maps to a valid run or is skipped with
its reason, and its step time is the csv's, not a FLOP formula's."""

from __future__ import annotations

import dataclasses
import math

import pandas as pd
import pytest

from trainsim.config import compose_run
from trainsim.config.data_path import DATA_DIR
from trainsim.config.validate import validate_run
from trainsim.validation.published import NEMO_ARCHITECTURES, TABLES, read_table, row_configs

NAME = "nemo2407_h100_fp8"


@pytest.fixture(scope="module")
def rows() -> pd.DataFrame:
    return read_table(NAME)


def csv() -> pd.DataFrame:
    return pd.read_csv(DATA_DIR / TABLES[NAME].path, comment="#")


def test_measured_step_time_is_the_csvs_derived_step_time(rows):
    raw = csv()
    assert len(rows) == len(raw)
    assert rows["measured_s"].tolist() == raw["derived_step_time_s"].astype(float).tolist()
    # the curator's derivation: GBS * seq / (tokens/s/GPU * gpus)
    derived = raw["global_batch"] * raw["seq_len"] / (raw["tokens_per_sec_per_gpu"] * raw["gpus"])
    assert (rows["measured_s"] / derived).between(0.999, 1.001).all()


def test_every_row_runs_the_context_parallel_ones_too(rows):
    assert rows["skip_reason"].isna().all()
    assert set(rows[rows["cp"] > 1]["model"]) == {"LLAMA3-8B", "LLAMA3-70B"}


def test_every_runnable_row_maps_to_a_valid_fp8_run(rows):
    table = TABLES[NAME]
    run = compose_run([f"hardware={table.hardware}", "model=gpt-small", "parallelism=single"])
    assert "fp8" in run.hardware.peak_flops_per_s
    for _, row in rows[rows["skip_reason"].isna()].iterrows():
        model, par = row_configs(table, row, run.model, run.parallelism)
        nodes = math.ceil(row["gpus"] / run.hardware.devices_per_node)
        hw = dataclasses.replace(run.hardware, num_nodes=max(run.hardware.num_nodes, nodes))
        validate_run(hw, model, par)
        arch = NEMO_ARCHITECTURES[row["model"]]
        assert (model.num_layers, model.hidden_size, model.family) == (arch.layers, arch.hidden, arch.family)
        assert par.world_size == row["gpus"] and par.dp == row["dp_derived"] and par.cp == row["cp"]
        assert par.micro_batch_size == row["micro_batch"] and par.virtual_stages == row["vp"]
        assert par.num_microbatches * par.micro_batch_size * par.dp == row["global_batch"]
        assert model.num_layers % (par.pp * par.virtual_stages) == 0
        assert model.seq_length == row["seq_len"]
        assert par.precision == "fp8" and par.zero_stage == 1 and par.overlap_param_gather
        assert par.sequence_parallel == (par.tp > 1)
        assert par.tp_comm_overlap == (par.tp > 1 and arch.tp_comm_overlap)
        assert par.schedule == ("interleaved-1f1b" if row["vp"] > 1 else "1f1b")
        assert model.attention == "fused" and par.recompute == arch.recompute
        assert model.dropout == (0.1 if row["model"].startswith("GPT3") else 0.0)
        # Megatron-Core DDP's default bucket: max(40M, 1M x dp) parameters of bf16 gradients (cp reduces with dp)
        assert par.dp_bucket_size_bytes == 2 * max(40_000_000, 1_000_000 * par.dp * par.cp)


def test_megatron_core_tables_use_its_gradient_buckets_and_2021_pytorchs():
    for name, bucket in (("mcore2024_h100", 2 * 48_000_000), ("megatron2021_a100", 25 * 2**20)):
        table = TABLES[name]
        run = compose_run([f"hardware={table.hardware}", "model=gpt-small", "parallelism=single"])
        row = read_table(name).iloc[3]
        assert row_configs(table, row, run.model, run.parallelism)[1].dp_bucket_size_bytes == bucket


def test_recipes_without_tp_overlap_and_with_selective_recompute_are_the_launchers():
    """NeMo 24.07's launcher: gpt3/175b.yaml and nemotron_340b.yaml leave ub_tp_comm_overlap off, and
    nemotron_340b.yaml sets selective recompute; the other recipes overlap and recompute nothing."""
    no_overlap = {name for name, arch in NEMO_ARCHITECTURES.items() if not arch.tp_comm_overlap}
    assert no_overlap == {"GPT3-175B", "Nemotron-340B"}
    assert {name: arch.recompute for name, arch in NEMO_ARCHITECTURES.items() if arch.recompute != "none"} == {
        "Nemotron-340B": "selective"}
    for name in no_overlap:
        assert "ub_tp_comm_overlap: False" in NEMO_ARCHITECTURES[name].source


def test_every_architecture_names_its_source():
    assert set(csv()["model"]) <= set(NEMO_ARCHITECTURES)
    for name, arch in NEMO_ARCHITECTURES.items():
        assert arch.source, name
        assert arch.hidden % arch.heads == 0 and arch.heads % (arch.kv_heads or arch.heads) == 0, name


def test_virtual_stages_that_do_not_divide_the_layers_are_reported(monkeypatch):
    raw = csv()
    raw.loc[raw["model"] == "LLAMA2-13B", "vp"] = 3  # 40 layers over pp 4 * vp 3
    monkeypatch.setattr(pd, "read_csv", lambda *a, **k: raw.copy())
    rows = read_table(NAME).set_index("model")
    assert "not divisible" in rows.loc["LLAMA2-13B", "skip_reason"]


def test_the_flop_formula_tables_are_unchanged():
    rows = read_table("mcore2024_h100").set_index("model")
    assert rows["skip_reason"].isna().all()
    assert (rows["micro_batch"] == 1).all() and (rows["family"] == "gpt").all()


def test_nemo_times_attention_at_flash_attention_2_and_bounds_fp8_gemms_by_their_measured_ceiling():
    from trainsim.validation.kernel_fit import CEILING_DTYPE, matmul_ceiling
    from trainsim.validation.published import table_hardware

    hw = compose_run(["hardware=h100-sxm-dgx"]).hardware
    nemo = table_hardware(TABLES[NAME], hw).kernel_model
    # FlashAttention-2's rates were measured at seq 8192: the efficiency the model reaches at long sequences
    # is the rate there over keys / (keys + tile keys)
    long_sequence = 1 + hw.kernel_model.attention_tile_keys / 8192
    assert hw.kernel_model.attention_tile_keys > 0
    assert nemo.attention_forward_efficiency == pytest.approx(284.1 / 989 * long_sequence)
    assert nemo.attention_backward_efficiency == pytest.approx(287.1 / 989 * long_sequence)
    assert nemo.attention_dropout_forward_s_per_score == hw.kernel_model.attention_dropout_forward_s_per_score
    assert table_hardware(TABLES["mcore2024_h100"], hw) is hw
    assert matmul_ceiling(hw, CEILING_DTYPE["fp8_matmul_efficiency"]) == pytest.approx(1402.6 / 1979)
    assert matmul_ceiling(hw, CEILING_DTYPE["matmul_efficiency"]) == pytest.approx(794.5 / 989)
