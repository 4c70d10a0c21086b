"""Parity with transformers for the families beyond Llama and Gemma: Qwen3, OLMo 2, SmolLM3,
Granite, Phi-3 (LongRoPE, partial rotary) and the mixtures of experts Mixtral and Qwen3-MoE.

As in tests/test_hf_parity.py, whose helpers these cases reuse: a tiny random model built by
transformers from a config (no download), saved, converted by convert_hf_checkpoint.py; in float32
the prefill logits and every cached decode step within 1e-4, and 32 greedy tokens identical. The
mixtures of experts also: a decode step reads only the experts its tokens chose, a batch (and
continuously batched requests) equals each prompt alone, a compiled model equals eager. Config fields we do not implement are refused
by the converter with one line naming the field.

Run: python -m pytest -q tests/test_architectures.py
"""
import copy
import json
import math

import pytest
import torch
import transformers  # the oracle: a test environment without it fails here, it does not skip

import kernels
from conftest import random_model
from convert_hf import convert_hf_checkpoint, hf_config_to_args, mxfp4_to_float
import scheduler
from engine import Chat, Engine
from errors import ConvertError
from loading import load_model
from model import MoEFeedForward, Transformer, param_bytes
from sampling import Sampling
from scheduler import Request
from test_hf_parity import (DECODE_STEPS, MISTAKE_MIN, PROMPT_LEN, TOL, build_hf_model, fresh_prefill, greedy,
                            hf_greedy, load_hf, load_ours, max_diff, tokens)
from thresholds import THRESHOLDS

HEAD_DIM = 16  # BASE: hidden 64 over 4 heads


def longrope(rope_dim=HEAD_DIM, orig=48):
    """LongRoPE factors that differ per dimension; the switch at `orig` falls between the prompt
    (40 tokens) and the end of the decode (72)."""
    n = rope_dim // 2
    return dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=orig,
                short_factor=[1.0 + 0.1 * i for i in range(n)], long_factor=[1.0 + 0.7 * i for i in range(n)])


