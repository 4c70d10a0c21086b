"""serve.py: a real server process on 127.0.0.1, driven by the official `openai` client: the same
text as generate.py, continuous batching that changes no request's text, the prefix cache, stop
strings, n, usage, /v1/models, /metrics, every bad input's error, disconnects, and SIGTERM."""
import concurrent.futures
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from conftest import ROOT, device_flags, needs_devices, run_script

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "List three colors:", "Once upon a time, in a small village,", "2 + 2 ="]
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(checkpoint, *extra, env=None, launcher=()):
    port = free_port()
    cmd = [*launcher] if launcher else [sys.executable]
    cmd += ["serve.py", "--checkpoint", str(checkpoint), "--port", str(port), "--api_key", API_KEY, *map(str, extra)]
    cmd += device_flags(cmd)
    log = open(ROOT / f".pytest_cache/serve-{port}.log", "w") if (ROOT / ".pytest_cache").exists() else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode} (log in .pytest_cache/serve-{port}.log)")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise AssertionError("the server did not start")


def stop_server(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.fixture(scope="module")
def server(smollm2_dir):
    # regional: a fraction of the compile (a whole-step graph is what test_batching.py compiles)
    proc, url = start_server(smollm2_dir, "--max_batch_size", 16, "--max_seq_length", 1024, "--max_waiting", 8,
                             "--compile_mode", "regional")
    yield url
    assert stop_server(proc) == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """generate.py's greedy text for PROMPTS[:2], plain and with --chat: 24 new tokens (eager: the
    compiled step gives the same float32 text, tests/test_generate.py, and compiling costs minutes)."""
    out = {}
    for chat in (False, True):
        for p in PROMPTS[:2]:
            r = run_script("generate.py", "--checkpoint", smollm2_dir, "--prompt", p, "--max_new_tokens", 24,
                           "--dtype", "float32", "--device", "cpu", "--no-compile", *(["--chat"] if chat else []))
            assert r.returncode == 0, r.stderr
            out[chat, p] = r.stdout[:-1]  # the trailing newline generate.py prints
    return out


def metrics(url) -> dict:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r"^(minillm_\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def test_same_text_as_generate(client, reference):
    for p in PROMPTS[:2]:
        r = client.completions.create(model="smollm2-135m", prompt=p, max_tokens=24, temperature=0)
        assert r.choices[0].text == reference[False, p]
        assert r.usage.completion_tokens <= 24 and r.choices[0].finish_reason in ("stop", "length")
        pieces = list(client.completions.create(model="smollm2-135m", prompt=p, max_tokens=24, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in pieces) == reference[False, p]
        assert pieces[0].choices[0].text  # the first chunk carries the first token
        fingerprints = {r.system_fingerprint, *(c.system_fingerprint for c in pieces)}
        chat = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": p}],
                                              max_tokens=24, temperature=0)
        assert chat.choices[0].message.content == reference[True, p]
        chunks = list(client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": p}], max_completion_tokens=24,
            temperature=0, stream=True, stream_options={"include_usage": True}))
        # as OpenAI: the role alone first, then the text without it
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
        assert chunks[1].choices[0].delta.content and all(c.choices[0].delta.role is None for c in chunks[1:-1])
        fingerprints |= {chat.system_fingerprint, *(c.system_fingerprint for c in chunks)}
        assert len(fingerprints) == 1 and re.fullmatch(r"fp_[0-9a-f]{10}", fingerprints.pop())
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference[True, p]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
        assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.slow  # (two minutes of compiling: make test-slow)
