"""What each architecture is, for the converters (convert_hf.py, convert_gguf.py):

- the names: Hugging Face "architectures" entries and llama.cpp architectures -> ours, and the
  per-layer tensor-name maps of both sources;
- `ARCHITECTURE_DEFAULTS`: what an architecture implies beyond its config.json (Gemma's norm
  offset, soft-capping, sliding layer patterns, ...), one `Architecture` a family;
- the config.json readers those entries use (`hf_int`, `hf_float`, ...): a wrong type or range is
  a line naming the key.

A GGUF file's metadata is first rewritten as config.json keys (convert_gguf.gguf_config), so the
same table applies to both sources.
"""
import math
from dataclasses import dataclass, field
from typing import Callable

from errors import ConvertError
from config_checks import CONFIG_MAX
from model import ModelArgs

# HF config "architectures" entry -> our architecture name
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # the text decoder only; the vision tower is dropped
    "Qwen3ForCausalLM": "qwen3",
    "Olmo2ForCausalLM": "olmo2",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
}
HF_MODEL_TYPES = {"gemma3_text": "gemma3"}  # model_type -> ours, where it differs from our name
# llama.cpp's general.architecture -> ours; a llama GGUF with llama.expert_count is Mixtral
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                      "olmo2": "olmo2", "granite": "granite", "smollm3": "smollm3", "phi3": "phi3", "gpt-oss": "gpt_oss"}
# llama.cpp's converter permutes q/k rows to Meta's interleaved pairs for these (its LlamaModel and subclasses)
GGUF_PERMUTED = ("llama", "granite", "smollm3")
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# per-layer HF names -> ours; q/k/v are handled separately because they are fused
HF_LAYER_NAMES = {
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
HF_SANDWICH_NAMES = {  # Gemma 2/3: four norms per layer; post_attention_layernorm is no longer pre-FFN
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffn_norm.weight",
}
HF_QK_NORM_NAMES = {"self_attn.q_norm.weight": "attention.q_norm.weight",
                    "self_attn.k_norm.weight": "attention.k_norm.weight"}
GGUF_LAYER_NAMES = {
    "attn_output.weight": "attention.wo.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "attn_norm.weight": "attention_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
}
GGUF_SANDWICH_NAMES = {"post_attention_norm.weight": "post_attention_norm.weight",
                       "post_ffw_norm.weight": "post_ffn_norm.weight"}
GGUF_QK_NORM_NAMES = {"attn_q_norm.weight": "attention.q_norm.weight",
                      "attn_k_norm.weight": "attention.k_norm.weight"}


def renamed_layer_tensors(args: ModelArgs, names: dict, sandwich_names: dict, qk_norm_names: dict) -> dict:
    """Per-layer name -> ours of the tensors a source (HF_* or GGUF_* maps) holds as we do."""
    layer_names = dict(names)
    if args.post_norms:
        layer_names.update(sandwich_names)
    if args.qk_norm:
        layer_names.update(qk_norm_names)
    if not args.pre_norms:  # OLMo 2: its only norms are after the sublayers
        layer_names = {k: v for k, v in layer_names.items() if v not in ("attention_norm.weight", "ffn_norm.weight")}
    return layer_names


# ---------------------------------------------------------------- config.json values, checked

REQUIRED = object()  # the default of a key config.json must have


def shown(value) -> str:
    return repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."


def hf_number(cfg: dict, key: str, kind: type, default, name: str):
    """cfg[key] as an int or a finite float; None when absent or null, unless REQUIRED."""
    value = cfg.get(key)
    if value is None:
        if default is REQUIRED:
            raise ConvertError(f"config.json lacks {name!r}")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConvertError(f"config.json key {name!r}: {shown(value)} is not {'an integer' if kind is int else 'a number'}")
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)  # 4096.0: a writer that stores every number as a float
    if kind is int and not isinstance(value, int):
        raise ConvertError(f"config.json key {name!r}: {shown(value)} is not an integer")
    if kind is float and not math.isfinite(value):
        raise ConvertError(f"config.json key {name!r}: {shown(value)} is not a finite number")
    return kind(value)


def hf_int(cfg: dict, key: str, default=REQUIRED, low: int = 1, high: int = 2 ** 31 - 1, name: str = None) -> int:
    """A size or a count from config.json (low..high; default when absent or null): a wrong type
    or range is a line naming the key, not a TypeError or ZeroDivisionError further on. name: the
    key as the user sees it, e.g. inside rope_parameters."""
    value = hf_number(cfg, key, int, default, name or key)
    if value is None:
        return default
    if not low <= value <= high:
        raise ConvertError(f"config.json key {name or key!r}: {value} is not an integer in {low}..{high}")
    return value


