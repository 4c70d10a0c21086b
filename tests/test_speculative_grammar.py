"""speculative.py under a grammar, penalties, logit_bias and logprobs (the host-picked round): greedy
output token-identical to Engine.generate's with the same grammar (SmolLM2 with llguidance JSON
schemas and regexes; a tiny model with a toy grammar that forces tokens), the sampled distribution
equal to the masked target's, every sampled output valid, KV rollback around forced tokens (full and
sliding-window attention), the prefix cache a run leaves, logprobs, stop strings and finish reasons
as Engine's."""
import copy
import json

import pytest
import torch

import speculative
from conftest import random_model
from engine import Engine
from loading import load_model
from sampling import Sampling, adjust_logits, logits_to_probs
from scheduler import Request
from test_speculative import (PROMPTS, RUNS, SAMPLE_PROMPT, SAMPLINGS, V, ScriptedProposer, chi_square_p_value,
                              every_continuation_logits, noisy_copy, small_vocab_pair, spec_engine)

pytestmark = pytest.mark.usefixtures("one_thread")


class ToyGrammar:
    """grammar.Constraint's interface in plain Python: never token `banned`, never the same token
    twice in a row, each of `leads` followed by the tokens `forced` (which the grammar forces;
    none of them a lead), and complete after `end` (if given)."""

    def __init__(self, vocab_size, banned=4, leads=(5,), forced=(6, 7), end=None):
        self.vocab_size, self.banned, self.leads, self.run, self.end = vocab_size, banned, set(leads), list(forced), end
        assert not self.leads & set(self.run)
        self.history, self.failed = [], False

    def fresh(self):
        return ToyGrammar(self.vocab_size, self.banned, self.leads, self.run, self.end)

    def _forced_now(self) -> list:
        """What must come next: the rest of `run` after a lead."""
        h = self.history
        for i in range(len(self.run)):
            if len(h) > i and h[-1 - i] in self.leads and h[len(h) - i:] == self.run[:i]:
                return self.run[i:]
        return []

    def allowed(self) -> list:
        if self.end is not None and self.end in self.history:
            return []
        forced = self._forced_now()
        if forced:
            return [forced[0]]
        return [t for t in range(self.vocab_size) if t != self.banned and (not self.history or t != self.history[-1])]

    def fill_mask(self, out):
        bits = torch.zeros(out.numel() * 32, dtype=torch.int64)
        bits[self.allowed()] = 1
        words = (bits.view(-1, 32) << torch.arange(32)).sum(-1)
        out.copy_(torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32))

    def accept(self, token) -> bool:
        if token not in self.allowed():
            self.failed = True
            return False
        self.history.append(token)
        return True

    def accept_all(self, tokens) -> bool:
        return all(self.accept(t) for t in tokens)

    def valid_prefix(self, tokens) -> int:
        n = 0
        while n < len(tokens) and self.accept(tokens[n]):
            n += 1
        self.failed = False
        self.rollback(n)
        return n

    def rollback(self, n):
        if n:
            del self.history[-n:]

    def forced(self) -> list:
        return self._forced_now()

    def done(self) -> bool:
        return self.end is not None and self.end in self.history

    def error(self):
        return "the toy grammar rejects a token" if self.failed else None


LEADS = range(3, 256, 8)


def grammar_for(model, prompt, run_length=2, **options) -> ToyGrammar:
    """A toy grammar that bites: it bans a token the model's free output has, and every 8th token
    leads into a forced run of tokens that output likes."""
    free = plain_output(model, prompt, 40)[0]
    banned = next(t for t in free[1:] if t not in LEADS)
    run = [t for t in dict.fromkeys(free[::-1] + list(range(256))) if t not in LEADS and t != banned][:run_length]
    return ToyGrammar(256, banned=banned, leads=LEADS, forced=run, **options)


def first_new(tokens: list, at: int) -> int:
    """The first token from index `at` on that does not occur before it."""
    return next(t for i, t in enumerate(tokens[at:], at) if t not in tokens[:i])


def plain_engine(model, max_seq_length=128, jump_forward=True) -> Engine:
    engine = Engine(model, 1, max_seq_length)
    engine.jump_forward = jump_forward  # (after sizing it: setup() starts a new scheduler)
    return engine


