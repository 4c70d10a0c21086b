"""The speculation cost model (spec_cost.py): each round's proposal count from what a verify costs
and how often proposals are accepted, none where plain decoding is faster; the server's rows per
request by its step's cost per row; a tree's nodes; threshold drafting."""
import pytest
import torch

import spec_cost
from conftest import TEST_DEVICE, random_model
from engine import Engine
from proposers import DraftProposer
from sampling import Sampling
from spec_cost import (Acceptance, ChainThreshold, LookaheadPlanner, Probe, RowCosts, Shadow, StepCosts,
                       TreeAcceptance, TreeShadow, best_count, best_tree, expected_tokens, grow_tree, share_rows)
from speculative import SpeculativeEngine
from test_speculative import PROMPTS, ScriptedProposer, noisy_copy, plain_greedy, sharpened
from tree import Tree


# ---------------------------------------------------------------- decisions, plain Python

def test_expected_tokens_counts_the_accepted_prefix_and_the_targets_token():
    assert expected_tokens([]) == [1.0]
    assert expected_tokens([0.5, 0.5]) == pytest.approx([1.0, 1.5, 1.75])
    assert expected_tokens([1.0] * 3) == [1.0, 2.0, 3.0, 4.0]


def test_best_count_maximizes_tokens_per_cost():
    # E = 1, 1.8, 2.2, 2.24 over f = 1, 1.2, 1.4, 1.6: gains 1.5, 1.571, 1.4
    assert best_count([0.8, 0.5, 0.1], [1.0, 1.2, 1.4, 1.6]) == 2
    assert best_count([0.9] * 8, [1 + 0.05 * n for n in range(9)]) == 8  # a cheap verify, a good proposer: all
    assert best_count([0.99] * 8, [1.0] * 9) == 8


def test_best_count_is_zero_when_nothing_beats_a_plain_step():
    assert best_count([0.1] * 8, [1 + 0.3 * n for n in range(9)]) == 0
    assert best_count([0.0] * 4, [1.0] * 5) == 0  # even a free verify gains nothing when nothing is accepted
    # 1.1 / 1.08 = 1.019: better than plain, but not by the margin
    assert best_count([0.1], [1.0, 1.08]) == 0 and best_count([0.1], [1.0, 1.08], min_gain=1.0) == 1


def test_best_count_charges_the_proposers_own_cost():
    rates, costs = [0.7] * 4, [1 + 0.1 * n for n in range(5)]
    assert best_count(rates, costs) == 4
    assert best_count(rates, costs, per_proposal=0.2) == 2  # gains 1.308, 1.358, 1.349, 1.303
    assert best_count(rates, costs, per_proposal=1.0) == 0  # a draft as costly as the target never pays


def test_step_costs_interpolate_extrapolate_and_cap_a_shorter_verify_by_a_longer():
    costs = StepCosts(8)
    assert costs.ratios() == pytest.approx([1 + spec_cost.PRIOR_PER_TOKEN * n for n in range(9)])  # nothing timed
    costs.seconds[:] = [0.010, 0.012, None, None, 0.018, None, None, None, None]
    f = costs.ratios()
    assert f[:5] == pytest.approx([1.0, 1.2, 1.4, 1.6, 1.8])
    assert f[8] == pytest.approx(1.8 + 4 * spec_cost.PRIOR_PER_TOKEN)
    costs.seconds[1] = 0.030  # a slow outlier: a longer verify's time overrules it
    assert costs.ratios()[1] == pytest.approx(1.8)
    costs.seconds[2] = 0.009  # a verify faster than a plain step (noise) counts as one plain step
    assert costs.ratios()[:3] == pytest.approx([1.0, 1.0, 1.0])
    first = StepCosts(4)
    first.observe(0, 0.010)
    first.observe(2, 1.0)  # a first verify 100x slower (a first call's setup): it moves the prior by a fifth
    assert first.ratios()[2] == pytest.approx(1.1 * 1.2)
    only_verify = StepCosts(4)
    only_verify.observe(2, 0.011)  # no plain step timed: its time is estimated from the verify's
    assert only_verify.plain_seconds() == pytest.approx(0.011 / (1 + 2 * spec_cost.PRIOR_PER_TOKEN))


