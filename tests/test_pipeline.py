"""Pipeline parallelism (pipeline.py) on CPU with gloo: generate.py --pp under torchrun against one
process, on SmolLM2-135M (30 layers, a tied head), float32 and int8; the stage split itself is
checked in one process.

Run: python -m pytest -q tests/test_pipeline.py
"""
import copy
import json

import pytest
import torch

import checkpoint
from conftest import ROOT, run_script
from loading import meta_model
from memory import weight_bytes
from pipeline import Stage, StageFile
from test_tp import bad_checkpoint, job_log, torchrun

FLAGS = ["--prompt", "The capital of France is", "--max_new_tokens", 16]


def single_process_text(ckpt, *extra) -> str:
    flags = FLAGS if "--prompt" not in extra else FLAGS[2:]
    r = run_script("generate.py", "--checkpoint", ckpt, *flags, "--no-compile", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(r.stdout) > 20
    return r.stdout


def stage(index: int, stages: int = 2) -> Stage:
    return Stage(index, stages, 0, 1, "tp", None, None, "pipe")


def test_stages_hold_their_layers_and_the_ends(smollm2_dir):
    """30 layers in 3 stages: 10 each, the embedding on the first, the norm on every one (its
    weight gives the dtype), the tied head (the embedding's table) on the last; each stage's
    checkpoint view names exactly what its model loads, its layers numbered from 0."""
    config = checkpoint.read_config(smollm2_dir)
    from safetensors import safe_open
    with safe_open(smollm2_dir / "model.safetensors", framework="pt") as f:
        for index in range(3):
            model, s = meta_model(config), stage(index, 3)
            s.shard_modules(model)
            assert len(model.layers) == 10 and s.first_layer == 10 * index
            held = {name for name, m in model.named_children() if m is not None}
            assert ("tok_embeddings" in held) == (index in (0, 2)) and ("output" in held) == (index == 2)
            assert model.args.tie_word_embeddings == (index == 2)
            view = StageFile(f, s, held)
            assert set(view.keys()) == set(checkpoint.expected_shapes(model))
            assert view.names["layers.0.attention.wqkv.weight"] == f"layers.{10 * index}.attention.wqkv.weight"


def test_too_many_stages_are_refused(smollm2_dir):
    config = checkpoint.read_config(smollm2_dir)
    with pytest.raises(Exception, match="only 30 layers"):
        stage(0, 31).shard_modules(meta_model(config))


@pytest.mark.parametrize("ckpt", ["float32", "int8"])
def test_pp2_text_is_single_process_text(smollm2_dir, tmp_path, ckpt, request):
    """Two stages of 15 layers print one process's greedy text, once; each rank holds its layers and
    its end of the model: the two together hold the whole model and the tied table once more."""
    path = smollm2_dir if ckpt == "float32" else request.getfixturevalue("int8_dir")
    metrics = tmp_path / "m.json"
    r = torchrun(2, "generate.py", "--checkpoint", path, *FLAGS, "--no-compile", "--pp", 2,
                 "--metrics_json", metrics, timeout=300)
    assert r.returncode == 0, job_log(r)
    assert r.stdout == single_process_text(path)
    assert r.stderr.count("decode ") == 1  # only rank 0 logs
    (m,) = json.loads(metrics.read_text())
    assert m["pp_stages"] == 2 and m["layers_per_rank"] == [15, 15]
    if ckpt == "float32":
        config = checkpoint.read_config(smollm2_dir)
        whole, table = weight_bytes(meta_model(config), torch.float32), config.vocab_size * config.dim * 4
        norm = config.dim * 4  # every stage keeps the final norm's weight
        assert sum(m["weight_bytes_per_rank"]) == whole + table + norm
        for held in m["weight_bytes_per_rank"]:
            assert abs(held - (whole + table) / 2) < 0.01 * whole


def test_pp2_compiled_text_is_single_process_text(smollm2_dir):
    """The default compiled step, its exchanges traced into the graph: one process's text."""
    r = torchrun(2, "generate.py", "--checkpoint", smollm2_dir, *FLAGS, "--pp", 2, "--wait_for_compile", timeout=300)
    assert r.returncode == 0, job_log(r)
    assert r.stdout == single_process_text(smollm2_dir)


def test_tp2_pp2_text_is_single_process_text(int8_dir, tmp_path):
    """4 ranks: 2 stages, each split over its own 2 tensor-parallel ranks."""
    metrics = tmp_path / "m.json"
    r = torchrun(4, "generate.py", "--checkpoint", int8_dir, *FLAGS, "--no-compile", "--pp", 2,
                 "--metrics_json", metrics, timeout=300)
    assert r.returncode == 0, job_log(r)
    assert r.stdout == single_process_text(int8_dir)
    (m,) = json.loads(metrics.read_text())
    assert m["tp_world_size"] == 2 and m["pp_stages"] == 2 and len(m["weight_bytes_per_rank"]) == 4


def test_inconsistent_sizes_are_refused_in_one_line(smollm2_dir):
    r = torchrun(2, "generate.py", "--checkpoint", smollm2_dir, "--pp", 3, "--no-compile", timeout=120)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: --pp 3 does not divide the 2 ranks torchrun started (world = tp x pp)"], r.stderr[-3000:]
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--pp", 2, "--no-compile")
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("error: --pp 2 runs under torchrun")


def test_pp2_serves_generate_text(smollm2_dir):
    """serve.py --pp 2: rank 0 serves, rank 1 follows its plans (received on a thread as they come);
    four requests at once, decoded in two groups whose steps are in the stages at once, get
    generate.py's greedy texts."""
    import concurrent.futures
    import os
    import signal
    import sys

    import openai
    from test_serve import API_KEY, rank0_pid, start_server

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The best way to learn is"]
    want = [single_process_text(smollm2_dir, "--prompt", p)[:-1] for p in prompts]
    proc, url = start_server(smollm2_dir, "--max_batch_size", 4, "--max_seq_length", 256, "--no-compile", "--pp", 2,
                             launcher=[sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       "--nproc_per_node=2"])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

        def complete(p):
            return client.completions.create(model="smollm2-135m", prompt=p, max_tokens=16, temperature=0).choices[0].text
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, prompts)) == want
    finally:  # torchrun treats a SIGTERM of its own as a failure: stop rank 0, the others follow it
        os.kill(rank0_pid(proc.pid), signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_pp2_bad_weight_ends_the_job_with_one_message(smollm2_dir, tmp_path):
    """A weight of the second stage's layers of the wrong shape: every rank stops, rank 0 names the
    tensor as the checkpoint does."""
    ckpt = bad_checkpoint(tmp_path / "bad", smollm2_dir)
    r = torchrun(2, "generate.py", "--checkpoint", ckpt, "--prompt", "Hi", "--no-compile", "--max_new_tokens", 4,
                 "--pp", 2, timeout=120)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: rank 1: layers.1.feed_forward.w1.weight has shape (63, 32) "
                      "in the checkpoint, config.json implies (64, 32)"], r.stderr[-3000:]


