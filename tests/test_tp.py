"""Tensor parallelism (tp.py) on CPU with gloo: sharded runs under torchrun against one process.

Each torchrun job (tests/tp_worker.py) runs several cases, since starting one costs seconds:
tiny random Llama-family and Gemma-family models on 2 ranks (float; int8 and int4 when
quantize.py is there; batch 1 and a batch of 2 different prompts; one compiled; speculative
decoding when speculative.py is there), SmolLM2-135M on 3 ranks, the generate.py command line on
2 ranks, and ranks that fail. The plan itself (head splits, int4 group boundaries, a row-wise
bias) is checked in one process.

Run: python -m pytest -q tests/test_tp.py
"""
import contextlib
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import kernels
from conftest import ROOT, device_flags, needs_devices, random_model, run_script, save_checkpoint
from loading import load_model
from test_gemma import tiny_gemma3
from tp import PLAN, TensorParallel, TPError, head_split, sharded_bytes
from tp_worker import run_case

GOLDEN = Path(__file__).parent / "golden" / "smollm2-135m.json"
PROMPTS_B1 = [[5, 17, 3, 200, 42, 9, 11]]
PROMPTS_B2 = [[5, 17, 3, 200, 42, 9, 11, 250, 7, 1, 30], [99, 4, 64, 128]]  # each row at its own positions
STEPS = 5


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


# A rank ended by one of these crashed below Python, rather than failing with an answer of ours
CRASH_SIGNALS = ("(SIGSEGV)", "(SIGABRT)", "(SIGBUS)")


def torchrun(n: int, *args, timeout=600, retry=True) -> subprocess.CompletedProcess:
    """One torchrun job. A job whose rank crashed below Python runs once more, the crash's report
    kept as a warning (CI's summary shows it): a 2-rank int8 generate.py job lost rank 1 to a
    SIGSEGV in one CI run that no local run repeated, nor ASAN on kernels.cpp. A crash that
    happens twice fails the test."""
    # a collective waits 300 s for a rank that the loaded cores hold back; a hang still fails the
    # test, and torchrun's SIGTERM makes every rank print where it was
    env = dict(os.environ, OMP_NUM_THREADS="1", MINILLM_TP_TIMEOUT_S="300", MINILLM_TP_STACKS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *map(str, args)]
    if device_flags(cmd):  # a command line: on the test device, one per rank
        needs_devices(n)
        cmd += device_flags(cmd)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if retry and r.returncode != 0 and any(s in r.stderr for s in CRASH_SIGNALS):
        warnings.warn(f"torchrun: a rank crashed, the job runs once more:\n{job_log(r)}")
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    return r


def job_log(r: subprocess.CompletedProcess, tail: int = 3000) -> str:
    """A failed job's stderr for a message: each rank's crash report first (faulthandler's "Fatal
    Python error", the lines before it where C++ says why it aborted, and the Python stack under
    it, which torchrun's own traceback pushes out of the tail), then the tail."""
    lines = r.stderr.splitlines()
    reports = ["\n".join(lines[max(0, i - 6):i + 30]) for i, line in enumerate(lines) if "Fatal Python error" in line]
    return "\n...\n".join([*reports[:4], r.stderr[-tail:] if tail else ""])


def run_worker(n: int, cases: list, tmp: Path, *extra) -> dict:
    (tmp / "cases.json").write_text(json.dumps(cases))
    r = torchrun(n, "-m", "tests.tp_worker", "--cases", tmp / "cases.json", "--out", tmp / "result.pt", *extra)
    assert r.returncode == 0, job_log(r)
    return torch.load(tmp / "result.pt", weights_only=True)


