"""A draft model and lookahead decoding in the serving engine's step (serve.py --speculative draft |
lookahead; draft_rows.py, speculation.LookaheadRounds): each request gets exactly its greedy tokens
alone, at one request and at several of different lengths (proposals some rejected, preemptions),
a sampled draft's distribution reaches the verify, rows go back when requests end, and the
server's flags and text."""
import collections
import copy

import pytest
import torch

from conftest import TEST_DEVICE, random_model, run_script
from draft_rows import DraftRows
from errors import UserError
from sampling import Sampling, logits_to_probs
from scheduler import Request
from spec_cost import LookaheadPlanner
from speculation import Speculation
from test_batching import alone, run_all, serving
from test_serve_speculative import repetitive
from test_speculative import noisy_copy

pytestmark = pytest.mark.usefixtures("one_thread")


def drafting(draft, rows: int, length: int, k: int = 4) -> Speculation:
    return Speculation("draft", k_max=k, draft=DraftRows(copy.deepcopy(draft), rows, length))


@pytest.fixture
def every_row(monkeypatch):
    """Every proposal a request may make rides (the cost model's say aside): rejections keep coming."""
    import speculation
    monkeypatch.setattr(speculation, "share_rows", lambda base, rates, seconds: [len(r) for r in rates])


# ---------------------------------------------------------------- a draft model

@pytest.mark.parametrize("kind", ["same model", "noisy copy"])
def test_draft_gives_a_lone_request_its_greedy_tokens(kind, every_row):
    """One request, drafted by the target itself (every proposal accepted) or by a noisy copy
    (some rejected, their keys in the draft's row written over): its solo greedy tokens."""
    model = random_model(device=TEST_DEVICE)
    prompt = repetitive(1, seed=2)[0]
    want = alone(model, prompt, 24)
    spec = drafting(model if kind == "same model" else noisy_copy(model, 0.05), 2, 256)
    engine = serving(copy.deepcopy(model), 2, 256, speculation=spec, prefill_chunk=16)
    req = Request(prompt, 24)
    run_all(engine, {0: [req]})
    assert req.out == want and spec.verifies > 0
    if kind == "same model":
        assert spec.accepted == spec.proposed
    else:
        assert 0 < spec.accepted < spec.proposed


def test_draft_rows_give_each_request_its_greedy_tokens(every_row):
    """Requests of different lengths joining at different steps, one opted out, beside each other
    with a cache that preempts: drafted together in the draft's rows, each gets its solo greedy
    tokens, and every row is free again at the end."""
    model = random_model(device=TEST_DEVICE)
    ps = repetitive(6, seed=4)
    want = [alone(model, p, 16) for p in ps]
    spec = drafting(noisy_copy(model, 0.05), 4, 256)
    longest = max(len(p) for p in ps) + 16
    engine = serving(copy.deepcopy(model), 4, 256, kv_tokens=2 * longest + 48, speculation=spec, prefill_chunk=16)
    reqs = [Request(p, 16, speculative=i != 3) for i, p in enumerate(ps)]
    run_all(engine, {0: reqs[:2], 2: reqs[2:4], 7: reqs[4:]})
    assert [r.out for r in reqs] == want
    assert 0 < spec.accepted < spec.proposed and engine.counters["preemptions"] > 0
    assert sorted(spec.draft.free) == [0, 1, 2, 3] and not spec.draft.held and not spec.states


def test_a_request_without_a_free_draft_row_is_not_drafted_for():
    """One row for two requests: the first holds it; the second proposes nothing until it is free."""
    spec = drafting(random_model(device=TEST_DEVICE), 1, 64)
    first, second = (Request([1, 2, 3, 4], 8, sampling=Sampling()) for _ in range(2))
    proposals = spec.propose([first, second])
    assert first in proposals and second not in proposals
    spec.finish(first)
    assert second in spec.propose([second])


class TimedDraft:
    """Drafts token 1 for every asked request; each of its forwards takes `seconds`."""

    def __init__(self, seconds):
        self.seconds, self.asked = seconds, []

    def propose(self, asked):
        self.asked.append(asked)
        return {req: ([1] * k, None) for req, k in asked}

    def release(self, req):
        pass


def test_a_draft_is_asked_for_the_rows_its_forwards_pay_for():
    """A lone request, a step of one row timed at 0.1 s: a free draft is asked for the 3 rows the
    prior acceptance pays for; one whose forward costs a step's time is asked for none, until its
    probe every PROBE_EVERY steps (2 proposals)."""
    from speculation import PROBE_DRAFTS, PROBE_EVERY
    for seconds, want in ((0.0, 3), (0.1, 0)):
        draft = TimedDraft(seconds)
        spec = Speculation("draft", k_max=8, draft=draft)
        spec.row_costs.seconds.update({rows: 0.1 * (1 + 0.05 * (rows - 1)) for rows in range(1, 10)})
        req = Request([1, 2, 3, 1, 2, 3], 50, sampling=Sampling())
        got = spec.propose([req])
        assert [k for asked in draft.asked for _, k in asked] == ([want] if want else [])
        assert len(got.get(req, [])) == want
    for _ in range(PROBE_EVERY - 1):
        spec.propose([req])
    assert [k for asked in draft.asked for _, k in asked] == [PROBE_DRAFTS]


