"""speculative.py: greedy output identical to the target's, the sampled distribution equal to the
target's (and a test that a wrong resampling step is caught), rejected positions leaving the caches
as a plain run leaves them (paged target cache, contiguous draft cache; full and sliding-window
attention), EOS and max_new_tokens inside an accepted block, compile, chat on the prefix cache, and
the CLI."""
import contextlib
import copy
import json

import pytest
import torch

import kernels
import proposers
import speculative
from conftest import TEST_DEVICE, random_model, run_script, save_checkpoint
from engine import Chat, Engine
from errors import UserError
from loading import load_model
from sampling import Sampling, logits_to_probs
from scheduler import Request
from proposers import DraftProposer, NgramProposer
from speculative import SpeculativeEngine

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 9, 200, 17], list(range(20, 31)), [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]]


def noisy_copy(model, std, seed=1):
    """The model with every weight perturbed: a draft that agrees with the target only sometimes."""
    import copy
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * std)
    return draft


def sharpened(model, scale):
    """The model with its output head scaled: the same greedy choices, `scale` times surer."""
    with torch.no_grad():
        model.output.weight.mul_(scale)
    return model


class ScriptedProposer(NgramProposer):
    """Proposes the target's own greedy continuation (known in advance) with every third proposal
    wrong: point-mass proposals with every acceptance length, independent of the n-gram lookup."""

    name = "scripted"

    def __init__(self, full: list, vocab: int):
        super().__init__(1)
        self.full, self.vocab, self.round = full, vocab, 0

    def propose(self, context, k, s):
        self.round += 1
        truth = self.full[len(context):len(context) + k]
        return [(t + 1) % self.vocab if (self.round + i) % 3 == 0 else t for i, t in enumerate(truth)], None


def plain_greedy(model, prompt, n, stop_ids=(), max_seq_length=128):
    # (an Engine allocates its model's KV cache anew: an engine made before on the same model must be done)
    engine = Engine(model, 1, max_seq_length)
    (out,), _ = engine.generate([prompt], n, Sampling(), stop_ids)
    return out


def spec_engine(target, k, draft=None, ngram=None, proposer=None, max_seq_length=128, compile=False, adaptive=True):
    if proposer is None:
        proposer = DraftProposer(draft, compile=compile) if draft is not None else NgramProposer(ngram)
    return SpeculativeEngine(Engine(target, 1, max_seq_length, compile=compile), proposer, k, compile=compile,
                             adaptive=adaptive)


@pytest.fixture(scope="module")
def target():
    return random_model(seed=0, device=TEST_DEVICE)


# ---------------------------------------------------------------- greedy

@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive-k", "fixed-k"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("proposer", ["draft=target", "noisy draft", "random draft", "ngram", "scripted"])
def test_speculative_greedy_is_token_identical(target, proposer, k, adaptive):
    drafts = {"draft=target": random_model(seed=0, device=TEST_DEVICE), "noisy draft": noisy_copy(target, 0.05),
              "random draft": random_model(seed=3, device=TEST_DEVICE)}
    accepted = 0
    for prompt in PROMPTS:
        expected = plain_greedy(target, prompt, 40)
        scripted = ScriptedProposer(prompt + expected, 256) if proposer == "scripted" else None
        spec = spec_engine(target, k, draft=drafts.get(proposer), ngram=3 if proposer == "ngram" else None,
                           proposer=scripted, adaptive=adaptive)
        (out,), stats = spec.generate([prompt], 40, Sampling())
        assert out == expected, prompt
        assert stats.new_tokens == 40
        accepted += sum(i * h for i, h in enumerate(stats.histogram))
    if proposer in ("draft=target", "scripted"):
        assert accepted > 0  # the test is not vacuous


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_draft_is_token_identical(target, mode, tmp_path):
    # a draft made by quantize.py from the target itself, loaded like any checkpoint
    import quantize
    src = save_checkpoint(target, tmp_path / "float")
    quantize.main(["--checkpoint", str(src), "--mode", mode, "--groupsize", "32", "--out", str(tmp_path / mode)])
    draft = load_model(tmp_path / mode, TEST_DEVICE)
    assert draft.args.quantization["mode"] == mode
    accepted = 0
    for prompt in PROMPTS:
        spec = spec_engine(target, 4, draft=draft)
        (out,), stats = spec.generate([prompt], 32, Sampling())
        assert out == plain_greedy(target, prompt, 32)
        accepted += sum(i * h for i, h in enumerate(stats.histogram))
    assert accepted > 0


