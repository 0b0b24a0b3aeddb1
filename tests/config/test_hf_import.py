"""A model from its published config.json: the same model as conf/model, every key accounted for, and
`model=hf:` composing wherever a run is composed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainsim.config import compose_run
from trainsim.config.hf_import import import_hf_config
from trainsim.config.imported_models import import_mismatches
from trainsim.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "config" / "fixtures" / "hf"
CONF = REPO / "conf"
IN_CONF = ["deepseek-v3", "gpt-oss-120b", "llama3-70b", "llama3-8b", "llama3.1-405b", "mixtral-8x7b",
           "qwen3-235b-a22b", "qwen3-30b-a3b"]
"""Models with both a published config.json fixture and a conf/model file."""


def test_published_configs_import_to_the_models_of_conf():
    assert all((CONF / "model" / f"{m}.yaml").is_file() and (FIXTURES / m / "config.json").is_file() for m in IN_CONF)
    assert import_mismatches(FIXTURES, CONF) == []


def test_a_conf_model_that_differs_is_named_field_by_field(tmp_path):
    (tmp_path / "model").mkdir()
    text = (CONF / "model" / "mixtral-8x7b.yaml").read_text()
    (tmp_path / "model" / "mixtral-8x7b.yaml").write_text(text.replace("num_kv_heads: 8", "num_kv_heads: 4"))
    assert import_mismatches(FIXTURES, tmp_path) == [("mixtral-8x7b", "num_kv_heads", 8, 4)]


@pytest.mark.parametrize("model, expected", [
    ("gpt-oss-120b", {"num_experts": 128, "moe_top_k": 4, "window_size": 128, "window_kind": "sliding",
                      "global_attention_every": 2, "attention_sinks": True, "moe_router_bias": True, "head_dim": 64}),
    ("kimi-k2", {"num_experts": 384, "moe_first_dense_layers": 1, "kv_lora_rank": 512, "q_lora_rank": 1536,
                 "qk_rope_head_dim": 64, "head_dim": 128, "num_attention_heads": 64, "moe_router": "sigmoid"}),
    ("llama4-maverick", {"num_experts": 128, "moe_top_k": 1, "moe_layer_freq": 2, "ffn_hidden_size": 16384,
                         "moe_ffn_hidden_size": 8192, "moe_shared_expert_ffn_hidden_size": 8192,
                         "window_size": 8192, "window_kind": "chunked", "global_attention_every": 4}),
    ("llama4-scout", {"num_experts": 16, "moe_layer_freq": 1, "window_kind": "chunked"}),
    ("qwen1.5-moe-a2.7b", {"num_experts": 60, "moe_top_k": 4, "moe_ffn_hidden_size": 1408,
                           "moe_shared_expert_ffn_hidden_size": 5632, "num_kv_heads": None, "window_size": None}),
    ("nemotron-h-8b", {"num_layers": 52, "mamba_state_dim": 128, "mamba_num_heads": 128, "mamba_num_groups": 8,
                       "hybrid_layer_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"}),
])
def test_architectures_without_a_conf_model_import_their_features(model, expected):
    fields = import_hf_config(FIXTURES / model / "config.json").fields
    assert {k: fields.get(k) for k in expected} == expected


def test_configs_written_by_newer_transformers_import_the_same(tmp_path):
    """transformers 4.53+ writes layer_types for every model and 5.x moves rope_theta into rope_parameters."""
    data = json.loads((FIXTURES / "qwen3-30b-a3b" / "config.json").read_text())
    theta = data.pop("rope_theta")
    data |= {"layer_types": ["full_attention"] * 48, "rope_parameters": {"rope_theta": theta, "rope_type": "default"}}
    (tmp_path / "config.json").write_text(json.dumps(data))
    newer = import_hf_config(tmp_path / "config.json", name="qwen3-30b-a3b")
    assert newer.fields == import_hf_config(FIXTURES / "qwen3-30b-a3b" / "config.json").fields
    data["layer_types"] = ["sliding_attention"] * 48
    data["sliding_window"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert import_hf_config(tmp_path / "config.json").fields["window_size"] == 4096


def test_what_is_approximated_or_left_out_is_said():
    gpt_oss = import_hf_config(FIXTURES / "gpt-oss-120b" / "config.json")
    assert any("SwiGLU clamp" in a for a in gpt_oss.fields["approximations"])
    assert any("expert biases" in a for a in gpt_oss.fields["approximations"])
    assert "quantization_config" in gpt_oss.ignored and "max_position_embeddings" in gpt_oss.ignored
    scout = import_hf_config(FIXTURES / "llama4-scout" / "config.json")
    assert any("vision encoder" in a for a in scout.fields["approximations"])
    qwen2_moe = import_hf_config(FIXTURES / "qwen1.5-moe-a2.7b" / "config.json").fields["approximations"]
    assert any("projection biases of Qwen2" in a for a in qwen2_moe)
    assert any("shared expert's sigmoid gate" in a for a in qwen2_moe)


def _edited(tmp_path: Path, model: str, **changes) -> Path:
    data = json.loads((FIXTURES / model / "config.json").read_text())
    data.update(changes)
    path = tmp_path / model / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("model, changes, message", [
    ("llama3-8b", {"some_new_feature": 3}, "some_new_feature=3 not modelled by the llama import"),
    ("llama3-8b", {"model_type": "falcon"}, "model_type='falcon' is not modelled; accepted: llama"),
    ("llama3-8b", {"hidden_act": "gelu"}, "hidden_act='gelu' is not modelled; accepted: silu"),
    ("gpt-oss-120b", {"layer_types": ["full_attention"] + ["sliding_attention"] * 35},
     "layer_types=['full_attention', "),
    ("qwen3-30b-a3b", {"mlp_only_layers": [5]}, "mlp_only_layers=[5] is not modelled"),
])
def test_a_key_that_cannot_be_modelled_is_refused_with_file_key_and_value(tmp_path, model, changes, message):
    path = _edited(tmp_path, model, **changes)
    with pytest.raises(ConfigError) as error:
        import_hf_config(path)
    assert str(path) in str(error.value) and message in str(error.value)


def test_model_hf_composes_with_a_key_that_follows_the_content(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the imports and the composition cache go under tmp_path/artifacts
    first = shutil.copytree(FIXTURES / "llama3-8b", tmp_path / "llama3-8b")
    run = compose_run([f"model=hf:{first}/config.json", "parallelism=dp2"], config_dir=CONF, check="layout")
    assert run.choices["model"] == f"hf:{first}/config.json"
    assert run.keys["model"].startswith("llama3-8b-") and run.model.name == run.keys["model"]
    assert (run.model.num_layers, run.model.num_kv_heads, run.model.seq_length) == (32, 8, 4096)
    again = compose_run([f"model=hf:{first}/config.json", "model.seq_length=8192"], config_dir=CONF,
                        check="layout")
    assert again.model.seq_length == 8192 and again.keys["model"].startswith(run.keys["model"] + "-")
    other = _edited(tmp_path / "b", "llama3-8b", num_hidden_layers=16)
    other_run = compose_run([f"model=hf:{other}"], config_dir=CONF, check="layout")
    assert other_run.model.num_layers == 16 and other_run.keys["model"] != run.keys["model"]


def test_a_sweep_axis_may_import_a_model(tmp_path, monkeypatch):
    from trainsim.config.sweep import sweep_points

    monkeypatch.chdir(tmp_path)
    source = FIXTURES / "mixtral-8x7b" / "config.json"
    _, points = sweep_points({"model": f"hf:{source},gpt-tiny", "parallelism": "dp2"})
    assert [p.run.choices["model"] for p in points] == [f"hf:{source}", "gpt-tiny"]
    assert points[0].run.model.num_experts == 8 and points[0].run.keys["model"].startswith("mixtral-8x7b-")


def test_a_missing_file_is_named():
    with pytest.raises(ConfigError, match="nowhere/config.json: cannot read the Hugging Face config.json"):
        import_hf_config("nowhere/config.json")
