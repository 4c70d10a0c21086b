"""llama.cpp GGUF file -> our checkpoint directory: the metadata rewritten as config.json keys
(`gguf_config`) and read by convert_hf.hf_config_to_args, every tensor dequantized to float32 and
renamed to ours, the tokenizer rebuilt from the metadata.

GGUFs of llama.cpp's llama-derived architectures (llama, granite, smollm3) store q/k rows in Meta's
interleaved-pair layout; they are un-permuted to HF's rotate_half rows. A GGUF's experts come as
3-D tensors, (experts, out, in), and are stacked as ours. llama.cpp folds the 1 of Gemma's (1 + w)
norms into its gemma3 weights, so it is subtracted here.
"""
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from architectures import (ARCHITECTURE_DEFAULTS, GGUF_ARCHITECTURES, GGUF_LAYER_NAMES, GGUF_PERMUTED,
                           GGUF_QK_NORM_NAMES, GGUF_SANDWICH_NAMES, renamed_layer_tensors)
from checkpoint import check_state, write_checkpoint
from convert_hf import fuse_qkv, hf_config_to_args, progress
from errors import ConvertError, one_line
from model import ModelArgs
from tokenizer import gguf_field, write_tokenizer_from_gguf


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


def gguf_required(reader, key: str, kind: type = int):
    """gguf_positive for a key the conversion cannot do without."""
    value = gguf_positive(reader, key, kind)
    if value is None:
        raise ConvertError(f"GGUF metadata lacks {key}")
    return value


def gguf_architecture(reader, arch: str) -> str:
    """Our architecture name for llama.cpp's general.architecture."""
    ours = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and gguf_value(reader, "llama.expert_count", int):
        ours = "mixtral"  # llama.cpp writes Mixtral as llama with experts
    return ours


def gguf_vocab(reader, tensors: dict) -> tuple[list | None, int]:
    """(tokenizer.ggml.tokens, the vocabulary size): the tokens' count, else token_embd's rows."""
    tokens = gguf_value(reader, "tokenizer.ggml.tokens", list)
    if tokens is not None and not all(isinstance(token, str) for token in tokens):
        raise ConvertError("GGUF metadata tokenizer.ggml.tokens is not an array of strings")
    embeddings = tensors.get("token_embd.weight")
    if not tokens and (embeddings is None or len(embeddings.shape) != 2):
        raise ConvertError("GGUF file has neither tokenizer.ggml.tokens nor a 2-d token_embd.weight")
    return tokens, len(tokens) if tokens else int(embeddings.shape[1])  # GGUF dims run innermost first


def gguf_block_count(reader, arch: str, tensors: dict) -> int:
    n_layers = gguf_required(reader, f"{arch}.block_count")
    blocks = {name.split(".")[1] for name in tensors if name.startswith("blk.")}
    if blocks != {str(i) for i in range(min(n_layers, len(blocks) + 1))}:  # a count the tensors do not bear out sizes nothing
        raise ConvertError(f"GGUF metadata {arch}.block_count is {n_layers}, but the file has "
                           f"tensors for {len(blocks)} blocks")
    return n_layers


def gguf_token_id(reader, kind: str, vocab: int):
    value = gguf_value(reader, f"tokenizer.ggml.{kind}_token_id", int)
    if value is not None and not 0 <= value < vocab:
        raise ConvertError(f"GGUF metadata tokenizer.ggml.{kind}_token_id is {value}, "
                           f"outside the vocabulary of {vocab}")
    return value


def gguf_eos_ids(reader, ours: str, tokens: list | None, vocab: int) -> list:
    eos = [gguf_token_id(reader, kind, vocab) for kind in ("eos", "eot")]
    if ours in ("qwen2", "qwen3", "qwen3_moe") and tokens and "<|endoftext|>" in tokens:
        # Qwen GGUFs name only <|im_end|>; a base-style continuation ends with <|endoftext|> (HF lists both)
        eos.append(tokens.index("<|endoftext|>"))
    return [token for token in eos if token is not None]