def hf_layers(cfg: dict) -> int:
    """num_hidden_layers, bounded as ModelArgs bounds it: per-layer lists are built from it first."""
    return hf_int(cfg, "num_hidden_layers", high=CONFIG_MAX["n_layers"])


def hf_float(cfg: dict, key: str, default=REQUIRED, positive: bool = True, name: str = None) -> float:
    """A scale or a rate from config.json: finite, and > 0 unless positive=False."""
    value = hf_number(cfg, key, float, default, name or key)
    if value is None:
        return default
    if positive and not value > 0:
        raise ConvertError(f"config.json key {name or key!r}: {value} is not a positive number")
    return value


def hf_dict(cfg: dict, key: str, name: str = None) -> dict:
    """A nested object of config.json ({} when absent or null)."""
    value = cfg.get(key) or {}
    if not isinstance(value, dict):
        raise ConvertError(f"config.json key {name or key!r}: {shown(value)} is not an object")
    return value


def hf_str(cfg: dict, key: str, default=None):
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ConvertError(f"config.json key {key!r}: {shown(value)} is not a string")
    return value


def hf_bool(cfg: dict, key: str) -> bool:
    value = cfg.get(key) or False
    if not isinstance(value, bool):  # bool("false") would be True
        raise ConvertError(f"config.json key {key!r}: {shown(value)} is not true or false")
    return value


# ---------------------------------------------------------------- what each architecture implies

ROPE_FLOATS = ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow",
               "mscale", "mscale_all_dim")


def rope_params(cfg: dict) -> tuple[dict, str]:
    """transformers 5's rope_parameters or the older rope_scaling, and which of them it was."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    return dict(hf_dict(cfg, key)), key


def hf_rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from transformers 5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` (whose kind is under "type" or "rope_type")."""
    params, key = rope_params(cfg)
    # 0 or null: unset
    theta = (hf_float(params, "rope_theta", None, positive=False, name=f"{key}.rope_theta")
             or hf_float(cfg, "rope_theta", None, positive=False) or 10000.0)
    if theta < 0:
        raise ConvertError(f"config.json key 'rope_theta': {theta} is not a positive number")
    params.pop("rope_theta", None)
    for name in ROPE_FLOATS:  # model.rope_inv_freq skips some for some kinds; none may be unusable
        params[name] = hf_float(params, name, None, positive=name not in ("mscale", "mscale_all_dim"),
                                name=f"{key}.{name}")
    params["original_max_position_embeddings"] = hf_int(params, "original_max_position_embeddings", None,
                                                        name=f"{key}.original_max_position_embeddings")
    params = {name: value for name, value in params.items() if value is not None}
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)  # Llama 3.1 configs carry both spellings
    params.pop("partial_rotary_factor", None)  # ModelArgs.rope_dim (rope_dim_of)
    if kind == "default":
        return theta, None
    if kind in ("linear", "dynamic", "yarn", "llama3") and "factor" not in params:  # dynamic reads it only mid-generation
        raise ConvertError(f"config.json key {key!r}: RoPE scaling {shown(kind)} needs a factor")
    return theta, {"rope_type": kind, **params}


def rope_dim_of(cfg: dict, head_dim: int) -> int | None:
    """Rotated dims per head from partial_rotary_factor (Phi-4-mini: 0.75), in rope_parameters or at the top."""
    params, key = rope_params(cfg)
    partial = (hf_float(params, "partial_rotary_factor", None, name=f"{key}.partial_rotary_factor")
               or hf_float(cfg, "partial_rotary_factor", 1.0))
    if partial > 1:
        raise ConvertError(f"config.json key 'partial_rotary_factor': {partial} is not in (0, 1]")
    return None if partial == 1.0 else int(head_dim * partial)


def one_rope(cfg: dict) -> tuple[float, dict | None, None]:
    """(theta, scaling, None): every layer shares one RoPE."""
    return (*hf_rope(cfg), None)


