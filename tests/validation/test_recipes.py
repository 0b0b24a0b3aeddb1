"""Published recipes read as a user writes them (validation/recipes.py)."""

import pandas as pd
import pytest

from trainsim.validation.recipes import cell, compose_recipe, nvidia_recipe, read_recipes, step_seconds


def test_a_cell_with_parentheses_holds_the_main_and_the_alternative_configuration():
    assert cell("64 (0)", alternative=False) == "64"
    assert cell("64 (0)", alternative=True) == "0"
    assert cell("8", alternative=True) == "8"


def test_a_row_with_an_alternative_gives_two_recipes_with_their_own_layouts():
    recipes = [r for r in read_recipes("megatron-bridge_25.09_pretrain.csv") if r.row == 1]  # GB200 Llama 3 70B
    assert [r.variant for r in recipes] == ["", "alternative"]
    main, alternative = (set(r.overrides) for r in recipes)
    assert {"parallelism.zero_stage=3", "parallelism.tp=1"} <= main
    assert {"parallelism.tp=2", "parallelism.pp=4", "parallelism.virtual_stages=5", "parallelism.fp8_recipe=mxfp8"} \
        <= alternative
    # one MBS cell (2) for both, GA "1 (16)": the alternative's micro-batch is 128 / (8 x 16) = 1
    assert "parallelism.micro_batch_size=2" in main and "parallelism.micro_batch_size=1" in alternative


def test_the_step_time_is_the_tokens_of_a_step_over_the_throughput_of_all_gpus():
    row = pd.Series({"System": "DGX-H100", "Model": "LLAMA3_70B", "#-GPUs": "64", "GBS": "128", "MBS": "1",
                     "Sequence Length": "8192", "FSDP": "0", "TP": "4", "PP": "8", "CP": "1", "VP": "5", "EP": "1",
                     "Tokens / sec / GPU": "1,619"})
    recipe = nvidia_recipe("megatron-bridge_25.09_pretrain.csv", 0, row, False)
    assert recipe.measured_s == pytest.approx(step_seconds(128, 8192, 1619, 64)) == pytest.approx(10.119, abs=1e-3)
    assert "parallelism.dp=2" in recipe.overrides and "parallelism.schedule=interleaved-1f1b" in recipe.overrides


def test_a_row_trainsim_cannot_write_is_refused_with_its_reason_never_dropped():
    row = pd.Series({"System": "DGX-Z900", "Model": "LLAMA3_70B", "#-GPUs": "8", "GBS": "8", "MBS": "1",
                     "Sequence Length": "8192", "TP": "1", "PP": "1", "CP": "1", "VP": "n/a", "EP": "n/a",
                     "Tokens / sec / GPU": "100"})
    composed = compose_recipe(nvidia_recipe("x.csv", 0, row, False))
    assert composed.run is None and "DGX-Z900" in composed.refusal


def test_an_accepted_recipe_composes_to_the_layout_its_row_states():
    recipe = next(r for r in read_recipes("nemo_24.07_dgx-h100_fp8_pretrain.csv") if r.label.startswith("LLAMA3-70B"))
    composed = compose_recipe(recipe)
    assert composed.refusal is None, composed.refusal
    par = composed.run.parallelism
    assert (par.tp, par.pp, par.cp, par.dp, par.virtual_stages) == (4, 4, 2, 2, 5)
    assert composed.run.hardware.num_nodes * composed.run.hardware.devices_per_node >= 64


def test_deepseek_v3_composes_with_megatron_bridges_pipeline_layout():
    recipe = next(r for r in read_recipes("megatron-bridge_25.09_pretrain.csv")
                  if r.label.startswith("DeepSeekV3 (dropless) DGX-H100") and not r.variant)
    composed = compose_recipe(recipe)
    assert composed.refusal is None, composed.refusal
    assert composed.run.parallelism.pipeline_layout == "Et|(tt|)*30L"
    # Bridge 25.09's H100 recipe overlaps the expert all-to-alls (A2A_1F1B); its Blackwell token-drop rows do not
    assert composed.run.parallelism.moe_a2a_overlap
    gb200 = next(r for r in read_recipes("megatron-bridge_25.09_pretrain.csv") if "GB200 256" in r.label)
    assert not compose_recipe(gb200).run.parallelism.moe_a2a_overlap