def gguf_config(reader, arch: str, tensors: dict) -> dict:
    """A GGUF file's metadata as the config.json keys hf_config_to_args reads, each value checked
    for type and range. What llama.cpp does not record but hard-codes per architecture (Gemma 3's
    layer pattern and local RoPE base, SmolLM3's layers without RoPE, gpt-oss's alternating
    windows) takes the architecture's default or llama.cpp's value."""
    ours = gguf_architecture(reader, arch)
    tokens, vocab = gguf_vocab(reader, tensors)
    n_layers = gguf_block_count(reader, arch, tensors)
    context = gguf_positive(reader, f"{arch}.context_length", int, 4096)
    eos = gguf_eos_ids(reader, ours, tokens, vocab)
    dim = gguf_required(reader, f"{arch}.embedding_length")
    n_heads = gguf_required(reader, f"{arch}.attention.head_count")
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
        "intermediate_size": gguf_required(reader, f"{arch}.feed_forward_length"),
        "rms_norm_eps": gguf_required(reader, f"{arch}.attention.layer_norm_rms_epsilon", float),
        "rope_theta": gguf_positive(reader, f"{arch}.rope.freq_base", float),
        "sliding_window": gguf_value(reader, f"{arch}.attention.sliding_window", int) or None,  # Phi-4 writes 0: none
        "max_position_embeddings": context,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": gguf_token_id(reader, "bos", vocab),
        "eos_token_id": eos,
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
    add_family_keys(cfg, reader, arch, ours)
    return {key: value for key, value in cfg.items() if value is not None}  # absent: the default applies


def add_family_keys(cfg: dict, reader, arch: str, ours: str) -> None:
    """The keys of one family: read from its metadata (experts, Granite's multipliers), or as
    llama.cpp hard-codes them (gpt-oss's layer pattern); what we do not implement is refused."""
    if ARCHITECTURE_DEFAULTS[ours].experts:
        cfg.update(num_local_experts=gguf_required(reader, f"{arch}.expert_count"),
                   num_experts_per_tok=gguf_required(reader, f"{arch}.expert_used_count"))
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
        cfg["intermediate_size"] = gguf_required(reader, f"{arch}.expert_feed_forward_length")
        # llama.cpp hard-codes the pattern: even layers slide, odd ones attend globally
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(cfg["num_hidden_layers"])]
        if cfg["rope_scaling"] and cfg["rope_scaling"]["rope_type"] == "yarn":
            cfg["rope_scaling"]["truncate"] = False  # as gpt-oss was trained (its config.json); llama.cpp truncates
    if ours == "granite":
        cfg.update(attention_multiplier=gguf_positive(reader, f"{arch}.attention.scale", float),
                   embedding_multiplier=gguf_positive(reader, f"{arch}.embedding_scale", float),
                   residual_multiplier=gguf_value(reader, f"{arch}.residual_scale", float),
                   logits_scaling=gguf_positive(reader, f"{arch}.logit_scale", float))
    if ours == "olmo2" and cfg["sliding_window"]:
        raise ConvertError("GGUF olmo2 with sliding-window layers (OLMo 3) is not supported")


class CheckedGGUFReader(gguf.GGUFReader):
    """gguf.GGUFReader that refuses to read past the end of the file: the stock reader returns
    short arrays there, so a corrupted array length spins through billions of empty items."""

    def _get(self, offset, dtype, count=1, override_order=None):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise ValueError(f"an item at byte {int(offset)} runs past the end of the file ({len(self.data)} bytes)")
        return super()._get(offset, dtype, count, override_order)


def open_gguf(gguf_path: Path) -> tuple[gguf.GGUFReader, str]:
    """(reader, llama.cpp's architecture name) of a GGUF file whose architecture we convert."""
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
    return reader, arch