def test_running_mean_falls_fast_and_rises_slowly():
    assert spec_cost.running_mean(None, 5.0) == 5.0
    assert spec_cost.running_mean(10.0, 2.0) == pytest.approx(6.0)
    assert spec_cost.running_mean(10.0, 1000.0) == pytest.approx(12.0)  # one slow step: at most a fifth


def test_acceptance_learns_per_position_rates():
    acceptance = Acceptance(4)
    assert acceptance.rates() == pytest.approx([spec_cost.PRIOR_RATE] * 4)
    for _ in range(30):
        acceptance.record(4, 1)  # the first always kept, the second never
    rates = acceptance.rates()
    assert rates[0] > 0.9 and rates[1] < 0.1
    assert rates[2] == pytest.approx(rates[3])  # never tried: the pooled rate
    for _ in range(30):
        acceptance.record(4, 0)
    assert acceptance.rates()[0] < 0.1  # recent rounds count most


def test_shadow_records_what_would_have_been_accepted():
    acceptance, shadow = Acceptance(4), Shadow()
    shadow.watch([7, 8, 9], at=10)
    shadow.watch([1, 1, 1], at=11)  # ignored while the first is unresolved
    known = list(range(10)) + [7, 8]
    shadow.check(known, acceptance)
    assert shadow.drafts and sum(acceptance.tried) == 0  # 2 matched so far: not resolved yet
    shadow.check(known + [5], acceptance)
    assert not shadow.drafts and acceptance.tried[:3] == [1, 1, 1] and acceptance.kept[:3] == [1, 1, 0]


def test_a_requests_acceptance_starts_from_the_servers():
    server = Acceptance(3)
    for _ in range(20):
        server.record(3, 3)
    request = Acceptance(3, parent=server)
    assert request.rates() == pytest.approx(server.rates()) and min(server.rates()) > 0.9
    for _ in range(20):
        request.record(3, 0)  # its own rounds outweigh the prior, and reach the server's counts too
    assert request.rates()[0] < 0.1 and server.rates()[0] < 0.2


# ---------------------------------------------------------------- the server's rows, plain Python

def test_row_costs_interpolate_extrapolate_and_never_fall_with_more_rows():
    costs = RowCosts()
    assert costs.curve(3) == pytest.approx([0.95, 1.0, 1.05, 1.1])  # nothing timed: the prior, in one-row steps
    costs.seconds.update({2: 0.10, 4: 0.12, 8: 0.20})
    t = costs.curve(10)
    assert t[2:9] == pytest.approx([0.10, 0.11, 0.12, 0.14, 0.16, 0.18, 0.20])
    assert t[10] == pytest.approx(0.20 + 2 * 0.10 / 6)  # past the last: the timed ones' mean slope
    assert t[1] == pytest.approx(0.10 - 0.05 * 0.10 / 1.05)  # before the first: PRIOR_PER_TOKEN of a one-row step per row
    costs.seconds[5] = 0.50  # a slow outlier: a wider step's time overrules it
    assert costs.curve(10)[5] == pytest.approx(costs.curve(10)[8])
    costs.observe(6, 10.0)  # a first step of 6 rows 60x slower: it moves the estimate by a fifth
    assert costs.seconds[6] == pytest.approx(0.20 * 1.2)


