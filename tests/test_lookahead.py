"""Lookahead decoding (lookahead.py): the chunk's mask gives every window token one sequence at
consecutive positions; the trajectory fills its levels, then feeds the pool, G n-grams per key; one
forward gives every token of both branches the logits of its own sequence fed alone (float64, the
reference attention and the CPU kernel); greedy rounds token-identical to plain greedy (a random model
with full, window and mixed attention, SmolLM2 on a repetitive and an open-ended prompt) and the cache
left as a plain run leaves it; compiled rounds without recompiling; sampling exact (chi-square against
the enumerated distribution, which catches a biased acceptance); the command line."""
import contextlib
import copy

import pytest
import torch

import generate_args
import kernels
import lookahead
from conftest import random_model, run_script
from engine import Engine
from errors import UserError
from kvcache import ForwardBatch
from loading import load_model
from lookahead import LookaheadProposer, window_mask
from sampling import Sampling
from spec_cost import StepCosts
from speculative import SpeculativeEngine
from tokenizer import Tokenizer
from test_speculative import (PROMPTS, RUNS, SAMPLE_PROMPT, SAMPLINGS, V, assert_target_cache_is_a_plain_run,
                              chi_square_p_value, exact_distribution, plain_greedy, recorded_requests,
                              sampled_counts, small_vocab_pair)
from test_suffix import REPEAT
from test_tree import WINDOWS, last_logits

pytestmark = pytest.mark.usefixtures("one_thread")

OPEN_ENDED = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def lookahead_engine(model, sizes: tuple, max_seq_length: int = 128, compile: bool = False,
                     proposer=None, adaptive: bool = False) -> SpeculativeEngine:
    """adaptive=False: every round a lookahead forward, as these tests check them (not the planner's choice)."""
    proposer = proposer or LookaheadProposer(*sizes)
    return SpeculativeEngine(Engine(model, 1, max_seq_length, compile=compile), proposer, sizes[1] - 1,
                             compile=compile, adaptive=adaptive)


def seen(chunk, t: int) -> list:
    """The chunk tokens token t sees, by their offsets."""
    return sorted(chunk.mask[t].nonzero().flatten().tolist(), key=lambda j: chunk.offsets[j])


# ---------------------------------------------------------------- the chunk, the window, the pool

def test_window_mask_gives_each_token_one_sequence():
    """Level 2's column 1 (W = 3, N = 4, after a root alone) sees the root, level 0's columns 0 and 1,
    then column 1 of levels 1 and 2; every window token's visible tokens stand at offsets 0, 1, ...,
    its own, once each."""
    mask = window_mask(3, 3, 1)
    at = lambda level, column: 1 + 3 * level + column  # noqa: E731
    assert mask[at(2, 1)].nonzero().flatten().tolist() == [0, at(0, 0), at(0, 1), at(1, 1), at(2, 1)]
    proposer = LookaheadProposer(3, 4, 2)
    proposer.pool = {7: [(1, 2, 3), (1, 4, 5)]}
    chunk = proposer.branches([9, 7])
    assert len(chunk.tokens) == len(chunk.offsets) == proposer.size == 1 + 3 * (3 + 2)
    for t in range(proposer.verify_size, proposer.size):
        assert [chunk.offsets[j] for j in seen(chunk, t)] == list(range(chunk.offsets[t] + 1))


def test_branches_see_nothing_of_each_other():
    """The tree of the pool's n-grams after the last token (merged, most recent first), padded to
    G * (N - 1) nodes, then the window: a tree node sees its path, a padding node the root and itself,
    a window token the root and window tokens only."""
    proposer = LookaheadProposer(2, 3, 3)
    proposer.pool = {7: [(1, 2), (1, 4)], 5: [(6, 6)]}
    chunk = proposer.branches([3, 7])
    assert chunk.tree.tokens == [7, 1, 4, 2] and chunk.tree.parents == [-1, 0, 1, 1]
    assert chunk.tokens[:4] == [7, 1, 4, 2] and chunk.offsets[:4] == [0, 1, 2, 2]
    assert chunk.tokens[7:] == [t for level in proposer.levels for t in level]
    assert seen(chunk, 3) == [0, 1, 3]
    assert seen(chunk, 5) == [0, 5] and chunk.offsets[5] == 1  # padding
    window = range(proposer.verify_size, proposer.size)
    assert all(set(seen(chunk, t)) <= {0, *window} for t in window)
    assert len(LookaheadProposer(2, 3, 3).branches([3, 7]).tokens) == proposer.size  # an empty pool: the same size