def test_the_verify_takes_the_drafts_distribution():
    """A draft drawn from q: with q at the verify, accepted with probability sum min(p, q) (all of
    them where q = p), as a point mass it would be sum p q; the tokens given are distributed as p
    (total variation under 0.05 over 3,000 draws; the noise expected is about 0.02)."""
    V, n, sampling = 8, 3000, Sampling(temperature=1.0)
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0)) * 1.5
    p = logits_to_probs(logits, sampling)  # (2, V): after the last token, after the proposal
    torch.manual_seed(0)
    for q in (p[:1], torch.softmax(torch.randn(1, V), -1)):
        spec = Speculation("draft", k_max=1, draft=object())
        req = Request([1, 2], 4, sampling=sampling)
        state, counts = spec.start(req), collections.Counter()
        for d in torch.multinomial(q[0], n, replacement=True).tolist():
            state.q = q
            counts[spec.accept(req, logits, [d])[0]] += 1
        tv = 0.5 * sum(abs(counts[t] / n - p[0, t].item()) for t in range(V))
        assert tv < 0.05, f"total variation {tv:.3f}"
        rate, exact = spec.accepted / n, torch.minimum(p[0], q[0]).sum().item()
        assert abs(rate - exact) < 0.04 and (exact < 0.9 or rate == 1.0)
        assert abs(rate - (p[0] * q[0]).sum().item()) > 0.1  # what a point mass would give


def test_sampled_drafts_of_the_target_are_accepted():
    """Sampling, drafted by the target itself: q is p, so nearly every proposal is accepted (as
    point masses about sum p^2 would be)."""
    model = random_model(device=TEST_DEVICE)
    spec = drafting(model, 4, 128)
    engine = serving(copy.deepcopy(model), 4, 128, speculation=spec, prefill_chunk=16)
    torch.manual_seed(0)
    reqs = [Request(p, 12, Sampling(temperature=1.0)) for p in repetitive(4, seed=6)]
    run_all(engine, {0: reqs})
    assert all(len(r.out) == 12 for r in reqs)
    assert spec.proposed > 0 and spec.accepted > 0.9 * spec.proposed


# ---------------------------------------------------------------- lookahead

@pytest.fixture
def every_round(monkeypatch):
    """Lookahead rounds whenever one request decodes (the cost model's say aside)."""
    monkeypatch.setattr(LookaheadPlanner, "pays", lambda self, children: True)


class KnownPools(Speculation):
    """Lookahead whose pools hold each request's greedy continuation (prompt -> tokens) as n-grams,
    each behind a wrong branch: the accepted path is a later sibling's, whose keys move into place."""

    def __init__(self, continuations: dict):
        super().__init__("lookahead")
        self.continuations = continuations

    def start(self, req):
        state = super().start(req)
        pool, context = state.lookahead, req.known()
        pool.from_context = False
        full = req.prompt + self.continuations[tuple(req.prompt)]
        for i in range(len(context) - 1, len(full) - pool.N + 1):
            gram = tuple(full[i:i + pool.N])
            pool.remember(gram)
            pool.remember((gram[0], gram[1] ^ 1) + gram[2:])  # the most recent: the tree's first branch
        return state


@pytest.fixture
def moves(monkeypatch):
    """The compactions of accepted paths (speculation's tree.compact), recorded."""
    import speculation
    done, compact = [], speculation.compact
    monkeypatch.setattr(speculation, "compact", lambda model, moved: (done.append(moved), compact(model, moved)))
    return done


@pytest.mark.parametrize("arch", ["llama", "sliding"])
def test_lookahead_gives_a_lone_request_its_greedy_tokens(arch, every_round, moves):
    """Requests one at a time: rounds accept paths, moved into place where a later branch's, and
    the tokens are each one's solo greedy ones; with the pool its own rounds fill, too."""
    over = dict(sliding_window=8, architecture="mistral") if arch == "sliding" else {}
    model = random_model(device=TEST_DEVICE, **over)
    ps = repetitive(3, seed=1 if over else 8)
    want = [alone(model, p, 32) for p in ps]
    for spec in (KnownPools({tuple(p): w for p, w in zip(ps, want)}), Speculation("lookahead", lookahead=(3, 4, 2))):
        engine = serving(copy.deepcopy(model), 2, 256, speculation=spec, prefill_chunk=16)
        reqs = [Request(p, 32) for p in ps]
        for req in reqs:
            run_all(engine, {0: [req]})
        assert [r.out for r in reqs] == want
        assert spec.verifies > 0 and not spec.states
    assert moves and 0 < spec.verifies < len(ps) * 32


