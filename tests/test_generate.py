"""generate.py: batching, compile, chat cache reuse, sampling, the golden output, the CLI and its errors."""
import copy
import json
import os
import platform
import re
import sys
from pathlib import Path

import pytest
import torch

import kernels
from conftest import random_model, run_script, save_checkpoint
from engine import Chat, Engine
from forwards import forward_rides
from loading import load_model
from sampling import Sampling, logits_to_probs, sample

GOLDEN = Path(__file__).parent / "golden" / "smollm2-135m.json"


def greedy(engine, prompts, n, max_seq_length=96):
    engine.setup(len(prompts), max_seq_length)
    outs, _ = engine.generate(prompts, n, Sampling())
    return outs


@pytest.mark.parametrize("window", [None, 6])
def test_batched_generation_matches_per_prompt(window):
    # different prompt lengths in one batch, each row at its own positions; a window smaller than every prompt
    model = random_model(sliding_window=window, n_kv_heads=1)
    engine = Engine(model)
    prompts = [[5, 9, 200], list(range(20, 31)), list(range(100, 117))]
    batched = greedy(engine, prompts, 24)
    alone = [greedy(engine, [p], 24)[0] for p in prompts]
    assert batched == alone
    assert len({tuple(o) for o in alone}) == 3  # the rows really differ


def test_stop_tokens_end_each_row_independently():
    engine = Engine(random_model())
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11]]
    free = greedy(engine, prompts, 16)
    stop = free[0][4]  # a token row 0 produces mid-way
    engine.setup(2, 96)
    outs, _ = engine.generate(prompts, 16, Sampling(), stop_ids=[stop])
    for row, out in zip(free, outs):
        cut = row.index(stop) + 1 if stop in row else len(row)
        assert out == row[:cut]


@pytest.mark.parametrize("compile_mode", ["default", "regional"])
def test_compiled_decode_matches_eager(compile_mode):
    model = random_model(n_layers=2)
    prompt = [list(range(3, 19))]
    eager = greedy(Engine(model), prompt, 32)  # the reference
    fast = kernels.install(copy.deepcopy(model))  # the CPU fast paths
    compiled = greedy(Engine(fast, compile=True, compile_mode=compile_mode), prompt, 32)
    assert compiled == eager


def test_the_in_step_sampler_draws_what_the_host_one_draws():
    """A compiled step's sampler takes temperature, top-p and min-p as a tensor: from the same
    random stream it picks the very tokens sample() picks from the numbers."""
    from sampling import sample_in_step, step_sampling
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * 3
    for s in (Sampling(0.0), Sampling(0.7), Sampling(1.3, top_p=0.8), Sampling(0.9, top_k=20, top_p=0.95),
              Sampling(1.0, top_k=5), Sampling(0.8, min_p=0.1), Sampling(1.0, top_k=400, top_p=0.5, min_p=0.05)):
        torch.manual_seed(1)
        want = sample(logits, s)
        torch.manual_seed(1)
        assert torch.equal(sample_in_step(logits, step_sampling(s, 300, "cpu")), want), s


def test_one_compiled_step_serves_every_temperature_top_p_and_min_p():
    """--temperature 0.7 after 0.8 (or another top-p, min-p) runs the graph already compiled."""
    engine = Engine(kernels.install(random_model(n_layers=2)), 1, 64, compile=True)
    torch._dynamo.reset()
    engine.generate([[5, 9, 200]], 6, Sampling(0.8, top_p=0.9, min_p=0.05))
    with torch.compiler.set_stance("fail_on_recompile"):
        for s in (Sampling(0.7, top_p=0.95, min_p=0.1), Sampling(1.2, top_p=0.5, min_p=0.01)):
            outs, _ = engine.generate([[5, 9, 200]], 6, s)
            assert len(outs[0]) == 6