def test_pp2_batch_in_microbatches_is_single_process_text(smollm2_dir):
    """Four prompts of over 200 tokens at once go in two micro-batches of two rows, which the stages
    run at the same time (the second stage the first part while the first stage the second)."""
    text = (ROOT / "data" / "hamlet.txt").read_text()
    prompts = [arg for i in range(4) for arg in ("--prompt", text[1000 * i:1000 * i + 700])]
    r = torchrun(2, "generate.py", "--checkpoint", smollm2_dir, *prompts, "--max_new_tokens", 8, "--no-compile",
                 "--pp", 2, "--microbatches", 2, timeout=300)
    assert r.returncode == 0, job_log(r)
    assert r.stdout == single_process_text(smollm2_dir, *prompts, "--max_new_tokens", 8) and r.stdout.count("--- row") == 4


def test_microbatches_have_two_rows_and_enough_tokens_at_least():
    s = stage(0)
    s.microbatches = 4
    assert s.parts(1, 300, True) == [(0, 1)] and s.parts(3, 300, True) == [(0, 3)]
    assert s.parts(5, 300, True) == [(0, 3), (3, 2)] and s.parts(9, 300, False) == [(0, 3), (3, 2), (5, 2), (7, 2)]
    assert s.parts(64, 1, False) == [(0, 64)]  # a decode step: one part
    assert s.parts(9, 300, True) == [(0, 9)]  # the last layer's 9 tokens past 8, parts of 2 to 4 not
    assert s.parts(32, 129, True) == [(0, 32)]  # parts of 8 rows would take their last layer's 8 tokens elsewhere