def test_share_rows_gives_a_lone_request_many_and_a_crowd_none():
    cheap = [0.1 * (1 + 0.05 * (r - 1)) for r in range(40)]  # the weights' read: rows nearly free
    assert share_rows(1, [[0.9] * 8], cheap) == [8]
    assert share_rows(1, [[0.5] * 8], cheap) == [3]  # E 1.875 over f 1.15: the best of 1 .. 8
    dear = [0.1 * r for r in range(40)]  # computing: a row costs what a token gives
    assert share_rows(16, [[0.9] * 8] * 16, dear) == [0] * 16
    assert share_rows(1, [[0.0] * 8], cheap) == [0]  # nothing accepted: nothing gained
    assert share_rows(1, [[]], cheap) == [0]  # no proposals


def test_share_rows_prefers_the_likelier_proposals():
    mid = [0.1 * (1 + 0.25 * (r - 1)) for r in range(40)]
    counts = share_rows(4, [[0.95] * 8, [0.3] * 8, [0.95] * 2, []], mid)
    assert counts[0] > counts[1] and counts[2] == 2 and counts[3] == 0, counts
    assert share_rows(2, [[0.95] * 8, [0.95] * 8], mid[:7]) == [2, 2]  # no wider than the costs known (max_rows)


# ---------------------------------------------------------------- trees, plain Python

def test_tree_acceptance_counts_the_children_tried():
    #   root -> 1 (-> 3), 2 (-> 4 -> 5): the path 2, 4 was accepted, then the target went elsewhere
    children = Tree([0, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 2, 4]).children()
    acceptance = TreeAcceptance(4)
    acceptance.record(children, [2, 4])
    assert acceptance.tried[0][:2] == [1, 1] and acceptance.kept[0][:2] == [0, 1]  # 1 rejected, then 2 kept
    assert acceptance.tried[1][0] == 1 and acceptance.kept[1][0] == 1  # 4, 2's only child
    assert acceptance.tried[2][0] == 1 and acceptance.kept[2][0] == 0  # 5 rejected
    assert acceptance.tried[3] == [0, 0, 0]


def test_grow_tree_orders_nodes_by_their_chance_of_being_on_the_path():
    children = Tree([0, 1, 2, 3, 4], [-1, 0, 0, 1, 2]).children()
    grown = grow_tree(children, [[0.5, 0.8, 0.5], [0.9, 0.5, 0.5]])
    # 1: 0.5; its child 3: 0.45; 2 (after 1 rejected): 0.5 * 0.8 = 0.4; 4: 0.36
    assert [n for n, _ in grown] == [1, 3, 2, 4]
    assert [p for _, p in grown] == pytest.approx([0.5, 0.45, 0.4, 0.36])
    assert [n for n, _ in grow_tree(children, [[0.5, 0.8, 0.5]])] == [1, 2]  # no deeper than the rates


def test_best_tree_cuts_to_what_pays_and_to_nothing():
    children = Tree.from_paths(0, [[1, 2, 3, 4], [5, 6], [7]]).children()
    rates = [[0.9, 0.5, 0.5]] * 4
    assert best_tree(children, rates, [1.0] * 8) == [1, 2, 3, 4, 5, 6, 7]  # a free verify: every node adds
    cheap = [1 + 0.02 * n for n in range(8)]
    assert best_tree(children, rates, cheap) == [1, 2, 3, 4]  # the likeliest chain; its siblings add too little
    steep = [1 + 0.6 * n for n in range(8)]
    assert best_tree(children, rates, steep) == [1, 2]  # gains 1.19, 1.23, 1.228, 1.20
    assert best_tree(children, [[0.05, 0.05, 0.05]] * 4, steep) == []  # a plain step
    assert best_tree(children, rates, cheap[:3]) == [1, 2]  # no more nodes than the costs cover


def test_tree_shadow_records_the_path_the_tokens_took():
    tree = Tree.from_paths(9, [[1, 2], [3, 4]])
    acceptance, shadow = TreeAcceptance(3), TreeShadow()
    shadow.watch(tree.children(), tree.tokens, at=5)
    shadow.check([0, 0, 0, 0, 9, 3], acceptance)
    assert shadow.children is not None  # 3 matched; the token after it is not decoded yet
    shadow.check([0, 0, 0, 0, 9, 3, 8], acceptance)
    assert shadow.children is None and acceptance.kept[0][:2] == [0, 1] and acceptance.tried[1][0] == 1