def test_regional_compile_compiles_each_kind_of_layer_once():
    """--compile_mode regional: the step's code defines one region per kind of layer (full and
    sliding attention, which keep keys in pools of their own) and calls it for each of the six
    layers, and its logits are eager's."""
    from torch._inductor.utils import run_and_get_code
    kinds = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    model = kernels.install(random_model(n_layers=6, layer_types=kinds, sliding_window=4))
    engine = Engine(model, 1, 32, compile=True, compile_mode="regional")
    tables = ([0, 1], [0, 1])  # blocks 0 and 1 of each kind of layer hold positions 0-31
    with torch.inference_mode():
        engine.run_chunk(list(range(3, 11)), 0, tables)
        # one token at position 8: (tokens, positions, block size, kv_len, logit rows), its slots and tables
        step = (torch.tensor([[17]]), torch.tensor([[8]]), 16, 32, torch.tensor([0]))
        views = engine.feeder.views([([17], 8, tables)], 2)
        expected, _ = forward_rides(copy.deepcopy(model), *step, **views)
        torch._dynamo.reset()
        (got, _), (code,) = run_and_get_code(engine.rides, model, *step, **views)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    regions = set(re.findall(r"# subgraph: (\w+)", code))
    assert len(regions) == 2 and len(re.findall(r"# subgraph: \w+", code)) == 6, code


@pytest.mark.parametrize("variant", [
    dict(n_kv_heads=1, attention_bias=True),  # MQA, q/k/v biases
    dict(sliding_window=5, attn_logit_softcapping=20.0, tie_word_embeddings=False),  # sliding window, soft-capping
])
def test_compiled_decode_step_logits_match_eager(variant):
    """The compiled CPU decode step with kernels.py's fast paths (CpuAttention, CpuLinear): its
    logits equal eager ones at every step, and so do those of a compiled 5-token forward
    (speculative verification)."""
    model = kernels.install(random_model(**variant))
    step = torch.compile(lambda m, t, p: m(t, p), fullgraph=True)
    with torch.inference_mode():
        model.setup_caches(1, 32)
        prompt = torch.arange(3, 11).view(1, -1)
        model(prompt, torch.arange(8))
        caches = [layer.attention.kv_cache for layer in model.layers]

        def snapshot():
            return [(c.k_cache.clone(), c.v_cache.clone()) for c in caches]

        def rewind(saved):  # each run starts from the same cache
            for c, (k, v) in zip(caches, saved):
                c.k_cache.copy_(k)
                c.v_cache.copy_(v)

        after_prompt = snapshot()
        tokens = [17, 99, 4, 250, 31, 8, 77, 140]
        eager = [model(torch.tensor([[t]]), torch.tensor([8 + i])) for i, t in enumerate(tokens)]
        after_steps = snapshot()
        rewind(after_prompt)
        for i, t in enumerate(tokens):
            got = step(model, torch.tensor([[t]]), torch.tensor([8 + i]))
            torch.testing.assert_close(got, eager[i], atol=1e-4, rtol=0)
        chunk, chunk_pos = torch.tensor([[5, 6, 7, 8, 9]]), torch.arange(16, 21)
        expected = model(chunk, chunk_pos)
        rewind(after_steps)
        torch.testing.assert_close(step(model, chunk, chunk_pos), expected, atol=1e-4, rtol=0)


