"""GGUF import of the families llama.cpp names beyond llama/qwen2/gemma3: qwen3, qwen3moe, Mixtral
(written as llama with experts), phi3, olmo2, granite, smollm3 and gpt-oss.

Each case builds a tiny random model with transformers (test_architectures' configs), saves it,
writes it as a GGUF laid out the way llama.cpp's convert_hf_to_gguf.py lays that family out (tensor
names, q/k rows permuted for its LlamaModel subclasses, experts stacked into 3-D tensors, Phi-3's
fused tensors and LongRoPE factor tensors, the metadata keys it writes), and checks that load_gguf
gives exactly the weights and config of our Hugging Face conversion of the same model, and
transformers' logits within 1e-4. A variant we do not implement is one line naming it.

Run: python -m pytest -q tests/test_gguf_families.py
"""
import json
import math

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from convert_gguf import load_gguf
from convert_hf import convert_hf_checkpoint, mxfp4_to_float
from errors import ConvertError
from conftest import run_script
from model import ModelArgs, Transformer
from test_architectures import CASES
from test_convert import llama_cpp_permute
from test_hf_parity import PROMPT_LEN, TOL, build_hf_model, load_hf, max_diff, tokens

PERMUTED = ("llama", "granite", "smollm3")  # llama.cpp's LlamaModel and its subclasses
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}
LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
         "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp", "mlp.router": "ffn_gate_inp"}
EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
           "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def gguf_tensors(hf: dict, cfg: dict, arch: str) -> dict:
    """HF tensors as llama.cpp's converter writes them for `arch` (torch shapes, outermost first)."""
    out, experts = {}, {}
    for name, t in hf.items():
        if name in TOP:
            out[TOP[name]] = t
            continue
        _, _, i, rest = name.split(".", 3)  # model.layers.{i}.{rest}
        block = f"blk.{i}."
        if arch == "gpt-oss" and rest.startswith("mlp.experts."):
            # (E, dim, 2 * ffn) with gate and up columns interleaved -> (E, ffn, dim) each; down transposed
            kind = rest.split(".")[-1]
            if kind == "gate_up_proj":
                out[block + "ffn_gate_exps.weight"] = t[..., ::2].transpose(1, 2)
                out[block + "ffn_up_exps.weight"] = t[..., 1::2].transpose(1, 2)
            elif kind == "gate_up_proj_bias":
                out[block + "ffn_gate_exps.bias"], out[block + "ffn_up_exps.bias"] = t[:, ::2], t[:, 1::2]
            elif kind == "down_proj":
                out[block + "ffn_down_exps.weight"] = t.transpose(1, 2)
            else:
                out[block + "ffn_down_exps.bias"] = t
            continue
        if ".experts." in rest:  # one tensor per expert -> stacked (E, out, in)
            *_, e, proj, _ = rest.split(".")
            experts.setdefault(block + EXPERTS[proj] + ".weight", {})[int(e)] = t
            continue
        if rest == "self_attn.sinks":
            out[block + "attn_sinks.weight"] = t
            continue
        module, kind = rest.rsplit(".", 1)
        gguf_name = LAYER[module]
        if module == "post_attention_layernorm" and arch in ("olmo2", "gpt-oss"):
            gguf_name = "post_attention_norm"
        if arch in PERMUTED and module in ("self_attn.q_proj", "self_attn.k_proj"):
            t = llama_cpp_permute(t, cfg["num_attention_heads"] if "q_proj" in module else cfg["num_key_value_heads"])
        out[f"{block}{gguf_name}.{kind}"] = t
    for name, by_expert in experts.items():
        out[name] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def write_gguf(path, arch: str, hf_dir, tensors: dict = None, **extra):
    """A GGUF of the HF model in hf_dir with the metadata llama.cpp's converter writes for `arch`;
    `tensors` replaces, adds or (None) drops tensors, a numpy array being MXFP4 bytes; `extra` adds metadata
    ({name: value}, the key prefixed with the architecture)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    keys = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
            "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": cfg["num_attention_heads"], "attention.head_count_kv": cfg["num_key_value_heads"],
            "rope.freq_base": float(rope["rope_theta"]), "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"]}
    if cfg.get("head_dim") and arch not in ("granite", "phi3"):  # Granite drops head_dim; Phi-3 writes its own keys
        keys.update({"attention.key_length": head_dim, "attention.value_length": head_dim})
    if arch in PERMUTED:  # LlamaModel.set_gguf_parameters
        keys.update(vocab_size=cfg["vocab_size"], **{"rope.dimension_count": head_dim})
    n_experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if n_experts:
        keys.update(expert_count=n_experts, expert_used_count=cfg["num_experts_per_tok"])
    if arch == "qwen3moe":
        keys["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    if arch == "gpt-oss":
        keys.update({"attention.sliding_window": cfg["sliding_window"],
                     "expert_feed_forward_length": cfg["intermediate_size"],
                     "rope.scaling.type": "yarn", "rope.scaling.factor": rope["factor"],
                     "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
                     "rope.scaling.yarn_beta_fast": rope["beta_fast"], "rope.scaling.yarn_beta_slow": rope["beta_slow"]})
    if arch == "granite":
        keys.update({"attention.scale": cfg["attention_multiplier"], "embedding_scale": cfg["embedding_multiplier"],
                     "residual_scale": cfg["residual_multiplier"], "logit_scale": cfg["logits_scaling"]})
    hf = load_file(hf_dir / "model.safetensors")
    out = gguf_tensors(hf, cfg, arch)
    if arch == "phi3":  # Phi3MiniModel: its own keys, and LongRoPE's factors as tensors
        original = rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        rope_dims = int(rope.get("partial_rotary_factor", 1.0) * cfg["hidden_size"]) // cfg["num_attention_heads"]
        keys.update({"rope.scaling.original_context_length": original, "rope.dimension_count": rope_dims,
                     "attention.sliding_window": cfg.get("sliding_window") or 0})
        if rope.get("long_factor"):
            scale = cfg["max_position_embeddings"] / original
            keys["rope.scaling.attn_factor"] = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            out["rope_factors_long.weight"] = torch.tensor(rope["long_factor"])
            out["rope_factors_short.weight"] = torch.tensor(rope["short_factor"])
    keys.update(extra)
    for key, value in keys.items():
        if isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_token_list([f"t{i}" for i in range(cfg["vocab_size"])])
    out.update(tensors or {})
    for name, t in out.items():
        if t is None:
            continue
        if isinstance(t, np.ndarray):  # raw quantized bytes
            w.add_tensor(name, t, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            w.add_tensor(name, t.float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# name -> (GGUF architecture, HF model_type, config overrides)
FAMILIES = {
    "qwen3": ("qwen3", *CASES["qwen3_head_dim_32"]),
    "qwen3_biases": ("qwen3", "qwen3", dict(num_key_value_heads=2, attention_bias=True)),  # o_proj's bias too
    "qwen3moe": ("qwen3moe", *CASES["qwen3_moe_top3_normalized"]),
    "mixtral": ("llama", *CASES["mixtral_8x_top2"]),
    "phi3_longrope": ("phi3", *CASES["phi3_longrope"]),
    "phi4_mini_partial_rotary": ("phi3", *CASES["phi4_mini_partial_rotary"]),
    "phi3_sliding": ("phi3", *CASES["phi3_sliding"]),
    "olmo2": ("olmo2", *CASES["olmo2_gqa"]),
    "granite": ("granite", *CASES["granite_multipliers"]),
    "smollm3": ("smollm3", *CASES["smollm3_every_4th_nope"]),
    # llama.cpp's gpt-oss clamps its SwiGLU at the default 7 (CASES' gpt-oss lowers the clamp)
    "gpt_oss": ("gpt-oss", "gpt_oss", dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                                           intermediate_size=64, sliding_window=8)),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def save_hf(name, root):
    arch, model_type, overrides = FAMILIES[name]
    build_hf_model(model_type, overrides).save_pretrained(root / "hf")
    return arch, root / "hf"


def assert_same_config(args: ModelArgs, ref: ModelArgs):
    """Every field equal, but LongRoPE's: its factors went through float32 and llama.cpp writes the
    attention factor that our config leaves to the model (the same formula)."""
    got, want = args.to_dict(), ref.to_dict()
    scaling, ref_scaling = got.pop("rope_scaling") or {}, want.pop("rope_scaling") or {}
    assert got == want
    if ref_scaling.get("rope_type") == "longrope":
        original = ref_scaling["original_max_position_embeddings"]
        factor = args.max_position_embeddings / original
        assert scaling.pop("attention_factor") == pytest.approx(math.sqrt(1 + math.log(factor) / math.log(original)))
        for key in ("long_factor", "short_factor"):
            np.testing.assert_allclose(scaling.pop(key), ref_scaling.pop(key), rtol=1e-6)
    assert scaling == ref_scaling


@pytest.mark.parametrize("name", list(FAMILIES))
@torch.inference_mode()
def test_gguf_import_equals_hf_conversion(name, tmp_path):
    arch, hf_dir = save_hf(name, tmp_path)
    write_gguf(tmp_path / "model.gguf", arch, hf_dir)
    args, state, _ = load_gguf(tmp_path / "model.gguf")
    ref_dir = convert_hf_checkpoint(hf_dir, tmp_path / "ours")
    ref = load_file(ref_dir / "model.safetensors")
    assert state.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(state[key], ref[key], rtol=0, atol=0, msg=key)
    assert_same_config(args, ModelArgs.from_json(ref_dir / "config.json"))
    model = Transformer(args)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and missing == (["output.weight"] if args.tie_word_embeddings else [])
    model.setup_caches(1, PROMPT_LEN)
    ids = tokens(PROMPT_LEN, seed=2)
    assert max_diff(model(ids, torch.arange(PROMPT_LEN)), load_hf(hf_dir)(ids).logits) <= TOL


def test_gguf_facts_per_family(tmp_path):
    """What the metadata alone decides: Mixtral from llama.expert_count, Qwen3-MoE's top-k always
    renormalized, gpt-oss's alternating windows and untruncated YaRN, Phi-4-mini's partial RoPE."""
    expect = {"mixtral": dict(architecture="mixtral", n_experts=8, n_experts_per_token=2, norm_topk_prob=True),
              "qwen3moe": dict(architecture="qwen3_moe", moe_intermediate_size=48, norm_topk_prob=True),
              "gpt_oss": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                              attention_sinks=True, swiglu_limit=7.0),
              "phi4_mini_partial_rotary": dict(rope_dim=8, head_dim=16, tie_word_embeddings=True)}
    for name, fields in expect.items():
        arch, hf_dir = save_hf(name, tmp_path / name)
        write_gguf(tmp_path / f"{name}.gguf", arch, hf_dir)
        args = load_gguf(tmp_path / f"{name}.gguf")[0]
        assert {key: getattr(args, key) for key in fields} == fields, name
        if name == "gpt_oss":
            assert args.rope_scaling["truncate"] is False and args.rope_scaling["factor"] == 32.0


def test_gguf_mxfp4_experts_dequantize_as_hf_mxfp4(tmp_path):
    """gpt-oss GGUFs keep the experts in MXFP4, repacked by llama.cpp from the HF checkpoint's
    blocks (32 e2m1 values per block: the low nibbles hold values 0-15, the high ones 16-31, after
    one e8m0 scale byte). The import equals the HF blocks dequantized as transformers does."""
    arch, hf_dir = save_hf("gpt_oss", tmp_path)
    E, dim, ffn = 8, 64, 64
    g = torch.Generator().manual_seed(0)
    hf_blocks = {"gate_up": torch.randint(0, 256, (E, 2 * ffn, dim // 32, 16), generator=g, dtype=torch.uint8),
                 "down": torch.randint(0, 256, (E, dim, ffn // 32, 16), generator=g, dtype=torch.uint8)}
    hf_scales = {"gate_up": torch.randint(120, 130, (E, 2 * ffn, dim // 32), generator=g, dtype=torch.uint8),
                 "down": torch.randint(120, 130, (E, dim, ffn // 32), generator=g, dtype=torch.uint8)}

    def ggml_mxfp4(blocks, scales):  # HF: byte j holds values 2j (low nibble) and 2j+1; ggml: j and j+16
        codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)  # (..., 32) in order
        packed = codes[..., :16] | (codes[..., 16:] << 4)
        return torch.cat([scales.unsqueeze(-1), packed], dim=-1).flatten(-2).numpy()  # (E, rows, blocks * 17)

    gate_up, down = (mxfp4_to_float(hf_blocks[k], hf_scales[k]).float() for k in ("gate_up", "down"))  # (E, in, out)
    tensors = {}
    for i in range(2):
        tensors[f"blk.{i}.ffn_gate_exps.weight"] = ggml_mxfp4(hf_blocks["gate_up"][:, ::2], hf_scales["gate_up"][:, ::2])
        tensors[f"blk.{i}.ffn_up_exps.weight"] = ggml_mxfp4(hf_blocks["gate_up"][:, 1::2], hf_scales["gate_up"][:, 1::2])
        tensors[f"blk.{i}.ffn_down_exps.weight"] = ggml_mxfp4(hf_blocks["down"], hf_scales["down"])
    write_gguf(tmp_path / "mxfp4.gguf", arch, hf_dir, tensors)
    _, state, reader = load_gguf(tmp_path / "mxfp4.gguf")
    assert {t.tensor_type.name for t in reader.tensors if "_exps.weight" in t.name} == {"MXFP4"}
    ours = "layers.1.feed_forward.experts."
    assert torch.equal(state[ours + "w1.weight"], gate_up[..., ::2].transpose(1, 2).reshape(-1, dim))
    assert torch.equal(state[ours + "w3.weight"], gate_up[..., 1::2].transpose(1, 2).reshape(-1, dim))
    assert torch.equal(state[ours + "w2.weight"], down.transpose(1, 2).reshape(-1, ffn))


def test_fused_gate_up_experts_are_split(tmp_path):
    """convert_hf_to_gguf.py --fuse-gate-up-exps writes one ffn_gate_up_exps: gate rows, then up."""
    arch, hf_dir = save_hf("qwen3moe", tmp_path)
    split = gguf_tensors(load_file(hf_dir / "model.safetensors"), json.loads((hf_dir / "config.json").read_text()), arch)
    fused = {}
    for i in range(2):
        gate, up = f"blk.{i}.ffn_gate_exps.weight", f"blk.{i}.ffn_up_exps.weight"
        fused.update({gate: None, up: None, f"blk.{i}.ffn_gate_up_exps.weight": torch.cat([split[gate], split[up]], dim=1)})
    write_gguf(tmp_path / "split.gguf", arch, hf_dir)
    write_gguf(tmp_path / "fused.gguf", arch, hf_dir, fused)
    expected, got = load_gguf(tmp_path / "split.gguf")[1], load_gguf(tmp_path / "fused.gguf")[1]
    assert expected.keys() == got.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


# family, tensors changed, metadata added, the line expected
REFUSALS = {
    "sigmoid_router": ("qwen3moe", {}, dict(expert_gating_func=2), "qwen3moe.expert_gating_func=2 is not supported"),
    "scaled_router": ("qwen3moe", {}, dict(expert_weights_scale=2.5), "qwen3moe.expert_weights_scale=2.5 is not supported"),
    "shared_expert": ("qwen3moe", {"blk.0.ffn_gate_shexp.weight": torch.zeros(48, 64)}, {},
                      "GGUF tensors this engine does not handle: blk.0.ffn_gate_shexp.weight"),
    "expert_shape": ("qwen3moe", {"blk.1.ffn_down_exps.weight": torch.zeros(8, 64, 32)}, {},
                     "GGUF tensor blk.1.ffn_down_exps.weight has shape (32, 64, 8), expected (48, 64, 8)"),
    "olmo3_windows": ("olmo2", {}, {"attention.sliding_window": 8}, "sliding-window layers (OLMo 3) is not supported"),
    "swiglu_clamp": ("gpt_oss", {}, dict(swiglu_clamp_exp=[7.0, 7.0]), "gpt-oss.swiglu_clamp_exp is not supported"),
    "yarn_log_multiplier": ("qwen3", {}, {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                          "rope.scaling.yarn_log_multiplier": 0.1},
                            "qwen3.rope.scaling.yarn_log_multiplier=0.1 is not supported"),
    "one_longrope_factor": ("phi3_longrope", {"rope_factors_short.weight": None}, {},
                            "only one of rope_factors_long and rope_factors_short"),
    "llama31_rope_freqs": ("mixtral", {"rope_freqs.weight": torch.ones(8)}, {},
                           "GGUF tensors this engine does not handle: rope_freqs.weight"),
}


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_unsupported_gguf_variant_is_one_line_naming_it(refusal, tmp_path):
    name, tensors, extra, message = REFUSALS[refusal]
    arch, hf_dir = save_hf(name, tmp_path)
    write_gguf(tmp_path / "model.gguf", arch, hf_dir, tensors, **extra)
    with pytest.raises(ConvertError) as e:
        load_gguf(tmp_path / "model.gguf")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unsupported_gguf_architecture_on_the_command_line(tmp_path):
    """An architecture llama.cpp names but this engine does not: one line, no output directory."""
    arch, hf_dir = save_hf("qwen3", tmp_path)
    write_gguf(tmp_path / "deepseek2.gguf", "deepseek2", hf_dir)
    r = run_script("convert_hf_checkpoint.py", "--gguf", tmp_path / "deepseek2.gguf", "--out", tmp_path / "out", timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert "GGUF architecture 'deepseek2' is not supported" in r.stderr and "qwen3moe" in r.stderr
    assert not (tmp_path / "out").exists()


def test_llama3_pre_tokenizer_splits_digits_in_threes():
    """SmolLM3's GGUF (Llama 3's tokenizer) names llama-bpe or smaug-bpe: the Llama 3 regex, which
    splits digit runs into threes and keeps newlines with the punctuation before them (gpt-2's
    regex keeps digit runs whole, SmolLM2's splits them one by one)."""
    from tokenizer import _byte_level_pre_tokenizer
    for pre in ("llama-bpe", "smaug-bpe", "dbrx"):
        normalizer, pre_tokenizer = _byte_level_pre_tokenizer(pre)
        pieces = [piece for piece, _ in pre_tokenizer.pre_tokenize_str("It's 1234567 cats!\n\n  ok")]
        assert normalizer is None
        assert pieces == ["It", "'s", "Ġ", "123", "456", "7", "Ġcats", "!ĊĊ", "Ġ", "Ġok"], pieces


# tiktoken's o200k_base pat_str, written out here as the reference the gpt-4o pre-tokenizer must match
_O200K_PAT = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
_VARIED_TEXT = (
    "HelloWorld DON'T we'll they've I'M ok.\n/usr/bin 1234567 3.14159!!!\n\n  \t x  Привет мир "
    "日本語テキスト नमस्ते café'S ÉCOLEdeParis (a)\r\n/ end   "
)


def test_gpt4o_pre_tokenizer_splits_like_o200k():
    """gpt-oss and Phi-4-mini GGUFs name gpt-4o: o200k's regex (Oniguruma in tokenizers) splits a
    varied text exactly where the `regex` module does, then maps the pieces' bytes like GPT-2."""
    import regex

    from tokenizer import _byte_level_pre_tokenizer
    normalizer, pre_tokenizer = _byte_level_pre_tokenizer("gpt-4o")
    assert normalizer is None
    got = pre_tokenizer.pre_tokenize_str(_VARIED_TEXT)
    reference = regex.findall(_O200K_PAT, _VARIED_TEXT)
    assert [_VARIED_TEXT[start:end] for _, (start, end) in got] == reference
    pieces = [piece for piece, _ in got]
    # case runs split words, digits go in threes, a punctuation run keeps its newlines and a "/"
    assert pieces[:2] == ["Hello", "World"] and "ĠDON'T" in pieces and ".Ċ/" in pieces
    assert ["123", "456", "7"] == pieces[11:14] and "ĠÃīCOLEde" in pieces