def quantized(ckpt: Path, mode="int8", *extra) -> Path:
    out = ckpt.with_name(f"{ckpt.name}-{mode}")
    r = subprocess.run([sys.executable, "quantize.py", "--checkpoint", ckpt, "--mode", mode, "--out", out, *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def tiny_models(tmp: Path) -> dict:
    """name -> checkpoint: GQA Llama with q/k/v biases and a tied head, Gemma 3 with one KV head
    (replicated on both ranks) and a sliding window shorter than the prompts, and a Llama with 3
    KV heads that 2 ranks split unevenly (2 + 1 query groups), like SmolLM2."""
    models = {
        "llama": random_model(seed=1, n_heads=4, n_kv_heads=2, attention_bias=True, tie_word_embeddings=True),
        "gemma": tiny_gemma3(seed=2, n_heads=4, n_kv_heads=1),
        "uneven": random_model(seed=3, n_heads=6, n_kv_heads=3, head_dim=16, intermediate_size=96),
    }
    return {name: save_checkpoint(m, tmp / name) for name, m in models.items()}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """One 2-rank job over every tiny case; returns (cases, results)."""
    tmp = tmp_path_factory.mktemp("tp2")
    ckpts = tiny_models(tmp)
    ckpts.update({f"{name}-int8": quantized(ckpts[name]) for name in ("llama", "gemma")})
    # int4 groups of 32: the uneven model's 2 + 1 query groups and 3 hidden groups split at group boundaries
    ckpts.update({f"{name}-int4": quantized(ckpts[name], "int4", "--groupsize", "32")
                  for name in ("llama", "uneven")})
    # the default mode: allreduce for float, exact for quantized (through kernels.py's loops)
    cases = [dict(name=f"{name}-b{len(prompts)}", checkpoint=str(ckpt), prompts=prompts, steps=STEPS)
             for name, ckpt in ckpts.items() for prompts in (PROMPTS_B1, PROMPTS_B2)]
    # the other mode: float in exact mode; quantized in allreduce mode with float activations
    # (see tp_worker.py), and once through the int8-activation loops, whose tokens may part
    cases += [dict(name=f"{name}-exact", checkpoint=str(ckpts[name]), prompts=PROMPTS_B2, steps=STEPS,
                   tp_mode="exact") for name in ("llama", "gemma", "uneven")]
    cases += [dict(name=f"{name}-allreduce", checkpoint=str(ckpts[name]), prompts=PROMPTS_B2, steps=STEPS,
                   tp_mode="allreduce", float_activations=True) for name in ("llama-int8", "uneven-int4")]
    cases.append(dict(name="llama-int4-kernels-allreduce", checkpoint=str(ckpts["llama-int4"]), prompts=PROMPTS_B2,
                      steps=STEPS, tp_mode="allreduce"))
    cases.append(dict(name="llama-compiled", checkpoint=str(ckpts["llama"]), prompts=PROMPTS_B1, steps=STEPS,
                      compile=True))
    cases.append(dict(name="llama-compiled-aside", checkpoint=str(ckpts["llama"]), prompts=PROMPTS_B2, steps=STEPS,
                      compile="aside"))
    # the target and its draft both sharded
    draft = save_checkpoint(random_model(seed=5, n_heads=4, n_kv_heads=2, n_layers=1), tmp / "draft")
    cases += [dict(name="uneven-draft", checkpoint=str(ckpts["uneven"]), draft=str(draft), prompts=PROMPTS_B1,
                   steps=12, speculate_k=3),
              dict(name="llama-ngram", checkpoint=str(ckpts["llama"]), ngram=2, prompts=[PROMPTS_B1[0] * 3],
                   steps=12, speculate_k=4)]
    return {c["name"]: c for c in cases}, run_worker(2, cases, tmp)


def assert_matches_single_process(case: dict, result: dict, atol: float = 0.0, tokens: bool = True):
    """Greedy tokens equal and logits within atol (0: the same bits) of one process's."""
    with kernels.switched_off() if case.get("float_activations") else contextlib.nullcontext():
        ref = run_case(load_model(case["checkpoint"]), case["prompts"], case["steps"])
    if tokens:
        assert torch.equal(result["tokens"], ref["tokens"]), f"{case['name']}: greedy tokens differ"
    assert len(result["logits"]) == len(ref["logits"])
    for step, (a, b) in enumerate(zip(result["logits"], ref["logits"])):
        assert b.std() > 0.5  # not a degenerate model
        diff = (a - b).abs().max().item()
        assert diff <= atol, f"{case['name']}: logits of step {step} differ by {diff:.2e}"


@pytest.mark.parametrize("name", ["llama", "gemma", "uneven"])
@pytest.mark.parametrize("batch", [1, 2])
def test_tp2_matches_single_process(tp2, name, batch):
    """Float: BLAS's order of additions may depend on a matrix's shape, so logits agree to 1e-4."""
    cases, results = tp2
    key = f"{name}-b{batch}"
    assert_matches_single_process(cases[key], results[key], atol=1e-4)


@pytest.mark.parametrize("name", ["llama", "gemma", "uneven"])
def test_tp2_float_in_exact_mode_matches_single_process(tp2, name):
    cases, results = tp2
    assert_matches_single_process(cases[f"{name}-exact"], results[f"{name}-exact"], atol=1e-4)


@pytest.mark.parametrize("name", ["llama-int8", "gemma-int8", "llama-int4", "uneven-int4"])
@pytest.mark.parametrize("batch", [1, 2])
def test_tp2_quantized_gives_single_process_bits(tp2, name, batch):
    """Through kernels.py's loops, which round activations to int8: exact mode adds every sum
    in one process's order, so not even a rounding step differs."""
    cases, results = tp2
    key = f"{name}-b{batch}"
    assert_matches_single_process(cases[key], results[key])


@pytest.mark.parametrize("name", ["llama-int8", "uneven-int4"])
def test_tp2_allreduce_mode_matches_single_process(tp2, name):
    cases, results = tp2
    assert_matches_single_process(cases[f"{name}-allreduce"], results[f"{name}-allreduce"], atol=1e-4)


def test_tp2_allreduce_mode_with_int8_activations_is_only_close(tp2):
    """kernels.py rounds activations to int8: a partial sum that the all-reduce adds in another
    order can round an element a step differently, and the greedy tokens may part from there
    (why exact is the default for quantized checkpoints). Until they part, the sharded logits stay
    closer to one process's than that process's own int8 rounding takes them from float activations."""
    cases, results = tp2
    case, result = cases["llama-int4-kernels-allreduce"], results["llama-int4-kernels-allreduce"]
    ref = run_case(load_model(case["checkpoint"]), case["prompts"], case["steps"])
    with kernels.switched_off():  # from the load on: the model takes its products' paths then
        float_acts = run_case(load_model(case["checkpoint"]), case["prompts"], 1)
    # the first decode step (the prompts are too many tokens for the int8 loops), on the same inputs
    assert torch.equal(float_acts["tokens"][:, 0], ref["tokens"][:, 0])
    rounding = (ref["logits"][1] - float_acts["logits"][1]).abs().max().item()
    assert rounding > 0.05  # the int8 activations move this model's logits
    for step, (a, b) in enumerate(zip(result["logits"], ref["logits"])):
        diff = (a - b).abs().max().item()
        assert diff <= rounding, f"logits of step {step} differ by {diff:.2e}, more than rounding's {rounding:.2e}"
        if not torch.equal(result["tokens"][:, step], ref["tokens"][:, step]):
            break  # the next step's inputs differ


def test_tp2_compiled_decode_matches_single_process(tp2):
    """engine.Engine's compiled decode step traces the collectives (fullgraph: no graph break)."""
    cases, results = tp2
    case = cases["llama-compiled"]
    ref = run_case(load_model(case["checkpoint"]), case["prompts"], case["steps"])
    assert results["llama-compiled"]["tokens"].tolist() == ref["tokens"].tolist()


def test_tp2_compiles_aside_then_takes_the_graphs_up_on_every_rank_at_once(tp2):
    """generate.py's default under torchrun: the ranks step eagerly while a thread on each compiles
    the step without running it (its collectives would interleave with the stepping thread's); they
    agree to take the graphs up at the same step, and the compiled run recompiles nothing."""
    cases, results = tp2
    case, result = cases["llama-compiled-aside"], results["llama-compiled-aside"]
    ref = run_case(load_model(case["checkpoint"]), case["prompts"], case["steps"])
    assert result["eager"].tolist() == result["tokens"].tolist() == ref["tokens"].tolist()
    eager, compiled = result["eager_steps"]
    assert eager > 0 and compiled == 0


@pytest.mark.parametrize("name", ["uneven-draft", "llama-ngram"])
def test_tp2_speculative_greedy_is_token_identical(tp2, name):
    """Speculative decoding on sharded models (a sharded draft, or n-gram proposals) gives the
    single process's plain greedy tokens."""
    cases, results = tp2
    case = cases[name]
    ref = run_case(load_model(case["checkpoint"]), case["prompts"], case["steps"])
    assert results[name]["tokens"].tolist() == ref["tokens"].tolist()


def test_no_process_group_thread_outlives_close(tp2):
    """tp.close(), which runs at exit, must stop the process group's threads while Python is
    alive, even with the sharded models and compiled steps still around: a gloo worker left
    running into interpreter finalization can abort the rank (see tp.close)."""
    _, results = tp2
    threads = results["gloo_threads"]
    assert threads["before_close"] and threads["after_close"] == [], threads


def test_tp2_heads_and_bytes_per_rank(tp2):
    """Each rank holds half of every sharded weight (the replicated rest whole); the uneven split
    gives rank 0 two of the three query groups and splits the feed-forward evenly."""
    cases, results = tp2
    sharded, replicated = sharded_bytes(load_model(cases["llama-b1"]["checkpoint"]))
    assert results["llama-b1"]["bytes"] == [(sharded // 2, replicated)] * 2
    assert results["llama-b1"]["n_heads"][0][0] == (2, 1)
    assert results["gemma-b1"]["n_heads"][1][0] == (2, 1)  # the one KV head replicated, 2 query heads each
    assert results["uneven-b1"]["n_heads"][0][0] == (4, 2) and results["uneven-b1"]["n_heads"][1][0] == (2, 1)
    sharded, replicated = sharded_bytes(load_model(cases["uneven-b1"]["checkpoint"]))
    assert sum(s for s, _ in results["uneven-b1"]["bytes"]) == sharded
    # the int8 shards are int8 (about a quarter of float32's bytes), not dequantized
    assert results["llama-int8-b1"]["bytes"][0][0] < 0.3 * results["llama-b1"]["bytes"][0][0]


def test_tp3_smollm2_gives_single_process_bits(smollm2_dir, smollm2_quantized, tmp_path):
    """SmolLM2-135M (9 query heads, 3 KV heads) on 3 ranks: one KV head each, 1/3 of every
    sharded weight per rank, the same tokens and logits as one process (bit for bit for int8 and
    int4), for a batch of 2 prompts."""
    from tokenizer import Tokenizer
    tok = Tokenizer(smollm2_dir)
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):\n   ")]
    cases = [dict(name=name, checkpoint=str(ckpt), prompts=prompts, steps=3)
             for name, ckpt in [("smollm2", smollm2_dir), *smollm2_quantized.items()]]
    results = run_worker(3, cases, tmp_path)
    for case in cases:  # float: allreduce mode, to 1e-4; quantized: exact mode, the same bits
        assert_matches_single_process(case, results[case["name"]], atol=0 if "-int" in case["name"] else 1e-4)
    result = results["smollm2"]
    sharded, replicated = sharded_bytes(load_model(smollm2_dir))
    assert result["bytes"] == [(sharded // 3, replicated)] * 3
    assert result["n_heads"] == [[(3, 1)] * 30] * 3


@pytest.fixture(scope="module")
def smollm2_quantized(smollm2_dir, tmp_path_factory) -> dict:
    """SmolLM2-135M in int8 and int4 (groups of 32), as quantize.py writes them."""
    import quantize
    tmp = tmp_path_factory.mktemp("smollm2-quantized")
    for mode in ("int8", "int4"):
        quantize.main(["--checkpoint", str(smollm2_dir), "--mode", mode, "--out", str(tmp / mode)])
    return {f"smollm2-{mode}": tmp / mode for mode in ("int8", "int4")}


# 3 ranks and int4 in the default suite: test_tp3_smollm2_gives_single_process_bits
@pytest.mark.parametrize("ranks,mode", [(2, "int8"), *[pytest.param(*case, marks=pytest.mark.slow)
                                                     for case in [(3, "int4"), (3, "int8"), (2, "int4"), (3, "float32")]]])
def test_cli_tp_text_is_single_process_text(smollm2_dir, smollm2_quantized, ranks, mode):
    """torchrun + generate.py with an int8 or int4 SmolLM2 (its activations rounded to int8 by
    kernels.py's loops) prints one process's greedy text: tp.py's exact mode. 96 tokens: in
    allreduce mode the int8 text parted from one process's at the 14th, the int4 one at the 2nd.
    (Float on 2 ranks: test_cli_tp2_prints_once_and_matches_single_process.)"""
    ckpt = smollm2_dir if mode == "float32" else smollm2_quantized[f"smollm2-{mode}"]
    flags = ["--checkpoint", ckpt, "--prompt", "The history of the Roman Empire", "--no-compile",
             "--max_new_tokens", 96]
    single = run_script("generate.py", *flags)
    assert single.returncode == 0, single.stderr[-3000:]
    r = torchrun(ranks, "generate.py", *flags)
    assert r.returncode == 0, job_log(r)
    assert r.stdout == single.stdout and len(single.stdout) > 200


@pytest.mark.parametrize("speculate", [[], ["--ngram", "2", "--speculate_k", "3"]], ids=["plain", "ngram"])
def test_cli_tp2_prints_once_and_matches_single_process(smollm2_dir, tmp_path, speculate):
    """torchrun + generate.py on 2 ranks (SmolLM2's 9 heads split 6 + 3): the golden greedy text,
    printed once, and rank 0's metrics with every rank's memory; also in exact mode with
    speculative decoding."""
    golden = json.loads(GOLDEN.read_text())[0]
    metrics = tmp_path / "m.json"
    exact = ["--tp_mode", "exact"] if speculate else []
    r = torchrun(2, "generate.py", "--checkpoint", smollm2_dir, "--prompt", golden["prompt"], "--no-compile",
                 "--max_new_tokens", golden["max_new_tokens"], "--metrics_json", metrics, *speculate, *exact)
    assert r.returncode == 0, job_log(r)
    assert r.stdout == golden["output_text"] + "\n"
    assert r.stderr.count("decode ") == 1  # only rank 0 logs
    (m,) = json.loads(metrics.read_text())
    assert m["tp_world_size"] == 2 and len(m["peak_memory_bytes_per_rank"]) == 2
    if not exact:  # 2 per layer, 1 for the vocabulary-split embedding; the logits gathered once
        assert m["tp_mode"] == "allreduce"
        assert m["all_reduces_per_step"] == 61 and m["all_reduce_bytes_per_step"] == 61 * 576 * 4
        assert m["all_gathers_per_step"] == 1 and m["all_gather_bytes_per_step"] == 49152 * 4
    else:  # per layer, the heads' outputs (6 + 3 heads of 64, each part padded to 384) gathered for
        # wo, wo's 288 + 288 output features, the 768 + 768 hidden features for w2 and its output;
        # the logits; one all-reduce, for the vocabulary-split embedding
        assert m["tp_mode"] == "exact"
        assert m["all_reduces_per_step"] == 1 and m["all_reduce_bytes_per_step"] == 576 * 4
        assert m["all_gathers_per_step"] == 4 * 30 + 1
        assert m["all_gather_bytes_per_step"] == (30 * (768 + 576 + 1536 + 576) + 49152) * 4


def bad_checkpoint(folder, tokenizer_from):
    """A small model whose layers.1.feed_forward.w1.weight lacks a row."""
    from safetensors.torch import load_file, save_file
    model = random_model(seed=4, vocab_size=49152, dim=32, intermediate_size=64)
    ckpt = save_checkpoint(model, folder, tokenizer_from=tokenizer_from)
    state = load_file(ckpt / "model.safetensors")
    state["layers.1.feed_forward.w1.weight"] = state["layers.1.feed_forward.w1.weight"][:-1].contiguous()
    save_file(state, ckpt / "model.safetensors")
    return ckpt


def test_cli_tp2_bad_checkpoint_ends_the_job_with_one_message(smollm2_dir, tmp_path):
    ckpt = bad_checkpoint(tmp_path / "bad", smollm2_dir)
    r = torchrun(2, "generate.py", "--checkpoint", ckpt, "--prompt", "Hi", "--no-compile", "--max_new_tokens", 4,
                 timeout=120)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: rank 0 (and 1 more rank): layers.1.feed_forward.w1.weight has shape (63, 32) "
                      "in the checkpoint, config.json implies (64, 32)"], r.stderr[-3000:]


@pytest.mark.parametrize("how", ["fail_rank", "crash_rank", "abort_rank"])
def test_a_failing_rank_ends_the_job(tmp_path, how):
    """fail_rank: rank 1 raises MemoryError while loading: all ranks stop, rank 0 says why.
    crash_rank: rank 1 dies without a word after loading, rank 0 waits in an all-reduce:
    torchrun ends the job. abort_rank: rank 1 crashes below Python, and its stderr names the
    Python line it was on. All within seconds, with a non-zero status."""
    ckpt = save_checkpoint(random_model(), tmp_path / "m")
    (tmp_path / "cases.json").write_text(json.dumps([dict(name="m", checkpoint=str(ckpt), prompts=PROMPTS_B1,
                                                          steps=2)]))
    t0 = time.monotonic()
    r = torchrun(2, "-m", "tests.tp_worker", "--cases", tmp_path / "cases.json", "--out", tmp_path / "r.pt",
                 f"--{how}", 1, timeout=120, retry=False)
    assert r.returncode != 0 and time.monotonic() - t0 < 90
    if how == "fail_rank":
        assert "TPError: rank 1: MemoryError: cannot allocate the shard (injected)" in r.stderr, r.stderr[-3000:]
    elif how == "crash_rank":
        assert "exitcode  : 3" in r.stderr, r.stderr[-3000:]
    else:
        report = job_log(r, tail=0)  # the crash report as a failed test shows it
        assert "Fatal Python error: Aborted" in report and 'tp_worker.py", line' in report, r.stderr[-3000:]


# ---------------------------------------------------------------- the plan itself, in one process

def test_head_split():
    # SmolLM2: 9 query heads, 3 KV heads
    assert [head_split(9, 3, 3, r) for r in range(3)] == [(0, 3, 0, 1), (3, 3, 1, 1), (6, 3, 2, 1)]
    assert [head_split(9, 3, 2, r) for r in range(2)] == [(0, 6, 0, 2), (6, 3, 2, 1)]  # whole query groups
    # multi-query (Gemma 3 270M: 4 query heads, 1 KV head): the KV head on every rank
    assert [head_split(4, 1, 2, r) for r in range(2)] == [(0, 2, 0, 1), (2, 2, 0, 1)]
    assert [head_split(8, 2, 4, r) for r in range(4)] == [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]
    with pytest.raises(TPError, match="cannot split 4 query heads and 2 KV heads over 3 ranks"):
        head_split(4, 2, 3, 0)
    with pytest.raises(TPError, match="cannot split 9 query heads and 3 KV heads over 6 ranks"):
        head_split(9, 3, 6, 0)


def write_int4_layer(path: Path, out_f: int, in_f: int, group: int, padded_in: int = None):
    """A quantize.py-style int4 row-wise layer on disk: packed weight (out, in/2), group-wise scales and zeros."""
    from safetensors.torch import save_file
    padded_in = padded_in or in_f
    g = torch.Generator().manual_seed(0)
    t = {"layers.0.feed_forward.w2.weight": torch.randint(0, 255, (out_f, padded_in // 2), generator=g,
                                                          dtype=torch.uint8),
         "layers.0.feed_forward.w2.scales": torch.rand(out_f, padded_in // group, generator=g),
         "layers.0.feed_forward.w2.zeros": torch.rand(out_f, padded_in // group, generator=g)}
    save_file(t, path)
    return t


def int4_meta_model(intermediate_size: int, group: int):
    """A meta-device model with qlayers.py's int4 layers, as load_model builds it before sharding."""
    import qlayers
    from model import ModelArgs, Transformer
    args = ModelArgs(vocab_size=16, dim=32, n_layers=1, n_heads=6, head_dim=32, intermediate_size=intermediate_size,
                     quantization={"mode": "int4", "groupsize": group})
    with torch.device("meta"):
        model = Transformer(args)
    qlayers.use_quantized_layers(model, args.quantization)
    return model


@pytest.mark.parametrize("world", [2, 3])
def test_int4_rowwise_split_falls_on_group_boundaries(tmp_path, world):
    """Each rank's packed weight, scales and zeros of w2 are its columns of whole groups, and the
    ranks' parts put together are the whole tensors."""
    from safetensors import safe_open
    full = write_int4_layer(tmp_path / "w.safetensors", 32, 192, 32)
    parts = {name: [] for name in full}
    for rank in range(world):
        tp = TensorParallel(rank, world, group_name="unused", mode="allreduce")  # no process group needed to read
        model = int4_meta_model(192, 32)
        tp.shard_modules(model)
        local = model.state_dict()
        with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
            for name in full:
                parts[name].append(tp.read(f, name))
                assert parts[name][-1].shape == local[name].shape
    for name, t in full.items():
        assert torch.equal(torch.cat(parts[name], dim=1), t)
    n_groups = 192 // 32  # 6 groups: 3 + 3 or 2 + 2 + 2
    assert [p.shape[1] for p in parts["layers.0.feed_forward.w2.scales"]] == [n_groups // world] * world
    assert [p.shape[1] for p in parts["layers.0.feed_forward.w2.weight"]] == [96 // world] * world


def test_int4_padded_input_features_are_refused_by_allreduce_mode_only():
    with pytest.raises(TPError, match="feed_forward.w2: its 80 input features are padded to groups of 32"):
        TensorParallel(0, 2, group_name="unused", mode="allreduce").shard_modules(int4_meta_model(80, 32))
    # exact mode (a quantized model's default) keeps w2's input features whole and splits its rows
    model = int4_meta_model(80, 32)
    TensorParallel(1, 2, group_name="unused").shard_modules(model)
    w2 = model.layers[0].feed_forward.w2
    assert w2.weight.shape == (16, 48) and w2.scales.shape == (16, 3)  # rows 16..31 of (32, 96 / 2)


def test_plan_names_existing_modules():
    """A renamed layer in model.py would silently be replicated: the plan must match real names."""
    model = random_model()
    names = {n for n, _ in model.named_modules()}
    for suffix in PLAN:
        assert suffix in names or f"layers.0.{suffix}" in names, suffix


def test_rowwise_bias_is_added_once(tmp_path):
    """No supported architecture has a bias on wo or w2, but a checkpoint that had one would get
    it from rank 0 only, so that the all-reduce adds it once; 1-D scales of a row-wise layer are
    replicated."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    bias, scales = torch.randn(64), torch.rand(64)
    save_file({"layers.0.attention.wo.bias": bias, "layers.0.feed_forward.w2.scales": scales}, tmp_path / "b.safetensors")
    for rank in range(2):
        tp = TensorParallel(rank, 2, group_name="unused", mode="allreduce")
        with torch.device("meta"):
            tp.shard_modules(random_model().to("meta"))
        with safe_open(tmp_path / "b.safetensors", framework="pt") as f:
            assert torch.equal(tp.read(f, "layers.0.attention.wo.bias"), bias if rank == 0 else torch.zeros(64))
            assert torch.equal(tp.read(f, "layers.0.feed_forward.w2.scales"), scales)
