"""staged.py: tree rounds of a draft token-identical to plain greedy (the target itself as the draft,
a noisy and a random draft; SmolLM2 as its own draft), paths kept through a sibling; the second
stage drafting the very chain the draft drafts alone, with fewer draft forwards on a repetitive
prompt; multi-draft rejection sampling exact (chi-square, and a wrong q caught), the engine's
sampled tokens the target's distribution, a draft equal to the target accepted whole; compiled
rounds without a recompile; host rounds (penalties) over chains; the command line."""
import contextlib

import pytest
import torch

import kernels
import speculative
from conftest import random_model, run_script
from engine import Engine
from loading import load_model
from proposers import DraftProposer
from sampling import Sampling
from speculative import SpeculativeEngine
from staged import StagedProposer
from tokenizer import Tokenizer
from test_speculative import (PROMPTS, RUNS, SAMPLE_PROMPT, SAMPLINGS, V, chi_square_p_value, exact_distribution,
                              noisy_copy, plain_greedy, sampled_counts, small_vocab_pair)
from test_suffix import REPEAT
from tree import Tree, sampled_path

pytestmark = pytest.mark.usefixtures("one_thread")

ALWAYS = 1.01  # branch_below: a sibling wherever the tree has room for one


def staged_engine(target, draft, k=4, nodes=10, max_seq_length=128, compile=False, adaptive=True, **options):
    proposer = StagedProposer(draft, compile=compile, **options)
    return SpeculativeEngine(Engine(target, 1, max_seq_length, compile=compile), proposer, k, compile=compile,
                             adaptive=adaptive, tree_nodes=nodes)


def recorded_paths(monkeypatch) -> list:
    """Every greedy tree round's (tree, accepted path), as speculative.py walks it."""
    paths, walk = [], speculative.greedy_path

    def recording(tree, target):
        path, token = walk(tree, target)
        paths.append((tree, path))
        return path, token
    monkeypatch.setattr(speculative, "greedy_path", recording)
    return paths


def through_a_sibling(tree: Tree, path: list) -> bool:
    """Whether the path leaves the draft's chain (each node's first child) somewhere."""
    children = tree.children()
    return any(children[tree.parents[node]][0] != node for node in path)


# ---------------------------------------------------------------- greedy

@pytest.mark.parametrize("lookup", [True, False], ids=["lookup", "draft alone"])
@pytest.mark.parametrize("draft", ["target", "noisy", "random"])
def test_staged_greedy_is_token_identical(draft, lookup, monkeypatch):
    target = random_model(seed=0)
    drafts = {"target": random_model(seed=0), "noisy": noisy_copy(target, 0.05), "random": random_model(seed=3)}
    paths = recorded_paths(monkeypatch)
    for prompt in PROMPTS:
        expected = plain_greedy(target, prompt, 40)
        for adaptive in (True, False):  # the cost model's cut of each tree, then whole trees
            seen = len(paths)
            spec = staged_engine(target, drafts[draft], lookup=lookup, branch_below=ALWAYS, adaptive=adaptive)
            (out,), stats = spec.generate([prompt], 40, Sampling())
            assert out == expected, (prompt, adaptive)
            assert stats.draft_forwards > 0
            if adaptive:  # a cut tree need not keep a sibling at every depth
                del paths[seen:]
            elif draft == "target":  # the draft's cache stays the target's: its chains are kept
                assert spec.metrics(stats)["tokens_per_target_forward"] > 2.5
    assert all(len(tree) == 1 + 2 * max(tree.depths) for tree, _ in paths)  # a sibling at every depth
    if draft == "noisy":
        assert any(through_a_sibling(tree, path) for tree, path in paths)


def test_staged_greedy_on_smollm2_as_its_own_draft(smollm2_dir):
    """SmolLM2 drafting for itself on a prompt it repeats: token-identical, several tokens a target
    forward, and the second stage needs fewer draft forwards for the same output."""
    model, tok = load_model(smollm2_dir), Tokenizer(smollm2_dir)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": REPEAT}]), add_bos=False)
    expected = plain_greedy(model, ids, 40, tok.eos_ids, max_seq_length=256)
    draft = load_model(smollm2_dir)
    forwards = {}
    for lookup in (False, True):
        spec = staged_engine(model, draft, k=6, nodes=12, max_seq_length=256, lookup=lookup)
        (out,), stats = spec.generate([ids], 40, Sampling(), tok.eos_ids)
        assert out == expected
        assert spec.metrics(stats)["tokens_per_target_forward"] > 2
        forwards[lookup] = stats.draft_forwards
    assert forwards[True] < 0.75 * forwards[False], forwards