def test_trajectory_fills_its_levels_then_feeds_the_pool():
    """N = 3: the first round's outputs of level 0 become level 1; from the next round each column and
    the last level's output is an n-gram, and the levels move up. At most G n-grams per key, the most
    recent first; one seen again becomes the most recent."""
    proposer = LookaheadProposer(2, 3, 2)
    proposer.start([5, 6, 7])
    level0 = proposer.levels[0]
    assert proposer.filled == 1 and set(level0) <= {5, 6, 7}
    proposer.observe([10, 11, 90, 91])  # level 1's outputs are placeholders' still
    assert proposer.levels == [level0, [10, 11]] and not proposer.pool
    proposer.observe([12, 13, 20, 21])
    assert proposer.levels == [[10, 11], [20, 21]]
    assert [10, 20] in proposer.candidates([level0[0]]) and [11, 21] in proposer.candidates([level0[1]])
    proposer.observe([0, 0, 30, 31])  # (10, 20, 30), (11, 21, 31)
    assert proposer.candidates([10]) == [[20, 30]] and proposer.levels == [[20, 21], [30, 31]]
    proposer.remember((10, 1, 1))
    proposer.remember((10, 20, 30))
    assert proposer.candidates([10]) == [[20, 30], [1, 1]]
    proposer.remember((10, 2, 2))
    assert proposer.candidates([10]) == [[2, 2], [20, 30]]
    assert proposer.propose([4, 10], 1, Sampling())[0] == [2]


def test_the_contexts_ngrams_join_the_pool():
    """from_context: each n-gram of the context once, as the context grows; not without it."""
    proposer = LookaheadProposer(2, 3, 2)
    context = [1, 2, 3, 1, 2]
    assert proposer.candidates(context) == [[3, 1]]
    assert proposer.candidates(context + [3]) == [[1, 2]]  # (3, 1, 2)
    assert proposer.candidates(context + [3, 9, 2]) == [[3, 9], [3, 1]]  # (2, 3, 9): the most recent
    assert LookaheadProposer(2, 3, 2, from_context=False).candidates(context) == []


# ---------------------------------------------------------------- the forward

@pytest.mark.parametrize("fast", [False, True], ids=["reference", "kernels"])
def test_lookahead_forward_gives_each_token_its_sequences_logits(fast):
    """Each token's logits equal plain decoding's after the context and the tokens it sees, in offset
    order (float64; the CPU fast paths in float32 agree)."""
    if fast and not kernels.available():
        pytest.skip("the CPU kernels are not built")
    reference = random_model(seed=3).double()
    model = kernels.install(copy.deepcopy(reference).float()) if fast else reference
    model.setup_caches(1, 64, dtype=torch.float32 if fast else torch.float64)
    context = [3, 17, 99, 4, 250, 8, 61]
    proposer = LookaheadProposer(3, 3, 2)
    proposer.start(context)
    proposer.pool = {61: [(5, 6), (5, 9)]}
    chunk = proposer.branches(context)
    start, T = len(context) - 1, len(chunk.tokens)
    model(torch.tensor([context[:-1]]), torch.arange(start))
    batch = ForwardBatch(torch.tensor([chunk.offsets]) + start, torch.arange(start, start + T).view(1, -1),
                         torch.zeros(1, 1, dtype=torch.long), 64, start + T, tree_mask=chunk.mask[None])
    logits = model(torch.tensor([chunk.tokens]), batch)[0]
    tolerance = 1e-4 if fast else 1e-6
    for t in range(len(chunk.tokens)):
        want = last_logits(reference, context[:-1] + [chunk.tokens[j] for j in seen(chunk, t)])
        torch.testing.assert_close(logits[t], want, rtol=tolerance, atol=tolerance)


# ---------------------------------------------------------------- greedy

SIZES = [(3, 3, 2), (2, 4, 3), (4, 2, 1)]