def plain_output(model, prompt, n, sampling=Sampling(), stop_ids=(), constraint=None, max_seq_length=128,
                 jump_forward=True, engine=None, **options):
    engine = engine or plain_engine(model, max_seq_length, jump_forward)
    (out,), stats = engine.generate([prompt], n, sampling, stop_ids,
                                    constraints=[constraint.fresh()] if constraint else None, **options)
    return out, stats


def cached_prefix(engine, tokens) -> int:
    """How many leading tokens of `tokens` the engine's prefix cache holds (whole blocks)."""
    return len(engine.blocks.match(tokens)[0]) * engine.blocks.block_size


def accepted_proposals(stats) -> int:
    return sum(i * h for i, h in enumerate(stats.histogram))


@pytest.fixture(scope="module")
def target():
    return random_model(seed=0)


# ---------------------------------------------------------------- a toy grammar on a tiny model

@pytest.mark.parametrize("jump_forward", [True, False], ids=["jump-forward", "no-jump"])
@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("proposer", ["draft=target", "noisy draft", "ngram", "scripted"])
def test_greedy_under_a_grammar_is_token_identical(target, proposer, k, jump_forward):
    grammar = grammar_for(target, PROMPTS[2], run_length=3)
    accepted = 0
    for prompt in PROMPTS:
        expected, plain_stats = plain_output(target, prompt, 40, constraint=grammar, jump_forward=jump_forward)
        draft = {"draft=target": random_model(seed=0), "noisy draft": noisy_copy(target, 0.05)}.get(proposer)
        scripted = ScriptedProposer(prompt + expected, 256) if proposer == "scripted" else None
        spec = spec_engine(target, k, draft=draft, ngram=3 if proposer == "ngram" else None, proposer=scripted)
        spec.jump_forward = jump_forward
        (out,), stats = spec.generate([prompt], 40, Sampling(), constraints=[grammar.fresh()])
        assert out == expected, prompt
        assert stats.finish_reasons == plain_stats.finish_reasons == ["length"]
        accepted += accepted_proposals(stats)
    if proposer in ("draft=target", "scripted"):
        assert accepted > 0  # the test is not vacuous


def test_proposals_the_grammar_forbids_are_cut(target):
    grammar = grammar_for(target, PROMPTS[0])
    expected = plain_output(target, PROMPTS[0], 30, constraint=grammar)[0]

    class Banned(ScriptedProposer):  # the right continuation, from its second proposal on
        def propose(self, context, k, s):
            return [grammar.banned] + self.full[len(context) + 1:len(context) + k], None

    for proposer, verifies in ((Banned(PROMPTS[0] + expected, 256), False),
                               (ScriptedProposer(PROMPTS[0] + expected, 256), True)):
        spec = spec_engine(target, 4, proposer=proposer)
        (out,), stats = spec.generate([PROMPTS[0]], 30, Sampling(), constraints=[grammar.fresh()])
        assert out == expected
        assert (sum(stats.histogram) > 0) == verifies  # cut to nothing: every round a plain step