def gemma3_rope(cfg: dict) -> tuple[float, dict | None, float]:
    """(global theta, global scaling, local theta): Gemma 3 scales RoPE on global layers only.
    transformers 5 writes one rope_parameters dict per layer type; older configs write
    rope_theta + rope_scaling (global) and rope_local_base_freq."""
    params = hf_dict(cfg, "rope_parameters")
    local_theta = hf_float(cfg, "rope_local_base_freq")
    if "full_attention" in params:
        theta, scaling = hf_rope({"rope_parameters": hf_dict(params, "full_attention", "rope_parameters.full_attention")})
        local = hf_dict(params, "sliding_attention", "rope_parameters.sliding_attention")
        if local.get("rope_type", "default") != "default":
            raise ConvertError(f"RoPE scaling on sliding layers ({shown(local['rope_type'])}) is not supported")
        return theta, scaling, hf_float(local, "rope_theta", local_theta, name="rope_parameters.sliding_attention.rope_theta")
    theta, scaling = hf_rope(cfg)
    return theta, scaling, local_theta


def phi3_rope(cfg: dict) -> tuple[float, dict | None, None]:
    """Phi-3 configs keep LongRoPE's original context at the top level, which transformers
    prefers to a copy among the factors."""
    theta, scaling = hf_rope(cfg)
    if scaling:
        scaling["original_max_position_embeddings"] = hf_int(cfg, "original_max_position_embeddings")
    return theta, scaling, None


def no_windows(cfg: dict, n_layers: int) -> tuple:
    return None, None


def every_layer_slides(cfg: dict, n_layers: int) -> tuple:
    """Mistral: every layer attends to the last sliding_window keys (none when it is null)."""
    return cfg.get("sliding_window"), None


def upper_layers_slide(cfg: dict, n_layers: int) -> tuple:
    """Qwen2: with use_sliding_window, layers >= max_window_layers slide (transformers 5 spells
    that out in layer_types)."""
    if not cfg.get("use_sliding_window"):
        return None, None
    first = hf_int(cfg, "max_window_layers", n_layers, low=0)
    return cfg.get("sliding_window"), cfg.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]


def listed_layers_slide(cfg: dict, n_layers: int) -> tuple:
    """SmolLM3: with use_sliding_window, the layers layer_types names slide."""
    if not cfg.get("use_sliding_window"):
        return None, None
    return cfg.get("sliding_window"), cfg.get("layer_types")


def layer_types_slide(cfg: dict, n_layers: int) -> tuple:
    """gpt-oss: config.json's layer_types says which layers slide."""
    return cfg.get("sliding_window"), cfg.get("layer_types")


def every_nth_layer_global(cfg: dict, n_layers: int) -> tuple:
    """Gemma 2/3: sliding_window_pattern - 1 sliding layers, then one global, repeated."""
    every = hf_int(cfg, "sliding_window_pattern")
    return cfg.get("sliding_window"), cfg.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)]


@dataclass(frozen=True)
class Architecture:
    """What an architecture implies beyond the config.json keys every architecture shares."""
    args: dict = field(default_factory=dict)  # ModelArgs fields every checkpoint of it has
    defaults: dict = field(default_factory=dict)  # config.json keys it may leave out -> the value transformers assumes
    windows: Callable = no_windows  # (config, n_layers) -> (sliding_window, layer_types)
    rope: Callable = one_rope  # config -> (rope_theta, rope_scaling, rope_local_theta)
    activations: dict = field(default_factory=lambda: HF_ACTIVATIONS)  # config.json activation -> ours
    scaled_embeddings: bool = False  # embeddings times sqrt(dim) (ModelArgs.embedding_scale)
    fields: Callable = lambda cfg: {}  # config -> more ModelArgs fields read from it
    # config.json key -> the only value we implement; another value is refused, naming the key
    requires: dict = field(default_factory=dict)
    fused: bool = False  # checkpoint holds self_attn.qkv_proj and mlp.gate_up_proj (Phi-3)
    experts: tuple | None = None  # mixture of experts: (module name, gate, up and down expert tensor names)
    o_proj_bias: bool = False  # attention_bias puts a bias on o_proj too, not only on q/k/v (unlike Qwen2)


def nope_layers(cfg: dict) -> dict:
    """SmolLM3's no_rope_layers is a per-layer flag, 1 where RoPE *is* applied (default: every 4th layer has none)."""
    n, every = hf_layers(cfg), hf_int(cfg, "no_rope_layer_interval", 4)
    flags = cfg.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)]
    if not isinstance(flags, list):
        raise ConvertError(f"config.json key 'no_rope_layers': {shown(flags)} is not a list")
    return dict(nope_layers=[i for i, use_rope in enumerate(flags) if not use_rope])