def test_deepseek_v3_mxfp8_composes_its_releases_recompute_modules_and_mxfp8_weights():
    """26.04's recipes (Megatron-Bridge v0.4.0): GB300 recomputes the latent attention's up projections, GB200 the
    dense MLPs; MXFP8 keeps the weights in MXFP8 alone (bf16_with_mxfp8_mixed)."""
    recipes = {r.label.split()[1]: r for r in read_recipes("megatron-bridge_26.04_pretrain.csv")
               if r.label.startswith("DeepSeekV3")}
    for system, modules in (("DGX-GB300", ["mla_up_proj"]), ("DGX-GB200", ["mlp"])):
        par = compose_recipe(recipes[system]).run.parallelism
        assert (par.recompute, list(par.recompute_modules), par.fp8_param_gather) == ("selective", modules, True)
    llama = next(r for r in read_recipes("megatron-bridge_26.04_pretrain.csv") if r.label.startswith("LLAMA3_70B"))
    assert compose_recipe(llama).run.parallelism.recompute == "none"


def test_a_layout_megatron_core_refuses_is_counted_apart_with_megatrons_reason():
    row = pd.Series({"System": "DGX-GB200", "Model": "DeepSeekV3 (tokendrop)", "#-GPUs": "256", "GBS": "2048",
                     "MBS": "1", "Sequence Length": "4096", "TP": "1", "PP": "4 (8)", "CP": "1", "VP": "4 (2)",
                     "EP": "64", "Tokens / sec / GPU": "3454 (2835)"})
    assert not nvidia_recipe("x.csv", 0, row, False).megatron_rejects
    alternative = compose_recipe(nvidia_recipe("x.csv", 0, row, True))
    assert alternative.recipe.megatron_rejects and alternative.run is None
    assert "pp * ep * etp = 512" in alternative.refusal and "no EP of its own" in alternative.refusal


def test_torchtitan_rows_train_in_bf16_unless_float8_and_name_their_framework():
    recipes = read_recipes("torchtitan_llama_perf.csv")
    bf16 = next(r for r in recipes if "bf16" in r.label)
    float8 = next(r for r in recipes if "float8 rowwise" in r.label)
    assert "parallelism.precision=bf16" in bf16.overrides and "framework=torchtitan" in bf16.overrides
    assert "parallelism.precision=fp8" in float8.overrides and "parallelism.precision=bf16" not in float8.overrides


def test_torchtitans_500_w_h100_runs_on_its_own_config_at_power_limited_clocks():
    """The source's H100 is a 500 W, HBM2e part: its peaks are the H100 SXM's at the clock a 500 W limit leaves
    (dynamic power ~ f^3), its bandwidth HBM2e's, and its kernel efficiencies the H100's (same silicon)."""
    from trainsim.config import compose_run

    h100 = next(r for r in read_recipes("torchtitan_llama_perf.csv") if "H100" in r.label)
    assert "hardware=h100-grand-teton" in h100.overrides
    capped = compose_run(["hardware=h100-grand-teton"]).hardware
    dgx = compose_run(["hardware=h100-sxm-dgx"]).hardware
    clock = (capped.power_per_device_w / dgx.power_per_device_w) ** (1 / 3)
    for dtype, peak in dgx.peak_flops_per_s.items():
        assert capped.peak_flops_per_s[dtype] == pytest.approx(peak * clock, rel=2e-3)
    assert capped.memory_bandwidth_bytes_per_s < dgx.memory_bandwidth_bytes_per_s
    assert capped.kernel_model.matmul_efficiency == dgx.kernel_model.matmul_efficiency
    assert capped.device_name != dgx.device_name  # its own GPU in the per-GPU fits