def test_grammar_completion_and_stop_tokens_end_the_output_as_in_engine(target):
    grammar = grammar_for(target, PROMPTS[1], run_length=3)
    constrained = plain_output(target, PROMPTS[1], 40, constraint=grammar)[0]
    grammar.end = first_new(constrained, 12)
    for stop_ids in ((), (first_new(constrained, 6),)):
        plain = plain_engine(copy.deepcopy(target))
        expected, plain_stats = plain_output(target, PROMPTS[1], 40, stop_ids=stop_ids, constraint=grammar,
                                             engine=plain)
        for k in (2, 8):
            spec = spec_engine(target, k, draft=random_model(seed=0))
            (out,), stats = spec.generate([PROMPTS[1]], 40, Sampling(), stop_ids, constraints=[grammar.fresh()])
            assert out == expected and stats.finish_reasons == plain_stats.finish_reasons == ["stop"]
            # a later request finds the run's blocks in the prefix cache, as many as the plain run's
            # at least (an accepted last proposal went through the target: its cache may hold one more token)
            context = PROMPTS[1] + out
            assert 0 < cached_prefix(plain, context) <= cached_prefix(spec.engine, context)
    for n in range(1, 14):  # max_new_tokens inside a block and inside a forced run
        expected, plain_stats = plain_output(target, PROMPTS[1], n, constraint=grammar)
        spec = spec_engine(target, 4, draft=random_model(seed=0))
        (out,), stats = spec.generate([PROMPTS[1]], n, Sampling(), constraints=[grammar.fresh()])
        assert out == expected and stats.finish_reasons == plain_stats.finish_reasons


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
@pytest.mark.parametrize("window", [None, 6])
def test_kv_rollback_with_forced_tokens(window, adaptive):
    # forced runs make the unfed tokens and blocks longer than k (with window 6, longer than the
    # window): the rejected positions after them must leave every kept position as a plain run
    # leaves it, and the prefix cache with the plain run's blocks (float64: exact comparisons)
    from test_speculative import assert_target_cache_is_a_plain_run, recorded_requests
    target = random_model(seed=0, sliding_window=window).double()
    grammar = grammar_for(target, PROMPTS[2], run_length=4)
    prompt = PROMPTS[2]
    expected = plain_output(copy.deepcopy(target), prompt, 48, constraint=grammar)[0]
    for k in (2, 5):
        spec = spec_engine(target, k, draft=noisy_copy(target, 0.05), adaptive=adaptive)
        started = recorded_requests(spec.engine)
        (out,), stats = spec.generate([prompt], 48, Sampling(), constraints=[grammar.fresh()])
        assert out == expected
        assert any(stats.histogram[1:k]) or adaptive, stats.histogram  # partial acceptances happened
        (row,) = started
        with torch.inference_mode():
            assert_target_cache_is_a_plain_run(spec.engine, row, prompt, prompt + out)


def masked_exact_distribution(model, prompt, s, grammar):
    """P(t1, t2, t3) of plain constrained sampling, by enumeration: (V, V, V). As Engine picks:
    penalties and logit_bias, the grammar's mask, then the sampling's temperature, top-k, top-p."""
    logits = every_continuation_logits(model, prompt)  # (V*V, L + 2, V), row a * V + b
    L = len(prompt)

    def probs(x, history):
        x = adjust_logits(x.unsqueeze(0), [Request(prompt, 3, s, out=list(history))])[0]
        allowed = torch.ones(V, dtype=torch.bool)
        if grammar is not None:
            g = grammar.fresh()
            assert g.accept_all(history)
            allowed[:] = False
            allowed[g.allowed()] = True
        return logits_to_probs(x.masked_fill(~allowed, float("-inf")).unsqueeze(0), s)[0].double()

    p = torch.zeros(V, V, V, dtype=torch.float64)
    p1 = probs(logits[0, L - 1], [])
    for a in p1.nonzero().view(-1).tolist():
        p2 = probs(logits[a * V, L], [a])
        for b in p2.nonzero().view(-1).tolist():
                p[a, b] = p1[a] * p2[b] * probs(logits[a * V + b, L + 1], [a, b])
    return p


def grammar_distribution_p_value(proposer, s, runs, grammar=ToyGrammar(V)):
    """As test_speculative's distribution_p_value, under the toy grammar (4 banned, 5 forces 6 7)."""
    target, draft = small_vocab_pair()
    spec = spec_engine(target, 2, draft=draft if proposer == "draft" else None,
                       ngram=2 if proposer == "ngram" else None, max_seq_length=32, adaptive=False)
    counts = torch.zeros([V] * 3)
    torch.manual_seed(0)
    proposed = 0
    for _ in range(runs):
        (out,), stats = spec.generate([SAMPLE_PROMPT], 4, s, constraints=[grammar.fresh()] if grammar else None)
        counts[tuple(out[:3])] += 1
        proposed += stats.proposed
    assert proposed > runs / 2  # most runs verified proposals
    exact = masked_exact_distribution(target, SAMPLE_PROMPT, s, grammar)
    assert counts[exact == 0].sum() == 0  # nothing the grammar forbids
    return min(chi_square_p_value(counts, exact), chi_square_p_value(counts.sum(0), exact.sum(0)))


PENALTIES = Sampling(temperature=1.0, repetition_penalty=1.5, presence_penalty=2.0, frequency_penalty=2.0,
                     logit_bias=((2, 1.0), (3, -1.0)))