def test_bfloat16_draft_for_a_float32_target_is_token_identical(target):
    # generate.py --draft_dtype bfloat16: the draft's own rounding changes what it proposes, never
    # what the float32 target keeps
    draft = copy.deepcopy(target).to(torch.bfloat16)
    accepted = 0
    for prompt in PROMPTS:
        spec = spec_engine(target, 4, draft=draft)
        assert spec.proposer.model.norm.weight.dtype == torch.bfloat16
        (out,), stats = spec.generate([prompt], 32, Sampling())
        assert out == plain_greedy(target, prompt, 32)
        accepted += sum(i * h for i, h in enumerate(stats.histogram))
    assert accepted > 0


def test_greedy_stops_at_eos_inside_an_accepted_block_and_at_max_new_tokens(target):
    prompt = PROMPTS[1]
    free = plain_greedy(target, prompt, 40)
    stop = next(t for i, t in enumerate(free[2:], 2) if t not in free[:i])  # first seen at index >= 2
    cut = free.index(stop) + 1
    for k in (4, 8):  # draft == target: every block is accepted whole, so the stop token is inside one
        spec = spec_engine(target, k, draft=random_model(seed=0, device=TEST_DEVICE))
        (out,), stats = spec.generate([prompt], 40, Sampling(), stop_ids=[stop])
        assert out == free[:cut]
        assert stats.target_forwards == 1  # one verify produced the whole block up to the stop token
        for n in (2, 7, 13):
            (out,), _ = spec.generate([prompt], n, Sampling())
            assert out == free[:n]


def test_inter_token_latency_of_accepted_blocks_is_not_zero(target):
    """A verify hands out a block of tokens at once: each is timed at its share of the round, so the
    metrics' inter-token latency is what a token cost, not the 0 ms between tokens of one block."""
    spec = spec_engine(target, 8, draft=random_model(seed=0, device=TEST_DEVICE), adaptive=False)
    (out,), stats = spec.generate([PROMPTS[1]], 25, Sampling())
    assert len(out) == 25 and stats.target_forwards == 3  # draft == target: every block of 8 accepted
    assert all(b > a for a, b in zip(stats.token_times, stats.token_times[1:])), stats.token_times
    m = spec.metrics(stats)
    assert m["inter_token_latency_median_s"] > 0 and m["inter_token_latency_p90_s"] > 0, m
    assert m["inter_token_latency_median_s"] <= stats.decode_s, m


def test_ngram_proposer_lookup():
    p = NgramProposer(3)
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    p.start(ctx)
    assert p.propose(ctx, 2, Sampling()) == ([7, 8], None)  # (2, 3): the most recent occurrence wins
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 8, 4, 2, 3]
    p.start(ctx)
    assert p.propose(ctx, 2, Sampling())[0] == [7, 8]
    ctx += [7, 1]
    assert p.propose(ctx, 3, Sampling())[0] == [2, 3, 7]  # (7, 1) unseen; (1,) most recently at index 4
    assert p.propose([4, 5, 6], 3, Sampling())[0] == []  # no match at all: no proposal
    ctx = [1, 2, 3, 1, 2, 3]
    p.start(ctx)
    assert p.propose(ctx, 5, Sampling())[0] == [1, 2, 3, 1, 2]  # past the end: copy the proposal itself
    q = NgramProposer(3, min_n=2)
    q.start([5, 1, 9, 1])
    assert q.propose([5, 1, 9, 1], 2, Sampling())[0] == []  # only (1,) matches, shorter than min_n