# name -> (HF model_type, config overrides), as test_hf_parity.CASES
CASES = {
    "qwen3_head_dim_32": ("qwen3", dict(num_key_value_heads=2, head_dim=32)),  # head_dim != hidden/heads
    # layer 0 full attention, layers 1-2 slide, windows shorter than the prompt; biases on q, k, v and o
    "qwen3_sliding_biases": ("qwen3", dict(num_hidden_layers=3, num_key_value_heads=2, use_sliding_window=True,
                                           sliding_window=8, max_window_layers=1, attention_bias=True)),
    "olmo2_gqa": ("olmo2", dict(num_key_value_heads=2)),  # k's norm is narrower than q's
    "smollm3_every_4th_nope": ("smollm3", dict(num_hidden_layers=4, num_key_value_heads=2)),
    "smollm3_nope_sliding": ("smollm3", dict(num_hidden_layers=4, num_key_value_heads=2, no_rope_layers=[0, 1, 1, 0],
                                             use_sliding_window=True, sliding_window=8)),
    "granite_multipliers": ("granite", dict(num_key_value_heads=2, attention_bias=True, embedding_multiplier=6.0, residual_multiplier=0.4,
                                            attention_multiplier=0.1, logits_scaling=1.5)),
    "phi3_longrope": ("phi3", dict(num_key_value_heads=2, max_position_embeddings=192, original_max_position_embeddings=48,
                                   rope_parameters=longrope())),
    # Phi-4-mini: RoPE on the first part of each head only, tied head
    "phi4_mini_partial_rotary": ("phi3", dict(
        num_key_value_heads=2, max_position_embeddings=192, original_max_position_embeddings=48, tie_word_embeddings=True,
        rope_parameters=dict(longrope(rope_dim=HEAD_DIM // 2), partial_rotary_factor=0.5))),
    "phi3_sliding": ("phi3", dict(sliding_window=8)),
    "mixtral_8x_top2": ("mixtral", dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe_top3_normalized": ("qwen3_moe", dict(num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
                                                    moe_intermediate_size=48, norm_topk_prob=True)),
    "qwen3_moe_top4_unnormalized": ("qwen3_moe", dict(num_key_value_heads=2, num_experts=16, num_experts_per_tok=4,
                                                      moe_intermediate_size=32, norm_topk_prob=False)),
    # attention sinks, biases everywhere, sliding and full layers alternating (windows shorter than
    # the prompt), YaRN, experts with biases and a SwiGLU clamp low enough to bite
    "gpt_oss_sinks_clamp": ("gpt_oss", dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                                            intermediate_size=48, sliding_window=8, swiglu_limit=1.0)),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


ORACLE_SINCE = (5, 20)  # transformers before this computes LongRoPE and gpt-oss otherwise (requirements-test.txt)


def oracle_for(model_type: str, overrides: dict) -> None:
    """Skip, naming the version, a LongRoPE or gpt-oss case where the installed transformers is older
    than their oracle (the GPU image's 5.17 failed exactly these); `make test` installs a new enough one."""
    longrope = (overrides.get("rope_parameters") or {}).get("rope_type") == "longrope"
    have = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if (longrope or model_type == "gpt_oss") and have < ORACLE_SINCE:
        pytest.skip(f"transformers {transformers.__version__} computes {model_type} otherwise than its oracle, "
                    f">= {ORACLE_SINCE[0]}.{ORACLE_SINCE[1]}, which requirements-test.txt installs for `make test`")


def convert(name, root):
    model_type, overrides = CASES[name]
    oracle_for(model_type, overrides)
    hf_dir, our_dir = root / "hf", root / "ours"
    build_hf_model(model_type, overrides).save_pretrained(hf_dir)
    convert_hf_checkpoint(hf_dir, our_dir)
    return hf_dir, our_dir


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, HF save_pretrained dir, our converted dir) for one config."""
    return request.param, *convert(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("fast_paths", [False, True], ids=["reference", "kernels-installed"])
@torch.inference_mode()
def test_prefill_and_cached_decode_match_hf(case, fast_paths):
    """The prefill's logits, then one token per step through both KV caches (past LongRoPE's
    switch length where the case has one); also with kernels.py's CPU paths installed."""
    name, hf_dir, our_dir = case
    hf, ours = load_hf(hf_dir), load_ours(our_dir)
    if fast_paths:
        kernels.install(ours)
    ids = tokens(PROMPT_LEN + DECODE_STEPS, seed=2)
    out = hf(ids[:, :PROMPT_LEN], use_cache=True)
    assert out.logits.std() > 0.5, "logits too small for the tolerance to mean anything"
    pkv = out.past_key_values
    diffs = [max_diff(ours(ids[:, :PROMPT_LEN], torch.arange(PROMPT_LEN)), out.logits)]
    for t in range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS):
        out = hf(ids[:, t:t + 1], past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values
        diffs.append(max_diff(ours(ids[:, t:t + 1], torch.tensor([t])), out.logits))
    print(f"{name}: prefill diff {diffs[0]:.2e}, decode max diff {max(diffs[1:]):.2e}")
    bad = [(i, d) for i, d in enumerate(diffs) if not d <= TOL]
    assert not bad, f"{name}: (step, diff) over tolerance: {bad}"


@pytest.mark.parametrize("name", ["gpt_oss_sinks_clamp", "phi3_longrope", "smollm3_nope_sliding",
                                  "qwen3_moe_top4_unnormalized"])
@torch.inference_mode()
def test_long_prefill_matches_hf(name, tmp_path):
    """A prompt longer than causal_sdpa_min_tokens from position 0 as a fresh chunk (the engine's
    first chunk of a prompt): full-attention layers take SDPA's causal mask (the sinks then build
    their own), LongRoPE its long factors, the experts their grouped path; the last position alone
    too (ForwardBatch.last)."""
    hf_dir, our_dir = convert(name, tmp_path)
    hf, ours = load_hf(hf_dir), load_ours(our_dir)
    T = THRESHOLDS.causal_sdpa_min_tokens + 40
    ours.setup_caches(max_batch_size=1, max_seq_length=T + 8)
    ids = tokens(T, seed=4)
    expected = hf(ids).logits
    diffs = [max_diff(fresh_prefill(ours, ids), expected),
             max_diff(fresh_prefill(ours, ids, last=True), expected[:, -1:])]
    assert max(diffs) <= TOL, f"{name}: {diffs}"


@torch.inference_mode()
def greedy_as_hf_generate(model, prompt: torch.Tensor, n: int) -> list[int]:
    """test_hf_parity.greedy, except that with LongRoPE the whole sequence is run again from position 0
    once it outgrows the original context, since the cached keys were rotated with the short
    factors: transformers' Phi-3 generate() drops its cache there (prepare_inputs_for_generation)."""
    scaling = model.args.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return greedy(model, prompt, n)
    switch = scaling["original_max_position_embeddings"]  # a sequence longer than this: long factors
    seq = prompt[0].tolist()
    logits = model(prompt, torch.arange(len(seq)))
    out = []
    while len(out) < n:
        out.append(int(logits[0, -1].argmax()))
        seq.append(out[-1])
        if len(seq) == switch + 1:
            logits = model(torch.tensor([seq]), torch.arange(len(seq)))
        else:
            logits = model(torch.tensor([[seq[-1]]]), torch.tensor([len(seq) - 1]))
    return out


@torch.inference_mode()
def test_greedy_tokens_match_hf(case):
    name, hf_dir, our_dir = case
    hf, ours = load_hf(hf_dir), load_ours(our_dir)
    prompt = tokens(PROMPT_LEN, seed=3)
    expected = hf_greedy(hf, prompt)
    got = greedy_as_hf_generate(ours, prompt, DECODE_STEPS)
    assert len(set(got)) > 3, "degenerate greedy output would make the comparison weak"
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    assert got == expected, f"{name}: greedy tokens differ from step {first}"


# The tolerance must be able to fail: each of these mistakes in a converted config has to exceed it.
MISTAKES = {  # name -> (case, change to our config.json)
    "nope_layer_rotated": ("smollm3_every_4th_nope", dict(nope_layers=[])),
    "residual_multiplier_ignored": ("granite_multipliers", dict(residual_multiplier=1.0)),
    "logits_scaling_ignored": ("granite_multipliers", dict(logits_scaling=1.0)),
    "longrope_never_long": ("phi3_longrope", dict(rope_scaling=dict(longrope(), original_max_position_embeddings=10**6))),
    "longrope_always_long": ("phi3_longrope", dict(rope_scaling=dict(longrope(), original_max_position_embeddings=2))),
    "topk_not_renormalized": ("qwen3_moe_top3_normalized", dict(norm_topk_prob=False)),
    "swiglu_clamp_ignored": ("gpt_oss_sinks_clamp", dict(swiglu_limit=None)),
    "sinks_ignored": ("gpt_oss_sinks_clamp", {}),  # the sinks' logits set to -inf below
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
@torch.inference_mode()
def test_comparison_detects_mistakes(mistake, tmp_path):
    name, change = MISTAKES[mistake]
    hf_dir, our_dir = convert(name, tmp_path)
    config = json.loads((our_dir / "config.json").read_text())
    config.update(change)
    if "rope_scaling" in change:  # only the switch moves: the cos/sin scale stays that of 192 / 48
        config["rope_scaling"]["attention_factor"] = math.sqrt(1 + math.log(192 / 48) / math.log(48))
    (our_dir / "config.json").write_text(json.dumps(config))
    hf, ours = load_hf(hf_dir), load_ours(our_dir)
    if mistake == "sinks_ignored":
        for layer in ours.layers:
            layer.attention.sinks.fill_(float("-inf"))
    ids = tokens(PROMPT_LEN + DECODE_STEPS, seed=2)
    out = hf(ids[:, :PROMPT_LEN], use_cache=True)
    diffs = [max_diff(ours(ids[:, :PROMPT_LEN], torch.arange(PROMPT_LEN)), out.logits)]
    for t in range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS):
        out = hf(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
        diffs.append(max_diff(ours(ids[:, t:t + 1], torch.tensor([t])), out.logits))
    print(f"{mistake}: max abs diff {max(diffs):.2e}")
    assert max(diffs) > MISTAKE_MIN, f"{mistake}: diff {max(diffs):.2e} would pass the parity tests"


@pytest.mark.parametrize("model_type, field, value", [
    ("smollm3", "mlp_bias", True),
    ("granite", "mlp_bias", True),
    ("qwen3_moe", "mlp_only_layers", [1]),  # dense layers among the sparse ones
    ("qwen3_moe", "decoder_sparse_step", 2),
])
def test_unsupported_config_field_is_refused_naming_it(model_type, field, value):
    cfg = dict(model_type=model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, vocab_size=384, num_experts=8, num_experts_per_tok=2)
    hf_config_to_args(cfg, {})  # the family's defaults convert
    with pytest.raises(ConvertError, match=field) as e:
        hf_config_to_args({**cfg, field: value}, {})
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- mixtures of experts beyond parity

def tiny_moe(seed=0, **overrides):
    """A random Mixtral-shaped model: 8 experts, top-2."""
    return random_model(seed=seed, **{**dict(architecture="mixtral", n_experts=8, n_experts_per_token=2,
                                            intermediate_size=48), **overrides})


# gpt-oss's variations on a mixture: sinks, every bias, the SwiGLU clamp, a sliding layer
GPT_OSS = dict(architecture="gpt_oss", attention_sinks=True, attention_bias=True, attention_out_bias=True,
               moe_bias=True, swiglu_limit=1.0, sliding_window=6, layer_types=["sliding_attention", "full_attention"])


def chosen_experts(model, run) -> list:
    """The set of experts each MoE layer's router chose during run(model)."""
    chosen, hooks = [], []
    for layer in model.layers:
        ff, seen = layer.feed_forward, set()
        chosen.append(seen)
        hooks.append(ff.gate.register_forward_hook(
            lambda m, i, logits, seen=seen, k=ff.top_k: seen.update(logits.topk(k, dim=-1).indices.flatten().tolist())))
    run(model)
    for h in hooks:
        h.remove()
    return chosen


def poison_others(model, chosen: list):
    """Every expert no token chose gets NaN weights: reading one makes the logits NaN."""
    for layer, keep in zip(model.layers, chosen):
        ff = layer.feed_forward
        others = [e for e in range(ff.gate.out_features) if e not in keep]
        for w in ff.experts.values():
            w.weight.data.view(w.n_experts, -1, w.in_features)[others] = float("nan")


@pytest.mark.parametrize("batch, tokens_per_row", [(1, 20), (2, 12), (1, 1), (3, 1), (2, 7)])
@torch.inference_mode()
def test_moe_reads_only_the_chosen_experts(batch, tokens_per_row):
    """Prompts (experts grouped: more token slots than experts), one decode token, a batch's
    decode step, a short chunk (chosen experts gathered): with every expert no token chose
    poisoned, the logits are unchanged."""
    model = tiny_moe(n_experts=32, n_experts_per_token=2)  # more than 2 * 12 token slots: some unchosen
    model.setup_caches(batch, 64)
    g = torch.Generator().manual_seed(0)
    model(torch.randint(0, 256, (batch, 5), generator=g), torch.arange(5))  # something in the cache
    ids = torch.randint(0, 256, (batch, tokens_per_row), generator=g)
    pos = torch.arange(5, 5 + tokens_per_row)
    clean = copy.deepcopy(model)
    chosen = chosen_experts(copy.deepcopy(model), lambda m: m(ids, pos))
    assert all(len(c) < 32 for c in chosen), "every expert chosen: nothing to poison"
    poison_others(model, chosen)
    expected, got = clean(ids, pos), model(ids, pos)
    assert torch.isfinite(got).all()
    assert max_diff(got, expected) <= 1e-5


def test_moe_gathers_for_few_tokens_and_groups_for_many():
    """The two paths of MoEFeedForward agree (float32 rounding) on the same tokens."""
    ff = tiny_moe(n_experts=8, n_experts_per_token=2).layers[0].feed_forward
    assert isinstance(ff, MoEFeedForward)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        grouped = ff(x.view(1, 9, 64))  # 18 token slots > 8 experts
        gathered = torch.cat([ff(x[i:i + 1].view(1, 1, 64)) for i in range(9)], dim=1)
    assert max_diff(grouped, gathered) <= 1e-5


def generate(engine, prompts, n=16, max_seq_length=96):
    engine.setup(len(prompts), max_seq_length)
    outs, _ = engine.generate(prompts, n, Sampling())
    return outs


PROMPTS = [[5, 9, 200], list(range(20, 31)), list(range(100, 137))]


@pytest.mark.parametrize("variant", [dict(architecture="qwen3_moe", n_experts_per_token=3),
                                     dict(architecture="qwen3_moe", n_experts_per_token=3, norm_topk_prob=False),
                                     GPT_OSS], ids=["qwen3_moe", "qwen3_moe_unnormalized", "gpt_oss"])
def test_moe_batched_generation_equals_each_prompt_alone(variant):
    """A batch of prompts of different lengths, each row at its own positions (prompts grouped by
    expert, decode steps gathered), gives each row what it gets alone; so do continuously batched
    requests (the server's engine: 2 rows for 3 requests, prompts in chunks of 16)."""
    model = tiny_moe(**variant)
    engine = Engine(model)
    alone = [generate(engine, [p])[0] for p in PROMPTS]
    assert generate(engine, PROMPTS) == alone
    assert len({tuple(o) for o in alone}) == 3
    batch = Engine.for_serving(copy.deepcopy(model), max_batch_size=2, max_seq_length=96, prefill_chunk=16)
    reqs = [Request(p, 16) for p in PROMPTS]
    for r in reqs:
        batch.submit(r)
    for _ in range(200):
        batch.step()
        if all(r.finish_reason for r in reqs):
            break
    assert [r.out for r in reqs] == alone


@pytest.mark.slow  # 30 s each compiling
@pytest.mark.parametrize("variant", [{}, GPT_OSS], ids=["mixtral", "gpt_oss"])
def test_moe_compiled_equals_eager(variant):
    """The compiled prefill (experts grouped in an opaque op) and decode step (experts gathered),
    with the CPU fast paths, give eager's greedy tokens, one prompt and a batch."""
    torch._dynamo.reset()  # the step's recompile limit counts the graphs of earlier tests' models too
    model = tiny_moe(**variant)
    eager = [generate(Engine(model), [p])[0] for p in PROMPTS]
    compiled = Engine(kernels.install(copy.deepcopy(model)), compile=True, compile_prefill=True)
    assert [generate(compiled, [p])[0] for p in PROMPTS] == eager
    assert generate(compiled, PROMPTS) == eager


# (mode, bound on each expert's weight error, on the logits' error); a dense model of this shape
# is as far from float: int8 ~0.022, int4 ~0.2
@pytest.mark.parametrize("mode, weight_bound, bound, variant", [
    ("int8", 0.01, 0.03, {}), ("int4", 0.15, 0.3, {}),
    pytest.param("int8", 0.01, 0.03, GPT_OSS, marks=pytest.mark.slow)], ids=["int8", "int4", "int8-gpt_oss"])
def test_moe_quantized_experts_within_bound(mode, weight_bound, bound, variant, tmp_path):
    """quantize.py stores every expert in the mode's format; the loaded model's logits stay within
    the scheme's bound of float (as tests/test_quantize.py's), and compiled decodes as eager."""
    import quantize
    from conftest import save_checkpoint
    from loading import load_model
    from safetensors import safe_open
    torch._dynamo.reset()  # the step's recompile limit counts the graphs of earlier tests' models too
    model = tiny_moe(std=0.05, dim=128, intermediate_size=64, n_kv_heads=2, **variant)
    src = save_checkpoint(model, tmp_path / "float")
    quantize.main(["--checkpoint", str(src), "--mode", mode, "--out", str(tmp_path / mode), "--groupsize", "32"])
    with safe_open(tmp_path / mode / "model.safetensors", "pt") as f:
        w1 = f.get_tensor("layers.0.feed_forward.experts.w1.weight")
        assert w1.dtype == (torch.int8 if mode == "int8" else torch.uint8)
        assert w1.shape == ((8 * 64, 128) if mode == "int8" else (8 * 64, 64))
    quantized, reference = load_model(tmp_path / mode), load_model(src)
    for name in ("w1", "w3", "w2"):
        q, w = quantized.layers[1].feed_forward.experts[name], reference.layers[1].feed_forward.experts[name]
        for e in range(8):
            want = w.expert(e, torch.float32)
            assert (q.expert(e, torch.float32) - want).norm() / want.norm() < weight_bound, (name, e)
    prompt = list(range(100, 140))
    for m in (quantized, reference):
        m.setup_caches(1, 64)
    with torch.inference_mode():  # 40 tokens: the experts grouped, one dequantized at a time
        lq, lf = (m(torch.tensor([prompt]), torch.arange(40)) for m in (quantized, reference))
    rel = ((lq - lf).norm() / lf.norm()).item()
    assert rel < bound, rel
    eager = generate(Engine(quantized), [prompt[:20]], 12, 64)
    compiled = Engine(quantized, compile=True, compile_prefill=True)
    assert generate(compiled, [prompt[:20]], 12, 64) == eager  # 20 tokens: the chosen experts' integers gathered


def test_moe_tp2_matches_single_process(tmp_path):
    """2 ranks, each with its part of every expert's hidden dimension: the logits of a batch of
    prompts of different lengths (prompt slots grouped by expert, decode steps gathered), of int8 experts and of a
    gpt-oss-shaped mixture (sinks split by head, biased experts) equal one process's within 1e-4,
    and the compiled decode step gives its greedy tokens."""
    from conftest import save_checkpoint
    from test_tp import PROMPTS_B2, STEPS, assert_matches_single_process, quantized, run_worker
    ckpt = save_checkpoint(tiny_moe(seed=4, intermediate_size=96, n_experts=8, n_experts_per_token=2), tmp_path / "moe")
    int8 = quantized(ckpt)
    gpt_oss = save_checkpoint(tiny_moe(seed=5, intermediate_size=96, **GPT_OSS), tmp_path / "gpt_oss")
    cases = [dict(name="moe", checkpoint=str(ckpt), prompts=PROMPTS_B2, steps=STEPS),
             dict(name="moe-int8", checkpoint=str(int8), prompts=PROMPTS_B2, steps=STEPS, float_activations=True),
             dict(name="gpt_oss", checkpoint=str(gpt_oss), prompts=PROMPTS_B2, steps=STEPS),
             dict(name="moe-compiled", checkpoint=str(ckpt), prompts=PROMPTS_B2, steps=STEPS, compile=True)]
    results = run_worker(2, cases, tmp_path)
    for case in cases[:3]:  # the experts' partial sums are all-reduced in every tp.py mode
        assert_matches_single_process(case, results[case["name"]], atol=1e-4)
    from tp_worker import run_case
    reference = run_case(load_model(ckpt), PROMPTS_B2, STEPS)
    assert torch.equal(results["moe-compiled"]["tokens"], reference["tokens"])


def test_moe_tp_plan_splits_every_experts_hidden_dim():
    """Rank r of 2 holds hidden features [48 r, 48 r + 48) of each of the 8 experts: rows of w1 and
    w3, columns of w2, whose output is all-reduced; the router is replicated."""
    from tp import TensorParallel
    args = tiny_moe(intermediate_size=96).args
    with torch.device("meta"):
        model = Transformer(args)
    tp = TensorParallel(1, 2, group_name="unused")
    tp.shard_modules(model)
    experts = model.layers[0].feed_forward.experts
    assert experts["w1"].weight.shape == experts["w3"].weight.shape == (8 * 48, 64)
    assert experts["w2"].weight.shape == (8 * 64, 48)
    assert tp.shards["layers.0.feed_forward.experts.w1"].ranges == [(96 * e + 48, 96 * e + 96) for e in range(8)]
    assert tp.shards["layers.0.feed_forward.experts.w2"].rowwise
    assert model.layers[0].feed_forward.gate.weight.shape == (8, 64)
    args = tiny_moe(**GPT_OSS).args  # gpt-oss's sinks: one per query head, the rank's heads
    with torch.device("meta"):
        model = Transformer(args)
    TensorParallel(1, 2, group_name="unused").shard_modules(model)
    assert model.layers[0].attention.sinks.shape == (2,)


def test_mxfp4_experts_dequantize_as_transformers_does():
    """gpt-oss's released experts are MXFP4 blocks and scales; the converter's dequantization
    equals transformers' own, in the orientation of the float checkpoint (E, in, out)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)  # 3 experts, 8 rows, 64 inputs
    scales = torch.randint(118, 136, (3, 8, 2), generator=g, dtype=torch.uint8)
    got = mxfp4_to_float(blocks, scales)
    assert got.shape == (3, 64, 8)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float(), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))


@pytest.mark.parametrize("variant", [{}, GPT_OSS], ids=["mixtral", "gpt_oss"])
def test_moe_speculative_greedy_is_token_identical(variant):
    """n-gram speculation verifies several tokens per forward (their slots gathered or grouped):
    greedy output equals plain decoding."""
    import proposers
    import speculative
    model = tiny_moe(**variant)
    prompt = PROMPTS[2] * 2  # repeats: the n-gram proposer has something to propose
    plain = generate(Engine(copy.deepcopy(model)), [prompt], 24, 128)
    spec = speculative.SpeculativeEngine(Engine(model, 1, 128), proposers.NgramProposer(2), 4)
    (out,), _ = spec.generate([prompt], 24, Sampling())
    assert out == plain[0]


def test_param_bytes_counts_the_experts_a_step_reads():
    """A batch-1 decode step reads n_experts_per_token of the n_experts experts: an 8-expert top-2
    mixture reads what the dense model of twice an expert's width reads, plus its router; B rows
    read at most min(n_experts, B * top-k) experts."""
    moe, dense = tiny_moe(intermediate_size=48), random_model(intermediate_size=2 * 48)
    router = sum(layer.feed_forward.gate.weight.nbytes for layer in moe.layers)
    experts = sum(w.weight.nbytes for layer in moe.layers for w in layer.feed_forward.experts.values())
    assert param_bytes(moe) == param_bytes(dense) + router
    assert param_bytes(moe, tokens=3) == param_bytes(moe) + experts * 4 // 8
    assert param_bytes(moe, tokens=100) == param_bytes(moe) + experts * 6 // 8
    assert param_bytes(dense, tokens=100) == param_bytes(dense)


# ---------------------------------------------------------------- LongRoPE's switch during generation

SWITCH = 16  # original_max_position_embeddings: a 10-token prompt and 32 new tokens cross it
PHI3_SWITCH = ("phi3", dict(num_key_value_heads=2, max_position_embeddings=192, original_max_position_embeddings=SWITCH,
                            rope_parameters=longrope(orig=SWITCH)))


@pytest.fixture(scope="module")
def phi3_switch(tmp_path_factory):
    """(transformers' model, our converted checkpoint) of a Phi-3 whose long and short factors differ."""
    root = tmp_path_factory.mktemp("phi3_switch")
    build_hf_model(*PHI3_SWITCH).save_pretrained(root / "hf")
    convert_hf_checkpoint(root / "hf", root / "ours")
    return load_hf(root / "hf"), root / "ours"


def hf_generate(hf, prompts: list) -> tuple:
    """transformers' greedy generate over left-padded prompts: (each row's DECODE_STEPS tokens, the
    raw logits of every step (steps, B, V))."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=DECODE_STEPS, min_new_tokens=DECODE_STEPS,
                      do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, width:].tolist(), torch.stack(out.logits)


PHI3_PROMPTS = [tokens(10, seed=5)[0].tolist(), tokens(7, seed=6)[0].tolist()]


@pytest.mark.parametrize("rerun", [True, False], ids=["as-hf", "mistake-no-rerun"])
@torch.inference_mode()
def test_longrope_generation_recomputes_the_cache_at_the_switch_as_hf(phi3_switch, rerun, monkeypatch):
    """transformers' Phi-3 generate() runs the whole sequence again once it first outgrows the
    original context, so every cached key is rotated with the long factors from then on; so does
    the engine (scheduler.Scheduler.recompute_if_crossing): the same 32 greedy tokens and logits
    within 1e-4, with sampling in the step and on the host (logprobs). In a batch each row, at its
    own positions, crosses the switch at its own step, as it does alone: its tokens are those of
    transformers' generate for it alone, their logprobs within the tolerance of its log-softmax.
    Without the re-run the logits move far past the tolerance."""
    oracle_for(*PHI3_SWITCH)
    hf, our_dir = phi3_switch
    if not rerun:
        monkeypatch.setattr(scheduler.Scheduler, "recompute_if_crossing", lambda self, req: None)
    model = load_model(our_dir)
    logits = []
    model.register_forward_hook(lambda module, args, out: logits.append(out[:, -1]))
    engine = Engine(model)
    expected, hf_logits = hf_generate(hf, PHI3_PROMPTS[:1])
    got = generate(engine, PHI3_PROMPTS[:1], DECODE_STEPS, 64)
    diff = max_diff(torch.stack(logits), hf_logits)  # the prefill's, then each step's
    if not rerun:
        assert diff > MISTAKE_MIN, f"diff {diff:.2e} without the re-run would pass"
        return
    assert len(set(got[0])) > 3, "degenerate greedy output would make the comparison weak"
    assert got == expected and diff <= TOL, (diff, got, expected)
    engine.setup(1, 64)
    (host,), _ = engine.generate(PHI3_PROMPTS[:1], DECODE_STEPS, Sampling(), logprobs=2)  # the host's loop
    assert [host] == expected
    alone = [hf_generate(hf, [p]) for p in PHI3_PROMPTS]
    engine.setup(2, 64)
    outs, stats = engine.generate(PHI3_PROMPTS, DECODE_STEPS, Sampling(), logprobs=3)
    assert outs == [row for (row,), _ in alone]
    for entries, ((row,), row_logits) in zip(stats.logprobs, alone):
        want = torch.log_softmax(row_logits[:, 0].double(), dim=-1)  # (steps, V)
        assert len(entries) == len(row) == DECODE_STEPS
        # a logit within TOL moves a log-softmax by at most 2 TOL
        worst = max(abs(lp - w[t].item()) for (chosen, top), token, w in zip(entries, row, want)
                    for t, lp in [(token, chosen), *top])
        assert worst <= 2 * TOL, worst


def test_longrope_compiled_generation_recomputes_the_cache_as_eager(phi3_switch):
    """The compiled decode step with the re-run in between gives eager's tokens."""
    torch._dynamo.reset()
    _, our_dir = phi3_switch
    eager = generate(Engine(load_model(our_dir)), PHI3_PROMPTS[:1], DECODE_STEPS, 64)
    assert generate(Engine(load_model(our_dir), compile=True), PHI3_PROMPTS[:1], DECODE_STEPS, 64) == eager


def test_longrope_switch_in_serving_speculation_and_chat(phi3_switch):
    """Every way of reusing cached keys meets the switch. Continuously batched requests (the
    server's engine) recompute their keys there, each at its own step, and give the tokens each
    gets alone; speculative decoding, which does not recompute, refuses a generation that would
    cross it with one line saying why; and the prefix cache is off for such a model (a cached
    block's keys may be rotated short), so a chat turn that continues the previous one past the
    switch is prefilled from position 0, and gives a fresh engine's tokens."""
    import proposers
    import speculative
    from errors import UserError
    _, our_dir = phi3_switch
    model = load_model(our_dir)
    alone = [generate(Engine(model), [p], DECODE_STEPS, 64)[0] for p in PHI3_PROMPTS]
    serving = Engine.for_serving(model, max_batch_size=2, max_seq_length=64)
    reqs = [Request(p, DECODE_STEPS) for p in PHI3_PROMPTS]
    for r in reqs:
        serving.submit(r)
    for _ in range(200):
        if all(r.finish_reason for r in reqs):
            break
        serving.step()
    assert [r.out for r in reqs] == alone
    spec = speculative.SpeculativeEngine(Engine(model, 1, 64), proposers.NgramProposer(2), 4)
    with pytest.raises(UserError, match="LongRoPE") as e:
        spec.generate(PHI3_PROMPTS[:1], DECODE_STEPS, Sampling())
    assert "\n" not in str(e.value)
    (out,), _ = spec.generate(PHI3_PROMPTS[:1], SWITCH - 10, Sampling())  # up to the switch: allowed
    assert out == alone[0][:SWITCH - 10]
    engine = Engine(model, 1, 64)
    assert not engine.blocks.prefix_caching
    chat, chars = Chat(engine, CharTokenizer()), CharTokenizer()
    chat.reply("abcdefghijklmnop", 1, Sampling())  # a full block of 16 tokens, rotated short
    (out, _) = chat.reply("qr", 8, Sampling())  # 19 tokens, the first 16 as before: the turn crosses the switch
    assert chat.last_prefill_tokens == chat.last_prompt_tokens == 19
    ids = chars.encode(chars.apply_chat_template(chat.messages[:3]), add_bos=False)
    assert generate(Engine(model), [ids], 8, 64) == [out]


class CharTokenizer:
    """What Chat asks of a tokenizer: one id per character, no template beyond concatenation."""
    eos_ids = ()

    def apply_chat_template(self, messages) -> str:
        return "".join(m["content"] for m in messages)

    def encode(self, text: str, add_bos: bool) -> list:
        return [ord(c) for c in text]

    def decode(self, ids: list) -> str:
        return "".join(chr(97 + i % 26) for i in ids)