class GGUFTensors:
    """A GGUF file's tensors, each taken once by name and dequantized; those left in `tensors` at
    the end are the ones the conversion did not use."""

    def __init__(self, tensors: dict, norm_weight_offset: float, bar):
        self.tensors, self.norm_weight_offset, self.bar = tensors, norm_weight_offset, bar

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def weight(self, name: str) -> torch.Tensor:
        t = self.tensors.pop(name, None)
        if t is None:
            raise ConvertError(f"GGUF file lacks tensor {name!r}")
        self.bar.update()
        return dequantized(t)

    def norm(self, name: str) -> torch.Tensor:
        # llama.cpp stores Gemma's norm weights with the +1 folded in; ours are HF-style (1 + w)
        return self.weight(name) - self.norm_weight_offset

    def shaped(self, name: str, *shape) -> torch.Tensor:
        """weight(name), its shape checked first: a split or reshape would fail with a traceback."""
        w = self.weight(name)
        if tuple(w.shape) != shape:
            raise ConvertError(f"GGUF tensor {name} has shape {tuple(reversed(w.shape))}, expected "
                               f"{tuple(reversed(shape))} from the metadata (innermost first)")
        return w


def load_gguf(gguf_path):
    """(ModelArgs, our float32 state dict, GGUFReader) from a GGUF file, dequantizing every tensor."""
    reader, arch = open_gguf(Path(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    args = hf_config_to_args(gguf_config(reader, arch, tensors), {})
    with progress("dequantizing", total=len(tensors)) as bar:
        state = gguf_state(GGUFTensors(tensors, args.norm_weight_offset, bar), args, arch)
    if tensors:  # e.g. Llama 3.1's rope_freqs: silently dropping it would give wrong logits
        raise ConvertError(f"GGUF tensors this engine does not handle: {', '.join(sorted(tensors)[:3])}")
    check_state(state, args)
    return args, state, reader


def gguf_layer_names(args: ModelArgs, arch: str, family) -> dict:
    """Per-layer GGUF name -> ours of the tensors that are only renamed, for this configuration."""
    layer_names = renamed_layer_tensors(args, GGUF_LAYER_NAMES, GGUF_SANDWICH_NAMES, GGUF_QK_NORM_NAMES)
    if arch == "gpt-oss":  # llama.cpp files gpt-oss's pre-feed-forward norm as post_attention_norm
        layer_names["post_attention_norm.weight"] = layer_names.pop("ffn_norm.weight")
    if family.fused or args.n_experts:  # read below: Phi-3's fused gate+up, or the experts
        layer_names = {k: v for k, v in layer_names.items() if not k.startswith(("ffn_gate.", "ffn_up.", "ffn_down."))}
    return layer_names


def gguf_state(w: GGUFTensors, args: ModelArgs, arch: str) -> dict:
    """Our state dict from the file's tensors."""
    family = ARCHITECTURE_DEFAULTS[args.architecture]
    layer_names = gguf_layer_names(args, arch, family)
    unpermute = arch in GGUF_PERMUTED
    ffn = args.moe_intermediate_size or args.intermediate_size
    state = {"tok_embeddings.weight": w.weight("token_embd.weight"), "norm.weight": w.norm("output_norm.weight")}
    if not args.tie_word_embeddings:
        state["output.weight"] = w.weight("output.weight")
    if (args.rope_scaling or {}).get("rope_type") == "longrope":  # read into the config by gguf_config
        for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            w.weight(name)
    for i in range(args.n_layers):
        block, ours = f"blk.{i}.", f"layers.{i}."
        for name, our_name in layer_names.items():
            state[ours + our_name] = w.norm(block + name) if "norm" in name else w.weight(block + name)
        state.update(gguf_attention(w, block, ours, args, unpermute))
        if family.fused:  # Phi-3: ffn_up holds the gate's rows, then the up projection's
            gate_up = w.shaped(block + "ffn_up.weight", 2 * args.intermediate_size, args.dim)
            state[ours + "feed_forward.w1.weight"], state[ours + "feed_forward.w3.weight"] = gate_up.chunk(2)
            state[ours + "feed_forward.w2.weight"] = w.weight(block + "ffn_down.weight")
        if args.n_experts:
            state.update(gguf_experts(w, block, ours, args, ffn))
    return state


def gguf_attention(w: GGUFTensors, block: str, ours: str, args: ModelArgs, unpermute: bool) -> dict:
    """q/k/v fused (Phi-3's come fused) and un-permuted where llama.cpp permuted them; o's bias, the sinks."""
    out = {}
    q_rows, kv_rows = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    if block + "attn_qkv.weight" in w:  # Phi-3: q, k, v rows fused in our order already
        qkv = w.shaped(block + "attn_qkv.weight", q_rows + 2 * kv_rows, args.dim)
        q, k, v = qkv.split([q_rows, kv_rows, kv_rows])
        out[ours + "attention.wqkv.weight"] = fuse_qkv(q, k, v, args, block + "attn_qkv.weight", unpermute)
    else:
        for kind in ("weight", "bias") if args.attention_bias else ("weight",):
            q, k, v = (w.weight(block + f"attn_{x}.{kind}") for x in "qkv")
            out[ours + f"attention.wqkv.{kind}"] = fuse_qkv(q, k, v, args, f"{block}attn_*.{kind}", unpermute)
    if args.attention_out_bias:
        out[ours + "attention.wo.bias"] = w.weight(block + "attn_output.bias")
    if args.attention_sinks:
        out[ours + "attention.sinks"] = w.weight(block + "attn_sinks.weight")
    return out


def gguf_experts(w: GGUFTensors, block: str, ours: str, args: ModelArgs, ffn: int) -> dict:
    """llama.cpp's 3-D expert tensors (experts outermost) -> ours, every expert's rows stacked:
    ffn_gate_exps / ffn_up_exps (E, ffn, dim) -> w1 / w3 (E * ffn, dim), ffn_down_exps (E, dim, ffn)
    -> w2 (E * dim, ffn); a converter run with --fuse-gate-up-exps writes gate then up rows in one."""
    E, ff = args.n_experts, ours + "feed_forward."
    out = {ff + "gate.weight": w.shaped(block + "ffn_gate_inp.weight", E, args.dim)}
    if block + "ffn_gate_up_exps.weight" in w:
        gate, up = w.shaped(block + "ffn_gate_up_exps.weight", E, 2 * ffn, args.dim).chunk(2, dim=1)
    else:
        gate, up = (w.shaped(block + f"ffn_{x}_exps.weight", E, ffn, args.dim) for x in ("gate", "up"))
    out[ff + "experts.w1.weight"], out[ff + "experts.w3.weight"] = gate.reshape(-1, args.dim), up.reshape(-1, args.dim)
    out[ff + "experts.w2.weight"] = w.shaped(block + "ffn_down_exps.weight", E, args.dim, ffn).reshape(-1, ffn)
    if args.moe_bias:  # gpt-oss: the router and every expert carry biases
        out[ff + "gate.bias"] = w.weight(block + "ffn_gate_inp.bias")
        for x, name, width in (("gate", "w1", ffn), ("up", "w3", ffn), ("down", "w2", args.dim)):
            out[ff + f"experts.{name}.bias"] = w.shaped(block + f"ffn_{x}_exps.bias", E, width).reshape(-1)
    return out


def convert_gguf(gguf_path, out_dir) -> Path:
    """GGUF file -> our checkpoint directory (float32 weights + tokenizer files); returns its path."""
    args, state, reader = load_gguf(gguf_path)
    return write_checkpoint(out_dir, args, state, add_files=lambda dst: write_tokenizer_from_gguf(reader, dst))