@pytest.mark.parametrize("sizes", SIZES, ids=[",".join(map(str, s)) for s in SIZES])
@pytest.mark.parametrize("window", list(WINDOWS))
def test_greedy_lookahead_is_token_identical(sizes, window):
    """Three prompts (the last one repeats itself) against a window of 3 keys where a window token
    stands further out, with the context's n-grams in the pool and without; n-grams are accepted."""
    target = random_model(seed=0, **WINDOWS[window])
    accepted = {True: 0, False: 0}
    for prompt in PROMPTS:
        expected = plain_greedy(target, prompt, 32)
        for from_context in accepted:
            spec = lookahead_engine(target, sizes, proposer=LookaheadProposer(*sizes, from_context=from_context))
            (out,), stats = spec.generate([prompt], 32, Sampling())
            assert out == expected, (prompt, from_context)
            accepted[from_context] += sum(stats.histogram[1:])
    assert accepted[True] > 0 and accepted[False] > 0, accepted


@pytest.mark.parametrize("window", [None, 6])
def test_lookahead_leaves_the_cache_of_a_plain_run(window):
    """float64: the kept positions hold a plain run's keys and values, nothing of the window's, and
    a later request over the context gets the plain run's logits."""
    target = random_model(seed=0, sliding_window=window).double()
    prompt = PROMPTS[0]  # (where rounds accept n-grams with either model)
    expected = plain_greedy(copy.deepcopy(target), prompt, 40)
    spec = lookahead_engine(target, (3, 3, 3))
    started = recorded_requests(spec.engine)
    (out,), stats = spec.generate([prompt], 40, Sampling())
    assert out == expected and sum(stats.histogram[1:]) > 0
    (row,) = started
    context = prompt + out
    assert row.fed == len(context) - 1
    with torch.inference_mode():
        assert_target_cache_is_a_plain_run(spec.engine, row, prompt, context)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_model(smollm2_dir), Tokenizer(smollm2_dir)


@pytest.mark.parametrize("prompt", [REPEAT, OPEN_ENDED], ids=["repetitive", "open-ended"])
def test_greedy_lookahead_on_smollm2_is_token_identical(smollm2, prompt):
    """The list repeated back: rounds accept the prompt's n-grams, and the trajectory's alone (1.83
    and 1.38 tokens a forward when written)."""
    model, tok = smollm2
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]), add_bos=False)
    expected = plain_greedy(model, ids, 48, tok.eos_ids, max_seq_length=256)
    for from_context, least in ((True, 1.5), (False, 1.2)):
        proposer = LookaheadProposer(4, 3, 3, from_context=from_context)
        spec = lookahead_engine(model, (4, 3, 3), max_seq_length=256, proposer=proposer)
        (out,), stats = spec.generate([ids], 48, Sampling(), tok.eos_ids)
        assert out == expected, from_context
        if prompt == REPEAT:
            assert spec.metrics(stats)["tokens_per_target_forward"] > least, (from_context, spec.metrics(stats))


def test_compiled_lookahead_rounds_match_plain_greedy(monkeypatch):
    """The warmed-up graph with a mask serves every round (guards checked on every call, recompiling
    refused) and gives plain greedy's output on the CPU fast paths."""
    target = kernels.install(random_model(seed=0))
    prompt = PROMPTS[2]
    expected = plain_greedy(target, prompt, 32)
    spec = lookahead_engine(target, (3, 3, 2), compile=True)
    spec.warm_up([prompt], Sampling())
    monkeypatch.setattr("engine.guards_skipped", lambda skip: contextlib.nullcontext())
    with torch.compiler.set_stance("fail_on_recompile"):
        (out,), stats = spec.generate([prompt], 32, Sampling())
    assert out == expected and sum(stats.histogram[1:]) > 0


@pytest.mark.parametrize("prompt", [REPEAT, OPEN_ENDED], ids=["repetitive", "open-ended"])
def test_adaptive_lookahead_plain_steps_where_rounds_do_not_pay(smollm2, prompt, monkeypatch):
    """With a round costing 2 plain steps (f(14) fixed), the planner runs lookahead rounds where the
    pool's n-grams are accepted (the list repeated back) and plain steps, with a probe now and then,
    where they are not (a story: more than three plain steps a round); greedy output identical."""
    monkeypatch.setattr(StepCosts, "observe", lambda self, n, seconds: None)
    model, tok = smollm2
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]), add_bos=False)
    expected = plain_greedy(model, ids, 64, tok.eos_ids, max_seq_length=256)
    spec = lookahead_engine(model, (4, 3, 3), max_seq_length=256, adaptive=True)
    spec.costs.seconds[:] = [1 + n / 14 for n in range(15)]
    (out,), stats = spec.generate([ids], 64, Sampling(), tok.eos_ids)
    assert out == expected
    rounds = sum(stats.histogram)
    if prompt == REPEAT:  # (23 tokens, then EOS: 16 forwards when written, 8 of them rounds)
        assert rounds >= 4 and sum(stats.histogram[1:]) >= 3, stats
    else:
        assert stats.plain_steps > 3 * rounds, stats


