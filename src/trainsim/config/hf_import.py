"""A model from its published Hugging Face config.json: every key mapped, ignored with a reason, or refused.

People arrive with a model's config.json, not with trainsim's field names. `import_hf_config` reads one (with
the json module only: no transformers import) and returns ModelConfig fields. Each key of the file is
  * mapped to a field (hidden_size -> hidden_size, n_routed_experts -> num_experts, ...),
  * ignored because it does not change a training step's work (IGNORED: tokenizer ids, initialisation, ...),
  * recorded in model.approximations when trainsim models it as something close (GPT-OSS's clamped SwiGLU as
    plain SwiGLU), which every prediction's warnings repeat, or
  * refused with a ConfigError naming the file, the key, its value and what is accepted.
Nothing is dropped silently: a key the mapping of its model_type does not know is refused (unless its value is
null: the feature it names is off).

The training sequence length is not in config.json (max_position_embeddings is the model's limit, not the
length it is trained at): it is an argument, DEFAULT_SEQ_LENGTH unless given.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainsim.errors import ConfigError

DEFAULT_SEQ_LENGTH = 4096  # set: the training length an import assumes unless told (DeepSeek-V3's and Qwen3's
# pre-training length); override it with model.seq_length=... or `import-model --seq-length`

IGNORED = {
    "architectures": "the transformers class name; model_type selects the mapping",
    "model_type": "selects the mapping",
    "_name_or_path": "where the checkpoint was loaded from",
    "auto_map": "the remote-code classes of the checkpoint",
    "transformers_version": "the library version that wrote the file",
    "torch_dtype": "the checkpoint's storage dtype; the training precision is parallelism.precision",
    "dtype": "the checkpoint's storage dtype; the training precision is parallelism.precision",
    "quantization_config": "how the released weights are stored (FP8 blocks, MXFP4); the training precision is "
                           "parallelism.precision",
    "initializer_range": "weight initialisation: no work in a step",
    "bos_token_id": "a tokenizer id", "eos_token_id": "a tokenizer id", "pad_token_id": "a tokenizer id",
    "boi_token_index": "a tokenizer id", "eoi_token_index": "a tokenizer id", "image_token_index": "a tokenizer id",
    "use_cache": "inference key/value cache",
    "num_logits_to_keep": "inference: logits kept at generation",
    "output_router_logits": "whether the transformers model returns router logits",
    "max_position_embeddings": "the model's longest context, not the training length (model.seq_length)",
    "initial_context_length": "the pre-training context of the release; the training length is model.seq_length",
    "pretraining_tp": "a tensor-parallel degree of the reference code's arithmetic; the layout is parallelism.tp",
    "ep_size": "an expert-parallel degree of the reference code; the layout is parallelism.ep",
    "rope_scaling": "context extension (YaRN, llama3 scaling) changes the rotary frequencies, not the work",
    "max_sequence_length": "the model's longest context (early LLaMA conversions), not the training length",
    "routed_scaling_factor": "a constant multiplying the routed experts' output (one elementwise op's operand)",
    "seq_aux": "sequence- or batch-wise balance loss: the same work",
    "topk_method": "auxiliary-loss-free expert bias (noaux_tc) or greedy selection: changes which experts a "
                   "token picks, not the work (the trace routes by model.moe_routing)",
    "router_jitter_noise": "noise on the router logits: one elementwise op",
    "attn_temperature_tuning": "rescales the queries of long contexts: one elementwise op",
    "attn_scale": "rescales the queries of long contexts: one elementwise op",
    "floor_scale": "rescales the queries of long contexts: one elementwise op",
    "for_llm_compressor": "a checkpoint-format flag",
    "residual_in_fp32": "the residual stream's dtype in inference kernels",
    "rescale_prenorm_residual": "weight initialisation: no work in a step",
    "time_step_min": "Mamba's dt initialisation", "time_step_max": "Mamba's dt initialisation",
    "time_step_floor": "Mamba's dt initialisation", "time_step_limit": "Mamba's dt clamp: one elementwise op",
    "time_step_rank": "Mamba-1 dt rank, unused by Mamba-2",
    "use_mamba_kernels": "whether inference uses the fused Mamba kernels",
    "chunk_size": "Mamba-2's scan chunk (a kernel tiling choice)",
    "use_conv_bias": "the bias of Mamba's depthwise convolution: added inside the convolution kernel",
    "no_rope_layers": "which layers skip rotary embedding (Llama 4: the full-attention ones): less work, "
                      "checked against global_attention_every",
    "moe_layers": "the MoE layers' indices, checked against interleave_moe_layer_step",
    "max_window_layers": "Qwen's layers without sliding windows; used only with use_sliding_window",
}
"""Keys that do not change a training step's work, with the reason (each is read from any model_type)."""

