"""Speculation in the serving engine's batched step (speculation.py, serve.py --speculative): verify
rows beside plain ones give each request exactly its greedy tokens alone (with a prefix-cache hit
on blocks a verify wrote, after preemptions), the opt-out and the requests that run without
proposals, the sampled distribution, and the server's flag."""
import collections
import copy

import pytest
import torch

import kernels
from conftest import TEST_DEVICE, random_model, run_script
from engine import Engine
from sampling import Sampling, logits_to_probs
from scheduler import Request
from speculation import Speculation
from test_batching import alone, prompts, run_all, serving

pytestmark = pytest.mark.usefixtures("one_thread")


def repetitive(n, seed=0):
    """Prompts that repeat a phrase of their own, so that prompt lookup and the suffix trie propose."""
    return [p + p[: len(p) // 2] + p for p in prompts(n, seed=seed)]


class Oracle(Speculation):
    """Proposes each request's known greedy continuation (prompt -> tokens), with one token in
    three wrong: blocks accepted whole, in part, and not at all."""

    def __init__(self, continuations: dict, k_max: int = 4):
        super().__init__("ngram", k_max)
        self.continuations = continuations

    def propose(self, decoding):
        out = {}
        for r in decoding:
            if not self.takes(r):
                continue
            self.states.get(r) or self.start(r)
            n = len(r.out)
            drafts = list(self.continuations[tuple(r.prompt)][n:n + min(self.k_max, r.max_new_tokens - n - 1)])
            if drafts and n % 3 == 1:
                drafts[n % len(drafts)] ^= 1
            if drafts:
                out[r] = drafts
        return out


@pytest.mark.parametrize("kind,compiled", [("oracle", False), ("oracle", True), ("ngram", False), ("suffix", False)])
def test_verify_rows_give_each_request_its_greedy_tokens(kind, compiled):
    """Requests joining at different steps, some opted out or asking for logprobs (no proposals)
    beside speculating ones: every request's tokens equal its solo greedy run, eager and compiled
    (after serve.py's warm-up, no verify step compiles)."""
    model = random_model(device=TEST_DEVICE)
    ps = repetitive(7, seed=1)
    want = [alone(model, p, 16) for p in ps]
    spec = Oracle({tuple(p): w for p, w in zip(ps, want)}) if kind == "oracle" else Speculation(kind, k_max=6)
    fast = kernels.install(copy.deepcopy(model)) if compiled else copy.deepcopy(model)
    engine = serving(fast, 4, 256, speculation=spec, prefill_chunk=16, compile=compiled)
    reqs = [Request(p, 16, speculative=i != 2, logprobs=1 if i == 4 else None) for i, p in enumerate(ps)]
    if compiled:  # serve.py's warm-up compiles every shape a verify takes too
        import serve
        torch._dynamo.reset()
        serve.warm_up(engine)
    with torch.compiler.set_stance("fail_on_recompile" if compiled else "default"):
        run_all(engine, {0: reqs[:2], 3: reqs[2:5], 9: reqs[5:]})
    assert [r.out for r in reqs] == want
    assert spec.verifies > 0 and len(reqs[4].token_logprobs) == 16 and not spec.states  # states end with requests
    if kind == "oracle":
        assert 0 < spec.accepted < spec.proposed


def test_grounded_text_as_alone(smollm2_dir):
    """SmolLM2 repeating a passage: suffix proposals are mostly accepted, and the greedy tokens
    are its solo run's."""
    from loading import load_model
    from tokenizer import Tokenizer
    tokenizer = Tokenizer(smollm2_dir)
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the door."
    ids = tokenizer.encode(f"{text}\n{text}\n{text[:20]}")
    model = load_model(smollm2_dir, "cpu", torch.float32)
    spec = Speculation("suffix")
    engine = serving(model, 2, 256, speculation=spec)
    req = Request(ids, 32)
    run_all(engine, {0: [req]})
    assert spec.accepted > spec.proposed / 2
    plain = Engine(model, 1, 256)
    (want,), _ = plain.generate([ids], 32, Sampling())
    assert req.out == want


def test_verified_blocks_serve_a_later_prompt():
    """Blocks sealed while a request speculated hold its accepted tokens' keys only: a later
    prompt that begins with that request's whole sequence finds them cached and decodes as alone."""
    model = random_model(device=TEST_DEVICE)
    first = repetitive(1, seed=3)[0]
    engine = serving(copy.deepcopy(model), 2, 256, speculation=Speculation("suffix"), prefill_chunk=16)
    req = Request(first, 40)
    run_all(engine, {0: [req]})
    again = Request(req.prompt + req.out, 12)
    run_all(engine, {0: [again]})
    assert again.cached_tokens >= 48
    assert again.out == alone(model, again.prompt, 12)


def test_speculating_requests_survive_preemption():
    """A cache too small for every request at once: requests are preempted and resumed while
    others verify, and each still gets its solo tokens."""
    model = random_model(device=TEST_DEVICE)
    ps = repetitive(4, seed=5)
    want = [alone(model, p, 24) for p in ps]
    spec = Oracle({tuple(p): w for p, w in zip(ps, want)})
    longest = max(len(p) for p in ps) + 24
    engine = serving(copy.deepcopy(model), 4, 256, kv_tokens=2 * longest + 32, speculation=spec, prefill_chunk=16)
    reqs = [Request(p, 24) for p in ps]
    run_all(engine, {0: reqs})
    assert engine.counters["preemptions"] > 0 and spec.accepted > 0
    assert [r.out for r in reqs] == want


def test_proposal_rows_follow_the_step_costs():
    """The cost model shares out the step's rows: a lone request, whose step costs little more
    with a few rows, proposes as many as its acceptance pays for (3 from the prior, all 8 once
    proposals are accepted); sixteen, whose step costs a token's time per row, propose none."""
    spec = Speculation("ngram", k_max=8)
    reqs = [Request([1, 2, 3, 1, 2, 3, 1, 2], 50, sampling=Sampling()) for _ in range(16)]
    spec.row_costs.seconds.update({rows: 0.1 * (1 + 0.05 * (rows - 1)) for rows in range(1, 10)})
    assert sum(map(len, spec.propose(reqs[:1]).values())) == 3
    for _ in range(20):
        spec.acceptance.record(8, 8)
    assert sum(map(len, spec.propose(reqs[:1]).values())) == 8
    spec.row_costs.seconds.update({rows: 0.1 * rows for rows in range(10, 40)})
    assert spec.propose(reqs) == {}
    spec.max_rows = 3  # no wider than the engine's widest step (CUDA graphs)
    assert sum(map(len, spec.propose(reqs[:1]).values())) == 2


def test_verify_rows_stay_within_the_compiled_shapes():
    """A compiled CPU step of fewer streams than make the float products change kernels takes no
    more rows than that (a wider one would compile while serving); an eager one any number."""
    model = random_model(device=TEST_DEVICE)
    assert serving(copy.deepcopy(model), 4, 64, speculation=Speculation("ngram")).speculation.max_rows is None
    compiled = serving(copy.deepcopy(model), 4, 64, speculation=Speculation("ngram"), compile=True, pad_rows=False)
    assert compiled.speculation.max_rows == kernels.compiled_onednn_min_tokens(torch.float32) - 1


def test_suffix_store_learns_from_earlier_requests():
    """A request's output is proposed to a later request that continues the same text."""
    spec = Speculation("suffix")
    done = Request([5, 6, 7], 8, sampling=Sampling())
    done.out = [9, 10, 11, 12, 13, 14]
    spec.finish(done)
    later = Request([40, 41, 7, 9, 10], 8, sampling=Sampling())
    assert spec.propose([later]) == {later: [11, 12, 13]}  # (3: what the cost model's priors pay for)


def last_logits(engine: Engine, tokens: list) -> torch.Tensor:
    """The logits (V,) after tokens, from an engine of one row."""
    req = Request(list(tokens), 1)
    engine.start(req)
    try:
        return engine.feed(req, tokens[req.fed:])
    finally:
        engine.scheduler.finish(req, "cancelled")


class FixedProposal(Speculation):
    """Proposes `drafts` at every request's first verify (after its first token)."""

    def __init__(self, drafts):
        super().__init__("ngram", k_max=len(drafts))
        self.drafts = drafts

    def propose(self, decoding):
        for r in decoding:
            self.states.get(r) or self.start(r)
        return {r: self.drafts for r in decoding if len(r.out) == 1}


def test_sampled_verify_keeps_the_distribution():
    """Temperature 0.3, the same proposal every time (the likeliest second token, p = 0.31): the
    token a verify gives after the first is distributed as the target's p(second token), summed
    over the first (exact, from the model). Total variation under 0.06 over 3,000 samples (the
    sampling noise expected is 0.023; resampling from p instead of the residual after a rejection
    is off by 0.16)."""
    model = random_model(device=TEST_DEVICE)
    prompt, sampling, V = [3, 17, 99, 3, 17], Sampling(temperature=0.3), model.args.vocab_size
    plain = Engine(copy.deepcopy(model), 1, 64)
    first = logits_to_probs(last_logits(plain, prompt).unsqueeze(0), sampling)[0]  # (V,)
    second = torch.stack([logits_to_probs(last_logits(plain, prompt + [a]).unsqueeze(0), sampling)[0]
                          for a in range(V)])  # (V, V): p(b | a)
    exact = first @ second
    proposal = int(exact.argmax())
    engine = serving(copy.deepcopy(model), 16, 64, speculation=FixedProposal([proposal, proposal]),
                     max_waiting=4000)
    torch.manual_seed(0)
    reqs = [Request(list(prompt), 2, sampling) for _ in range(3000)]
    run_all(engine, {0: reqs}, max_steps=10000)
    counts = collections.Counter(r.out[1] for r in reqs)
    seen = torch.tensor([counts[b] for b in range(V)], dtype=torch.float64) / len(reqs)
    tv = 0.5 * (seen - exact.double()).abs().sum().item()
    assert 0.2 < exact[proposal] < 0.5 and engine.speculation.verifies == len(reqs)
    assert tv < 0.06, f"total variation {tv:.3f}"


def test_serve_refuses_a_draft_without_checkpoint_and_bad_speculate_k(smollm2_dir):
    for flags, message in ((["--speculative", "draft"], "--draft_checkpoint"), (["--speculative", "beam"], "choose"),
                           (["--speculative", "ngram", "--speculate_k", "0"], "--speculate_k")):
        r = run_script("serve.py", "--checkpoint", str(smollm2_dir), *flags, timeout=60)
        assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr


def test_server_text_as_generate_and_the_opt_out(smollm2_dir):
    """serve.py --speculative suffix gives generate.py's greedy text, with proposals (some accepted,
    /metrics says) and opted out (none); a `speculative` that is not a boolean is a 400."""
    import openai
    from test_serve import API_KEY, metrics, start_server, stop_server
    prompt = "Copy this line twice: the quick brown fox jumps over the lazy dog.\nthe quick brown fox"
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--prompt", prompt, "--max_new_tokens", 24,
                   "--dtype", "float32", "--device", "cpu", "--no-compile")
    assert r.returncode == 0, r.stderr
    proc, url = start_server(smollm2_dir, "--speculative", "suffix", "--no-compile", "--max_seq_length", 256,
                             "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        for extra in ({}, {"speculative": False}):
            out = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=24, temperature=0,
                                            extra_body=extra)
            assert out.choices[0].text == r.stdout[:-1]
            if not extra:
                accepted = metrics(url)["minillm_speculative_accepted_tokens_total"]
                assert accepted > 0
        assert metrics(url)["minillm_speculative_accepted_tokens_total"] == accepted  # opted out: no proposals
        with pytest.raises(openai.BadRequestError, match="speculative"):
            client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=4, extra_body={"speculative": 1})
    finally:
        assert stop_server(proc) == 0
