"""suffix.py and the suffix proposer: the trie's counts (built incrementally, removed exactly), the
longest match, the most frequent continuation and where it stops, the store's cap and LRU order (in
plain Python); greedy output token-identical to plain decoding (a random model; SmolLM2 asked to
repeat a list, then the same task again, proposed from the stored output), the sampled distribution
the target's, and the command line."""
import json

import pytest
import torch

from conftest import TEST_DEVICE, random_model, run_script
from engine import Engine
from loading import load_model
from proposers import SuffixProposer
from sampling import Sampling
from speculative import SpeculativeEngine
from suffix import SuffixIndex, SuffixTrie
from test_speculative import (PROMPTS, RUNS, SAMPLE_PROMPT, SAMPLINGS, chi_square_p_value, exact_distribution,
                              plain_greedy, sampled_counts, small_vocab_pair)
from tokenizer import Tokenizer


def trie_of(*sequences, depth=4) -> SuffixTrie:
    trie = SuffixTrie(depth)
    for seq, tokens in enumerate(sequences):
        trie.extend([], tokens, seq)
    return trie


def all_counts(trie: SuffixTrie) -> dict:
    """substring -> count, for every node."""
    out, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.next.items():
            out[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return out


def brute_counts(sequences, depth) -> dict:
    out = {}
    for s in sequences:
        for i in range(len(s)):
            for j in range(i + 1, min(i + depth, len(s)) + 1):
                out[tuple(s[i:j])] = out.get(tuple(s[i:j]), 0) + 1
    return out


def test_trie_counts_every_substring_up_to_its_depth():
    a, b = [1, 2, 3, 1, 2, 4, 1, 2, 3], [2, 3, 5]
    trie = trie_of(a, b)
    assert all_counts(trie) == brute_counts([a, b], 4)
    assert trie.count([1, 2]) == 3 and trie.count([1, 2, 3]) == 2 and trie.count([2, 3]) == 3
    assert trie.count([1, 2, 3, 1, 2]) == 0  # the trie counts substrings of at most `depth` tokens


def test_incremental_extension_equals_building_at_once():
    tokens = [7, 1, 7, 1, 7, 2, 9, 7, 1, 7]
    trie, tails = SuffixTrie(5), []
    for i in range(0, len(tokens), 3):  # in rounds of up to 3 tokens, as accepted blocks arrive
        tails = trie.extend(tails, tokens[i:i + 3], 0)
    assert all_counts(trie) == all_counts(trie_of(tokens, depth=5))
    assert len(tails) == 5 and all(tails[i] is trie.find(tokens[-1 - i:]) for i in range(5))


def test_removing_a_sequence_leaves_the_others_counts():
    a, b = [1, 2, 3, 1, 2, 4], [2, 3, 1, 2, 9]
    trie = trie_of(a, b)
    trie.remove(a)
    assert all_counts(trie) == brute_counts([b], 4)
    trie.remove(b)
    assert trie.root.next == {}


def test_longest_match_needs_a_continuation_and_min_match():
    trie = trie_of([5, 1, 2, 3, 8, 0, 2, 3], depth=6)
    assert trie.longest_match([4, 1, 2, 3], 1) is trie.find([1, 2, 3])  # seen followed by 8
    assert trie.longest_match([9, 9, 0, 2, 3], 1) is trie.find([2, 3])  # (0, 2, 3) only ends the sequence
    assert trie.longest_match([9, 9, 0, 2, 3], 3) is None
    assert trie.longest_match([4, 4], 1) is None


def test_continuation_follows_the_most_frequent_path():
    index = SuffixIndex(depth=6, min_match=1, min_prob=0.0)
    context = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]
    index.start(context)
    assert index.continuation(context, 3) == [3, 1, 2]  # (1, 2) was followed by 3 twice, by 4 once
    context = [5, 6, 7, 8, 9, 5, 6]
    index.start(context)
    assert index.continuation(context, 8) == [7, 8, 9, 5, 6, 7, 8, 9]  # re-matched past the trie's depth
    assert index.continuation(context + [0], 3) == []  # 0 never seen: no proposal


def test_continuation_stops_where_it_becomes_unlikely():
    context = [1, 2, 3, 1, 2, 4, 1, 2, 5, 6, 1, 2]  # after (1, 2): 3, 4 and 5, once each
    assert SuffixIndex(depth=6, min_match=1, min_prob=0.5).continuation(context, 4) == []
    sure = [9, 1, 2, 3, 4, 9, 1, 2, 3, 7, 9, 1]  # after (9, 1): 2 twice, then (2, 3) sure, then 4 or 7
    assert SuffixIndex(depth=8, min_match=1, min_prob=0.6).continuation(sure, 5) == [2, 3]
    assert SuffixIndex(depth=8, min_match=1, min_prob=0.4).continuation(sure, 5) == [2, 3, 4, 9, 1]
    assert SuffixIndex(depth=8, min_match=3, min_prob=0.0).continuation(sure, 5) == []  # (9, 1) too short


def test_a_later_call_continuing_the_sequence_extends_it():
    index = SuffixIndex(depth=4)
    index.start([1, 2, 3])
    index.continuation([1, 2, 3, 4], 2)
    index.start([1, 2, 3, 4, 5])  # a chat's next turn: no copy of the earlier turns is stored
    assert index.stored == {} and index.tokens == [1, 2, 3, 4, 5] and index.trie.count([1, 2]) == 1


def test_the_store_makes_an_earlier_output_proposable():
    index = SuffixIndex(depth=8, min_match=2)
    index.start([50, 51, 52, 53])
    index.continuation([50, 51, 52, 53, 10, 11, 12, 13, 14], 4)  # the output 10..14
    index.start([50, 51, 52, 53])  # the same prompt again
    assert list(index.stored.values()) == [[50, 51, 52, 53, 10, 11, 12, 13, 14]]
    assert index.continuation([50, 51, 52, 53], 4) == [10, 11, 12, 13]