def test_serves_while_compiling(smollm2_dir, reference):
    """The default on CPU: /health answers before the step is compiled (a cold compile takes
    minutes), the eager step serves generate.py's text meanwhile, and the compiled one takes over."""
    start = time.perf_counter()
    proc, url = start_server(smollm2_dir, "--max_seq_length", 256, "--compile_mode", "regional")
    try:
        assert time.perf_counter() - start < 60
        assert metrics(url)["minillm_step_compiling"] == 1  # the compile thread is still running
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

        def text():
            return client.completions.create(model="smollm2-135m", prompt=PROMPTS[0], max_tokens=24, temperature=0).choices[0].text
        assert text() == reference[False, PROMPTS[0]]
        deadline = time.time() + 900
        while metrics(url)["minillm_step_compiling"] == 1 and time.time() < deadline:
            time.sleep(2)
        assert metrics(url)["minillm_step_compiling"] == 0
        assert text() == reference[False, PROMPTS[0]]
    finally:
        assert stop_server(proc) == 0


def test_concurrent_requests_as_alone(client, server):
    """16 requests of different lengths at once and while others run: each greedy text equals its
    solo run; seeded sampled requests are reproducible."""
    jobs = [(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), 8 + 3 * i) for i in range(16)]

    def one(job, seed=None):
        prompt, n = job
        kw = dict(temperature=0.9, top_p=0.95, seed=seed) if seed is not None else dict(temperature=0)
        return client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=n, **kw).choices[0].text

    solo = [one(j) for j in jobs[:6]] + [None] * 10
    sampled_solo = one(jobs[1], seed=7)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = []
        for i, job in enumerate(jobs):
            futures.append(pool.submit(one, job))
            if i % 4 == 3:
                time.sleep(0.3)  # later ones join while earlier ones are mid-generation
        sampled = pool.submit(one, jobs[1], 7)
        together = [f.result() for f in futures]
        assert sampled.result() == sampled_solo
    for i in range(6, 16):
        solo[i] = one(jobs[i])
    assert together == solo
    assert metrics(server)["minillm_requests_waiting"] == 0


