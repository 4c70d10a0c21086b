"""Parity with Hugging Face transformers, the reference implementation of every architecture.

Each case builds a tiny random model with transformers from a config (no download), saves it
with save_pretrained, converts it with convert_hf_checkpoint.py, and checks in float32 that:
the prefill logits match, every step of an incremental decode through the KV cache matches
HF's own cached decode, and 32 greedy tokens are identical. The weights are re-drawn with a
large std (and random norms/biases), so a wrong RoPE, mask or head layout moves the logits by
far more than the 1e-4 tolerance (5e-4 on a GPU); test_comparison_detects_* pins that it does.

Run: PYTHONPATH=. python -m pytest -q tests/test_hf_parity.py
"""
import json
import math

import pytest
import torch
import transformers  # the oracle: a test environment without it fails here, it does not skip
from safetensors.torch import load_file

import kernels
from conftest import TEST_DEVICE, on_test_device
from convert_hf import convert_hf_checkpoint
from kvcache import ForwardBatch
from model import ModelArgs, Transformer
from thresholds import THRESHOLDS

# against transformers on the CPU; a GPU sums in another order (600-token prefills came to 1.0e-4 and, Gemma 3
# with qk-norm, 2.3e-4 on an H200). A deliberate mistake must exceed 10x the CPU's tolerance, 2x the GPU's.
TOL = 1e-4 if TEST_DEVICE == "cpu" else 5e-4
MISTAKE_MIN = 1e-3
PROMPT_LEN = 40  # longer than max_position_embeddings=32 below, so dynamic NTK actually rescales
DECODE_STEPS = 32
MAX_SEQ_LENGTH = PROMPT_LEN + DECODE_STEPS + 8
VOCAB = 384

# Shared by every case; each case overrides what it is about.
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
            rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)

# name -> (HF model_type, config overrides)
CASES = {
    "llama2_mha": ("llama", dict(rms_norm_eps=1e-6)),  # HF LlamaConfig's default eps
    "llama3_gqa_rope_llama3": ("llama", dict(
        max_position_embeddings=256, num_attention_heads=8, num_key_value_heads=2, head_dim=16,  # head_dim != hidden/heads
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32))),
    "llama32_tied": ("llama", dict(max_position_embeddings=1024, num_key_value_heads=2, tie_word_embeddings=True,
                                   rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=32.0,
                                                        low_freq_factor=1.0, high_freq_factor=4.0,
                                                        original_max_position_embeddings=32))),
    "llama_mqa_rope_linear": ("llama", dict(
        num_key_value_heads=1, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0))),
    "llama_rope_dynamic": ("llama", dict(
        num_key_value_heads=2, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "llama_rope_yarn": ("llama", dict(
        max_position_embeddings=128, num_key_value_heads=2, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                    original_max_position_embeddings=32))),
    "smollm2_like": ("llama", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                                   tie_word_embeddings=True, rope_parameters=dict(rope_type="default",
                                                                                  rope_theta=100000.0))),
    "mistral_sliding_window": ("mistral", dict(num_key_value_heads=2, sliding_window=8)),
    "qwen2_biases_untied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=False,
                                          rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    "qwen2_tied": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=1, tie_word_embeddings=True)),
    # Layer 0 full attention, layers 1-2 slide (Qwen2's max_window_layers).
    "qwen2_sliding": ("qwen2", dict(num_hidden_layers=3, num_key_value_heads=2, use_sliding_window=True,
                                    sliding_window=8, max_window_layers=1)),
    # Gemma: (1 + w) norms, sqrt(dim) embedding scale, GeGLU, tied head. The windows (16) are shorter
    # than the prompt (40) and the generation (72): keys leave the window during prefill and decode.
    "gemma_mqa": ("gemma", dict(num_key_value_heads=1, head_dim=32)),  # head_dim != hidden/heads
    "gemma2_softcap_sliding": ("gemma2", dict(
        num_hidden_layers=4, num_key_value_heads=2, sliding_window=16, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=8.0)),
    "gemma3_qk_norm_local_rope": ("gemma3_text", dict(
        num_hidden_layers=6, num_key_value_heads=2, head_dim=32, sliding_window=16, query_pre_attn_scalar=24,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})),
}


def build_hf_model(model_type: str, overrides: dict, seed: int = 0):
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    # Transformers' init (std 0.02, unit norms, zero biases) gives near-zero logits that would
    # hide layout bugs under the tolerance: re-draw every parameter with real spread.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:  # embeddings too: a tied head then gives logits of the same scale as untied
                p.normal_(0.0, 0.15)
    return model.eval()


