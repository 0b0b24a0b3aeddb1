"""Layouts imported from launch settings (Megatron-LM arguments, torchtitan TOML): what a user who pastes their
launch line gets back, and the Megatron round trip of every conf/parallelism preset."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainsim.config import compose_run
from trainsim.config.imported_layout import ONE_BUCKET_BYTES, read_parallelism_file
from trainsim.config.megatron_layout import import_megatron, megatron_arguments, megatron_round_trip_mismatches
from trainsim.config.torchtitan_layout import import_torchtitan
from trainsim.errors import ConfigError

PRESETS = sorted(Path("conf/parallelism").glob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_preset_survives_the_megatron_round_trip(path):
    par = read_parallelism_file(path)
    mismatches = megatron_round_trip_mismatches(par)
    if par.schedule == "gpipe":  # Megatron-LM has no GPipe schedule: refused with that reason
        assert len(mismatches) == 1 and "no GPipe schedule" in mismatches[0]
    else:
        assert mismatches == []


def test_megatron_defaults_are_megatrons_not_trainsims():
    fields = import_megatron("--tensor-model-parallel-size 4 --bf16 --micro-batch-size 2 --num-experts 8", 32).fields
    assert (fields["dp"], fields["etp"], fields["global_batch_size"]) == (8, 4, 16)  # dp from the world size
    assert fields["moe_token_dispatcher"] == "allgather" and fields["moe_grouped_gemm"] is False
    assert fields["grad_reduce_in_fp32"] is True and fields["gradient_accumulation_fusion"] is True
    assert fields["dp_bucket_size_bytes"] == ONE_BUCKET_BYTES  # no --overlap-grad-reduce: one bucket
    overlapped = import_megatron("--bf16 --grad-reduce-in-bf16 --overlap-grad-reduce --context-parallel-size 2 "
                                 "--micro-batch-size 1 --no-gradient-accumulation-fusion", 128).fields
    assert overlapped["dp_bucket_size_bytes"] == 2 * 128_000_000  # max(40M, 1M x dp x cp) bf16 gradients
    assert overlapped["grad_reduce_in_fp32"] is False and overlapped["gradient_accumulation_fusion"] is False
    assert import_megatron("--sequence-parallel --micro-batch-size 1", 8).fields["sequence_parallel"] is False


def test_megatron_layouts_of_the_shared_contract_are_emitted_by_name():
    layout = import_megatron(
        "--pipeline-model-parallel-size 4 --pipeline-model-parallel-layout 'Et*3|(tt|)*5,t|tL' --bf16 "
        "--fp8-format hybrid --fp8-recipe mxfp8 --fp8-param-gather --use-distributed-optimizer "
        "--num-distributed-optimizer-instances 2 --overlap-grad-reduce --micro-batch-size 1", 32)
    overrides = layout.overrides()
    for expected in ("parallelism.pipeline_layout='Et*3|(tt|)*5,t|tL'", "parallelism.virtual_stages=2",
                     "parallelism.schedule=interleaved-1f1b", "parallelism.fp8_recipe=mxfp8",
                     "parallelism.fp8_param_gather=true", "parallelism.dp_shard_size=4", "parallelism.zero_stage=1"):
        assert expected in overrides
    uneven = import_megatron("--pipeline-model-parallel-size 16 --num-virtual-stages-per-pipeline-rank 4 "
                             "--decoder-first-pipeline-num-layers 4 --decoder-last-pipeline-num-layers 8 "
                             "--bf16 --fp4-format e2m1 --micro-batch-size 1", 128).fields
    assert (uneven["first_stage_layers"], uneven["last_stage_layers"], uneven["virtual_stages"]) == (4, 8, 4)
    assert uneven["precision"] == "fp4"
    counted = import_megatron("--pipeline-model-parallel-size 16 --account-for-embedding-in-pipeline-split "
                              "--account-for-loss-in-pipeline-split --micro-batch-size 1", 128).fields
    assert counted["account_for_embedding_in_pipeline_split"] and counted["account_for_loss_in_pipeline_split"]
    chunks = import_megatron("--pipeline-model-parallel-size 8 --num-layers-per-virtual-pipeline-stage 2 "
                             "--num-layers 80 --micro-batch-size 1", 64)
    assert chunks.fields["virtual_stages"] == 5 and chunks.model_arguments == ["--num-layers 80"]
    block = ("--recompute-granularity full --recompute-method block --micro-batch-size 1 "
             "--pipeline-model-parallel-size 8")
    assert import_megatron(f"{block} --recompute-num-layers 10 --num-layers 80", 8).fields["recompute"] == "full"
    with pytest.raises(ConfigError, match="--recompute-method"):  # block 9 of a 10-layer stage: not every layer
        import_megatron(f"{block} --recompute-num-layers 9 --num-layers 80", 8)


def test_megatron_recompute_modules_import_and_round_trip():
    fields = import_megatron("--recompute-granularity selective --recompute-modules mla_up_proj mlp "
                             "--micro-batch-size 1", 8).fields
    assert (fields["recompute"], fields["recompute_modules"]) == ("selective", ["mla_up_proj", "mlp"])
    par = compose_run(["parallelism=dp2", "parallelism.recompute=selective",
                       "parallelism.recompute_modules=[core_attn,shared_experts]"], check="layout").parallelism
    assert megatron_arguments(par).count("--recompute-modules") == 1
    assert not megatron_round_trip_mismatches(par)


@pytest.mark.parametrize("arguments, named", [
    ("--recompute-granularity selective --recompute-modules core_attn moe_act", "--recompute-modules"),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 2", "--recompute-method"),
    ("--bf16 --fp8-format hybrid --fp8-recipe custom", "--fp8-recipe"),
    ("--cp-comm-type a2a", "--cp-comm-type"),
    ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads", "--data-parallel-sharding-strategy"),
    ("--moe-token-dispatcher-type flex", "--moe-token-dispatcher-type"),
    ("--tensor-model-parallel-size 3", "not divisible by tp * pp * cp"),
    ("--tensor-model-parallel-size 2 --tp-comm-overlap", "--sequence-parallel"),
    ("--sequence-parralel", "did you mean --sequence-parallel"),
    ("--use-torch-fsdp2 --pipeline-model-parallel-size 2", "--use-torch-fsdp2"),
    ("--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 4 --decoder-first-pipeline-num-layers 3",
     "--decoder-first-pipeline-num-layers"),
    ("--pipeline-model-parallel-size 4 --decoder-last-pipeline-num-layers 3 --account-for-loss-in-pipeline-split",
     "--account-for-embedding/loss-in-pipeline-split"),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Ett|ttL' --account-for-loss-in-pipeline-split",
     "--pipeline-model-parallel-layout"),
])
def test_megatron_values_trainsim_cannot_model_are_refused_by_name(arguments, named):
    with pytest.raises(ConfigError, match="accepted|Megatron|did you mean") as error:
        import_megatron(f"{arguments} --micro-batch-size 1", 8)
    assert named in str(error.value)


def test_unknown_megatron_arguments_are_listed_when_allowed():
    layout = import_megatron("--tensor-model-parallel-size 2 --lr 3e-4 --micro-batch-size 1", 8, allow_unknown=True)
    assert layout.unknown == ["--lr 3e-4"]
    assert "# not known to import-layout, left out: --lr 3e-4\n" in layout.yaml_text()


def test_an_imported_file_and_its_overrides_compose_to_the_same_layout(tmp_path):
    layout = import_megatron("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --bf16 "
                             "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
                             "--micro-batch-size 1 --global-batch-size 8", 8, name="mine")
    assert layout.fields["etp"] == 1 and "parallelism.etp=2" in layout.notes[0]  # a dense model: said, not silent
    path = tmp_path / "mine.yaml"
    path.write_text(layout.yaml_text())
    assert read_parallelism_file(path) == layout.parallelism()
    run = compose_run(["model=gpt-tiny", *layout.overrides()], check="layout")
    assert run.parallelism == layout.parallelism()


TORCHTITAN = """
[model]
name = "llama3"
flavor = "70B"
converters = ["float8"]
[training]
local_batch_size = 2
seq_len = 8192
[parallelism]
data_parallel_replicate_degree = 2
tensor_parallel_degree = 8
expert_tensor_parallel_degree = 8
enable_async_tensor_parallel = true
[activation_checkpoint]
mode = "full"
[float8]
enable_fsdp_float8_all_gather = true
[compile]
enable = true
"""


def test_a_torchtitan_job_becomes_hsdp_with_fp8_all_gathers():
    layout = import_torchtitan(TORCHTITAN, world_size=256)
    f = layout.fields
    assert (f["dp"], f["tp"], f["zero_stage"], f["dp_shard_size"]) == (32, 8, 3, 16)  # 2 replicas of 16 shards
    assert f["sequence_parallel"] and f["tp_comm_overlap"] and f["recompute"] == "full"
    assert (f["precision"], f["fp8_recipe"], f["fp8_param_gather"]) == ("fp8", "current", True)
    assert (f["micro_batch_size"], f["global_batch_size"]) == (2, 64)
    assert "training.seq_len = 8192" in layout.model_arguments and "compile.enable" in layout.notes[0]
    assert f["etp"] == 1 and "parallelism.etp=8" in layout.notes[1]  # experts over tp only for a MoE model
    inactive = TORCHTITAN.replace('converters = ["float8"]', "").replace("[float8]", '[quantize.linear.float8]\n'
                                                                          'filter_fqns = ["output", "wq"]')
    assert import_torchtitan(inactive, world_size=256).fields["precision"] == "bf16"  # float8 keys inert
    with pytest.raises(ConfigError, match="--gpus"):
        import_torchtitan(TORCHTITAN)  # data_parallel_shard_degree -1 needs the world size


def test_torchtitan_pipelines_and_defaults():
    text = TORCHTITAN.replace('mode = "full"', 'mode = "none"').replace("enable_async_tensor_parallel = true", """