NULL_REASON = "null: the feature is off"
"""Why a key whose value is null (sliding_window, rope_scaling of many releases) is left out."""

ACCEPTED_ACTIVATIONS = ("silu",)
"""hidden_act of the gated MLPs trainsim builds (SwiGLU)."""


@dataclass
class ImportedModel:
    """ModelConfig fields read from one config.json, and what was ignored."""

    source: Path
    model_type: str
    fields: dict[str, Any]
    """ModelConfig fields (name, family, ..., approximations)."""
    ignored: dict[str, str] = field(default_factory=dict)
    """Keys of the file left out, with the reason."""


class _Keys:
    """The keys of one (possibly nested) config dict, tracking which ones the mapping read."""

    def __init__(self, path: Path, data: dict[str, Any], model_type: str, prefix: str = ""):
        self.path, self.data, self.model_type, self.prefix = path, data, model_type, prefix
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        value = self.data.get(key)
        return default if value is None else value

    def need(self, key: str) -> Any:
        if self.data.get(key) is None:
            raise ConfigError(f"{self.path}: {self.prefix}{key} is missing; a {self.model_type} config.json "
                              f"needs it")
        return self.get(key)

    def refuse(self, key: str, accepted: str) -> ConfigError:
        return ConfigError(f"{self.path}: {self.prefix}{key}={self.data.get(key)!r} is not modelled; "
                           f"accepted: {accepted}")

    def left_over(self) -> list[str]:
        return [key for key, value in self.data.items()
                if key not in self.read and key not in IGNORED and value is not None]


def slug(path: Path) -> str:
    """A model name from a file: its folder's name for config.json (hub checkouts), else the file's stem."""
    stem = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return re.sub(r"[^a-z0-9.]+", "-", stem.lower()).strip("-") or "imported"


def import_hf_config(path: str | Path, name: str = "", seq_length: int = DEFAULT_SEQ_LENGTH) -> ImportedModel:
    """The ModelConfig fields of a Hugging Face config.json (see the module docstring)."""
    path = Path(path)
    path = path / "config.json" if path.is_dir() else path  # a checkout of the model's hub repository
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the Hugging Face config.json ({exc.strerror})") from exc
    except ValueError as exc:
        raise ConfigError(f"{path}: not a JSON config.json ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config.json holds one JSON object, got {type(data).__name__}")
    model_type = data.get("model_type")
    if model_type not in MAPPINGS:
        raise ConfigError(f"{path}: model_type={model_type!r} is not modelled; accepted: {', '.join(MAPPINGS)}")
    outer = _Keys(path, data, model_type)
    text = outer
    approximations: list[str] = []
    if model_type == "llama4":
        text = _Keys(path, outer.need("text_config"), model_type, "text_config.")
        if outer.get("vision_config"):
            approximations.append("vision encoder not modelled: the text decoder only")
        if outer.get("tie_word_embeddings", False):
            approximations.append("tied input and output embeddings modelled as untied")
    fields = {"name": name or slug(path), "seq_length": seq_length, "approximations": approximations}
    fields |= _common(text, approximations)
    MAPPINGS[model_type](text, fields, approximations)
    for keys in {id(k): k for k in (outer, text)}.values():
        unknown = keys.left_over()
        if unknown:
            raise ConfigError(f"{path}: {', '.join(f'{keys.prefix}{k}={keys.data[k]!r}' for k in unknown)} not "
                              f"modelled by the {model_type} import; accepted: its mapped keys "
                              f"({', '.join(sorted(keys.read))}) and those trainsim.config.hf_import.IGNORED lists")
    ignored = {f"{keys.prefix}{k}": IGNORED.get(k, NULL_REASON) for keys in (outer, text) for k, value in
               keys.data.items() if k in IGNORED or (value is None and k not in keys.read)}
    return ImportedModel(source=path, model_type=model_type, fields=fields, ignored=ignored)