# ---------------------------------------------------------------- sampling

class SeededPool(LookaheadProposer):
    """A pool that holds two n-grams for every token from the start: every round verifies a tree."""

    def start(self, context, sampling=None):
        super().start(context, sampling)
        for a in range(V):
            for b in (a * 3 % V, (a + 5) % V):
                self.remember((a, b, (a + b) % V))


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
def test_lookahead_sampling_matches_the_target_distribution(sampling):
    """t1, t2, t3 sampled RUNS times with lookahead rounds against the enumerated target distribution:
    chi-square on (t1, t2, t3) and on (t2, t3), p > 1e-3 / 2 (as test_tree's check)."""
    target, _ = small_vocab_pair()
    spec = lookahead_engine(target, (2, 3, 2), max_seq_length=32, proposer=SeededPool(2, 3, 2))
    counts = sampled_counts(spec, SAMPLE_PROMPT, SAMPLINGS[sampling], RUNS)
    exact = exact_distribution(target, SAMPLE_PROMPT, SAMPLINGS[sampling])
    p = min(chi_square_p_value(counts, exact), chi_square_p_value(counts.sum(0), exact.sum(0)))
    assert p > 1e-3 / 2, p


def test_a_biased_acceptance_is_caught(monkeypatch):
    """Always accepting a node's first child, then sampling from the target, favours the pool's
    n-grams: the same check fails by far."""
    def first_children(tree, probs):
        children, path, node = tree.children(), [], 0
        while children[node]:
            node = children[node][0]
            path.append(node)
        return path, int(torch.multinomial(probs[node].float(), 1))

    monkeypatch.setattr(lookahead, "sampled_path", first_children)
    target, _ = small_vocab_pair()
    spec = lookahead_engine(target, (2, 3, 2), max_seq_length=32, proposer=SeededPool(2, 3, 2))
    counts = sampled_counts(spec, SAMPLE_PROMPT, SAMPLINGS["t=1"], RUNS)
    exact = exact_distribution(target, SAMPLE_PROMPT, SAMPLINGS["t=1"])
    assert chi_square_p_value(counts, exact) < 1e-6


# ---------------------------------------------------------------- the command line

def test_lookahead_sizes_are_checked():
    assert generate_args.lookahead_sizes("5,4,5") == (5, 4, 5)
    args = generate_args.parse_args(["--checkpoint", ".", "--lookahead"])
    assert generate_args.lookahead_sizes(args.lookahead) == (4, 3, 3)
    assert generate_args.verify_slots(args) == (14, "--lookahead")
    for text in ("4,1,3", "0,3,3", "4,3,0", "4,3", "a,b,c"):
        with pytest.raises(UserError, match="--lookahead"):
            generate_args.lookahead_sizes(text)


def test_cli_lookahead_end_to_end(smollm2_dir):
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--chat", "--prompt", REPEAT, "--lookahead", "4,3,3",
                   "--max_new_tokens", "24", "--no-compile", "--compare_plain")
    assert r.returncode == 0, r.stderr
    assert "apples, bread, cheese" in r.stdout and "output identical" in r.stderr, r.stdout + r.stderr
    assert "speculation (lookahead, k=2)" in r.stderr
    assert "--lookahead" in run_script("generate.py", "--help").stdout


CLI_ERRORS = {"n-gram of one": ["4,1,3"], "not numbers": ["four"], "with ngram": ["--ngram", "2"],
              "with suffix": ["--suffix"], "with a tree": ["--speculate_tree", "8"],
              "with a draft": ["--draft_checkpoint", "."]}


@pytest.mark.parametrize("case", list(CLI_ERRORS))
def test_cli_lookahead_errors_are_one_line(case, smollm2_dir):
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--no-compile", "--max_new_tokens", "4",
                   "--lookahead", *CLI_ERRORS[case])
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--" in lines[0], r.stderr