def gpt_oss_fields(cfg: dict) -> dict:
    """Biases on q/k/v and o alike, attention sinks, experts with biases and the clamped SwiGLU;
    the router's softmax over its top-k logits equals renormalized top-k probabilities."""
    return dict(moe_fields(True)(cfg), attention_sinks=True, moe_bias=True, swiglu_limit=hf_float(cfg, "swiglu_limit"),
                swiglu_alpha=hf_float(cfg, "swiglu_alpha", positive=False))


def granite_multipliers(cfg: dict) -> dict:
    return dict(embedding_scale=hf_float(cfg, "embedding_multiplier", 1.0),
                residual_multiplier=hf_float(cfg, "residual_multiplier", 1.0, positive=False),
                attention_multiplier=hf_float(cfg, "attention_multiplier", 1.0),
                logits_scaling=hf_float(cfg, "logits_scaling", 1.0))


def moe_fields(norm_topk_prob_default: bool) -> Callable:
    def read(cfg: dict) -> dict:
        # transformers 5 renames num_experts
        n = hf_int(cfg, "num_local_experts", None) or hf_int(cfg, "num_experts")
        k = hf_int(cfg, "num_experts_per_tok")
        return dict(n_experts=n, n_experts_per_token=k, moe_intermediate_size=hf_int(cfg, "moe_intermediate_size", None),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", norm_topk_prob_default)))
    return read


# config.json keys any architecture may leave out, and the value transformers then assumes
HF_DEFAULTS = dict(rms_norm_eps=1e-6, max_position_embeddings=4096, attention_bias=False,
                   tie_word_embeddings=False, hidden_act="silu")
GEMMA = dict(norm_weight_offset=1.0)  # ModelArgs fields of the whole family: norms multiply by (1 + w)

# Adding an architecture: an entry here (and in HF_ARCHITECTURES / GGUF_ARCHITECTURES), any new
# ModelArgs field with its forward change in model.py, new tensor names in the name maps above,
# a case in tests/test_hf_parity.py or tests/test_architectures.py, and a row in the README's
# table of architectures. Config keys the family may set but we do not implement go in `requires`.
ARCHITECTURE_DEFAULTS = {
    "llama": Architecture(),
    "mistral": Architecture(windows=every_layer_slides),
    "qwen2": Architecture(args=dict(attention_bias=True), windows=upper_layers_slide),
    "gemma": Architecture(
        args=GEMMA, scaled_embeddings=True,
        defaults=dict(tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh"),
        # Gemma 1's config says "gelu", but it was trained with the tanh approximation
        activations={**HF_ACTIVATIONS, "gelu": "gelu_tanh"}),
    "gemma2": Architecture(
        args=dict(GEMMA, post_norms=True), scaled_embeddings=True, windows=every_nth_layer_global,
        defaults=dict(tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", sliding_window=4096,
                      sliding_window_pattern=2, query_pre_attn_scalar=256,
                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma3": Architecture(
        args=dict(GEMMA, post_norms=True, qk_norm=True), scaled_embeddings=True,
        windows=every_nth_layer_global, rope=gemma3_rope,
        defaults=dict(tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", sliding_window=4096,
                      sliding_window_pattern=6, query_pre_attn_scalar=256,
                      rope_theta=1e6, rope_local_base_freq=10000.0)),
    "qwen3": Architecture(args=dict(qk_norm=True), windows=upper_layers_slide, o_proj_bias=True),
    "olmo2": Architecture(args=dict(qk_norm=True, qk_norm_full_width=True, pre_norms=False, post_norms=True),
                          o_proj_bias=True),
    "smollm3": Architecture(windows=listed_layers_slide, fields=nope_layers, defaults=dict(tie_word_embeddings=True),
                            o_proj_bias=True),
    "granite": Architecture(fields=granite_multipliers, o_proj_bias=True),
    "phi3": Architecture(windows=every_layer_slides, rope=phi3_rope, fused=True,
                         defaults=dict(original_max_position_embeddings=4096)),
    "mixtral": Architecture(windows=every_layer_slides, fields=moe_fields(True),
                            experts=("block_sparse_moe", "w1", "w3", "w2")),
    "qwen3_moe": Architecture(args=dict(qk_norm=True), windows=upper_layers_slide, fields=moe_fields(False),
                              experts=("mlp", "gate_proj", "up_proj", "down_proj"),
                              o_proj_bias=True, requires=dict(mlp_only_layers=[], decoder_sparse_step=1)),
    "gpt_oss": Architecture(windows=layer_types_slide, fields=gpt_oss_fields, experts=("mlp",), o_proj_bias=True,
                            defaults=dict(attention_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702)),
}
