"""Constrained decoding (grammar.py) and the sampling controls, in Engine.generate (generate.py's
way) and in the serving engine (Engine.for_serving, stepped request by request as serve.py does)."""
import json
import math
import re

import jsonschema
import pytest
import torch

from conftest import run_script
from engine import Engine
from errors import UserError
from grammar import Grammars, unpack_mask, unpack_mask_on_host
from loading import load_model
from sampling import Sampling, adjust_logits, check_sampling, logits_to_probs, sample_rows
from scheduler import Request
from tokenizer import StopStrings, Tokenizer

S = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0.5, "maximum": 99.5},
                                      "qty": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9}},
     "required": ["price", "qty"], "additionalProperties": False},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {"first": S, "last": S},
                                                 "required": ["first", "last"], "additionalProperties": False},
                                      "id": {"type": "integer", "minimum": 1, "maximum": 999}},
     "required": ["person", "id"], "additionalProperties": False},
    {"type": "object", "properties": {"title": S, "note": S}, "required": ["title"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                          {"type": "string", "maxLength": 8}, {"type": "null"}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}, "mode": {"const": "xy"}},
     "required": ["points", "mode"], "additionalProperties": False},
]
REGEXES = [r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[a-z]{2,6}@[a-z]{3,5}\.(com|org)", r"\(\d{1,2}, \d{1,2}\)"]


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    model = load_model(smollm2_dir)
    tok = Tokenizer(smollm2_dir)
    return model, tok, Grammars(smollm2_dir, model.args.vocab_size, tok.eos_ids)


def chat(tok, text):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)


def sampled(smol, prompt, grammar, n, max_new_tokens):
    """n outputs sampled at temperature 1, in one batch, each row with its own matcher."""
    model, tok, grammars = smol
    engine = Engine(model, n, len(prompt) + max_new_tokens)
    torch.manual_seed(0)
    outs, stats = engine.generate([prompt] * n, max_new_tokens, Sampling(temperature=1.0), tok.eos_ids,
                                  constraints=[grammars.constraint(grammar) for _ in range(n)])
    return [tok.decode([t for t in o if t not in tok.eos_ids]) for o in outs], stats.finish_reasons


@pytest.mark.parametrize("n", [20, pytest.param(100, marks=pytest.mark.slow)])
@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_sampled_json_validates_against_its_schema(smol, i, n):
    grammar = smol[2].compile("json_schema", SCHEMAS[i])
    texts, reasons = sampled(smol, chat(smol[1], "Answer in JSON."), grammar, n, 96)
    assert reasons == ["stop"] * n, [t for t, r in zip(texts, reasons) if r != "stop"][:3]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[i])


@pytest.mark.parametrize("n", [20, pytest.param(100, marks=pytest.mark.slow)])
def test_sampled_text_full_matches_each_regex(smol, n):
    for pattern in REGEXES:
        texts, reasons = sampled(smol, chat(smol[1], "Say something."), smol[2].compile("regex", pattern), n, 32)
        assert reasons == ["stop"] * n
        assert all(re.fullmatch(pattern, t) for t in texts), (pattern, texts[:5])


def test_json_object_and_lark_grammar(smol):
    texts, reasons = sampled(smol, chat(smol[1], "A JSON object please."), smol[2].compile("json_object", None), 8, 160)
    assert reasons.count("stop") >= 4  # at temperature 1 a few run on past 160 tokens
    for text, reason in zip(texts, reasons):
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
    lark = 'start: "The answer is " ANSWER "."\nANSWER: /[0-9]+/ | "unknown"\n'
    lines, _ = sampled(smol, chat(smol[1], "What is 6 x 7?"), smol[2].compile("grammar", lark), 8, 24)
    assert all(re.fullmatch(r"The answer is ([0-9]+|unknown)\.", t) for t in lines), lines


def greedy(smol, prompt, n, constraint=None, jump=True, batch=False, **kw):
    model, tok, _ = smol
    if batch:  # the serving engine, stepped as serve.py steps it
        engine = Engine.for_serving(model, 2, 512)
        engine.jump_forward = jump
        req = Request(prompt, n, Sampling(), stop_ids=frozenset(tok.eos_ids), constraint=constraint, **kw)
        engine.submit(req)
        while engine.has_work():
            engine.step()
        return req.out
    engine = Engine(model, 1, 512)
    engine.jump_forward = jump  # (after sizing the engine: setup() starts a new scheduler)
    (out,), _ = engine.generate([prompt], n, Sampling(), tok.eos_ids, constraints=[constraint] if constraint else None,
                                host=True)
    return out


@pytest.mark.parametrize("batch", [False, True], ids=["generate", "serving"])
def test_constraint_that_allows_the_greedy_text_changes_nothing(smol, batch):
    model, tok, grammars = smol
    prompt = chat(tok, "Name three fruits.")
    free = greedy(smol, prompt, 24, batch=batch)
    text = tok.decode(free)
    # the greedy text is one of three alternatives, each step's greedy token stays allowed
    pattern = "(" + "|".join(map(re.escape, [text, text[:5] + "zzz", "Something else"])) + ")"
    constrained = greedy(smol, prompt, 24, grammars.constraint(grammars.compile("regex", pattern)), jump=False,
                         batch=batch)
    assert constrained == free[:len(constrained)] and tok.decode(constrained) == text