# ---------------------------------------------------------------- KV cache rollback

def next_logits_after_run(model, context, fed):
    """The model's logits for the position after `context`, given that its own contiguous cache
    (setup_caches' row 0, as a draft keeps it) holds context[:fed]."""
    return model(torch.tensor([context[fed:]]), torch.arange(fed, len(context)))[0, -1]


def plain_run(model, prompt, context, max_seq_length=128):
    """A fresh copy of the model: prefill the prompt, then feed the rest one token at a time.
    Returns the copy (its cache holds context, position p in slot p) and the logits after context."""
    m = copy.deepcopy(model)
    m.setup_caches(1, max_seq_length)
    logits = m(torch.tensor([prompt]), torch.arange(len(prompt)))[0, -1]
    for i in range(len(prompt), len(context)):
        logits = m(torch.tensor([context[i:i + 1]]), torch.tensor([i]))[0, -1]
    return m, logits


def plain_run_logits(model, prompt, context, max_seq_length=128):
    return plain_run(model, prompt, context, max_seq_length)[1]


def recorded_requests(engine) -> list:
    """The requests engine.start() admits from now on (a SpeculativeEngine's target row), kept so
    that a test can look at the blocks they held."""
    started, start = [], engine.start
    engine.start = lambda request: started.append(request) or start(request)
    return started


def keys_and_values(model, slots: list) -> list:
    """Every layer's keys and values at the KV cache's slots: (len(slots), n_kv_heads, head_dim) each."""
    index = torch.tensor(slots, dtype=torch.long)
    caches = [layer.attention.kv_cache for layer in model.layers]
    return [pool for c in caches for pool in c.get(index)]


def logits_after_prefix_cache(engine, context) -> tuple:
    """A new request over context: (its logits for the next position, computed after the blocks of
    context it found in the engine's prefix cache, and how many tokens those blocks hold)."""
    request = Request(list(context), 1)
    engine.start(request)
    try:
        return engine.feed(request, context[request.fed:]), request.cached_tokens
    finally:
        engine.scheduler.finish(request, "length")