def test_lookahead_planner_runs_rounds_whose_candidates_pay_and_probes_the_rest():
    costs = StepCosts(14)
    costs.seconds[:] = [1 + n / 14 for n in range(15)]  # a round of 15 tokens costs 2 plain steps
    planner = LookaheadPlanner(15, 2, costs)
    alone = Tree.from_paths(7, []).children()  # no candidates: a round gives one token
    assert [planner.ask(alone, [7], [1, 7]) for _ in range(2)] == [False, True]  # a probe
    planner.verified(alone, [], 2.0)  # it lost: the next comes after 4
    assert [planner.ask(alone, [7], [1, 7]) for _ in range(4)] == [False, False, False, True]
    planner.verified(alone, [], 2.0)  # lost again: after 8
    tree = Tree.from_paths(7, [[1, 2], [3, 4], [5, 6]])
    planner.acceptance.tried = [[50.0] * 3, [50.0] * 3]
    planner.acceptance.kept = [[49.0] * 3, [49.0] * 3]  # each first child near certain: 2.9 tokens
    assert planner.ask(tree.children(), tree.tokens, [1, 7])
    planner.acceptance.kept = [[5.0] * 3, [5.0] * 3]  # 1 in 10, rarely a path: about 1.3 tokens
    assert not planner.ask(tree.children(), tree.tokens, [1, 7, 0])
    assert planner.shadow.children is not None  # watched: the tokens decoded next say what it would have given


def test_probe_backs_off_while_losing():
    probe = Probe()
    due = [probe.due() for _ in range(2)]
    assert due == [False, True]
    probe.outcome(won=False)
    assert [probe.due() for _ in range(4)] == [False, False, False, True]
    probe.outcome(won=True)
    assert [probe.due() for _ in range(2)] == [False, True]


def test_chain_threshold_falls_with_acceptance():
    threshold = ChainThreshold()
    start = threshold.value
    for _ in range(20):
        threshold.update(4, 4)
    assert threshold.value < start and threshold.value == pytest.approx(ChainThreshold.LOWEST, abs=0.02)
    for _ in range(20):
        threshold.update(4, 0)
    assert threshold.value == pytest.approx(ChainThreshold.HIGHEST, abs=0.02)
    assert ChainThreshold(rate=1.0).value == pytest.approx(ChainThreshold.LOWEST)
    assert ChainThreshold(rate=0.0).value == pytest.approx(ChainThreshold.HIGHEST)


# ---------------------------------------------------------------- in the engine

@pytest.mark.parametrize("rate, sharp, expected", [(0.0, 1.0, 1), (1.0, 20.0, 8)])
@torch.inference_mode()
def test_threshold_drafting_stops_where_the_chain_is_unlikely(rate, sharp, expected):
    # a random model spreads its probability (a chain of two is below the highest threshold); sharpened it is sure
    draft = DraftProposer(sharpened(random_model(seed=0, device=TEST_DEVICE), sharp))
    draft.setup(128)
    draft.adapt(True)
    draft.threshold.rate = rate
    draft.start(PROMPTS[1], Sampling())
    drafts, _ = draft.propose(PROMPTS[1], 8, Sampling())
    assert len(drafts) == expected
    draft.adapt(False)  # fixed k: always k
    draft.accepted(0)
    assert len(draft.propose(PROMPTS[1], 8, Sampling())[0]) == 8


@pytest.fixture
def fixed_costs(monkeypatch):
    """Verify costs that do not depend on this machine's timings: f(n) = 1 + 0.1 n."""
    monkeypatch.setattr(StepCosts, "observe", lambda self, n, seconds: None)

    def costs(k):
        c = StepCosts(k)
        c.seconds[:] = [1 + 0.1 * n for n in range(k + 1)]
        return c
    return costs