pipeline_parallel_degree = 4
pipeline_parallel_schedule = "Interleaved1F1B"
pipeline_parallel_microbatch_size = 1""")
    f = import_torchtitan(text, world_size=256).fields
    assert (f["pp"], f["virtual_stages"], f["schedule"], f["zero_stage"]) == (4, 2, "interleaved-1f1b", 2)
    assert f["account_for_embedding_in_pipeline_split"] and f["account_for_loss_in_pipeline_split"]
    op = import_torchtitan(TORCHTITAN.replace('mode = "full"', 'mode = "selective"\nselective_ac_option = "op"'), 256)
    assert op.fields["recompute"] == "op"
    with pytest.raises(ConfigError, match="activation_checkpoint.*selective_ac_option 2"):
        import_torchtitan(TORCHTITAN.replace('mode = "full"', 'mode = "selective"\nselective_ac_option = "2"'), 256)
    with pytest.raises(ConfigError, match="rowwise_with_gw_hp"):
        import_torchtitan(TORCHTITAN.replace("[float8]", '[float8]\nrecipe_name = "rowwise_with_gw_hp"'), 256)
    with pytest.raises(ConfigError, match="parallelism.pipeline_paralel_degree"):
        import_torchtitan(TORCHTITAN.replace("[parallelism]", "[parallelism]\npipeline_paralel_degree = 2"), 256)


def test_megatron_bridge_overrides_are_read_as_the_arguments_they_set():
    layout = import_megatron("model.tensor_model_parallel_size=2 model.pipeline_model_parallel_size=4 "
                             "model.virtual_pipeline_model_parallel_size=5 model.sequence_parallel=true "
                             "train.micro_batch_size=1 train.global_batch_size=256 ddp.use_distributed_optimizer=true "
                             "mixed_precision=bf16_with_mxfp8_mixed model.gradient_accumulation_fusion=false "
                             "model.num_layers=80 model.recompute_modules=[core_attn]", 64)
    f = layout.fields
    assert (f["tp"], f["pp"], f["virtual_stages"], f["dp"], f["global_batch_size"]) == (2, 4, 5, 8, 256)
    assert (f["precision"], f["fp8_recipe"], f["fp8_param_gather"]) == ("fp8", "mxfp8", True)
    assert f["sequence_parallel"] and f["zero_stage"] == 1 and f["gradient_accumulation_fusion"] is False
    assert layout.model_arguments == ["--num-layers 80"]
    reduced = import_megatron("mixed_precision=bf16_with_fp8_current_scaling_bf16_params_bf16_grad_reduce "
                              "--use-distributed-optimizer --micro-batch-size 1", 8)
    assert reduced.fields["fp8_recipe"] == "current" and reduced.fields["grad_reduce_in_fp32"] is False
    assert not reduced.fields.get("fp8_param_gather") and "first_last_layers_bf16" in reduced.notes[0]
    with pytest.raises(ConfigError, match="mixed_precision=bf16_with_fp9"):
        import_megatron("mixed_precision=bf16_with_fp9 --micro-batch-size 1", 8)


def test_a_pasted_torchrun_line_sizes_the_job():
    line = ("torchrun --nnodes=16 --nproc-per-node 8 pretrain_gpt.py \\\n"
            "    --tensor-model-parallel-size 8 --micro-batch-size 1 \\\n    --num-layers 80")
    layout = import_megatron(line)
    assert layout.fields["dp"] == 16 and layout.model_arguments == ["--num-layers 80"] and not layout.unknown
    assert import_megatron(line, world_size=64).fields["dp"] == 8  # --gpus wins
    with pytest.raises(ConfigError, match="elastic"):
        import_megatron(line.replace("--nnodes=16", "--nnodes=8:16"))


def test_a_2024_torchtitan_job_reads_as_todays():
    """torchtitan's published December 2024 runs used [training] degrees, [experimental] pipelines and
    float8.enable_float8_linear."""
    legacy = """