def test_decoding_groups_have_two_rows_and_keep_the_kernel_path():
    """Groups of a step's rows, where a product changes path at 16 tokens (float32's oneDNN)."""
    s = stage(0)
    s.groups = 2
    assert [s.group_rows(n, (16,)) for n in (1, 2, 3)] == [1, 2, 3]  # a group of one row: not split
    assert [s.group_rows(n, (16,)) for n in (4, 7, 8, 15)] == [2, 4, 4, 8]
    assert s.group_rows(16, (16,)) == 16 and s.group_rows(40, (16,)) == 20  # 16 rows: another path than 8
    assert s.group_rows(8, (8,)) == 8  # bfloat16's oneDNN from 8 tokens
    s.groups = 3
    assert s.group_rows(7, (16,)) == 4 and s.group_rows(9, (16,)) == 3  # 3 + 3 + 1 would leave a row alone


def test_decoding_groups_step_in_flight_and_give_lockstep_tokens():
    """The engine's side of decoding groups, in one process: a model that decodes in two groups (as a
    pipeline stage says) runs one group's step while the other's is in flight, and every request
    gets the greedy tokens of an engine that steps them all at once."""
    from conftest import random_model
    from engine import Engine
    from sampling import Sampling

    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11], [12, 13, 14]]
    model = random_model(seed=3)
    want, _ = Engine(copy.deepcopy(model), len(prompts), 64).generate(prompts, 8, Sampling())
    model.groups, model.group_rows = 2, lambda running: -(-running // 2) if running >= 4 else running
    model.share = lambda out, wait: out  # one process: every stage's result is already its own
    engine, flying = Engine(model, len(prompts), 64), []
    step = engine.step
    engine.step = lambda: (step(), flying.append([len(p.requests) for p, *_ in engine.flights]))[0]
    got, stats = engine.generate(prompts, 8, Sampling())
    assert got == want
    assert [3, 2] in flying and [2, 3] in flying  # a step of each group in flight at once
    assert len(stats.token_times) == 8  # a time a round: the first token, then 7 rounds of both groups


# int8 under decoding groups in make test-slow: the default suite's pp int8 tests run lockstep
@pytest.mark.parametrize("ckpt", ["float32", pytest.param("int8", marks=pytest.mark.slow)])
def test_pp2_decoding_groups_text_is_single_process_text(smollm2_dir, ckpt, request):
    """Four prompts decoded in two groups of two (--pp_groups defaults to the stages): each stage runs
    one group's step while the other runs the other's, and every row prints one process's text."""
    path = smollm2_dir if ckpt == "float32" else request.getfixturevalue("int8_dir")
    prompts = [arg for p in ("The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,")
               for arg in ("--prompt", p)]
    flags = [*prompts, "--max_new_tokens", 12, "--ignore_eos"]
    r = torchrun(2, "generate.py", "--checkpoint", path, *flags, "--no-compile", "--pp", 2, timeout=300)
    assert r.returncode == 0, job_log(r)
    assert r.stdout == single_process_text(path, *flags) and r.stdout.count("--- row") == 4


def test_pp3_untied_model_text_is_single_process_text(smollm2_dir, tmp_path):
    """Three stages of one layer each: a middle stage holds neither end, and an untied head lives on
    the last stage alone."""
    from conftest import random_model, save_checkpoint
    model = random_model(seed=5, vocab_size=49152, dim=32, intermediate_size=64, n_layers=3)
    assert not model.args.tie_word_embeddings
    ckpt = save_checkpoint(model, tmp_path / "untied", tokenizer_from=smollm2_dir)
    r = torchrun(3, "generate.py", "--checkpoint", ckpt, *FLAGS, "--no-compile", "--pp", 3, timeout=300)
    assert r.returncode == 0, job_log(r)
    assert r.stdout == single_process_text(ckpt)