def contexts_of_its_own_output(draft, prompt, n) -> list:
    """prompt + the draft's greedy output, cut after each of its tokens: contexts where the
    draft's continuation often repeats what came before (a small random model falls into loops)."""
    out = plain_greedy(draft, prompt, n)
    return [prompt + out[:i] for i in range(n - 8)]


@pytest.mark.parametrize("vocab", [256, V])
def test_lookup_drafts_the_chain_the_draft_drafts_alone(vocab):
    """Greedy, no siblings: the staged draft's tree is the plain draft's chain of 6, with the
    second stage or without; with it, fewer draft forwards (the draft agrees with its n-grams).
    (float64: a chunk's logits and a step's round alike, no near-tie flips a pick)"""
    draft = random_model(seed=5, vocab_size=vocab, std=0.4)
    contexts = [c for prompt in PROMPTS for c in contexts_of_its_own_output(draft, [t % vocab for t in prompt], 24)]
    draft.double()
    counts = {True: 0, False: 0}
    for context in contexts:
        plain = DraftProposer(draft)
        plain.setup(64)
        plain.start(context, Sampling())
        chain, _ = plain.propose(context, 6, Sampling())
        for lookup in (True, False):
            staged = StagedProposer(draft, branch_below=0.0, lookup=lookup)
            staged.setup(64)
            staged.start(context, Sampling())
            before = staged.forwards
            tree = staged.propose_tree(context, 8, 6)
            assert tree.tokens == [context[-1]] + chain and tree.parents == list(range(-1, 6))
            counts[lookup] += staged.forwards - before
    assert counts[True] < counts[False], counts


def test_the_drafts_cache_follows_the_path_the_target_keeps():
    """Whatever path of a tree the target keeps (through a sibling, or none of it), the next
    round's tree is the one a draft started afresh on the new context drafts."""
    draft, twin = random_model(seed=3).double(), random_model(seed=3).double()
    rng = torch.Generator().manual_seed(0)
    staged = StagedProposer(draft, branch_below=ALWAYS)
    staged.setup(96)
    context = list(PROMPTS[1])
    staged.start(context, Sampling())
    kept_siblings = 0
    for _ in range(12):
        tree = staged.propose_tree(context, 8, 4)
        node = int(torch.randint(len(tree), (), generator=rng))
        path = [n for n in range(len(tree)) if tree.ancestor_mask()[node, n] and n]
        kept_siblings += through_a_sibling(tree, path)
        context = context + [tree.tokens[n] for n in path] + [int(torch.randint(256, (), generator=rng))]
        staged.accepted(len(path))
        fresh = StagedProposer(twin, branch_below=ALWAYS)
        fresh.setup(96)
        fresh.start(context, Sampling())
        assert staged.propose_tree(context, 8, 4) == fresh.propose_tree(context, 8, 4)
        staged.accepted(0)  # (the tree compared is not verified: the next one starts from the same context)
    assert kept_siblings > 0


def test_host_rounds_keep_the_chain():
    """A repetition penalty picks on the host: staged rounds there are the draft's chains, with the
    target's own output."""
    target = random_model(seed=0)
    penalized = Sampling(repetition_penalty=1.3)
    for prompt in PROMPTS:
        (expected,), _ = Engine(target, 1, 128).generate([prompt], 24, penalized)
        spec = staged_engine(target, noisy_copy(target, 0.05))
        (out,), stats = spec.generate([prompt], 24, penalized)
        assert out == expected and sum(stats.histogram) > 0


# ---------------------------------------------------------------- sampling

def two_level_draws(p0, p1, q0, q1, tree_q: bool, runs: int) -> torch.Tensor:
    """(t1, t2) counts over runs rounds: the root's two children and the first child's two drawn
    independently from q0 and q1[child]; the target's p0 after the root and p1[t] after a token t.
    Where the round hands out one token, the next round's (from p1) completes the pair."""
    counts = torch.zeros(len(p0), len(p0))
    for _ in range(runs):
        a, b = torch.multinomial(q0, 2, replacement=True).tolist()
        c, d = torch.multinomial(q1[a], 2, replacement=True).tolist()
        q = torch.stack([q0, q1[a], q1[b], q1[c], q1[d]]) if tree_q else torch.full((5, len(p0)), 1 / len(p0))
        tree = Tree([0, a, b, c, d], [-1, 0, 0, 1, 1], q)
        probs = torch.stack([p0, p1[a], p1[b], p1[c], p1[d]])
        path, token = sampled_path(tree, probs)
        out = [tree.tokens[n] for n in path] + [token]
        if len(out) == 1:
            out.append(int(torch.multinomial(p1[out[0]], 1)))
        counts[out[0], out[1]] += 1
    return counts