class WrongThenRight(ScriptedProposer):
    """Proposes wrong tokens for the first `wrong` positions of the output, the target's after."""

    def __init__(self, full, vocab, wrong_until):
        super().__init__(full, vocab)
        self.wrong_until = wrong_until

    def propose(self, context, k, s):
        truth = self.full[len(context):len(context) + k]
        return [(t + 1) % self.vocab if len(context) < self.wrong_until else t for t in truth], None


def test_plain_steps_while_proposals_lose_and_verifies_once_they_win(fixed_costs):
    target = random_model(seed=0, device=TEST_DEVICE)
    prompt = PROMPTS[1]
    expected = plain_greedy(target, prompt, 100)
    proposer = WrongThenRight(prompt + expected, 256, wrong_until=len(prompt) + 30)
    spec = SpeculativeEngine(Engine(target, 1, 128), proposer, 8)
    spec.costs = fixed_costs(8)
    (out,), stats = spec.generate([prompt], 100, Sampling())
    assert out == expected
    # the first 30 tokens: a verify or two learns the proposals lose, then plain steps (their
    # proposals checked in the shadow); after: the shadow sees them win, and blocks of 8 are verified
    wasted = stats.histogram[0]
    assert 1 <= wasted <= 4 and 25 <= stats.plain_steps <= 35, stats
    assert stats.histogram[8] >= 4, stats.histogram


def test_threshold_drafting_through_the_engine_is_token_identical(fixed_costs, monkeypatch):
    # every round drafts (the planner asks for k), the draft stopping where it grows unsure
    target = random_model(seed=0, device=TEST_DEVICE)
    draft = sharpened(noisy_copy(target, 0.05), 4.0)
    monkeypatch.setattr(spec_cost.RoundPlanner, "ask", lambda self, known, limit: limit)
    for prompt in PROMPTS:
        expected = plain_greedy(target, prompt, 40)
        spec = SpeculativeEngine(Engine(target, 1, 128), DraftProposer(draft), 6)
        spec.costs = fixed_costs(6)
        (out,), stats = spec.generate([prompt], 40, Sampling())
        assert out == expected, prompt
        verifies = sum(stats.histogram)
        assert stats.plain_steps <= 1 and 1 < stats.proposed / verifies < 6, stats  # (the last token: a plain step)


class WrongThenRightTrees(ScriptedProposer):
    """Trees of two branches: a wrong one first, then the target's own tokens from `wrong_until`
    on (wrong before), so that the path runs through the root's second child."""

    def __init__(self, full, vocab, wrong_until):
        super().__init__(full, vocab)
        self.wrong_until = wrong_until

    def propose_tree(self, context, nodes, depth):
        truth = self.full[len(context):len(context) + depth]
        wrong = [(t + 1) % self.vocab for t in truth]
        second = truth if len(context) >= self.wrong_until else [(t + 2) % self.vocab for t in truth]
        tree = Tree.from_paths(context[-1], [wrong, second])
        return tree.subtree(list(range(1, min(nodes + 1, len(tree)))))


def test_tree_rounds_plain_while_trees_lose_and_verify_once_they_win(fixed_costs):
    target = random_model(seed=0, device=TEST_DEVICE)
    prompt = PROMPTS[1]
    expected = plain_greedy(target, prompt, 100)
    proposer = WrongThenRightTrees(prompt + expected, 256, wrong_until=len(prompt) + 30)
    spec = SpeculativeEngine(Engine(target, 1, 160), proposer, 4, tree_nodes=10)
    spec.costs = fixed_costs(10)
    (out,), stats = spec.generate([prompt], 100, Sampling())
    assert out == expected
    assert 1 <= stats.histogram[0] <= 4 and 25 <= stats.plain_steps <= 35, stats  # the shadow sees them lose
    assert stats.histogram[4] >= 8, stats.histogram  # then whole paths through the second child