@pytest.mark.parametrize("batch", [False, True], ids=["generate", "serving"])
def test_forced_token_chunks_equal_stepping(smol, batch):
    model, tok, grammars = smol
    for schema, ask in [(SCHEMAS[0], "A person as JSON."), (SCHEMAS[4], "A user record as JSON."),
                        (SCHEMAS[9], "Two points as JSON.")]:
        prompt = chat(tok, ask)
        grammar = grammars.compile("json_schema", schema)
        jumped = greedy(smol, prompt, 96, grammars.constraint(grammar), jump=True, batch=batch)
        stepped = greedy(smol, prompt, 96, grammars.constraint(grammar), jump=False, batch=batch)
        assert tok.decode(jumped) == tok.decode(stepped)
        jsonschema.validate(json.loads(tok.decode(jumped)), schema)


def test_grammar_cut_off_by_max_tokens_ends_with_length(smol):
    model, tok, grammars = smol
    req = Request(chat(tok, "A person."), 4, Sampling(), stop_ids=frozenset(tok.eos_ids),
                  constraint=grammars.constraint(grammars.compile("json_schema", SCHEMAS[0])))
    engine = Engine.for_serving(model, 1, 256)
    engine.submit(req)
    while engine.has_work():
        engine.step()
    assert req.finish_reason == "length" and len(req.out) == 4


def test_each_row_has_its_own_constraint_in_one_step(smol):
    model, tok, grammars = smol
    prompt = chat(tok, "Reply.")
    engine = Engine.for_serving(model, 3, 256)
    reqs = [Request(prompt, 24, Sampling(), stop_ids=frozenset(tok.eos_ids), constraint=c) for c in
            [grammars.constraint(grammars.compile("regex", r"\d{4}")), None,
             grammars.constraint(grammars.compile("regex", "(alpha|beta)"))]]
    for r in reqs:
        engine.submit(r)
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    texts = [tok.decode([t for t in r.out if t not in tok.eos_ids]) for r in reqs]
    assert re.fullmatch(r"\d{4}", texts[0]) and texts[2] in ("alpha", "beta")
    assert reqs[1].out == greedy(smol, prompt, 24, batch=True)  # the free row is what it is alone
    assert steps <= 25  # the rows ran side by side


def test_bad_grammars_are_user_errors(smol):
    grammars = smol[2]
    for kind, spec, words in [("json_schema", {"type": "strin"}, "strin"), ("json_schema", "{not json", "JSON"),
                              ("regex", "a(b", "unclosed"), ("grammar", "start: undefined_rule", "undefined_rule")]:
        with pytest.raises(UserError, match=words) as e:
            grammars.compile(kind, spec)
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------- sampling controls

def test_penalties_and_logit_bias_against_direct_computation():
    torch.manual_seed(0)
    V = 11
    logits = torch.randn(3, V) * 3
    rows = [Request([1, 2, 2], 8, Sampling(repetition_penalty=1.5), out=[3, 3, 4]),
            Request([1, 2], 8, Sampling(presence_penalty=0.7, frequency_penalty=0.3), out=[5, 5, 5, 6]),
            Request([0], 8, Sampling(logit_bias=((9, 4.0), (0, -100.0))), out=[9])]
    got = adjust_logits(logits, rows)
    want = logits.clone()
    for t in (1, 2, 3, 4):  # prompt and output tokens: positive logits divided, negative multiplied
        want[0, t] = want[0, t] / 1.5 if want[0, t] > 0 else want[0, t] * 1.5
    want[1, 5] -= 0.7 + 3 * 0.3  # output tokens only: presence once, frequency per occurrence
    want[1, 6] -= 0.7 + 1 * 0.3
    want[2, 9] += 4.0
    want[2, 0] -= 100.0
    torch.testing.assert_close(got, want)
    assert adjust_logits(logits, [Request([1], 8, Sampling())] * 3) is logits  # nothing to adjust: untouched


def test_min_p_keeps_tokens_at_least_min_p_of_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    p = logits_to_probs(logits, Sampling(temperature=1.0, min_p=0.2))  # threshold 0.1: drops 0.08
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.3, 0.12, 0.0]]) / 0.92)
    draws = torch.stack([sample_rows(logits, [Sampling(1.0, min_p=0.5)], [None]) for _ in range(500)]).view(-1)
    assert set(draws.tolist()) == {0, 1}  # 0.3 >= 0.25 stays, 0.12 goes


def test_sampling_settings_out_of_range_are_user_errors():
    for bad in [Sampling(presence_penalty=2.5), Sampling(frequency_penalty=-3), Sampling(repetition_penalty=0),
                Sampling(min_p=1.5), Sampling(logit_bias=((50, 1.0),)), Sampling(logit_bias=((1, 101.0),)),
                Sampling(top_p=0), Sampling(top_k=0), Sampling(temperature=-1)]:
        with pytest.raises(UserError):
            check_sampling(bad, 50)
    check_sampling(Sampling(0.7, 5, 0.9, 0.1, 1.2, 1.0, -1.0, ((3, -100.0),)), 50)


