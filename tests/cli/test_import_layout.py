"""`trainsim import-layout`: a launch line in, a parallelism file or overrides out, bad input named."""

from __future__ import annotations

import yaml

from trainsim.cli import main

MEGATRON = ("--tensor-model-parallel-size 4 --pipeline-model-parallel-size 8 --num-virtual-stages-per-pipeline-rank 5 "
            "--sequence-parallel --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --bf16 "
            "--micro-batch-size 1 --global-batch-size 128 --num-layers 80 --hidden-size 8192")


def test_megatron_line_becomes_a_parallelism_file(tmp_path, capsys):
    out = tmp_path / "mine.yaml"
    assert main(["import-layout", "--nodes", "8", "--megatron", MEGATRON, "-o", str(out)]) == 0
    values = yaml.safe_load(out.read_text())
    assert values["defaults"] == ["parallelism_schema", "_self_"]
    assert (values["dp"], values["tp"], values["pp"], values["virtual_stages"]) == (2, 4, 8, 5)
    assert values["name"] == "mine" and values["zero_stage"] == 1  # named after the file, as the presets are
    err = capsys.readouterr().err
    assert "--num-layers 80; --hidden-size 8192" in err and "conf/model" in err


def test_overrides_and_refusals(tmp_path, capsys):
    assert main(["import-layout", "--gpus", "64", "--megatron", MEGATRON, "--overrides"]) == 0
    out = capsys.readouterr().out
    assert "parallelism.tp=4" in out and "parallelism.schedule=interleaved-1f1b" in out
    assert main(["import-layout", "--megatron", MEGATRON]) == 2  # no world size
    assert "--gpus N" in capsys.readouterr().err
    assert main(["import-layout", "--gpus", "64", "--megatron", MEGATRON + " --lr 1e-4"]) == 2
    assert "--lr 1e-4" in capsys.readouterr().err
    job = tmp_path / "job.toml"
    job.write_text('[parallelism]\ntensor_parallel_degree = 2\n[activation_checkpoint]\nmode = "full"\n')
    assert main(["import-layout", "--gpus", "8", "--torchtitan", str(job)]) == 0
    values = yaml.safe_load(capsys.readouterr().out)
    assert (values["dp"], values["tp"], values["zero_stage"], values["precision"]) == (4, 2, 3, "bf16")