def load_ours(ckpt_dir) -> Transformer:
    """Our checkpoint dir -> Transformer: strict, except that a tied head has no output.weight."""
    args = ModelArgs.from_json(ckpt_dir / "config.json")
    model = Transformer(args)
    sd = load_file(ckpt_dir / "model.safetensors")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert missing == (["output.weight"] if args.tie_word_embeddings else []), missing
    model.setup_caches(max_batch_size=1, max_seq_length=MAX_SEQ_LENGTH)
    return on_test_device(model.eval())


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, HF save_pretrained dir, our converted dir) for one config."""
    name = request.param
    model_type, overrides = CASES[name]
    root = tmp_path_factory.mktemp(name)
    hf_dir, our_dir = root / "hf", root / "ours"
    build_hf_model(model_type, overrides).save_pretrained(hf_dir)
    convert_hf_checkpoint(hf_dir, our_dir)
    return name, hf_dir, our_dir


def load_hf(hf_dir):
    # A fresh instance per test: dynamic NTK keeps the longest sequence seen in module state.
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    return model.eval()


def tokens(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, n), generator=g)  # (1, n)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@torch.inference_mode()
def test_prefill_logits_match_hf(case):
    name, hf_dir, our_dir = case
    hf, ours = load_hf(hf_dir), load_ours(our_dir)
    ids = tokens(PROMPT_LEN, seed=1)
    expected = hf(ids).logits
    got = ours(ids, torch.arange(PROMPT_LEN))
    assert got.shape == expected.shape
    assert expected.std() > 0.5, "logits too small for the tolerance to mean anything"
    diff = max_diff(got, expected)
    print(f"{name}: prefill max abs diff {diff:.2e}")
    assert diff <= TOL, f"{name}: prefill logits differ by {diff:.2e}"


@pytest.mark.parametrize("fast_paths", [False, True], ids=["reference", "kernels-installed"])
@torch.inference_mode()
def test_incremental_decode_matches_hf(case, fast_paths):
    """Teacher-forced decode, one token per step through both KV caches; also with kernels.py's
    CPU paths installed, as load_model does (its attention kernel serves every step)."""
    name, hf_dir, our_dir = case
    hf, ours = load_hf(hf_dir), load_ours(our_dir)
    if fast_paths:
        kernels.install(ours)
    ids = tokens(PROMPT_LEN + DECODE_STEPS, seed=2)
    out = hf(ids[:, :PROMPT_LEN], use_cache=True)
    pkv = out.past_key_values
    diffs = [max_diff(ours(ids[:, :PROMPT_LEN], torch.arange(PROMPT_LEN)), out.logits)]
    for t in range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS):
        out = hf(ids[:, t:t + 1], past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values
        diffs.append(max_diff(ours(ids[:, t:t + 1], torch.tensor([t])), out.logits))
    print(f"{name}: decode max abs diff {max(diffs):.2e} over {len(diffs) - 1} steps")
    bad = [(i, d) for i, d in enumerate(diffs) if not d <= TOL]
    assert not bad, f"{name}: (step, diff) over tolerance: {bad}"


def fresh_prefill(model: Transformer, ids: torch.Tensor, last: bool = False) -> torch.Tensor:
    """ids (1, T) from position 0 as the engine's first chunk of a prompt runs them: nothing cached
    before them (ForwardBatch.fresh), so attention reads the chunk's own keys, and full-attention
    layers take SDPA's causal mask past causal_sdpa_min_tokens; last: only the last position goes
    through the last layer (ForwardBatch.last), whose logits alone come back (1, 1, V)."""
    T, device = ids.shape[1], model.norm.weight.device
    final = torch.full((1, 1), T - 1, device=device) if last else None
    return model(ids, ForwardBatch.rows(torch.arange(T, device=device), 1, model.max_seq_length, fresh=True,
                                        last=final))


@torch.inference_mode()
def test_long_prefill_logits_match_hf(case):
    """A whole prompt from position 0 longer than causal_sdpa_min_tokens, as a fresh chunk (the
    engine's first chunk of a prompt): full-attention layers take SDPA's causal mask instead of
    ours, and with ForwardBatch.last the last layer computes the last position only. Through the
    cache (the whole row read under our additive mask), and as two halves through the cache, the
    same prompt runs under our mask over the cached keys."""
    name, hf_dir, our_dir = case
    hf, ours = load_hf(hf_dir), load_ours(our_dir)
    T = THRESHOLDS.causal_sdpa_min_tokens + 88
    ours.setup_caches(max_batch_size=1, max_seq_length=T + 8)
    ids = tokens(T, seed=4)
    expected = hf(ids).logits
    diffs = {"causal SDPA": max_diff(fresh_prefill(ours, ids), expected),
             "last position only": max_diff(fresh_prefill(ours, ids, last=True), expected[:, -1:]),
             "our mask": max_diff(ours(ids, torch.arange(T)), expected)}
    h = T // 2  # a fresh transformers model through its cache: dynamic NTK rescales by the length seen
    hf = load_hf(hf_dir)
    hf_first = hf(ids[:, :h], use_cache=True)
    hf_second = hf(ids[:, h:], past_key_values=hf_first.past_key_values, use_cache=True)
    first = ours(ids[:, :h], torch.arange(h))
    diffs["two halves"] = max(max_diff(first, hf_first.logits),
                              max_diff(ours(ids[:, h:], torch.arange(h, T)), hf_second.logits))
    print(f"{name}: {T}-token prefill max abs diff {diffs}")
    assert max(diffs.values()) <= TOL, f"{name}: {diffs}"


@torch.inference_mode()
def greedy(model: Transformer, prompt: torch.Tensor, n: int) -> list[int]:
    """Prefill, then feed back the argmax one token at a time."""
    T = prompt.shape[1]
    logits = model(prompt, torch.arange(T))
    out = [int(logits[0, -1].argmax())]
    for t in range(T, T + n - 1):
        logits = model(torch.tensor([[out[-1]]]), torch.tensor([t]))
        out.append(int(logits[0, -1].argmax()))
    return out


def hf_greedy(hf, prompt: torch.Tensor) -> list[int]:
    """transformers' greedy generate: DECODE_STEPS new tokens, no end-of-sequence stop."""
    return hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=DECODE_STEPS,
                       min_new_tokens=DECODE_STEPS, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, prompt.shape[1]:].tolist()