def test_lookahead_beside_other_requests(every_round, moves):
    """Requests arriving while others decode: rounds while one decodes, plain rows beside others;
    each request's solo greedy tokens."""
    model = random_model(device=TEST_DEVICE)
    ps = repetitive(4, seed=9)
    want = [alone(model, p, 24) for p in ps]
    spec = KnownPools({tuple(p): w for p, w in zip(ps, want)})
    engine = serving(copy.deepcopy(model), 4, 256, speculation=spec, prefill_chunk=16)
    reqs = [Request(p, 24) for p in ps]
    run_all(engine, {0: reqs[:1], 10: reqs[1:3], 30: reqs[3:]})
    assert [r.out for r in reqs] == want and spec.verifies > 0 and moves


def test_lookahead_rounds_only_while_one_request_decodes(every_round):
    """A round's window cannot ride in one-token rows: with two requests decoding, neither proposes."""
    spec = Speculation("lookahead")
    one, two = (Request(p, 16, sampling=Sampling()) for p in repetitive(2, seed=3))
    assert list(spec.propose([one])) == [one] and len(spec.propose([one])[one].tokens) == spec.rounds.size
    assert spec.propose([one, two]) == {}


def test_lookahead_sampling_runs():
    """Sampled requests take rounds too (recursive rejection sampling over point masses) and end."""
    model = random_model(device=TEST_DEVICE)
    spec = Speculation("lookahead")
    engine = serving(copy.deepcopy(model), 2, 256, speculation=spec, prefill_chunk=16)
    req = Request(repetitive(1, seed=1)[0], 24, Sampling(temperature=0.7))
    run_all(engine, {0: [req]})
    assert len(req.out) == 24


@pytest.mark.slow
def test_lookahead_compiled_after_warm_up(every_round, moves):
    """serve.py's warm-up compiles a round's forward: serving compiles nothing more, and gives the
    solo greedy tokens."""
    import kernels
    import serve
    model = random_model(device=TEST_DEVICE)
    ps = repetitive(2, seed=8)
    want = [alone(model, p, 24) for p in ps]
    spec = KnownPools({tuple(p): w for p, w in zip(ps, want)})
    engine = serving(kernels.install(copy.deepcopy(model)), 2, 256, speculation=spec, prefill_chunk=16, compile=True)
    torch._dynamo.reset()
    serve.warm_up(engine)
    reqs = [Request(p, 24) for p in ps]
    with torch.compiler.set_stance("fail_on_recompile"):
        for req in reqs:
            run_all(engine, {0: [req]})
    assert [r.out for r in reqs] == want and spec.verifies > 0 and moves


# ---------------------------------------------------------------- the server

def test_serve_refuses_bad_speculation_flags(smollm2_dir, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    for flags, message in ((["--speculative", "draft"], "--draft_checkpoint"),
                           (["--draft_checkpoint", smollm2_dir], "--draft_checkpoint"),
                           (["--speculative", "draft", "--draft_checkpoint", tmp_path], "tokenizer"),
                           (["--lookahead", "5,3,3"], "--speculative lookahead"),
                           (["--speculative", "lookahead", "--lookahead", "4,1,3"], "W,N,G")):
        r = run_script("serve.py", "--checkpoint", str(smollm2_dir), *flags, timeout=60)
        assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, (flags, r.stderr)


def test_serve_refuses_a_draft_or_lookahead_under_torchrun(smollm2_dir):
    """Rank 0 alone would draft, or compact a lookahead round's path: refused before anything loads."""
    import argparse

    import serve
    for kind in ("draft", "lookahead"):
        args = argparse.Namespace(device="cpu", dtype="float32", checkpoint=smollm2_dir, speculative=kind)
        with pytest.raises(UserError, match="torchrun"):
            serve.load_engine(args, tp=object())


@pytest.mark.parametrize("kind", ["draft", "lookahead"])
def test_server_text_as_generate(smollm2_dir, kind, request):
    """serve.py --speculative draft (the int8 checkpoint drafting) and lookahead give generate.py's greedy text."""
    import openai
    flags = [kind] + (["--draft_checkpoint", request.getfixturevalue("int8_dir")] if kind == "draft" else [])
    from test_serve import API_KEY, metrics, start_server, stop_server
    prompt = "Copy this line twice: the quick brown fox jumps over the lazy dog.\nthe quick brown fox"
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--prompt", prompt, "--max_new_tokens", 24,
                   "--dtype", "float32", "--device", "cpu", "--no-compile")
    assert r.returncode == 0, r.stderr
    proc, url = start_server(smollm2_dir, "--speculative", *flags, "--no-compile", "--max_seq_length", 256,
                             "--max_batch_size", 2, "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        out = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=24, temperature=0)
        assert out.choices[0].text == r.stdout[:-1]
        assert metrics(url)["minillm_speculative_verifies_total"] > 0
    finally:
        assert stop_server(proc) == 0