def test_logprobs_are_the_models_log_softmax(smol):
    model, tok, _ = smol
    prompt = tok.encode("The capital of France is")
    engine = Engine(model, 1, 64)
    (out,), stats = engine.generate([prompt], 6, Sampling(), logprobs=3)
    ids = torch.tensor([prompt + out])
    with torch.inference_mode():
        model.setup_caches(1, 64)
        logp = torch.log_softmax(model(ids, torch.arange(ids.shape[1]))[0].float(), -1)
    for i, (chosen, top) in enumerate(stats.logprobs[0]):
        row = logp[len(prompt) - 1 + i]
        assert math.isclose(chosen, row[out[i]].item(), abs_tol=1e-3)
        assert [t for t, _ in top] == row.topk(3).indices.tolist()
        assert top[0][0] == out[i] and top[0][1] == chosen  # greedy: the chosen token is the top one


def test_repetition_penalty_changes_a_repetitive_greedy_output(smol):
    model, tok, _ = smol
    prompt = tok.encode("1, 2, 3, 1, 2, 3, 1, 2, 3,")
    engine = Engine(model, 1, 128)
    (plain,), _ = engine.generate([prompt], 12, Sampling())
    (penalized,), _ = engine.generate([prompt], 12, Sampling(repetition_penalty=3.0))
    assert plain != penalized
    (biased,), _ = engine.generate([prompt], 5, Sampling(logit_bias=((28, 100.0),)))
    assert biased == [28] * 5  # +100 on one token: greedy picks it every time


def test_stop_strings_split_across_tokens(smol):
    model, tok, _ = smol
    ids = tok.encode("one two three four five")
    pieces = [tok.decode([t]) for t in ids]
    stop = pieces[2][-2:] + pieces[3][:2]  # the end of one token and the start of the next
    stream = StopStrings(tok, [stop])
    ready = []
    for t in ids:
        if stream.push(t):
            break
        ready.append(stream.ready())
    text = "".join(pieces)
    assert stream.finish() == text[:text.index(stop)]
    assert all(not r.endswith(stop[:1]) or len(r) < len(text[:text.index(stop)]) for r in ready)
    assert all(stop not in r for r in ready)


def test_cli_stop_and_json(smollm2_dir, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS[0]))
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--chat", "--prompt", "A person as JSON.",
                   "--json_schema", schema, "--no-compile", "--max_new_tokens", "64")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), SCHEMAS[0])
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--prompt", "One, two, three, four,",
                   "--stop", "six", "--no-compile", "--max_new_tokens", "12")
    assert r.returncode == 0 and r.stdout.strip() == "five,", (r.stdout, r.stderr)
    for flags, words in [(["--regex", "a(b"], "unclosed group"), (["--logit_bias", "99999=1"], "out of range"),
                         (["--json_schema", tmp_path / "missing.json"], "cannot read"),
                         (["--json_schema", schema, "--max_new_tokens", "3"], "ran out")]:
        r = run_script("generate.py", "--checkpoint", smollm2_dir, "--no-compile", *flags)
        assert r.returncode == 1 and words in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_unpack_mask_reads_bit_t_mod_32_of_word_t_div_32():
    masks = torch.tensor([[1 << 5, -2147483647]], dtype=torch.int32)  # word 1 = 0x80000001: bits 0 and 31
    assert unpack_mask(masks, 64)[0].nonzero().view(-1).tolist() == [5, 32, 63]
    assert unpack_mask(masks, 40).shape == (1, 40)  # the logits' width, not a multiple of 32
    masks = torch.randint(-2**31, 2**31 - 1, (3, 7), dtype=torch.int32)
    assert torch.equal(unpack_mask_on_host(masks, 220), unpack_mask(masks, 220))


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)],  # 48 s compiling
                         ids=["eager", "compiled"])
def test_mask_in_the_step_equals_masking_on_the_host(smol, compiled):
    """Grammars alone are applied inside the decode step; with host=True the same masks are applied
    to the logits on the host (pick_tokens): the same tokens, a row without a grammar included.
    The host side runs eager (its compiled step is the plain one, which other tests compile)."""
    model, tok, grammars = smol
    prompts = [chat(tok, "A person as JSON."), chat(tok, "Count to five."), chat(tok, "Pick a code.")]
    schema = grammars.compile("json_schema", SCHEMAS[0])
    code = grammars.compile("regex", r"[A-Z]{3}-[0-9]{3}")
    outs = {}
    for host in (False, True):
        engine = Engine(model, 3, max(map(len, prompts)) + 40, compile=compiled and not host)
        engine.jump_forward = False
        constraints = [grammars.constraint(schema), None, grammars.constraint(code)]
        outs[host], _ = engine.generate(prompts, 40, Sampling(), tok.eos_ids, constraints=constraints, host=host)
    assert outs[False] == outs[True]
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{3}", tok.decode([t for t in outs[False][2] if t not in tok.eos_ids]))