def test_multi_draft_rejection_sampling_is_exact_and_a_wrong_q_is_caught():
    """Children drawn from q, accepted by min(1, r / q): (t1, t2) has the target's distribution
    (chi-square, p > 1e-3); the same draws claimed to come from a uniform q do not (p < 1e-6)."""
    torch.manual_seed(0)
    n = 5
    p0, p1 = torch.softmax(torch.randn(n) * 1.5, -1), torch.softmax(torch.randn(n, n) * 1.5, -1)
    q0, q1 = torch.softmax(torch.randn(n) * 1.5, -1), torch.softmax(torch.randn(n, n) * 1.5, -1)
    exact = p0.view(n, 1) * p1
    assert chi_square_p_value(two_level_draws(p0, p1, q0, q1, True, 20000), exact) > 1e-3
    assert chi_square_p_value(two_level_draws(p0, p1, q0, q1, False, 20000), exact) < 1e-6


@pytest.mark.parametrize("lookup", [True, False], ids=["lookup", "draft alone"])
@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
def test_staged_sampling_matches_the_target_distribution(sampling, lookup):
    """t1, t2, t3 sampled RUNS times with staged tree rounds (k=2, a sibling at every depth) against
    the enumerated target distribution, as test_tree's check."""
    target, draft = small_vocab_pair()
    spec = staged_engine(target, draft, k=2, nodes=4, max_seq_length=32, lookup=lookup, branch_below=ALWAYS)
    counts = sampled_counts(spec, SAMPLE_PROMPT, SAMPLINGS[sampling], RUNS)
    exact = exact_distribution(target, SAMPLE_PROMPT, SAMPLINGS[sampling])
    p = min(chi_square_p_value(counts, exact), chi_square_p_value(counts.sum(0), exact.sum(0)))
    assert p > 1e-3 / 2, p


def test_a_draft_equal_to_the_target_is_accepted_whole_when_sampling():
    """With q = p every drafted child is accepted (min(1, p / q) = 1): nearly every round keeps
    its whole chain, where point masses would be kept with the target's probability only."""
    target = random_model(seed=0)
    spec = staged_engine(target, random_model(seed=0), k=4, adaptive=False)
    torch.manual_seed(0)
    (out,), stats = spec.generate([PROMPTS[0]], 41, Sampling(temperature=1.0))
    assert len(out) == 41
    assert stats.histogram[4] >= 0.8 * sum(stats.histogram), stats.histogram


# ---------------------------------------------------------------- compile

def test_compiled_staged_rounds_match_plain_greedy_without_recompiling(monkeypatch):
    """The draft's one-token step and its chunk of guesses, warmed up, serve every round (guards
    checked on every call, recompiling refused), with plain greedy's output: the target as its
    own draft, trees of every size up to 9 nodes (a sibling wherever there is room), chunks of
    every length (prompt lookup on a repeating prompt)."""
    target, draft = kernels.install(random_model(seed=0)), kernels.install(random_model(seed=0))
    prompt = PROMPTS[2]
    expected = plain_greedy(target, prompt, 32)
    spec = staged_engine(target, draft, compile=True, branch_below=ALWAYS)
    spec.warm_up([prompt], Sampling())
    monkeypatch.setattr("engine.guards_skipped", lambda skip: contextlib.nullcontext())
    with torch.compiler.set_stance("fail_on_recompile"):
        (out,), stats = spec.generate([prompt], 32, Sampling())
    assert out == expected and sum(stats.histogram[2:]) > 0
    assert spec.proposer.rows_ready is None and spec.proposer.ready is None  # both graphs taken up


# ---------------------------------------------------------------- the command line

def test_cli_staged_end_to_end(smollm2_dir):
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--draft_checkpoint", smollm2_dir, "--staged",
                   "--chat", "--prompt", REPEAT, "--max_new_tokens", "24", "--no-compile", "--compare_plain")
    assert r.returncode == 0, r.stderr
    assert "apples, bread, cheese" in r.stdout and "identical" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "speculation (staged" in r.stderr, r.stderr


@pytest.mark.parametrize("rest", [["--staged"], ["--staged", "--ngram", "3"], ["--draft_checkpoint", "DRAFT",
                                                                                 "--speculate_tree", "8"]],
                         ids=["without a draft", "with n-grams", "a tree without --staged"])
def test_cli_staged_errors_are_one_line(rest, smollm2_dir):
    rest = [str(smollm2_dir) if a == "DRAFT" else a for a in rest]
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--no-compile", "--max_new_tokens", "4", *rest)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