def test_bfloat16_prefill_and_decode_match_float32_products(one_thread):
    """kernels.CpuLinear in bfloat16: several tokens (prefill; float32 products on CPUs without
    bf16 instructions), one token eager and compiled all give x W^T of the same bf16 numbers."""
    import torch.nn.functional as F
    from kernels import CpuLinear
    torch.manual_seed(0)
    lin = CpuLinear(64, 48, bias=True).to(torch.bfloat16)
    w, b = lin.weight.float(), lin.bias.float()
    compiled = torch.compile(lambda m, v: m(v), fullgraph=True)
    with torch.no_grad():
        for x in (torch.randn(2, 5, 64).bfloat16(), torch.randn(1, 1, 64).bfloat16()):
            expected = F.linear(x.float(), w, b)
            torch.testing.assert_close(lin(x).float(), expected, atol=0.03, rtol=0.01)
            torch.testing.assert_close(compiled(lin, x).float(), expected, atol=0.03, rtol=0.01)


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    p = logits_to_probs(logits, Sampling(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    # top_p=0.7: 0.5 alone is short of 0.7, 0.5+0.25 reaches it -> keep two tokens
    p = logits_to_probs(logits, Sampling(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    p = logits_to_probs(logits, Sampling(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([[0.5, 0.25, 0.15, 0]]) / 0.9)


def test_sampling_draws_from_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = torch.log(probs).expand(20000, 4)
    ids = sample(logits, Sampling(temperature=1.0)).view(-1)
    freq = torch.bincount(ids, minlength=4).float() / ids.numel()
    assert (freq - probs).abs().sum() / 2 < 0.015  # total variation
    assert freq[3] == 0


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from tokenizer import Tokenizer
    return load_model(smollm2_dir), Tokenizer(smollm2_dir)


def golden_outputs(model, tok, cases):
    engine = Engine(model)
    results = []
    for case in cases:
        text = tok.apply_chat_template([{"role": "user", "content": case["prompt"]}]) if case["chat"] \
            else case["prompt"]
        ids = tok.encode(text, add_bos=False if case["chat"] else None)
        engine.setup(1, 256)
        (out,), _ = engine.generate([ids], case["max_new_tokens"], Sampling(), stop_ids=tok.eos_ids)
        results.append(out)
    return results


def test_golden_greedy_output_smollm2(smollm2):
    # tests/golden/smollm2-135m.json was written by `PYTHONPATH=. python tests/test_generate.py --update-golden`,
    # and checked then against transformers' greedy generate on the same GGUF (see that function)
    model, tok = smollm2
    cases = json.loads(GOLDEN.read_text())
    for case, out in zip(cases, golden_outputs(model, tok, cases)):
        assert out == case["output_ids"], case["prompt"]
        assert tok.decode(out) == case["output_text"]


def test_chat_cache_reuse_equals_reprefill(smollm2):
    model, tok = smollm2
    engine = Engine(model, 1, 512)
    turns = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]
    reuse, fresh = Chat(engine, tok), Chat(engine, tok, reuse_cache=False)
    for turn in turns:
        a, _ = reuse.reply(turn, 24, Sampling())
        prefilled = reuse.last_prefill_tokens
        b, _ = fresh.reply(turn, 24, Sampling())
        assert a == b
        assert fresh.last_prefill_tokens == len(tok.encode(tok.apply_chat_template(fresh.messages[:-1]),
                                                            add_bos=False))
    # the third turn found the earlier turns' blocks in the prefix cache: it prefilled its new tokens
    # and what was left of the earlier ones past their last full block
    assert prefilled < fresh.last_prefill_tokens / 2


def test_cli_streams_text_to_stdout_and_metrics_to_stderr(smollm2_dir, tmp_path):
    from tokenizer import Tokenizer
    tok = Tokenizer(smollm2_dir)
    mj = tmp_path / "m.json"
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--prompt", "The capital of France is",
                   "--max_new_tokens", "12", "--no-compile", "--num_samples", "2", "--metrics_json", mj)
    assert r.returncode == 0, r.stderr
    metrics = json.loads(mj.read_text())
    assert len(metrics) == 2
    for m in metrics:
        for key in ("prompt_tokens", "new_tokens", "ttft_s", "decode_tokens_per_s", "bandwidth_gb_s",
                    "peak_memory_bytes"):
            assert m[key] > 0, key
    assert "tokens/s" in r.stderr and "tokens/s" not in r.stdout
    engine = Engine(load_model(smollm2_dir))
    engine.setup(1, 64)
    (out,), _ = engine.generate([tok.encode("The capital of France is")], 12, Sampling(), tok.eos_ids)
    expected = tok.decode([t for t in out if t not in tok.eos_ids])
    assert r.stdout == (expected + "\n") * 2


def test_cli_interactive_chat_reuses_the_cache(smollm2_dir, tmp_path):
    mj = tmp_path / "m.json"
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--interactive", "--no-compile",
                   "--max_new_tokens", "16", "--max_seq_length", "512", "--metrics_json", mj,
                   stdin="Hi there!\nWhat is 2+2?\n\n")
    assert r.returncode == 0, r.stderr
    first, second = json.loads(mj.read_text())
    assert first["prefilled_tokens"] == first["conversation_tokens"]
    # the second turn's prompt holds the whole first exchange, yet only the new turn is prefilled
    assert second["conversation_tokens"] > first["conversation_tokens"] + first["new_tokens"]
    assert second["prefilled_tokens"] < second["conversation_tokens"] - first["conversation_tokens"]
    assert len(r.stdout.strip().splitlines()) >= 2


# ---------------------------------------------------------------- bad input

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    # a small random model with SmolLM2's tokenizer, so error cases load fast
    model = random_model(vocab_size=49152, eos_token_ids=[2])
    return save_checkpoint(model, tmp_path_factory.mktemp("tiny") / "ckpt", tokenizer_from=smollm2_dir)


@pytest.mark.parametrize("mode", ["logprobs", "json"])
def test_a_second_identical_run_compiles_nothing(tiny_dir, tmp_path, mode):
    """The on-disk compile cache holds for every mode: run twice, the second run finds every graph
    (these modes once compiled for a minute on every identical run). A schema that a random model
    completes in a few tokens: a sampled boolean beside the forced ones, under the grammar's mask."""
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}')
    flags = {"logprobs": ["--logprobs", "3"], "json": ["--json_schema", schema]}[mode]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    misses = []
    for i in range(2):
        mj = tmp_path / f"m{i}.json"
        r = run_script("generate.py", "--checkpoint", tiny_dir, "--prompt", "Hi", "--max_new_tokens", "24",
                       "--wait_for_compile", "--metrics_json", mj, *flags, env=env, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        misses.append(json.loads(mj.read_text())[0]["compile_cache_misses"])
        assert "0.00 tokens/s" not in r.stderr  # a run whose tokens were all forced says there was no step
    assert misses[0] > 0 and misses[1] == 0, misses


@pytest.mark.parametrize("mode", ["plain", "rows", "logprobs", "json", "chat"])
def test_generate_steps_eagerly_while_compiling_aside_then_compiles_nothing(tiny_dir, mode):
    """generate.py's default: the first token at once from the eager step while a thread compiles
    the plans of the steps this run takes (warmup.generate_plans); once taken up, the same run
    compiles nothing more, and its tokens are the eager ones."""
    from grammar import Grammars
    from tokenizer import Tokenizer
    from torch._dynamo.utils import counters
    tok, model = Tokenizer(tiny_dir), load_model(tiny_dir)
    prompts = [[5, 9, 200, 7], list(range(20, 31))] if mode == "rows" else [[5, 9, 200, 7]]
    grammars = Grammars(tiny_dir, model.args.vocab_size, tok.eos_ids) if mode == "json" else None
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'

    def run(engine):
        if mode == "chat":  # a turn, then one after it on the cached turn's blocks
            talk = Chat(engine, tok)
            return [talk.reply(text, 6, Sampling())[0] for text in ("Hi", "And?")], None
        options = {"logprobs": 2} if mode == "logprobs" else {}
        if grammars:
            options["constraints"] = [grammars.constraint(grammars.compile("json_schema", schema))]
        outs, stats = engine.generate(prompts, 8, Sampling(), **options)
        return outs, stats

    want, _ = run(Engine(model, len(prompts), 64))
    engine = Engine(model, len(prompts), 64, compile=True, prefill_chunk=64)
    torch._dynamo.reset()
    thread = engine.warm_up(None if mode == "chat" else prompts, Sampling(), host=mode == "logprobs",
                            constrained=mode == "json", aside=True)
    assert thread.is_alive() and not engine.step_compiled
    before = engine.eager_steps
    eager, _ = run(engine)
    assert engine.eager_steps > before
    thread.join(timeout=900)
    graphs = counters["stats"]["unique_graphs"]
    with torch.compiler.set_stance("fail_on_recompile"):
        compiled, stats = run(engine)
    assert engine.step_compiled and counters["stats"]["unique_graphs"] == graphs
    assert stats is None or stats.eager_steps == 0
    assert eager == compiled == want


def test_cli_prints_before_the_compile_ends_and_exits_cleanly(tiny_dir, tmp_path):
    """The default run with empty compile caches: the text comes from the eager step, the metrics
    say so, and the process exits 0 with the compile thread still running (an interpreter that
    shuts down under a thread inside the compiler aborts: exit status 134 one time in three)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    for _ in range(3):
        r = run_script("generate.py", "--checkpoint", tiny_dir, "--prompt", "Hi", "--max_new_tokens", "6",
                       "--ignore_eos", env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "steps eager while the compiled step compiled" in r.stderr
        assert "the run ended before the compiled step was ready" in r.stderr


def broken_copy(src: Path, dst: Path, config=None, weights=None) -> Path:
    import shutil
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    if weights:
        weights(dst / "model.safetensors")
    return dst


def truncate(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def drop_weight(path: Path, name="layers.1.feed_forward.w2.weight", reshape=False):
    from safetensors.torch import load_file, save_file
    state = load_file(path)
    if reshape:
        state[name] = state[name][:, :-1].contiguous()
    else:
        del state[name]
    save_file(state, path)


BAD_INPUTS = {
    "missing_checkpoint": (lambda d, t: [t / "nope"], "does not exist"),
    "truncated_weights": (lambda d, t: [broken_copy(d, t / "c", weights=truncate)], "truncated"),
    "unsupported_architecture": (lambda d, t: [broken_copy(d, t / "c", config={"architecture": "gpt2"})],
                                 "unsupported architecture"),
    "missing_weight": (lambda d, t: [broken_copy(d, t / "c", weights=drop_weight)], "lacks"),
    "wrong_shape": (lambda d, t: [broken_copy(d, t / "c", weights=lambda p: drop_weight(p, reshape=True))],
                    "shape"),
    "prompt_longer_than_cache": (lambda d, t: [d, "--prompt", "word " * 100, "--max_seq_length", "32"],
                                 "max_seq_length"),
    "max_new_tokens_beyond_cache": (lambda d, t: [d, "--max_new_tokens", "100", "--max_seq_length", "64"],
                                    "exceeds"),
    "unknown_device": (lambda d, t: [d, "--device", "tpu9"], "device"),
    "unavailable_cuda": (lambda d, t: [d, "--device", "cuda"] if not torch.cuda.is_available()
                         else [d, "--device", "cuda:99"], "cuda"),
    "unknown_dtype": (lambda d, t: [d, "--dtype", "float8"], "dtype"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gives_one_line_error(case, tiny_dir, tmp_path):
    make_args, expected = BAD_INPUTS[case]
    ckpt, *rest = make_args(tiny_dir, tmp_path)
    r = run_script("generate.py", "--checkpoint", ckpt, "--no-compile", "--max_new_tokens", "4", *rest)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert expected in lines[0]
    assert r.stdout == ""


def update_golden():
    """Regenerate the golden file and check it against transformers' greedy generate on the GGUF."""
    import transformers
    from conftest import SMOLLM2
    from tokenizer import Tokenizer
    cases = [
        {"prompt": "Once upon a time, there was a little", "chat": False, "max_new_tokens": 32},
        {"prompt": "def fibonacci(n):", "chat": False, "max_new_tokens": 32},
        {"prompt": "What is the capital of France?", "chat": True, "max_new_tokens": 48},
    ]
    model, tok = load_model(SMOLLM2), Tokenizer(SMOLLM2)
    gguf = Path.home() / ".cache" / "minillm" / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    hf = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    for case, out in zip(cases, golden_outputs(model, tok, cases)):
        text = tok.apply_chat_template([{"role": "user", "content": case["prompt"]}]) if case["chat"] \
            else case["prompt"]
        ids = torch.tensor([tok.encode(text, add_bos=False if case["chat"] else None)])
        ref = hf.generate(ids, max_new_tokens=case["max_new_tokens"], do_sample=False,
                          eos_token_id=tok.eos_ids, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert ref == out, (case["prompt"], ref, out)
        case.update(output_ids=out, output_text=tok.decode(out))
        print(case["prompt"], "->", repr(case["output_text"]))
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":  # PYTHONPATH=. python tests/test_generate.py --update-golden
    if sys.argv[1:] == ["--update-golden"]:
        update_golden()


FAULTS_SCRIPT = """
import resource, sys, torch
from loading import load_model
from kvcache import ForwardBatch
model = load_model(sys.argv[1])
model.setup_caches(1, 512)
tokens = torch.randint(0, 1000, (1, 300))
batch = ForwardBatch.rows(torch.arange(300), 1, 512, kv_len=300, last=torch.tensor([[299]]))
faults = []
with torch.inference_mode():
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model(tokens, batch)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                    reason="keep_freed_memory only sets glibc's allocator; elsewhere it does nothing, "
                           "so there is no claim to check")
def test_repeated_prefill_reuses_freed_memory(smollm2_dir):
    # loading.keep_freed_memory: without it each prefill maps fresh pages for its activations
    # (thousands of page faults a call, as many as the first); with it the later calls take few
    r = run_script("-c", FAULTS_SCRIPT, smollm2_dir)
    assert r.returncode == 0, r.stderr
    first, *later = map(int, r.stdout.split())
    assert first > 1000, (first, later)  # the activations do need fresh pages the first time
    # the median of the later calls: one of them now and then maps a few thousand pages more;
    # without the setting all take about as many as the first
    assert sorted(later)[1] < first / 10, (first, later)