@pytest.mark.parametrize("sampling", list(SAMPLINGS) + ["t=1,penalties"])
@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_sampling_under_a_grammar_matches_the_masked_target_distribution(proposer, sampling):
    p = grammar_distribution_p_value(proposer, SAMPLINGS.get(sampling, PENALTIES), RUNS)
    assert p > 1e-3 / 2, p  # two tests per check (Bonferroni)


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_sampling_with_penalties_matches_the_target_distribution(proposer):
    # the penalties of each position in a block count the block's tokens before it
    p = grammar_distribution_p_value(proposer, PENALTIES, RUNS, grammar=None)
    assert p > 1e-3 / 2, p


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_wrong_resampling_under_a_grammar_is_caught(proposer, monkeypatch):
    # the mask leaves the bias fewer tokens to show in: more runs than the check above
    monkeypatch.setattr(speculative, "residual_distribution", lambda p, q: p)
    p = grammar_distribution_p_value(proposer, SAMPLINGS["t=1"], 3 * RUNS)
    assert p < 1e-6, p


# ---------------------------------------------------------------- penalties, logit_bias, logprobs, stop strings

def test_penalties_and_logit_bias_greedy_are_token_identical(target):
    free = plain_output(target, PROMPTS[0], 40)[0]
    adjusts = Sampling(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
                       logit_bias=((free[2], -100.0), (free[7], 3.0)))
    for prompt in PROMPTS:
        expected = plain_output(target, prompt, 40, adjusts)[0]
        assert expected != plain_output(target, prompt, 40)[0]  # the penalties change the output
        for proposer in ("draft", "ngram"):
            spec = spec_engine(target, 4, draft=random_model(seed=0) if proposer == "draft" else None,
                               ngram=2 if proposer == "ngram" else None)
            (out,), stats = spec.generate([prompt], 40, adjusts)
            assert out == expected, (proposer, prompt)


def test_logprobs_are_the_targets_as_in_engine(target):
    grammar = grammar_for(target, PROMPTS[2])
    for constraint in (None, grammar):
        expected, plain_stats = plain_output(target, PROMPTS[2], 30, constraint=constraint, logprobs=3)
        spec = spec_engine(target, 4, draft=random_model(seed=0))
        (out,), stats = spec.generate([PROMPTS[2]], 30, Sampling(), logprobs=3,
                                      constraints=[grammar.fresh()] if constraint else None)
        assert out == expected and accepted_proposals(stats) > 0
        (got,), (want,) = stats.logprobs, plain_stats.logprobs
        assert len(got) == len(want)
        for (lp, top), (lp_want, top_want) in zip(got, want):
            assert lp == pytest.approx(lp_want, abs=1e-4)
            assert [t for t, _ in top] == [t for t, _ in top_want]
    (out,), stats = spec.generate([PROMPTS[2]], 30, Sampling(), host=True)  # the host path with nothing to adjust
    assert out == plain_output(target, PROMPTS[2], 30)[0] and stats.logprobs == []


def test_stop_string_inside_an_accepted_block_ends_the_output(target):
    prompt = PROMPTS[1]
    free = plain_output(target, prompt, 40)[0]
    seen = []

    def on_tokens(ids):  # a "stop string": the 9th token
        seen.extend(ids)
        return [0] if len(seen) == 9 else []

    spec = spec_engine(target, 8, draft=random_model(seed=0))  # every block accepted whole
    (out,), stats = spec.generate([prompt], 40, Sampling(), on_tokens=on_tokens, logprobs=0)
    assert out == free[:9] == seen and stats.finish_reasons == ["stop"]
    assert len(stats.logprobs[0]) == 9


# ---------------------------------------------------------------- SmolLM2 with llguidance

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "city", "age"],
          "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}}}
COPY_ME = 'Copy this JSON exactly: {"name": "Ada Lovelace", "city": "London", "age": 36}'
SHIRT = {"type": "object", "additionalProperties": False, "required": ["color", "size", "price"],
         "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer", "minimum": 1,
                                                                                "maximum": 9},
                        "price": {"type": "string", "maxLength": 6}}}
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-[0-3]\d"


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from grammar import Grammars
    from tokenizer import Tokenizer
    model, tok = load_model(smollm2_dir), Tokenizer(smollm2_dir)
    return model, tok, Grammars(smollm2_dir, model.args.vocab_size, tok.eos_ids)


def chat_ids(tok, text):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)


