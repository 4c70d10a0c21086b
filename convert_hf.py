"""Hugging Face checkpoint (config.json + safetensors or pytorch_model*.bin) -> our checkpoint
directory: config.json from `hf_config_to_args`, tensors renamed to Transformer(args).state_dict()
(q/k/v fused into wqkv; a mixture's experts stacked into one matrix per projection; no
output.weight when the embeddings are tied), the tokenizer files copied.

q/k rows stay in HF's "rotate_half" RoPE layout, which model.apply_rope expects. Gemma norm
weights are stored HF-style: the model multiplies by (1 + w) (ModelArgs.norm_weight_offset).
"""
import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from architectures import (ARCHITECTURE_DEFAULTS, HF_ARCHITECTURES, HF_DEFAULTS, HF_LAYER_NAMES, HF_MODEL_TYPES,
                           HF_QK_NORM_NAMES, HF_SANDWICH_NAMES, hf_bool, hf_float, hf_int, hf_layers, hf_str,
                           renamed_layer_tensors, rope_dim_of, shown)
from checkpoint import TOKENIZER_FILES, check_state, copy_files, write_checkpoint
from errors import ConvertError, one_line
from model import ModelArgs
from progress import progress as progress_bar

# copied next to the tokenizer files: the stop tokens HF's generate() uses, for reference
HF_EXTRA_FILES = ("generation_config.json",)


def progress(desc: str, total=None, unit: str = "tensor"):
    """A bar on a terminal, else a line every few seconds (progress.py): update() it."""
    return progress_bar(None, desc, total=total, unit=unit)


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
    except ValueError as e:  # config_checks.ConfigError: a configuration the model refuses
        raise ConvertError(f"config.json: {e}") from None


# ---------------------------------------------------------------- Hugging Face: weights

def read_safetensors(path: Path, bar) -> dict:
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


def unpermute_rope_rows(w, n_heads: int) -> torch.Tensor:
    """Meta interleaved-pair RoPE rows (as llama.cpp stores llama q/k) -> HF rotate_half rows;
    here because fuse_qkv un-permutes after its shape check."""
    if w.dim() == 1:  # a bias: treat it as a single column
        return unpermute_rope_rows(w.unsqueeze(1), n_heads).squeeze(1)
    dim = w.shape[-1]
    head_dim = w.shape[0] // n_heads
    # (n_heads, head_dim/2, 2, dim): pairs (x0, x1) -> (n_heads, 2, head_dim/2, dim): halves
    return w.view(n_heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(-1, dim)


def hf_text_decoder(hf: dict) -> dict:
    """The decoder's tensors under the "model." prefix: multimodal Gemma 3 loses its vision tower,
    old checkpoints their stored RoPE frequencies."""
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}  # old checkpoints
    text_prefixes = ("language_model.model.", "model.language_model.")  # as saved, as loaded by transformers 5
    if any(k.startswith(text_prefixes) for k in hf):  # multimodal Gemma 3: keep the text decoder only
        vision = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
        hf = {k.replace("language_model.model.", "model.", 1).replace("model.language_model.", "model.", 1)
              .replace("language_model.lm_head.", "lm_head.", 1): v
              for k, v in hf.items() if not k.startswith(vision)}
    return hf


def hf_layer_names(args: ModelArgs, family) -> dict:
    """Per-layer HF name -> ours of the tensors that are only renamed, for this configuration."""
    layer_names = renamed_layer_tensors(args, HF_LAYER_NAMES, HF_SANDWICH_NAMES, HF_QK_NORM_NAMES)
    if family.fused or family.experts:  # the feed-forward's tensors are read below (Phi-3: all but down_proj)
        fused = ("feed_forward.w1.weight", "feed_forward.w3.weight")
        layer_names = {k: v for k, v in layer_names.items()
                       if not (v in fused if family.fused else v.startswith("feed_forward."))}
    return layer_names


def hf_to_ours(hf: dict, args: ModelArgs) -> dict:
    """Rename HF tensors to ours and fuse q/k/v; unknown leftovers are an error."""
    hf = hf_text_decoder(hf)
    family = ARCHITECTURE_DEFAULTS[args.architecture]
    layer_names = hf_layer_names(args, family)

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
        if family.fused:
            out.update(phi3_fused_layer(take, prefix, args))
            continue
        out.update(hf_attention(take, prefix, args))
        if args.moe_bias:  # gpt-oss: every expert in one tensor, gate and up interleaved
            out.update(gpt_oss_experts(take, prefix, args))
        elif family.experts:
            out.update(stacked_experts(take, prefix, args, family.experts))
    if hf:
        names = sorted(hf)
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise ConvertError(f"checkpoint has tensors this architecture does not use: {', '.join(names[:3])}{more}")
    return out


def phi3_fused_layer(take: Callable, prefix: str, args: ModelArgs) -> dict:
    """Phi-3: q, k, v rows already in our order; gate rows, then up rows."""
    out = {}
    qkv = take(prefix + "self_attn.qkv_proj.weight")
    q, k, v = qkv.split([args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim,
                         args.n_kv_heads * args.head_dim])
    out[prefix + "attention.wqkv.weight"] = fuse_qkv(q, k, v, args, f"model.{prefix}self_attn.qkv_proj.weight")
    gate_up = take(prefix + "mlp.gate_up_proj.weight")
    if gate_up.shape != (2 * args.intermediate_size, args.dim):
        raise ConvertError(f"model.{prefix}mlp.gate_up_proj.weight has shape {tuple(gate_up.shape)}, "
                           f"expected {(2 * args.intermediate_size, args.dim)} from the config")
    out[prefix + "feed_forward.w1.weight"], out[prefix + "feed_forward.w3.weight"] = gate_up.chunk(2)
    return out


def hf_attention(take: Callable, prefix: str, args: ModelArgs) -> dict:
    """q/k/v (and their biases) fused; o_proj's bias and the sinks where the config has them."""
    out = {}
    for kind in ("weight", "bias") if args.attention_bias else ("weight",):
        q, k, v = (take(prefix + f"self_attn.{x}_proj.{kind}") for x in "qkv")
        out[prefix + f"attention.wqkv.{kind}"] = fuse_qkv(q, k, v, args, f"model.{prefix}self_attn.*_proj.{kind}")
    if args.attention_out_bias:
        out[prefix + "attention.wo.bias"] = take(prefix + "self_attn.o_proj.bias")
    if args.attention_sinks:
        out[prefix + "attention.sinks"] = take(prefix + "self_attn.sinks")
    return out


def stacked_experts(take: Callable, prefix: str, args: ModelArgs, experts: tuple) -> dict:
    """One tensor per expert -> their rows stacked (n_experts * out, in); experts: Architecture.experts."""
    module, *names = experts
    out = {prefix + "feed_forward.gate.weight": take(prefix + f"{module}.gate.weight")}
    for hf_name, ours in zip(names, ("w1", "w3", "w2")):
        out[prefix + f"feed_forward.experts.{ours}.weight"] = torch.cat(
            [take(prefix + f"{module}.experts.{e}.{hf_name}.weight") for e in range(args.n_experts)])
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