def _common(keys: _Keys, approximations: list[str]) -> dict[str, Any]:
    """Fields every decoder config states the same way."""
    heads = keys.need("num_attention_heads")
    hidden = keys.need("hidden_size")
    kv_heads = keys.get("num_key_value_heads", heads)
    head_dim = keys.get("head_dim")
    out = {"family": "llama", "num_layers": keys.need("num_hidden_layers"), "hidden_size": hidden,
           "num_attention_heads": heads, "num_kv_heads": None if kv_heads == heads else kv_heads,
           "head_dim": None if head_dim in (None, hidden // heads) else head_dim,
           "ffn_hidden_size": keys.need("intermediate_size"), "vocab_size": keys.need("vocab_size"),
           "norm_eps": float(keys.get("rms_norm_eps", keys.get("layer_norm_epsilon", 1e-5))),
           "attention_dropout": float(keys.get("attention_dropout", 0.0)),
           "dropout": float(keys.get("hidden_dropout", 0.0))}
    rope = keys.get("rope_parameters", {})  # transformers 5: rope_theta and the scaling in one dict
    theta = keys.get("rope_theta", rope.get("rope_theta"))
    if theta is not None:
        out["rope_theta"] = float(theta)
    accepted = ("relu2",) if keys.model_type == "nemotron_h" else ACCEPTED_ACTIVATIONS  # its MLP: mlp_hidden_act
    if keys.get("hidden_act", accepted[0]) not in accepted:
        raise keys.refuse("hidden_act", f"{', '.join(accepted)} (the MLP the {keys.model_type} import builds)")
    if keys.get("tie_word_embeddings", False):
        approximations.append("tied input and output embeddings modelled as untied (one more weight matrix's "
                              "gradient and optimizer state)")
    if keys.get("attention_bias", False):
        approximations.append("attention projection biases not modelled")
    if keys.get("mlp_bias", False):
        approximations.append("MLP biases not modelled")
    return out


QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
"""model_types whose sliding_window counts only with use_sliding_window, from layer max_window_layers on."""


def _sliding(keys: _Keys, fields: dict[str, Any]) -> None:
    """One sliding window on every layer (Mistral; Qwen with use_sliding_window and max_window_layers 0)."""
    window = keys.get("sliding_window")
    if "layer_types" in keys.data:  # transformers 4.53 and later write the kind of every layer
        keys.get("max_window_layers"), keys.get("use_sliding_window")  # what layer_types was derived from
        fields |= _windows(keys, fields["num_layers"], keys.get("layer_types"), window, "sliding_attention",
                           "sliding")
        return
    if not keys.get("use_sliding_window", keys.model_type not in QWEN_TYPES) or not window:
        return
    if keys.model_type in QWEN_TYPES and keys.get("max_window_layers", 0) not in (0, fields["num_layers"]):
        raise keys.refuse("max_window_layers", f"0 (every layer windowed) or {fields['num_layers']} (none)")
    if keys.get("max_window_layers", 0) == 0:
        fields |= {"window_size": window, "window_kind": "sliding", "global_attention_every": 0}


def _moe_router_aux(keys: _Keys, fields: dict[str, Any], coefficient_key: str = "router_aux_loss_coef") -> None:
    fields["moe_aux_loss_coeff"] = float(keys.get(coefficient_key, 0.0))


def _llama(keys: _Keys, fields: dict[str, Any], approximations: list[str]) -> None:
    """Llama 1-3.x, Mistral-shaped dense decoders and Qwen2/Qwen3 dense."""
    _sliding(keys, fields)
    if keys.model_type in ("qwen2", "qwen2_moe"):
        approximations.append("query/key/value projection biases of Qwen2 not modelled")
    if keys.model_type in ("qwen3", "qwen3_moe"):
        approximations.append("per-head query/key RMSNorm (QK-norm) of Qwen3 not modelled")


def _mixtral(keys: _Keys, fields: dict[str, Any], approximations: list[str]) -> None:
    fields |= {"num_experts": keys.need("num_local_experts"), "moe_top_k": keys.need("num_experts_per_tok"),
               "moe_router": "softmax"}
    _sliding(keys, fields)
    _moe_router_aux(keys, fields)


def _qwen_moe(keys: _Keys, fields: dict[str, Any], approximations: list[str]) -> None:
    """Qwen2-MoE and Qwen3-MoE: fine-grained experts, Qwen2-MoE with a gated shared expert."""
    _llama(keys, fields, approximations)
    fields |= {"num_experts": keys.need("num_experts"), "moe_top_k": keys.need("num_experts_per_tok"),
               "moe_ffn_hidden_size": keys.need("moe_intermediate_size"), "moe_router": "softmax"}
    if not keys.get("norm_topk_prob", True):
        approximations.append("router probabilities not renormalised over the top-k (norm_topk_prob false): "
                              "modelled as a softmax over the top-k, the same work")
    shared = keys.get("shared_expert_intermediate_size", 0)
    if shared:
        fields["moe_shared_expert_ffn_hidden_size"] = shared
        approximations.append("the shared expert's sigmoid gate not modelled")
    _moe_layers(keys, fields, keys.get("decoder_sparse_step", 1), keys.get("mlp_only_layers", []))
    _moe_router_aux(keys, fields)


def _moe_layers(keys: _Keys, fields: dict[str, Any], every: int, dense_layers: list[int]) -> None:
    """MoE every `every` layers, with leading dense layers (Qwen's mlp_only_layers must be a leading block)."""
    if dense_layers != list(range(len(dense_layers))) or (dense_layers and every != 1):
        raise keys.refuse("mlp_only_layers", "[] or, with decoder_sparse_step 1, the leading layers [0, ..., k-1]")
    fields["moe_first_dense_layers"] = len(dense_layers)
    fields["moe_layer_freq"] = every


def _deepseek_v3(keys: _Keys, fields: dict[str, Any], approximations: list[str]) -> None:
    """DeepSeek-V3 and Kimi K2: multi-head latent attention, shared experts, leading dense layers."""
    fields |= {"q_lora_rank": keys.get("q_lora_rank", 0), "kv_lora_rank": keys.need("kv_lora_rank"),
               "head_dim": keys.need("qk_nope_head_dim"), "qk_rope_head_dim": keys.need("qk_rope_head_dim"),
               "v_head_dim": keys.need("v_head_dim"), "num_kv_heads": None,
               "num_experts": keys.need("n_routed_experts"), "moe_top_k": keys.need("num_experts_per_tok"),
               "moe_ffn_hidden_size": keys.need("moe_intermediate_size"),
               "moe_shared_expert_ffn_hidden_size": keys.get("n_shared_experts", 0) * keys.get("moe_intermediate_size"),
               "moe_first_dense_layers": keys.get("first_k_dense_replace", 0)}
    if keys.get("moe_layer_freq", 1) != 1:  # DeepSeek counts it from layer 0 (i % k == 0), the contract from 1
        raise keys.refuse("moe_layer_freq", "1 (every layer after first_k_dense_replace an MoE layer)")
    scoring = keys.get("scoring_func", "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise keys.refuse("scoring_func", "softmax, sigmoid")
    fields["moe_router"] = scoring
    if not keys.get("norm_topk_prob", True):
        approximations.append("routing weights not renormalised over the top-k (norm_topk_prob false): the same work")
    groups, groups_per_token = keys.get("n_group", 1), keys.get("topk_group", 1)
    if groups_per_token < groups:
        approximations.append(f"group-limited routing (each token to {groups_per_token} of {groups} expert groups) "
                              "not modelled: tokens routed without the limit")
    mtp = keys.get("num_nextn_predict_layers", 0)
    if mtp:
        approximations.append(f"multi-token prediction ({mtp} extra layer(s)) not modelled")
    _moe_router_aux(keys, fields, "aux_loss_alpha")


def _gpt_oss(keys: _Keys, fields: dict[str, Any], approximations: list[str]) -> None:
    """GPT-OSS: every layer MoE (no dense MLP), attention sinks, alternating sliding/full attention."""
    experts_per_token = keys.need("num_experts_per_tok")
    if keys.get("experts_per_token", experts_per_token) != experts_per_token:
        raise keys.refuse("experts_per_token", f"num_experts_per_tok ({experts_per_token})")
    fields |= {"num_experts": keys.need("num_local_experts"), "moe_top_k": experts_per_token,
               "moe_router": "softmax", "moe_router_bias": True, "attention_sinks": True}
    fields |= _windows(keys, fields["num_layers"], keys.need("layer_types"), keys.need("sliding_window"),
                       "sliding_attention", "sliding")
    if keys.get("swiglu_limit"):
        approximations.append(f"SwiGLU clamp (swiglu_limit {keys.get('swiglu_limit')}) of GPT-OSS modelled as "
                              "plain SwiGLU")
    approximations.append("expert biases not modelled")
    _moe_router_aux(keys, fields)


def _windows(keys: _Keys, layers: int, kinds: list[str], window: int, local: str, kind: str) -> dict[str, Any]:
    """window_size and global_attention_every from a per-layer list of attention kinds."""
    is_local = [k == local for k in kinds]
    if len(kinds) != layers or not all(k in (local, "full_attention") for k in kinds):
        raise keys.refuse("layer_types", f"{layers} entries of '{local}' or 'full_attention'")
    if not any(is_local):
        return {}
    for every in (0, *range(2, layers + 1)):
        if is_local == [every == 0 or (i + 1) % every != 0 for i in range(layers)]:
            return {"window_size": window, "window_kind": kind, "global_attention_every": every}
    raise keys.refuse("layer_types", "windowed layers with every k-th layer (i+1) % k == 0 full, or all windowed")


def _llama4(keys: _Keys, fields: dict[str, Any], approximations: list[str]) -> None:
    """Llama 4 text decoder: MoE every interleave_moe_layer_step layers with a shared expert; chunked attention
    on the rotary layers, full attention on every fourth (NoPE) one."""
    layers = fields["num_layers"]
    every = keys.get("interleave_moe_layer_step", 1)
    moe = keys.get("moe_layers") or list(range(every - 1, layers, every))
    if moe != list(range(every - 1, layers, every)):
        raise keys.refuse("moe_layers", f"layers i with (i+1) % interleave_moe_layer_step ({every}) == 0")
    expert = keys.need("intermediate_size")
    fields |= {"num_experts": keys.need("num_local_experts"), "moe_top_k": keys.need("num_experts_per_tok"),
               "ffn_hidden_size": keys.get("intermediate_size_mlp", expert), "moe_ffn_hidden_size": expert,
               "moe_shared_expert_ffn_hidden_size": expert, "moe_router": "sigmoid", "moe_layer_freq": every}
    chunk = keys.get("attention_chunk_size", 0)
    nope = keys.get("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(layers)]
    if chunk:
        kinds = ["chunked" if rope else "full_attention" for rope in nope]
        fields |= _windows(keys, layers, kinds, chunk, "chunked", "chunked")
    if keys.get("use_qk_norm", False):
        approximations.append("query/key L2 norm (use_qk_norm) of Llama 4 not modelled")
    _moe_router_aux(keys, fields)


def _nemotron_h(keys: _Keys, fields: dict[str, Any], approximations: list[str]) -> None:
    """Nemotron-H: Mamba-2, attention and squared-ReLU MLP layers in the order of hybrid_override_pattern."""
    pattern = keys.need("hybrid_override_pattern")
    if len(pattern) != fields["num_layers"] or set(pattern) - set("M*-"):
        raise keys.refuse("hybrid_override_pattern", f"{fields['num_layers']} characters of M, *, - (MoE layers "
                                                     "'E' of Nemotron 3 are not imported yet)")
    if keys.get("mlp_hidden_act", "relu2") != "relu2" or keys.get("mamba_hidden_act", "silu") != "silu":
        raise keys.refuse("mlp_hidden_act" if keys.data.get("mlp_hidden_act", "relu2") != "relu2"
                          else "mamba_hidden_act", "mlp_hidden_act relu2, mamba_hidden_act silu")
    heads = keys.get("mamba_num_heads", 0)
    fields |= {"family": "gpt", "hybrid_layer_pattern": pattern, "mamba_state_dim": keys.need("ssm_state_size"),
               "mamba_head_dim": keys.need("mamba_head_dim"), "mamba_num_heads": heads,
               "mamba_num_groups": keys.need("n_groups"), "mamba_conv_kernel": keys.get("conv_kernel", 4)}
    expand = keys.get("expand", 2)
    if heads and heads * fields["mamba_head_dim"] != expand * fields["hidden_size"]:
        raise keys.refuse("expand", f"mamba_num_heads x mamba_head_dim / hidden_size "
                                    f"({heads * fields['mamba_head_dim'] / fields['hidden_size']:g})")
    width = fields["head_dim"] or fields["hidden_size"] // fields["num_attention_heads"]
    if keys.get("attention_head_dim", width) != width:
        raise keys.refuse("attention_head_dim", f"head_dim ({width})")
    for key in ("use_bias", "mamba_proj_bias"):
        if keys.get(key, False):
            approximations.append(f"{key}: Mamba projection biases not modelled")
    approximations += ["squared-ReLU MLP of Nemotron-H modelled as GELU (the same two matrices)",
                       "RMSNorm of Nemotron-H modelled as LayerNorm",
                       "no position embedding in Nemotron-H: modelled with learned positions"]


MAPPINGS = {"llama": _llama, "mistral": _llama, "qwen2": _llama, "qwen3": _llama, "mixtral": _mixtral,
            "qwen2_moe": _qwen_moe, "qwen3_moe": _qwen_moe, "deepseek_v3": _deepseek_v3, "kimi_k2": _deepseek_v3,
            "gpt_oss": _gpt_oss, "llama4": _llama4, "nemotron_h": _nemotron_h}
"""The mapping of each model_type this import reads."""
