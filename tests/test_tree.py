"""Tree verification (tree.py): the tree's description; a tree forward gives each node the logits of
its path fed alone (float64, the reference attention and the CPU kernel); compaction leaves the
cache as plain decoding of the accepted path; greedy tree rounds token-identical to plain greedy
(random trees on a random model, the suffix proposer's trees on SmolLM2); recursive rejection
sampling exact (chi-square against the enumerated distribution, p > 1e-3); the proposers' trees;
the command line."""
import contextlib
import copy
import random

import pytest
import torch

import kernels
from conftest import random_model, run_script
from engine import Engine
from loading import load_model
from kvcache import ForwardBatch
from proposers import NgramProposer, Proposer, SuffixProposer
from sampling import Sampling
from speculative import SpeculativeEngine
from suffix import SuffixIndex
from tokenizer import Tokenizer
from test_speculative import (PROMPTS, RUNS, SAMPLE_PROMPT, SAMPLINGS, V, chi_square_p_value, exact_distribution,
                              plain_greedy, sampled_counts, small_vocab_pair)
from test_suffix import REPEAT
from tree import Tree, compact, greedy_path, sampled_path

pytestmark = pytest.mark.usefixtures("one_thread")

# root 7; 1 -> (2 -> 3, 4), 5 -> 6: nodes 0..6 in that order
EXAMPLE = Tree([7, 1, 2, 3, 4, 5, 6], [-1, 0, 1, 2, 2, 0, 5])


# ---------------------------------------------------------------- the description

def test_from_paths_merges_shared_beginnings():
    tree = Tree.from_paths(7, [[1, 2, 3], [1, 2, 4], [5, 6], [1, 2]])
    assert tree == EXAMPLE
    assert tree.depths == [0, 1, 2, 3, 3, 1, 2]
    assert tree.children() == [[1, 5], [2], [3, 4], [], [], [6], []]


def test_ancestor_mask_is_each_nodes_path():
    mask = EXAMPLE.ancestor_mask()
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 2, 4]
    assert mask[6].nonzero().flatten().tolist() == [0, 5, 6]
    assert mask.diagonal().all() and not mask.triu(1).any()  # parents come first


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 0, 3, 1]])
def test_a_parent_after_its_child_is_refused(parents):
    with pytest.raises(ValueError):
        Tree(list(range(len(parents))), parents)


def test_greedy_path_follows_the_targets_argmax():
    assert greedy_path(EXAMPLE, [1, 2, 4, 0, 0, 0, 0]) == ([1, 2, 4], 0)  # the second child at depth 3
    assert greedy_path(EXAMPLE, [5, 0, 0, 0, 0, 6, 8]) == ([5, 6], 8)  # the root's second branch, to its leaf
    assert greedy_path(EXAMPLE, [9, 2, 3, 0, 0, 6, 0]) == ([], 9)  # no child holds the target's token


# ---------------------------------------------------------------- the forward and compaction

def tree_batch(start: int, tree: Tree, row_length: int) -> ForwardBatch:
    """Node t at slot start + t of row 0, at position start + its depth."""
    depths = torch.tensor([tree.depths]) + start
    return ForwardBatch(depths, torch.arange(start, start + len(tree)).view(1, -1), torch.zeros(1, 1, dtype=torch.long),
                        row_length, start + len(tree), tree_mask=tree.ancestor_mask().unsqueeze(0))


def last_logits(model, tokens: list, row_length: int = 64):
    """Plain decoding's logits after tokens: one prefill, fresh caches."""
    model.setup_caches(1, row_length)
    return model(torch.tensor([tokens]), torch.arange(len(tokens)))[0, -1]


CONTEXT = [3, 17, 99, 4, 250, 8, 61]
BIG = Tree.from_paths(CONTEXT[-1], [[5, 6, 7, 8], [5, 9], [10, 11, 12], [13], [10, 14, 15, 16]])


@pytest.mark.parametrize("fast", [False, True], ids=["reference", "kernels"])
def test_tree_forward_gives_each_node_its_paths_logits(fast):
    """Each node's logits equal plain decoding's after the context and its path (float64 weights and
    caches); the CPU
    fast paths (float32, up to attend_max_queries queries in the kernel) agree with them."""
    reference = random_model(seed=3).double()
    model = kernels.install(copy.deepcopy(reference).float()) if fast else reference
    if fast and not kernels.available():
        pytest.skip("the CPU kernels are not built")
    model.setup_caches(1, 64, dtype=torch.float64 if not fast else torch.float32)
    prefix = CONTEXT[:-1]
    model(torch.tensor([prefix]), torch.arange(len(prefix)))
    logits = model(torch.tensor([BIG.tokens]), tree_batch(len(prefix), BIG, 64))[0]  # (N, V)
    for node in range(len(BIG)):
        path = [BIG.tokens[i] for i in BIG.ancestor_mask()[node].nonzero().flatten().tolist()]
        want = last_logits(reference, prefix + path)
        tolerance = 1e-4 if fast else 1e-6  # (logits come back float32)
        torch.testing.assert_close(logits[node], want, rtol=tolerance, atol=tolerance)