def test_the_store_drops_the_least_recently_used_past_its_cap():
    index = SuffixIndex(depth=4, min_match=2, store_tokens=8)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    index.start(a)
    index.start(b)
    index.start([1, 2])
    assert index.continuation([1, 2], 1) == [3]  # follows a: a is now the most recently used
    index.start(c)  # stores [1, 2]: 10 tokens held, b (least recently used) goes
    assert list(index.stored.values()) == [a, [1, 2]] and index.stored_size == 6
    assert index.trie.count([5, 6]) == 0 and index.trie.count([1, 2]) == 2
    assert all_counts(index.trie) == brute_counts([a, [1, 2], c], 4)
    nothing = SuffixIndex(depth=4, store_tokens=0)
    nothing.start(a)
    nothing.start(b)
    assert nothing.stored == {} and all_counts(nothing.trie) == brute_counts([b], 4)


@pytest.mark.parametrize("options", [dict(depth=1), dict(min_match=0), dict(min_match=8), dict(min_prob=2),
                                     dict(store_tokens=-1)])
def test_bad_options_are_refused(options):
    with pytest.raises(ValueError):
        SuffixIndex(**options)


# ---------------------------------------------------------------- with a model

def suffix_engine(model, k, max_seq_length=256, **options):
    return SpeculativeEngine(Engine(model, 1, max_seq_length), SuffixProposer(**options), k)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_suffix_greedy_is_token_identical_on_a_random_model(k, adaptive):
    target = random_model(seed=0, device=TEST_DEVICE)
    expected = [plain_greedy(target, prompt, 24) for prompt in PROMPTS]
    spec = suffix_engine(target, k, 128, min_prob=0.0)  # propose wherever anything matches
    spec.adaptive = adaptive  # (adaptive: the cost model verifies only what pays, maybe nothing here)
    proposed = 0
    for prompt, want in [*zip(PROMPTS, expected)] * 2:  # the second time, earlier outputs are in the store
        (out,), stats = spec.generate([prompt], 24, Sampling())
        assert out == want
        proposed += stats.proposed
    assert proposed > 0 or adaptive


@pytest.mark.usefixtures("one_thread")
def test_suffix_sampling_matches_the_target_distribution():
    """Proposals from this call's context and from earlier samples' outputs are point masses: the
    rejection sampling keeps the target's distribution (the chi-square check of test_speculative)."""
    target, _ = small_vocab_pair()
    spec = suffix_engine(target, 2, 32, min_prob=0.0)
    counts = sampled_counts(spec, SAMPLE_PROMPT, SAMPLINGS["t=1"], RUNS)
    exact = exact_distribution(target, SAMPLE_PROMPT, SAMPLINGS["t=1"])
    assert spec.proposer.index.stored  # earlier samples were there to propose from
    p = min(chi_square_p_value(counts, exact), chi_square_p_value(counts.sum(0), exact.sum(0)))
    assert p > 1e-3 / 2, p


REPEAT = "Repeat this list exactly: apples, bread, cheese, dates, eggs, flour, grapes, honey, ice cream, jam."


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    model, tok = load_model(smollm2_dir), Tokenizer(smollm2_dir)
    return model, tok, tok.encode(tok.apply_chat_template([{"role": "user", "content": REPEAT}]), add_bos=False)


@pytest.mark.usefixtures("one_thread")
def test_suffix_greedy_is_token_identical_on_smollm2(smollm2):
    model, tok, ids = smollm2
    expected = plain_greedy(model, ids, 40, tok.eos_ids, max_seq_length=256)
    spec = suffix_engine(model, 8)
    (out,), first = spec.generate([ids], 40, Sampling(), tok.eos_ids)
    assert out == expected
    assert spec.metrics(first)["tokens_per_target_forward"] > 1.5  # the answer copies the list
    (out,), again = spec.generate([ids], 40, Sampling(), tok.eos_ids)  # the same task: the stored output hits
    assert out == expected and again.target_forwards < first.target_forwards, (again, first)


@pytest.mark.usefixtures("one_thread")
def test_suffix_sampling_is_verified_by_rejection_sampling(smollm2):
    model, tok, ids = smollm2
    spec = suffix_engine(model, 4)
    torch.manual_seed(0)
    (out,), stats = spec.generate([ids], 24, Sampling(temperature=0.7, top_p=0.9), tok.eos_ids)
    assert 0 < len(out) <= 24 and sum(stats.histogram) > 0 and stats.proposed > 0


def test_cli_suffix_end_to_end(smollm2_dir, tmp_path):
    mj = tmp_path / "m.json"
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--chat", "--prompt", REPEAT, "--suffix",
                   "--speculate_k", "6", "--max_new_tokens", "24", "--no-compile", "--num_samples", "2",
                   "--metrics_json", mj)
    assert r.returncode == 0, r.stderr
    first, second = json.loads(mj.read_text())
    assert first["proposer"] == "suffix" and r.stdout.count("apples, bread, cheese") == 2, r.stdout
    assert second["tokens_per_target_forward"] > first["tokens_per_target_forward"] > 1  # the second proposes the first


@pytest.mark.parametrize("rest", [["--suffix", "--ngram", "2"], ["--suffix", "--batch_size", "2"],
                                  ["--suffix", "--pp", "2"]], ids=["with ngram", "batch", "pipeline"])
def test_cli_suffix_errors_are_one_line(rest, smollm2_dir):
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--no-compile", "--max_new_tokens", "4", *rest)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