def test_prefix_reuse_and_multi_turn(client):
    """The prefix cache is block-granular: a repeated prompt finds every full block but the one
    holding its last token (fed again for its logits); the next turn of a conversation finds the
    blocks of the turns before it."""
    from engine import BLOCK_SIZE
    messages = [{"role": "system", "content": "You are a terse assistant. " * 20},
                {"role": "user", "content": "Name a fruit."}]
    first = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=12, temperature=0)
    again = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=12, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    cached, prompt = again.usage.prompt_tokens_details.cached_tokens, again.usage.prompt_tokens
    assert cached % BLOCK_SIZE == 0 and prompt - BLOCK_SIZE <= cached < prompt, (cached, prompt)
    turn = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "user", "content": "And a vegetable?"}]
    second = client.chat.completions.create(model="smollm2-135m", messages=turn, max_tokens=12, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % BLOCK_SIZE == 0 and cached > first.usage.prompt_tokens - BLOCK_SIZE  # only the new turn is prefilled
    assert second.usage.prompt_tokens - cached < 30 + BLOCK_SIZE


def test_stop_n_usage_models_metrics(client, server, reference):
    before = metrics(server)
    text = reference[False, PROMPTS[0]]
    word = text.split()[1]  # a stop string in the middle of the greedy text
    r = client.completions.create(model="smollm2-135m", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                  stop=[word, "zzzz"])
    assert r.choices[0].text == text[:text.index(word)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2-135m", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=word, stream=True))
    assert streamed == r.choices[0].text  # held back: no piece of the stop string leaks
    r = client.completions.create(model="smollm2-135m", prompt=PROMPTS[2], max_tokens=5, n=3, temperature=1, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 15
    assert r.usage.total_tokens == r.usage.prompt_tokens + 15
    r = client.completions.create(model="smollm2-135m", prompt=PROMPTS[3], max_tokens=40, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2-135m"]
    after = metrics(server)
    assert after["minillm_generation_tokens_total"] >= before["minillm_generation_tokens_total"] + 55
    assert after["minillm_time_to_first_token_seconds_count"] > before["minillm_time_to_first_token_seconds_count"]
    assert after["minillm_requests_running"] == 0


def test_prompt_lists_as_alone(client, smollm2_dir):
    """A list `prompt` (strings, token ids, lists of token ids) runs as one batch: choice p * n + j is
    prompt p's j-th, its text that prompt's alone; usage sums over the prompts; streamed chunks too."""
    from tokenizer import Tokenizer

    def complete(prompt, **kw):
        return client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=12, temperature=0, **kw)

    texts = PROMPTS[2:4]
    alone = [complete(p) for p in texts]
    both = complete(texts)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [r.choices[0].text for r in alone]
    assert [c.finish_reason for c in both.choices] == [r.choices[0].finish_reason for r in alone]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(both.usage, key) == sum(getattr(r.usage, key) for r in alone)
    r = complete(texts, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert r.usage.prompt_tokens == both.usage.prompt_tokens  # each prompt counted once, as OpenAI
    ids = [Tokenizer(smollm2_dir).encode(t) for t in texts]  # as the server encodes a string
    assert complete(ids[0]).choices[0].text == alone[0].choices[0].text
    assert [c.text for c in complete(ids).choices] == [c.text for c in both.choices]
    pieces = ["", ""]
    chunks = list(complete(texts, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks[:-1]:
        pieces[chunk.choices[0].index] += chunk.choices[0].text
    assert pieces == [c.text for c in both.choices]
    assert chunks[-1].usage.completion_tokens == both.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as refused:  # every prompt checked before any runs
        complete([texts[0], "Hi " * 1100])
    assert refused.value.body["param"] == "prompt" and "prompt 1 has" in refused.value.body["message"]


@pytest.fixture(scope="module")
def loglikelihood(smollm2_dir, device):
    """eval.py's log-likelihood of token ids (every token after the first given those before it),
    in float32, as one window."""
    import eval as ev
    from loading import load_model

    model = load_model(smollm2_dir, device, torch.float32)

    def score(ids: list) -> float:
        ppl, scored = ev.perplexity(model, ids, window=len(ids), stride=len(ids))
        return -math.log(ppl) * scored
    return score


def check_echoed_logprobs(choice, text: str, ids: list, expected: float):
    """A choice of echo + logprobs with max_tokens 0: the prompt alone, its tokens' logprobs (none for
    the first), which sum to `expected`, and their offsets in the text."""
    lp = choice.logprobs
    assert choice.text == text and choice.finish_reason == "length"
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert sum(lp.token_logprobs[1:]) == pytest.approx(expected, abs=1e-3)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert token in top and top[token] == logprob and max(top.values()) >= logprob


def test_echo_logprobs_equal_eval(client, smollm2_dir, loglikelihood):
    """echo + logprobs + max_tokens 0 scores the prompt (as evaluation harnesses do): the sum of its
    tokens' logprobs is eval.py's log-likelihood of the text, for a list of prompts in one batch, for
    a prompt longer than a prefill chunk, and for one whose blocks the prefix cache holds."""
    from tokenizer import Tokenizer

    long = (ROOT / "data" / "hamlet.txt").read_text(encoding="utf-8")[:1200]  # ~300 tokens: two prefill chunks
    texts = PROMPTS[:3] + [long]
    ids = [Tokenizer(smollm2_dir).encode(t) for t in texts]
    expected = [loglikelihood(i) for i in ids]
    r = client.completions.create(model="smollm2-135m", prompt=texts, max_tokens=0, echo=True, logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 0
    for choice, text, i, e in zip(r.choices, texts, ids, expected):
        check_echoed_logprobs(choice, text, i, e)
    again = client.completions.create(model="smollm2-135m", prompt=ids[3], max_tokens=0, echo=True, logprobs=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # scored afresh, not read from the cache
    check_echoed_logprobs(again.choices[0], long, ids[3], expected[3])


def test_echo_prepends_the_prompt(client, smollm2_dir):
    """echo returns the prompt's text before the completion's, which is the same as without echo; with
    logprobs, the completion's tokens follow the prompt's, their offsets past the prompt's text;
    streamed, the prompt comes first."""
    from tokenizer import Tokenizer

    plain = client.completions.create(model="smollm2-135m", prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                      logprobs=1)
    echoed = client.completions.create(model="smollm2-135m", prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == PROMPTS[1] + plain.choices[0].text and echoed.choices[0].logprobs is None
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    scored = client.completions.create(model="smollm2-135m", prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                       echo=True, logprobs=1)
    lp, out = scored.choices[0].logprobs, plain.choices[0].logprobs
    assert scored.choices[0].text == echoed.choices[0].text
    assert lp.tokens[-len(out.tokens):] == out.tokens  # the first one's logits from a scored prompt: not the same bits
    assert lp.token_logprobs[-len(out.tokens):] == pytest.approx(out.token_logprobs, abs=1e-4)
    assert lp.text_offset[-len(out.tokens):] == [len(PROMPTS[1]) + o for o in out.text_offset]
    assert len(lp.tokens) == scored.usage.prompt_tokens + len(out.tokens) and lp.token_logprobs[0] is None
    pieces = list(client.completions.create(model="smollm2-135m", prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                            echo=True, stream=True))
    assert pieces[0].choices[0].text == PROMPTS[1]
    assert "".join(c.choices[0].text for c in pieces) == echoed.choices[0].text
    bare = client.completions.create(model="smollm2-135m", prompt=PROMPTS[2], max_tokens=0, echo=True)
    assert bare.choices[0].text == PROMPTS[2] and bare.choices[0].finish_reason == "length"
    # as lm-evaluation-harness asks: one token after the prompt, its entry last even when it is a stop token
    eos = Tokenizer(smollm2_dir).eos_ids[0]
    ended = client.completions.create(model="smollm2-135m", prompt=PROMPTS[2], max_tokens=1, echo=True, logprobs=1,
                                      temperature=0, logit_bias={str(eos): 100})
    lp = ended.choices[0].logprobs
    assert ended.choices[0].text == PROMPTS[2] and ended.choices[0].finish_reason == "stop"
    assert len(lp.tokens) == ended.usage.prompt_tokens + 1 and lp.text_offset[-1] == len(PROMPTS[2])


@pytest.mark.slow
def test_lm_eval_loglikelihood_equals_eval(server, smollm2_dir, loglikelihood, tmp_path):
    """lm-evaluation-harness's local-completions model runs the log-likelihood task of tests/lm_eval
    (offline: the task's data and the tokenizer are local files) through echo + logprobs: each item's
    log-likelihood, the continuation's tokens given the context's, is eval.py's within 1e-3."""
    pytest.importorskip("lm_eval", reason="make test-slow installs lm-eval (requirements-slow.txt)")
    from tokenizer import Tokenizer

    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    model = (f"base_url={server}/v1/completions,model=smollm2-135m,tokenizer_backend=huggingface,"
             f"tokenizer={smollm2_dir},max_length=1024")
    r = subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model,
                        "--tasks", "minillm_echo", "--include_path", "tests/lm_eval", "--log_samples",
                        "--output_path", str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (samples,) = (tmp_path / "out").glob("*/samples_minillm_echo_*.jsonl")
    items = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(items) == len((ROOT / "tests" / "lm_eval" / "items.jsonl").read_text().splitlines())
    tokenizer = Tokenizer(smollm2_dir)
    for item in items:
        context, continuation = item["doc"]["context"], item["doc"]["continuation"]
        ids = tokenizer.encode(context + continuation)  # as the harness splits them: the whole text's tokens
        n = len(tokenizer.encode(context))
        assert float(item["resps"][0][0][0]) == pytest.approx(loglikelihood(ids) - loglikelihood(ids[:n]), abs=1e-3)


def post(url, path, body, key=API_KEY, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json",
                                                                 **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", None, 400, None),  # malformed JSON
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hi " * 1100}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),  # as vLLM: 0 only with echo
    ("/v1/completions", {"prompt": "Hi", "echo": "yes"}, 400, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "Hi", "temperature": 5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "Hi", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "parallel_tool_calls": False}, 400,
     "parallel_tool_calls"),  # as OpenAI: only with tools
    ("/v1/nowhere", {}, 404, None),
])
def test_bad_input(server, path, body, status, param):
    code, reply = post(server, path, body, raw=b"{not json" if body is None else None)
    assert code == status, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"} and reply["error"]["message"]
    assert reply["error"]["param"] == param
    ok, good = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})  # served right after
    assert ok == 200 and good["choices"][0]["text"] is not None


def test_content_type_and_no_cors(server):
    """A body sent as a form gets a 415; JSON with a charset, or with no Content-Type, is served. No
    CORS header without --cors_origins."""
    import http.client
    host, port = server.rsplit(":", 1)
    body = json.dumps({"prompt": "Hi", "max_tokens": 2})
    for kind, status in (("application/x-www-form-urlencoded", 415), ("text/plain", 415),
                         ("application/json; charset=utf-8", 200), (None, 200)):
        c = http.client.HTTPConnection("127.0.0.1", int(port), timeout=60)
        c.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {API_KEY}", "Origin": "https://a.example",
                                                     **({"Content-Type": kind} if kind else {})})
        r = c.getresponse()
        reply = json.loads(r.read())
        assert r.status == status, (kind, reply)
        assert status == 200 or set(reply["error"]) == {"message", "type", "param", "code"}
        assert r.getheader("Access-Control-Allow-Origin") is None
        c.close()


def test_api_key(server):
    for key in (None, "wrong"):
        code, reply = post(server, "/v1/completions", {"prompt": "Hi"}, key=key)
        assert code == 401 and reply["error"]["code"] == "invalid_api_key"


def test_too_many_requests(client, server):
    """16 requests running and 8 waiting: the next request gets a 429, and nothing is lost."""
    def long(_):
        try:
            return client.completions.create(model="smollm2-135m", prompt="Count:", max_tokens=40,
                                             temperature=0, extra_body={"ignore_eos": True}).usage.completion_tokens
        except openai.RateLimitError:
            return 429

    with concurrent.futures.ThreadPoolExecutor(30) as pool:
        results = list(pool.map(long, range(30)))
    assert results.count(429) >= 1 and results.count(40) == 30 - results.count(429) >= 24


def test_disconnect_ends_the_request(server):
    """16 streams running, every row of a step; their clients hang up: each request ends, and a new
    request is admitted at once."""
    import http.client
    host, port = server.rsplit(":", 1)
    conns = []
    for _ in range(16):  # every row, streaming
        c = http.client.HTTPConnection("127.0.0.1", int(port), timeout=60)
        c.request("POST", "/v1/completions", json.dumps({"prompt": "Count:", "max_tokens": 900, "stream": True,
                                                         "ignore_eos": True}),
                  {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        resp = c.getresponse()
        resp.readline()  # the first event: generating
        conns.append((c, resp))
    assert metrics(server)["minillm_requests_running"] == 16
    for c, resp in conns:
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
    start = time.time()
    code, reply = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert code == 200 and time.time() - start < 30  # admitted at once, not after 900 tokens
    deadline = time.time() + 30
    while metrics(server)["minillm_requests_running"] and time.time() < deadline:
        time.sleep(0.2)
    assert metrics(server)["minillm_requests_running"] == 0


def metrics_when(url, ok, timeout: float) -> dict:
    """/metrics once ok(its figures) holds, or at the timeout."""
    deadline = time.time() + timeout
    while not ok(m := metrics(url)) and time.time() < deadline:
        time.sleep(0.05)
    return m


@pytest.mark.parametrize("path,stream,n", [("/v1/completions", False, 1), ("/v1/chat/completions", False, 2),
                                           ("/v1/completions", True, 2), ("/v1/chat/completions", True, 1)])
def test_hang_up_frees_the_rows_at_once(server, path, stream, n):
    """A client that goes away while its tokens flow, streaming or not, frees its n rows within a
    few steps, not at max_tokens (counted in tokens: a fast machine generates 900 in a second or two)."""
    import http.client
    running, generated = "minillm_requests_running", "minillm_generation_tokens_total"
    body = {"max_tokens": 900, "ignore_eos": True, "stream": stream, "n": n}
    body.update({"messages": [{"role": "user", "content": "Count:"}]} if "chat" in path else {"prompt": "Count:"})
    assert metrics_when(server, lambda m: m[running] == 0, 60)[running] == 0
    c = http.client.HTTPConnection("127.0.0.1", int(server.rsplit(":", 1)[1]), timeout=60)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    start = metrics_when(server, lambda m: m[running] == n, 60)[generated]
    flowing = metrics_when(server, lambda m: m[generated] >= start + 16 * n, 60)  # past any warm-up pause
    assert flowing[running] == n
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    after = metrics_when(server, lambda m: m[running] == 0, 10)
    assert after[running] == 0 and after[generated] - flowing[generated] < 20 * n


def test_sigterm_finishes_running_requests(smollm2_dir):
    proc, url = start_server(smollm2_dir, "--max_batch_size", 2, "--max_seq_length", 256, "--no-compile")
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(lambda: client.completions.create(model="smollm2-135m", prompt="Count:", max_tokens=60,
                                                                extra_body={"ignore_eos": True}))
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        assert running.result().usage.completion_tokens == 60
    assert proc.wait(timeout=60) == 0


def test_serve_cli_errors(tmp_path, smollm2_dir):
    r = run_script("serve.py", "--checkpoint", tmp_path / "missing")
    assert r.returncode != 0 and r.stderr.strip().startswith("error:") and "Traceback" not in r.stderr
    r = run_script("serve.py", "--checkpoint", smollm2_dir, "--max_batch_size", 100000, "--max_seq_length", 100000)
    assert r.returncode != 0 and "lower --kv_cache_tokens (or --max_batch_size, --max_seq_length)" in r.stderr
    assert "Traceback" not in r.stderr


def test_tensor_parallel_same_text(smollm2_dir, client):
    """torchrun with 2 ranks on gloo serves the same greedy texts."""
    needs_devices(2)
    proc, url = start_server(smollm2_dir, "--max_batch_size", 4, "--max_seq_length", 256, "--no-compile",
                             launcher=[sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       "--nproc_per_node=2"])
    try:
        tp_client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        for p in PROMPTS[:3]:
            want = client.completions.create(model="smollm2-135m", prompt=p, max_tokens=16, temperature=0)
            got = tp_client.completions.create(model="smollm2-135m", prompt=p, max_tokens=16, temperature=0)
            assert got.choices[0].text == want.choices[0].text
    finally:  # torchrun treats a SIGTERM of its own as a failure: stop rank 0, the others follow it
        rank0 = rank0_pid(proc.pid)
        os.kill(rank0, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


@pytest.mark.slow
def test_tensor_parallel_serves_while_compiling_then_compiled(smollm2_dir, reference):
    """torchrun's default: every rank compiles aside without running the graphs (compile.dry_run)
    while the eager step serves; once compiled, the ranks take the graphs up at the same step. The
    greedy texts are the same throughout (the eager and compiled float32 steps agree here)."""
    from scripts.bench_serve import compiling
    needs_devices(2)
    proc, url = start_server(smollm2_dir, "--max_batch_size", 4, "--max_seq_length", 256,
                             launcher=[sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       "--nproc_per_node=2"])
    try:
        tp_client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        want = [reference[False, p] for p in PROMPTS[:2]]
        assert compiling(url)
        for _ in range(2):  # eager, then (after the compile) compiled
            got = [tp_client.completions.create(model="smollm2-135m", prompt=p, max_tokens=24, temperature=0)
                   .choices[0].text for p in PROMPTS[:2]]
            assert got == want
            deadline = time.time() + 1200
            while compiling(url) and time.time() < deadline:
                time.sleep(2)
            assert not compiling(url)
    finally:
        os.kill(rank0_pid(proc.pid), signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def rank0_pid(launcher_pid: int) -> int:
    """The torchrun worker with RANK=0 among the launcher's children (Linux /proc)."""
    for pid in map(int, open(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read().split()):
        if "RANK=0" in open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0"):
            return pid
    raise AssertionError("no rank 0 worker found")