def test_compaction_leaves_the_cache_of_plain_decoding():
    """After a tree forward, the path 10 -> 14 -> 15 (nodes fed at slots far apart) moved to the
    positions after the context: the next token's logits are plain decoding's."""
    model = random_model(seed=4).double()
    model.setup_caches(1, 64, dtype=torch.float64)
    prefix, start = CONTEXT[:-1], len(CONTEXT) - 1
    model(torch.tensor([prefix]), torch.arange(start))
    model(torch.tensor([BIG.tokens]), tree_batch(start, BIG, 64))
    path = [BIG.tokens.index(10), BIG.tokens.index(14), BIG.tokens.index(15)]
    source, target = torch.tensor([start + n for n in path]), torch.arange(start + 1, start + 4)
    compact(model, {False: (source, target), True: (source, target)})
    after = start + 4  # the root and three accepted nodes
    got = model(torch.tensor([[16]]), ForwardBatch.rows(torch.tensor([after]), 1, 64))[0, -1]
    torch.testing.assert_close(got, last_logits(model, CONTEXT + [10, 14, 15, 16]), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- greedy

class RandomTrees(Proposer):
    """Trees of random branches around the known greedy output: its true path sits on a random
    branch, sometimes cut short or wrong, among distractors; nodes past the first true one move."""

    name = "random trees"

    def __init__(self, expected: list, prompt_len: int, seed: int):
        self.expected, self.prompt_len, self.random = expected, prompt_len, random.Random(seed)

    def start(self, context, sampling=None):
        pass

    def propose(self, context, k, sampling):
        return [], None

    def propose_tree(self, context, nodes, depth):
        r, done = self.random, len(context) - self.prompt_len
        truth = self.expected[done:done + r.randint(0, depth)]
        if truth and r.random() < 0.3:
            truth[r.randrange(len(truth))] = r.randrange(256)
        paths = [[r.randrange(256) for _ in range(r.randint(1, depth))] for _ in range(r.randint(0, 3))]
        paths.insert(r.randint(0, len(paths)), truth)
        tree = Tree.from_paths(context[-1], paths)
        return Tree(tree.tokens[:nodes + 1], tree.parents[:nodes + 1])


WINDOWS = {"full": {}, "window 3": dict(sliding_window=3),
           "mixed": dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"])}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window", list(WINDOWS))
def test_greedy_over_random_trees_is_token_identical(seed, window):
    """Paths of up to 4 nodes against a window of 3 keys: a deep node must not see its far ancestors;
    a model mixing window and full layers keeps the sliding layers' keys in pools of their own. Every
    tree verified whole (trees cut by the cost model: test_spec_cost)."""
    target = random_model(seed=0, **WINDOWS[window])
    for prompt in PROMPTS:
        expected = plain_greedy(target, prompt, 24)
        spec = SpeculativeEngine(Engine(target, 1, 128), RandomTrees(expected, len(prompt), seed), 4, tree_nodes=10,
                                 adaptive=False)
        (out,), stats = spec.generate([prompt], 24, Sampling())
        assert out == expected
        assert sum(stats.histogram[2:]) > 0  # paths of two or more were accepted


def test_greedy_tree_on_smollm2_is_token_identical(smollm2_dir):
    model, tok = load_model(smollm2_dir), Tokenizer(smollm2_dir)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": REPEAT}]), add_bos=False)
    expected = plain_greedy(model, ids, 40, tok.eos_ids, max_seq_length=256)
    spec = SpeculativeEngine(Engine(model, 1, 256), SuffixProposer(), 8, tree_nodes=12)
    for _ in range(2):  # the second time the stored output is proposed too
        (out,), stats = spec.generate([ids], 40, Sampling(), tok.eos_ids)
        assert out == expected
    assert spec.metrics(stats)["tokens_per_target_forward"] > 2
    torch.manual_seed(0)  # sampled tree rounds run through (their exactness: the tests below)
    (out,), stats = spec.generate([ids], 24, Sampling(temperature=0.7, top_p=0.9), tok.eos_ids)
    assert 0 < len(out) <= 24 and sum(stats.histogram) > 0


def test_compiled_tree_rounds_match_plain_greedy(monkeypatch):
    """The warmed-up verify graph with a tree mask serves every tree size and position (guards checked
    on every call, recompiling refused) and gives plain greedy's output on the CPU fast paths."""
    target = kernels.install(random_model(seed=0))
    prompt = PROMPTS[2]
    expected = plain_greedy(target, prompt, 32)
    spec = SpeculativeEngine(Engine(target, 1, 128, compile=True), RandomTrees(expected, len(prompt), 0), 4,
                             compile=True, adaptive=False, tree_nodes=10)
    spec.warm_up([prompt], Sampling())
    monkeypatch.setattr("engine.guards_skipped", lambda skip: contextlib.nullcontext())
    with torch.compiler.set_stance("fail_on_recompile"):
        (out,), stats = spec.generate([prompt], 32, Sampling())
    assert out == expected and sum(stats.histogram[2:]) > 0


# ---------------------------------------------------------------- sampling

def output_distribution(tree: Tree, probs: torch.Tensor) -> dict:
    """Exact P(accepted path tokens + the next token) when the target samples from probs[node]
    after each node: a token that is a child's goes on from that child."""
    out, children = {}, tree.children()

    def walk(node, prefix, prob):
        by_token = {tree.tokens[c]: c for c in children[node]}
        for token, p in enumerate(probs[node].tolist()):
            if token in by_token:
                walk(by_token[token], prefix + (token,), prob * p)
            elif p > 0:
                out[prefix + (token,)] = prob * p

    walk(0, (), 1.0)
    return out


def test_recursive_rejection_sampling_over_a_tree_is_exact():
    """20000 draws of sampled_path over a tree with two and three children per node, against the
    exact distribution of its outputs: chi-square p > 1e-3 (a wrong residual fails by far)."""
    torch.manual_seed(0)
    tree = Tree.from_paths(0, [[1, 2], [1, 3], [2, 4], [3]])
    probs = torch.softmax(torch.randn(len(tree), 5) * 1.5, dim=-1)
    exact = output_distribution(tree, probs)
    counts = dict.fromkeys(exact, 0)
    for _ in range(20000):
        path, token = sampled_path(tree, probs)
        counts[tuple(tree.tokens[n] for n in path) + (token,)] += 1
    keys = sorted(exact)
    p = chi_square_p_value(torch.tensor([float(counts[k]) for k in keys]), torch.tensor([exact[k] for k in keys]))
    assert p > 1e-3, p


class FixedTree(Proposer):
    """Every round the same tree over the small vocabulary: three first tokens, two after each."""

    name = "fixed tree"

    def start(self, context, sampling=None):
        pass

    def propose(self, context, k, sampling):
        return [], None

    def propose_tree(self, context, nodes, depth):
        return Tree.from_paths(context[-1], [[a, b][:depth] for a in (1, 4, 6) for b in (0, 5)])


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
def test_tree_sampling_matches_the_target_distribution(sampling):
    """t1, t2, t3 sampled RUNS times with tree rounds against the enumerated target distribution:
    chi-square on (t1, t2, t3) and on (t2, t3), p > 1e-3 / 2 (as test_speculative's chain check)."""
    target, _ = small_vocab_pair()
    spec = SpeculativeEngine(Engine(target, 1, 32), FixedTree(), 2, tree_nodes=9)
    counts = sampled_counts(spec, SAMPLE_PROMPT, SAMPLINGS[sampling], RUNS)
    exact = exact_distribution(target, SAMPLE_PROMPT, SAMPLINGS[sampling])
    assert counts.shape == (V, V, V)
    p = min(chi_square_p_value(counts, exact), chi_square_p_value(counts.sum(0), exact.sum(0)))
    assert p > 1e-3 / 2, p


# ---------------------------------------------------------------- proposers

def test_suffix_continuations_are_best_first():
    index = SuffixIndex(depth=4)
    index.start([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2, 5, 1])
    tokens, parents = index.continuations([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2, 5, 1], 3, 3, min_prob=0.0)
    assert tokens[0] == 2 and parents[0] == -1  # after 1 always came 2
    assert tokens[1] == 3 and parents[1] == 0  # then 3 (twice as often as 4 or 5)
    assert all(p < i for i, p in enumerate(parents))
    assert index.continuations([9, 9], 5, 3) == ([], [])


def test_ngram_tree_holds_every_matching_lengths_continuation():
    proposer = NgramProposer(3)
    context = [1, 2, 3, 1, 9, 3, 4, 2, 3]  # "4 2 3": no match; "2 3" -> 1 9; "3" (most recently) -> 4 2
    tree = proposer.propose_tree(context, 8, 2)
    assert tree.tokens == [3, 1, 9, 4, 2] and tree.parents == [-1, 0, 1, 0, 3]
    assert tree.tokens[1:3] == proposer.propose(context, 2, Sampling())[0]  # the chain: the longest match's
    assert len(proposer.propose_tree(context, 3, 2)) == 4  # cut to 3 candidates
    same = NgramProposer(3).propose_tree([4, 5, 6, 9, 5, 6, 1, 5, 6], 8, 2)  # "5 6" and "6" -> 1 5: one path
    assert same.tokens[1:] == [1, 5]


# ---------------------------------------------------------------- the command line

def test_cli_suffix_tree_end_to_end(smollm2_dir):
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--chat", "--prompt", REPEAT, "--suffix",
                   "--speculate_tree", "12", "--speculate_k", "6", "--max_new_tokens", "24", "--no-compile",
                   "--compare_plain")
    assert r.returncode == 0, r.stderr
    assert "apples, bread, cheese" in r.stdout and "identical" in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("rest", [["--speculate_tree", "8"], ["--suffix", "--speculate_tree", "-1"]],
                         ids=["without a proposer", "negative"])
def test_cli_tree_errors_are_one_line(rest, smollm2_dir):
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--no-compile", "--max_new_tokens", "4", *rest)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