@pytest.mark.parametrize("case", ["ngram, schema", "draft, schema", "draft, regex", "draft, schema, no-jump"])
def test_greedy_with_llguidance_is_token_identical_on_smollm2(smollm2, case):
    import jsonschema
    model, tok, grammars = smollm2
    schema = "schema" in case
    grammar = grammars.compile("json_schema", PERSON) if schema else grammars.compile("regex", DATE)
    ids = chat_ids(tok, COPY_ME if schema else "When did the Berlin wall fall? Answer with a date.")
    jump = "no-jump" not in case
    plain = plain_engine(model, 256, jump)  # later only its block bookkeeping is read (spec's engine takes the cache)
    expected, plain_stats = plain_output(model, ids, 40, stop_ids=tok.eos_ids, constraint=grammars.constraint(grammar),
                                         engine=plain)
    draft = copy.deepcopy(model).to(torch.bfloat16) if "draft" in case else None
    spec = spec_engine(model, 8 if "ngram" in case else 4, draft=draft, ngram=3 if "ngram" in case else None,
                       max_seq_length=256)
    spec.jump_forward = jump
    (out,), stats = spec.generate([ids], 40, Sampling(), tok.eos_ids, constraints=[grammars.constraint(grammar)])
    assert out == expected
    assert stats.finish_reasons == plain_stats.finish_reasons == ["stop"]
    assert 0 < cached_prefix(plain, ids + out) <= cached_prefix(spec.engine, ids + out)  # the blocks a later turn finds
    assert accepted_proposals(stats) > 0  # proposals were verified under the grammar
    text = tok.decode([t for t in out if t not in tok.eos_ids])
    if schema:
        jsonschema.validate(json.loads(text), PERSON)
        if "ngram" in case:
            assert json.loads(text) == {"name": "Ada Lovelace", "city": "London", "age": 36}
            assert stats.target_forwards < len(out) / 3  # copied in long blocks
    else:
        assert len(text) == 10, text


def test_sampling_with_llguidance_is_always_valid_on_smollm2(smollm2):
    import jsonschema
    model, tok, grammars = smollm2
    grammar = grammars.compile("json_schema", SHIRT)
    ids = chat_ids(tok, "Describe a shirt as JSON with its color, size and price.")
    # a target each: an engine owns its model's KV cache (and both find the prompt in their prefix caches)
    spec = {proposer: spec_engine(copy.deepcopy(model) if proposer == "ngram" else model, 4,
                                  draft=noisy_copy(model, 0.002) if proposer == "draft" else None,
                                  ngram=2 if proposer == "ngram" else None, max_seq_length=256)
            for proposer in ("draft", "ngram")}
    accepted = 0
    for seed in range(20):
        torch.manual_seed(seed)
        (out,), stats = spec["draft" if seed % 2 else "ngram"].generate(
            [ids], 40, Sampling(temperature=1.0), tok.eos_ids, constraints=[grammars.constraint(grammar)])
        assert stats.finish_reasons == ["stop"], tok.decode(out)
        jsonschema.validate(json.loads(tok.decode([t for t in out if t not in tok.eos_ids])), SHIRT)
        accepted += accepted_proposals(stats)
    assert accepted > 0


def test_a_grammar_that_forces_the_whole_output_needs_no_forward(smollm2):
    model, tok, grammars = smollm2
    grammar = grammars.compile("regex", "yes")
    ids = chat_ids(tok, "Say yes.")
    expected, plain_stats = plain_output(model, ids, 8, stop_ids=tok.eos_ids, constraint=grammars.constraint(grammar),
                                         max_seq_length=256)
    spec = spec_engine(model, 4, ngram=2, max_seq_length=256)
    forwards = []
    hook = model.register_forward_pre_hook(lambda module, args: forwards.append(args[0].shape))
    try:
        (out,), stats = spec.generate([ids], 8, Sampling(), tok.eos_ids, constraints=[grammars.constraint(grammar)])
    finally:
        hook.remove()
    assert out == expected and tok.decode(out) == "yes"
    assert stats.finish_reasons == plain_stats.finish_reasons == ["stop"]
    assert stats.target_forwards == 0 and forwards == []  # nothing went through the target
    assert cached_prefix(spec.engine, ids) == 0  # nor into its cache