[training]
batch_size = 16
data_parallel_shard_degree = 32
tensor_parallel_degree = 8
compile = true
[experimental]
enable_async_tensor_parallel = true
[activation_checkpoint]
mode = "full"
[float8]
enable_float8_linear = true
enable_fsdp_float8_all_gather = true
"""
    layout = import_torchtitan(legacy)
    f = layout.fields
    assert (f["dp"], f["tp"], f["micro_batch_size"], f["zero_stage"]) == (32, 8, 16, 3)
    assert (f["precision"], f["fp8_param_gather"], f["tp_comm_overlap"]) == ("fp8", True, True)
    assert "compile.enable" in layout.notes[0]
    with pytest.raises(ConfigError, match="experimental.pipeline_parallel_split_points"):
        import_torchtitan(legacy.replace("[experimental]\n", "[experimental]\npipeline_parallel_degree = 2\n"
                                         "pipeline_parallel_microbatches = 4\n"
                                         "pipeline_parallel_split_points = ['layers.40']\n"), 512)


def test_cpu_activation_offloading_is_read_and_written_as_megatron_spells_it():
    fields = import_megatron("--bf16 --micro-batch-size 2 --cpu-offloading --cpu-offloading-num-layers 40", 64).fields
    assert fields["cpu_offload_layers"] == 40
    assert import_megatron("--bf16 --micro-batch-size 2 --cpu-offloading-num-layers 40", 64).fields[
        "cpu_offload_layers"] == 0  # the count alone does not turn it on
