"""`trainsim import-model`: a conf/model YAML a user can review, which composes to the imported model."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from trainsim.cli import main
from trainsim.config import compose_run
from trainsim.config.hf_import import import_hf_config

FIXTURES = Path(__file__).resolve().parents[1] / "config" / "fixtures" / "hf"


def test_import_model_writes_a_yaml_that_composes_to_the_import(tmp_path, monkeypatch, repo, capsys):
    conf = shutil.copytree(repo / "conf", tmp_path / "conf")
    monkeypatch.chdir(tmp_path)
    source = FIXTURES / "gpt-oss-120b" / "config.json"
    assert main(["import-model", str(source), "--name", "oss", "--seq-length", "2048"]) == 0
    out = capsys.readouterr().out
    assert "wrote conf/model/oss.yaml" in out and "SwiGLU clamp" in out
    text = (conf / "model" / "oss.yaml").read_text()
    assert str(source) in text and "quantization_config" in text  # the source, and what was left out and why
    model = compose_run(["model=oss"], config_dir=conf, check="layout").model
    expected = import_hf_config(source, name="oss", seq_length=2048).fields
    assert {k: v for k, v in dataclasses.asdict(model).items() if k in expected} == expected
    assert main(["import-model", str(source), "--name", "oss"]) == 2  # an existing file is kept
    assert "pass --force" in capsys.readouterr().err


def test_import_model_prints_to_stdout_and_refuses_what_it_cannot_model(tmp_path, capsys):
    assert main(["import-model", str(FIXTURES / "kimi-k2" / "config.json"), "-o", "-"]) == 0
    assert "kv_lora_rank: 512" in capsys.readouterr().out
    data = json.loads((FIXTURES / "mixtral-8x7b" / "config.json").read_text()) | {"hidden_act": "gelu"}
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert main(["import-model", str(tmp_path / "config.json"), "-o", "-"]) == 2
    assert "hidden_act='gelu' is not modelled" in capsys.readouterr().err