def assert_target_cache_is_a_plain_run(engine, row, prompt, context):
    """After a speculative run of row (finished: its blocks released, their slots untouched since):
    every position it kept (row.fed) holds in its block the keys and values of a plain run of
    context (a sliding-window model: the positions of the blocks its window still held); and a
    later request over context finds the full ones in the prefix cache (where the model has one)
    and, after them, gets the plain run's logits."""
    bs = engine.block_size
    plain, plain_logits = plain_run(engine.model, prompt, context)
    held = [p for p in range(row.fed) if row.blocks[p // bs] >= 0]
    window = engine.model.args.sliding_window  # the next query (at row.fed) sees window - 1 kept positions
    assert len(held) >= (row.fed if window is None else min(row.fed, window - 1))
    kept = [row.blocks[p // bs] * bs + p % bs for p in held]
    torch.testing.assert_close(keys_and_values(engine.model, kept), keys_and_values(plain, held), atol=1e-5, rtol=0)
    logits, cached = logits_after_prefix_cache(engine, context)
    if engine.blocks.prefix_caching:
        assert cached == min(row.fed, len(context) - 1) // bs * bs > 0
    else:  # sliding windows: nothing cached, every token computed again
        assert cached == 0
    torch.testing.assert_close(logits, plain_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
@pytest.mark.parametrize("window", [None, 6])
def test_kv_rollback_leaves_caches_as_a_plain_run(window, adaptive):
    # nothing is rewound: rejected positions lie past what the target's request keeps (its blocks)
    # and what the draft keeps (its own cache), and are written again later. Window 6: the sliding
    # layers keep every position and mask the keys outside the window; k = 8 reaches past it.
    # float64: float32 logits already differ by ~1e-5 between a chunked and a one-token-at-a-time
    # run of the same tokens; in float64 they agree exactly, so any difference is a rollback error.
    # Adaptive: rounds mix verifies, plain steps and threshold drafting; the draft catches up in chunks
    target = random_model(seed=0, sliding_window=window).double()
    draft = noisy_copy(target, 0.05)
    prompt = PROMPTS[2]
    expected = plain_greedy(copy.deepcopy(target), prompt, 48)
    if window is not None:  # the window is in effect: without it the output differs
        assert expected != plain_greedy(random_model(seed=0).double(), prompt, 48)
    for k in (2, 4, 5, 8):
        spec = spec_engine(target, k, draft=draft, adaptive=adaptive)
        started = recorded_requests(spec.engine)
        (out,), stats = spec.generate([prompt], 48, Sampling())
        assert out == expected
        assert any(stats.histogram[1:k]) or adaptive, stats.histogram  # partial acceptances happened
        assert sum(stats.histogram) > 0 and (stats.plain_steps > 1 or not adaptive), stats
        context = prompt + out
        (row,) = started
        assert row.fed == len(context) - 1  # every token but the last went through the target
        with torch.inference_mode():
            assert_target_cache_is_a_plain_run(spec.engine, row, prompt, context)
            fed = spec.proposer.fed
            assert fed == context[:len(fed)] and (len(fed) >= len(context) - 2 or adaptive)
            got = next_logits_after_run(draft, context, len(fed))
            torch.testing.assert_close(got, plain_run_logits(draft, prompt, context), atol=1e-5, rtol=0)


@pytest.mark.parametrize("proposer", ["noisy draft", "ngram"])
def test_sliding_window_with_k_not_below_the_window_is_token_identical(proposer):
    # blocks of k >= window proposals: a ring cache could not undo them (k had to stay below the
    # window); the paged cache keeps every position and rewinds nothing, so any k is exact
    target = random_model(seed=0, sliding_window=4)
    prompt = PROMPTS[1]
    expected = plain_greedy(copy.deepcopy(target), prompt, 40)
    assert expected != plain_greedy(random_model(seed=0), prompt, 40)  # the window is in effect
    for k in (4, 8):
        spec = spec_engine(target, k, draft=noisy_copy(target, 0.05) if proposer == "noisy draft" else None,
                           ngram=2 if proposer == "ngram" else None, adaptive=False)
        (out,), stats = spec.generate([prompt], 40, Sampling())
        assert out == expected
        assert sum(stats.histogram) > 0  # blocks were verified


def test_batch_larger_than_one_is_refused(target):
    with pytest.raises(UserError, match="one sequence at a time"):
        SpeculativeEngine(Engine(target, 2, 128), NgramProposer(2), 4)
    spec = SpeculativeEngine(Engine(target, 1, 128), NgramProposer(2), 4)
    with pytest.raises(UserError, match="one sequence at a time"):
        spec.generate([PROMPTS[0], PROMPTS[1]], 8, Sampling())


def test_compiled_matches_eager(target, monkeypatch):
    draft = sharpened(noisy_copy(target, 0.05), 4.0)  # sure enough that threshold drafting drafts several
    prompt = PROMPTS[2]
    expected = plain_greedy(target, prompt, 40)
    fast = kernels.install(copy.deepcopy(target))  # the CPU fast paths, against the reference's output
    spec = spec_engine(fast, 4, draft=draft, compile=True)
    spec.warm_up([prompt], Sampling())
    lengths = []
    chunk = spec.engine.short_chunk  # the engine's compiled chunk forward, which every verify runs

    def recorded(model, tokens, *rest, **views):
        if rest[-1] is None:  # every token's logits (no `last`): a verify
            lengths.append(tokens.shape[1])
        return chunk(model, tokens, *rest, **views)

    spec.engine.short_chunk = recorded
    monkeypatch.setattr("spec_cost.RoundPlanner.ask", lambda self, known, limit: limit)  # a draft every round
    # the verify graph is dynamic: every proposal count and context length runs the warmed-up graph
    # (guards checked on every call here, so that a call needing another graph would fail)
    monkeypatch.setattr("engine.guards_skipped", lambda skip: contextlib.nullcontext())
    with torch.compiler.set_stance("fail_on_recompile"):
        (out,), stats = spec.generate([prompt], 40, Sampling())
    assert out == expected
    assert len(set(lengths)) > 1, lengths  # threshold drafting verified blocks of several lengths
    monkeypatch.undo()
    spec = spec_engine(fast, 4, ngram=2, compile=True)
    (out,), stats = spec.generate([prompt], 40, Sampling())
    assert out == expected
    assert stats.plain_steps > 0 and sum(stats.histogram) > 0  # both compiled graphs ran


@pytest.mark.parametrize("host", [False, True], ids=["in-step", "host"])
def test_compiled_aside_drafts_eagerly_then_takes_the_graphs_up(target, host):
    """generate.py's default: the verify and the draft's step compile on a thread while both run
    eagerly; the draft's compile wrote its slot 0, so it starts over when it takes its step up. The
    text is plain greedy's throughout, and after the take-up nothing compiles."""
    prompt = PROMPTS[2]
    expected = plain_greedy(target, prompt, 40)
    spec = spec_engine(kernels.install(copy.deepcopy(target)), 4, draft=noisy_copy(target, 0.05), compile=True,
                       adaptive=False)  # (a draft as large as the target never pays: the cost model would not draft)
    options = {"logprobs": 1} if host else {}
    torch._dynamo.reset()
    thread = spec.warm_up([prompt], Sampling(), host=host, aside=True)
    assert thread.is_alive() and spec.proposer.step is proposers.draft_one_token
    (eager,), stats = spec.generate([prompt], 40, Sampling(), **options)
    assert stats.eager_steps > 0
    thread.join(timeout=900)
    with torch.compiler.set_stance("fail_on_recompile"):
        (out,), stats = spec.generate([prompt], 40, Sampling(), **options)
    assert stats.eager_steps == 0 and spec.proposer.step is not proposers.draft_one_token
    assert eager == out == expected and sum(stats.histogram[1:]) > 0  # the restarted draft still proposes well


# ---------------------------------------------------------------- sampling

V = 8  # small enough to enumerate every 3-token continuation


def every_continuation_logits(model, prompt):
    """The logits (V*V, L + 2, V) of prompt + [a, b] for every two tokens a, b (row a * V + b)."""
    import copy
    m = copy.deepcopy(model)
    m.setup_caches(V * V, len(prompt) + 2)
    with torch.inference_mode():
        rows = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        return m(rows, torch.arange(rows.shape[1]))


def exact_distribution(model, prompt, s):
    """P(t1, t2, t3) under the target's own sampling, by enumeration: (V, V, V)."""
    logits = every_continuation_logits(model, prompt)
    L = len(prompt)
    probs = [logits_to_probs(logits[:, L - 1 + i], s).double().view(V, V, V) for i in range(3)]
    p1 = probs[0][0, 0]  # (V,): the prompt alone
    p2 = probs[1][:, 0]  # (V, V): given t1 (t2 = row's b, not seen yet)
    p3 = probs[2]  # (V, V, V): given t1, t2
    return p1.view(V, 1, 1) * p2.view(V, V, 1) * p3


def chi_square_p_value(counts, expected_probs, min_expected=5.0):
    """Pearson's chi-square test; cells expected fewer than min_expected times are pooled."""
    counts, probs = counts.flatten().double(), expected_probs.flatten().double()
    expected = probs * counts.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(obs) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()


def sampled_counts(spec, prompt, s, runs, seed=0):
    counts = torch.zeros([V] * 3)
    torch.manual_seed(seed)
    for _ in range(runs):
        (out,), _ = spec.generate([prompt], 4, s)  # 4 tokens: the first round has 2 proposals (k=2)
        counts[tuple(out[:3])] += 1
    return counts


SAMPLINGS = {"t=1": Sampling(temperature=1.0), "t=0.7,top_k=5,top_p=0.9": Sampling(0.7, top_k=5, top_p=0.9)}
SAMPLE_PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 4, 6, 1, 3, 5, 7, 0]  # every token recurs: n-gram proposals always


def small_vocab_pair():
    # a flat-ish target and a peaked draft that disagree often: rejections, and resampling, are common
    target = random_model(seed=0, vocab_size=V, dim=32, n_layers=1, std=0.15)
    draft = random_model(seed=5, vocab_size=V, dim=32, n_layers=1, std=0.4)
    return target, draft


def distribution_p_value(proposer, s, runs, adaptive=False, seed=0):
    """Sample t1, t2, t3 `runs` times with speculation (k=2) and compare with the exact target
    distribution: the smaller p-value of chi-square tests on the joint (t1, t2, t3) and on
    (t2, t3) alone (t1 comes from prefill; the marginal has fewer cells, so more power).
    adaptive: the cost model may verify fewer proposals, or none (a plain step)."""
    target, draft = small_vocab_pair()
    spec = spec_engine(target, 2, draft=draft if proposer == "draft" else None,
                       ngram=2 if proposer == "ngram" else None, max_seq_length=32, adaptive=adaptive)
    counts = sampled_counts(spec, SAMPLE_PROMPT, s, runs, seed)
    exact = exact_distribution(target, SAMPLE_PROMPT, s)
    return min(chi_square_p_value(counts, exact), chi_square_p_value(counts.sum(0), exact.sum(0)))


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_speculative_sampling_matches_the_target_distribution(proposer, sampling, adaptive):
    # under a correct sampler p is uniform on (0, 1); the cost model's choices follow the step
    # times, so with adaptive k the draws differ from run to run: a p below the threshold is
    # checked on a second seed, and only both failing fails (a wrong sampler gives p < 1e-6)
    p = distribution_p_value(proposer, SAMPLINGS[sampling], RUNS, adaptive)
    if p <= 1e-3 / 2:  # two tests per check (Bonferroni)
        p = max(p, distribution_p_value(proposer, SAMPLINGS[sampling], RUNS, adaptive, seed=1))
    assert p > 1e-3 / 2, p


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_wrong_resampling_step_is_caught(proposer, monkeypatch):
    # resampling from p instead of norm(max(p - q, 0)) favours the proposals: the same check must fail
    # (fixed k: every round verifies, as the distribution test's fixed-k runs do)
    monkeypatch.setattr(speculative, "residual_distribution", lambda p, q: p)
    p = distribution_p_value(proposer, SAMPLINGS["t=1"], RUNS)
    assert p < 1e-6, p


RUNS = 800


# ---------------------------------------------------------------- the real model, chat, the CLI

GROUNDED = ("Fix the spelling mistakes in this paragraph and write it out again:\n\n"
            "The quick brown fox jumpd over the lazy dog. It then ran into the forrest, where it "
            "met an old owl who lived in a hollow tree.")


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from tokenizer import Tokenizer
    return load_model(smollm2_dir), Tokenizer(smollm2_dir)


def test_ngram_greedy_is_token_identical_on_smollm2(smollm2):
    model, tok = smollm2
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": GROUNDED}]), add_bos=False)
    expected = plain_greedy(model, ids, 40, tok.eos_ids, max_seq_length=256)
    spec = spec_engine(model, 8, ngram=3, max_seq_length=256)
    (out,), stats = spec.generate([ids], 40, Sampling(), tok.eos_ids)
    assert out == expected
    m = spec.metrics(stats)
    assert m["tokens_per_target_forward"] > 1.5, m  # the answer copies the passage: long accepted blocks


def test_chat_with_speculation_equals_plain_chat(smollm2):
    # each turn finds the earlier turns' blocks in the prefix cache (and the draft its own cache);
    # with speculation both caches held rejected positions past the conversation, which later
    # turns must not see
    model, tok = smollm2
    turns = ["Repeat after me: the cat sat on the mat.", "Now say it again, in capitals.", "And once more."]
    plain = Engine(copy.deepcopy(model), 1, 512)  # an engine of its own: each engine owns its model's cache
    spec = spec_engine(model, 4, draft=noisy_copy(model, 0.002), max_seq_length=512)
    a, b = Chat(plain, tok), Chat(spec, tok)
    for i, turn in enumerate(turns):
        out_a, _ = a.reply(turn, 16, Sampling())
        out_b, stats = b.reply(turn, 16, Sampling())
        assert out_a == out_b
        assert (stats.cached_tokens > 0) == (i > 0)  # from the second turn on, the prefix cache serves
    assert b.last_prefill_tokens < b.last_prompt_tokens / 2  # the cache was reused
    assert sum(stats.histogram[1:]) > 0


def test_cli_ngram_end_to_end(smollm2_dir, smollm2, tmp_path):
    model, tok = smollm2
    mj = tmp_path / "m.json"
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--chat", "--prompt", GROUNDED, "--ngram", "3",
                   "--speculate_k", "6", "--max_new_tokens", "24", "--no-compile", "--metrics_json", mj)
    assert r.returncode == 0, r.stderr
    (m,) = json.loads(mj.read_text())
    assert m["proposer"] == "ngram" and len(m["acceptance_histogram"]) == 7
    assert m["tokens_per_target_forward"] > 1 and m["decode_tokens_per_s"] > 0
    assert "acceptance histogram" in r.stderr and "tokens per target forward" in r.stderr
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": GROUNDED}]), add_bos=False)
    stop = sorted(set(model.args.eos_token_ids) | set(tok.eos_ids))
    expected = plain_greedy(model, ids, 24, stop, max_seq_length=256)
    assert r.stdout == tok.decode([t for t in expected if t not in stop]) + "\n"


def test_cli_bfloat16_draft_gives_the_plain_output(smollm2_dir, tmp_path):
    mj = tmp_path / "m.json"
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--draft_checkpoint", smollm2_dir,
                   "--draft_dtype", "bfloat16", "--speculate_k", "4", "--chat", "--prompt", GROUNDED,
                   "--max_new_tokens", "16", "--no-compile", "--compare_plain", "--metrics_json", mj)
    assert r.returncode == 0, r.stderr
    assert "weights in bfloat16" in r.stderr and "output identical" in r.stderr, r.stderr
    (m,) = json.loads(mj.read_text())
    assert m["identical_to_plain"] and m["draft_forwards"] > 0


@pytest.mark.parametrize("case", ["other tokenizer", "both proposers", "batch", "k below 1", "draft dtype alone",
                                  "bad draft dtype"])
def test_cli_speculation_errors_are_one_line(case, smollm2_dir, tmp_path):
    import shutil
    other = save_checkpoint(random_model(vocab_size=49152), tmp_path / "other", tokenizer_from=smollm2_dir)
    cfg = json.loads((other / "tokenizer.json").read_text())
    cfg["model"]["vocab"]["<|my_token|>"] = cfg["model"]["vocab"].pop("hello")  # one entry differs
    (other / "tokenizer.json").write_text(json.dumps(cfg))
    same = tmp_path / "same"
    shutil.copytree(other, same)
    shutil.copy(smollm2_dir / "tokenizer.json", same / "tokenizer.json")
    rest = {"other tokenizer": ["--draft_checkpoint", other],
            "both proposers": ["--draft_checkpoint", same, "--ngram", "2"],
            "batch": ["--ngram", "2", "--batch_size", "2"],
            "k below 1": ["--ngram", "2", "--speculate_k", "0"],
            "draft dtype alone": ["--ngram", "2", "--draft_dtype", "bfloat16"],
            "bad draft dtype": ["--draft_checkpoint", same, "--draft_dtype", "int3"]}[case]
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--no-compile", "--max_new_tokens", "4", *rest)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    if case == "other tokenizer":
        assert "different tokenizers" in lines[0]