@torch.inference_mode()
def test_greedy_tokens_match_hf(case):
    name, hf_dir, our_dir = case
    hf, ours = load_hf(hf_dir), load_ours(our_dir)
    prompt = tokens(PROMPT_LEN, seed=3)
    expected = hf_greedy(hf, prompt)
    assert len(expected) == DECODE_STEPS
    got = greedy(ours, prompt, DECODE_STEPS)
    assert len(set(got)) > 3, "degenerate greedy output would make the comparison weak"
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    assert got == expected, f"{name}: greedy tokens differ from step {first}"


# The tolerance must be able to fail: each of these small mistakes has to exceed it.
MISTAKES = {  # name -> case it is made on
    "rope_theta_off_by_1pct": "llama_rope_yarn",
    "yarn_factor_off": "llama_rope_yarn",
    "dynamic_ntk_ignored": "llama_rope_dynamic",
    "sliding_window_off_by_one": "mistral_sliding_window",
    "one_weight_nudged": "qwen2_biases_untied",
    "attn_softcap_ignored": "gemma2_softcap_sliding",
    "local_rope_theta_as_global": "gemma3_qk_norm_local_rope",
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
@torch.inference_mode()
def test_comparison_detects_small_mistakes(mistake, tmp_path):
    hf = build_hf_model(*CASES[MISTAKES[mistake]])
    hf.save_pretrained(tmp_path / "hf")
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "ours")
    config_path = tmp_path / "ours" / "config.json"
    config = json.loads(config_path.read_text())
    if mistake == "rope_theta_off_by_1pct":
        config["rope_theta"] *= 1.01
    elif mistake == "yarn_factor_off":
        config["rope_scaling"]["factor"] = 4.1
    elif mistake == "dynamic_ntk_ignored":
        config["rope_scaling"] = None
    elif mistake == "sliding_window_off_by_one":
        config["sliding_window"] += 1
    elif mistake == "attn_softcap_ignored":
        config["attn_logit_softcapping"] = None
    elif mistake == "local_rope_theta_as_global":
        config["rope_local_theta"] = config["rope_theta"]
    config_path.write_text(json.dumps(config))
    ours = load_ours(tmp_path / "ours")
    if mistake == "one_weight_nudged":
        ours.layers[0].attention.wo.weight[0, 0] += 1e-2
    ids = tokens(PROMPT_LEN, seed=1)
    diff = max_diff(ours(ids, torch.arange(PROMPT_LEN)), hf(ids).logits)
    print(f"{mistake}: max abs diff {diff:.2e}")
    assert math.isfinite(diff)
    assert diff > MISTAKE_MIN, f"{mistake}: diff {diff:.2e} would pass the parity tests"
