"""serve.py's structured output and sampling controls, through the official `openai` client:
`.parse()` with a Pydantic model, json_object / json_schema / regex / grammar, tool calls (named
and "required", cut ones, calls read from the text under "auto", streamed too), tools given to the
chat template and a conversation that carries a call and its result, logprobs (chat, completions,
streamed, under a grammar), penalties, logit_bias and min_p, the same constrained greedy text as the
engine, and a 400 for each bad input."""
import enum
import json
import re
import shutil
import urllib.error
import urllib.request
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from test_serve import API_KEY, metrics, post, start_server, stop_server

MODEL = "smollm2-135m"
ORIGIN = "https://app.example"  # the web page the server lets call it (--cors_origins)
ORDER_PROMPT = "An order: 2 apples and 1 pear, in red. Status open."
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "size": {"enum": ["small", "large"]}},
          "required": ["city", "rank", "size"], "additionalProperties": False}
SCHEMA_PROMPT = "Describe the biggest city of France as JSON."
ITEM_DEFS = {"$defs": {"Unit": {"enum": ["c", "f"], "type": "string"}}}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                        "unit": {"$ref": "#/$defs/Unit"}},
                       "required": ["city", "unit"], "additionalProperties": False, **ITEM_DEFS}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASKED = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}
CONVERSATION = [ASKED, {"role": "assistant", "content": None, "tool_calls": [CALL]}, RESULT]
# a template that describes the tools and reads a call's arguments as an object, as tool-calling models' templates do
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}"
    "{{ t.function.name }}: {{ t.function.description }} {{ t.function.parameters | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<call id={{ c.id }}>{{ c.function.name }}(city={{ c.function.arguments.city }}) "
    "{{ c.function.arguments | tojson }}</call>{% endfor %}"
    "{% elif m.role == 'tool' %}<result id={{ m.tool_call_id }}>{{ m.content }}</result>"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Color(str, enum.Enum):
    red = "red"
    blue = "blue"


class Item(BaseModel):
    name: Annotated[str, Field(max_length=8)]
    qty: Annotated[int, Field(ge=0, le=9)]


class Order(BaseModel):
    items: Annotated[list[Item], Field(max_length=3)]
    color: Color
    status: Literal["open", "closed"]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    # no compiling: constrained, penalized and logprob requests sample on the host anyway
    proc, url = start_server(smollm2_dir, "--max_batch_size", 4, "--max_seq_length", 512, "--no-compile",
                             "--cors_origins", ORIGIN)
    yield url
    assert stop_server(proc) == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from tokenizer import Tokenizer
    return Tokenizer(smollm2_dir)


def chat(client, content, temperature=0, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          temperature=temperature, **kw)


def test_parse_pydantic_round_trip(client):
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": ORDER_PROMPT}],
                                      temperature=0, max_tokens=80, response_format=Order)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Order) and choice.message.parsed.items
    assert Order.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_schema_regex_grammar(client):
    r = chat(client, 'Reply with a JSON object with one key "ok" and the value true.', max_tokens=30,
             response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    r = chat(client, SCHEMA_PROMPT, max_tokens=40,
             response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = chat(client, "Give me a phone number.", max_tokens=20, extra_body={"regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].message.content) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=10, temperature=0,
                                  extra_body={"grammar": 'start: "The answer is " ("yes" | "no") "."'})
    assert re.fullmatch(r"The answer is (yes|no)\.", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    # vLLM's name, with n: every choice has a matcher of its own
    r = chat(client, SCHEMA_PROMPT, max_tokens=40, n=2, temperature=1.0, seed=3, extra_body={"guided_json": SCHEMA})
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def check_call(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_tool_calls_named_and_required(client):
    named = {"type": "function", "function": {"name": "add"}}
    r = chat(client, "What is 2 + 3?", max_tokens=30, tools=TOOLS, tool_choice=named)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    check_call(r.choices[0].message.tool_calls[0], "add")
    r = chat(client, "What is the weather in Paris?", max_tokens=40, tools=TOOLS, tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    check_call(r.choices[0].message.tool_calls[0])
    chunks = list(chat(client, "What is 2 + 3?", max_tokens=30, tools=TOOLS, tool_choice=named, stream=True))
    calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(chunk.choices[0].delta.content for chunk in chunks)
    check_call(calls[0], "add")
    # SmolLM2's template teaches no call format: "auto" gives text
    r = chat(client, "What is 2 + 3?", max_tokens=8, tools=TOOLS, tool_choice="auto")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


# a Hermes-style template (Qwen2.5's, abridged): the tools in <tools>, each call in <tool_call> tags
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call functions:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools>\nFor each call, reply with <tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SAID = 'Let me add them.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def hermes_checkpoint(smollm2_dir, root):
    """SmolLM2's weights under a Hermes-style chat template, in `root`."""
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (root / name).symlink_to(smollm2_dir / name)
    shutil.copy(smollm2_dir / "tokenizer_config.json", root)
    (root / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return root


@pytest.fixture(scope="module")
def hermes_client(smollm2_dir, tmp_path_factory):
    """A server of SmolLM2's weights under a Hermes-style chat template, and its client."""
    root = hermes_checkpoint(smollm2_dir, tmp_path_factory.mktemp("hermes"))
    proc, url = start_server(root, "--max_batch_size", 2, "--max_seq_length", 512, "--no-compile",
                             "--model_name", MODEL)
    yield openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    assert stop_server(proc) == 0


def test_auto_tool_calls_are_read_from_text(hermes_client):
    """tool_choice "auto": the calls the model writes in its template's format come back as `tool_calls`,
    the text before them as content, streamed too. The model's text is made deterministic with a
    grammar that forces it (the call is still read from the generated text)."""
    forced = {"grammar": "start: " + json.dumps(SAID)}
    for choice in ({"tool_choice": "auto"}, {}):  # "auto" is the default when tools are sent
        r = chat(hermes_client, "What is 2 + 3?", max_tokens=60, tools=TOOLS, extra_body=forced, **choice)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == "Let me add them."
        [call] = r.choices[0].message.tool_calls
        check_call(call, "add")
        assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    chunks = list(chat(hermes_client, "What is 2 + 3?", max_tokens=60, tools=TOOLS, extra_body=forced, stream=True))
    content = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices[0].delta.content]
    calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert "".join(content) == "Let me add them." and len(content) > 1  # the text went out as it came
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "add"
    assert json.loads(calls[0].function.arguments) == {"a": 2, "b": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # a call of a function not in `tools` is text
    r = chat(hermes_client, "What is 2 + 3?", max_tokens=60, tools=TOOLS[:1], extra_body=forced)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == SAID
    assert r.choices[0].message.tool_calls is None


def test_cut_constrained_call_is_a_call(hermes_client):
    """A "required" or named call cut by max_tokens comes back as a call with finish_reason "length"."""
    for choice in ("required", NAMED):
        r = chat(hermes_client, "What is 2 + 3?", max_tokens=3, tools=TOOLS[1:], tool_choice=choice)
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None
        assert r.choices[0].message.tool_calls[0].function.name == "add"
        chunks = list(chat(hermes_client, "What is 2 + 3?", max_tokens=3, tools=TOOLS[1:], tool_choice=choice,
                           stream=True))
        calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
        assert chunks[-1].choices[0].finish_reason == "length" and calls[0].function.name == "add"


def test_chat_template_sees_tools_and_tool_calls(smollm2_dir, tmp_path, tokenizer):
    """A template that describes tools gets them, and a call's JSON arguments as an object, rendered as
    transformers renders them; SmolLM2's own template ignores tools."""
    import transformers

    from chat_tools import chat_messages
    from tokenizer import Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tmp_path)
    (tmp_path / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    messages = chat_messages(CONVERSATION)
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "unit": "c"}}}]}
    ours = Tokenizer(tmp_path).apply_chat_template(messages, tools=TOOLS)
    assert "get_weather: The weather in a city" in ours and "add: Add two numbers" in ours
    assert '<call id=call_1>get_weather(city=Paris) {"city": "Paris", "unit": "c"}</call>' in ours
    assert "<result id=call_1>18 degrees and sunny</result>" in ours
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(smollm2_dir / "tokenizer.json"))
    assert ours == hf.apply_chat_template(messages, tools=TOOLS, chat_template=TOOLS_TEMPLATE, tokenize=False,
                                          add_generation_prompt=True)
    assert "Tools:" not in Tokenizer(tmp_path).apply_chat_template(messages)
    smollm2 = tokenizer.apply_chat_template(messages, tools=TOOLS)
    assert smollm2 == tokenizer.apply_chat_template(messages) and "18 degrees and sunny" in smollm2


def test_tool_conversation_is_served(server, client, tokenizer):
    """A conversation that carries a call and its result, with tools, gets a text reply; its prompt is
    the template's rendering of the conversation; a named call may follow the result."""
    from chat_tools import chat_messages

    r = client.chat.completions.create(model=MODEL, messages=CONVERSATION, tools=TOOLS, temperature=0, max_tokens=16)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    text = tokenizer.apply_chat_template(chat_messages(CONVERSATION), tools=TOOLS)
    assert r.usage.prompt_tokens == len(tokenizer.encode(text, add_bos=False))
    conversation_tokens = r.usage.prompt_tokens
    r = chat(client, "What is the weather in Paris?", max_tokens=8, tools=TOOLS)  # tools, no call asked for
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    # this server's own call sent back, then a call of another function
    first = chat(client, "What is the weather in Paris?", max_tokens=40, tools=TOOLS,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert first.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]
    messages = [ASKED, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
                {"role": "user", "content": "And what is 2 + 3?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=30,
                                       tool_choice=NAMED)
    assert r.choices[0].finish_reason == "tool_calls"
    check_call(r.choices[0].message.tool_calls[0], "add")
    # arguments as an object and a result as text parts: the same prompt
    as_object = {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}
    as_parts = {**RESULT, "content": [{"type": "text", "text": "18 degrees and sunny"}]}
    code, reply = post(server, CHAT, {"messages": [ASKED, {"role": "assistant", "tool_calls": [as_object]}, as_parts],
                                      "tools": TOOLS, "max_tokens": 4})
    assert code == 200 and reply["usage"]["prompt_tokens"] == conversation_tokens, reply
    # a function called without arguments: `arguments` "", read as {}
    code, reply = post(server, CHAT, {"messages": calling([with_arguments("")], tool_call_id="call_1", content="ok"),
                                      "tools": TOOLS, "max_tokens": 2})
    assert code == 200, reply


def test_constrained_greedy_matches_engine(client, smollm2_dir, tokenizer):
    """The server's greedy JSON for a schema is the engine's (Engine.generate with the same constraint)."""
    from engine import Engine
    from loading import load_model
    from sampling import Sampling
    from grammar import Grammars

    r = chat(client, SCHEMA_PROMPT, max_tokens=40,
             response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    model = load_model(smollm2_dir)
    engine = Engine(model, 1, 512)
    grammars = Grammars(smollm2_dir, model.args.vocab_size, tokenizer.eos_ids)
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": SCHEMA_PROMPT}]), add_bos=False)
    (out,), stats = engine.generate([ids], 40, Sampling(), tokenizer.eos_ids,
                                    constraints=[grammars.constraint(grammars.compile("json_schema", SCHEMA))])
    assert stats.finish_reasons == ["stop"]
    assert r.choices[0].message.content == tokenizer.decode([t for t in out if t not in tokenizer.eos_ids])


def test_penalties_logit_bias_min_p(client, tokenizer):
    def complete(prompt="Repeat after me: go go go go go go", temperature=0, extra=None, **kw):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=temperature,
                                         extra_body={"ignore_eos": True, **(extra or {})}, **kw).choices[0].text

    plain = complete()
    assert plain.split() == ["go"] * 8  # greedy repeats the prompt's word
    for kw in ({"presence_penalty": 2}, {"frequency_penalty": 2}, {"extra": {"repetition_penalty": 1.5}}):
        assert complete(**kw).split().count("go") < 4, kw
    cat = tokenizer.encode(" cat", add_bos=False)
    assert len(cat) == 1
    assert complete(logit_bias={str(cat[0]): 100}) == " cat" * 8
    first = tokenizer.encode(plain, add_bos=False)[0]
    assert tokenizer.encode(complete(logit_bias={str(first): -100}), add_bos=False)[0] != first
    # min_p 1 keeps only the most likely token: sampling hot gives the greedy text
    prompt = "The capital of France is"
    assert complete(prompt, temperature=1.5, seed=5, extra={"min_p": 1.0}) == complete(prompt)


def test_logprobs(client):
    r = chat(client, "What is the capital of France?", max_tokens=8, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")  # not the EOS
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert t.logprob <= 0 and len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert t.token == t.top_logprobs[0].token and t.logprob == pytest.approx(tops[0])  # greedy: the top one
        assert bytes(t.bytes).decode() == t.token
    chunks = list(chat(client, "What is the capital of France?", max_tokens=8, logprobs=True, top_logprobs=3,
                       stream=True))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    # the same up to the last bits (this request reuses the cached prompt, prefilled in other chunks)
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    for c in chunks:  # each chunk carries the logprobs of the tokens it carries
        assert "".join(t.token for t in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])) == \
            (c.choices[0].delta.content or "")

    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  logprobs=2)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, logprob, top, offset in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert text[offset:offset + len(token)] == token and logprob <= 0
        assert len(top) == 2 and top[token] == pytest.approx(max(top.values()))
    cut = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                    logprobs=0, stop=".")  # the tokens from the stop string on are not in it
    assert "".join(cut.choices[0].logprobs.tokens) == cut.choices[0].text == text[:text.index(".")]

    # under a grammar every token has its logprobs (forced ones too), and the text is the same
    form = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}  # its keys are forced
    plain = chat(client, SCHEMA_PROMPT, max_tokens=40, response_format=form)
    r = chat(client, SCHEMA_PROMPT, max_tokens=40, response_format=form, logprobs=True)
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert all(t.top_logprobs == [] and t.logprob <= 0 for t in r.choices[0].logprobs.content)


CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
NAMED = {"type": "function", "function": {"name": "add"}}


def calling(calls, **result):
    """The question, an assistant message with `calls`, and a tool message of `result`'s fields if any."""
    return [ASKED, {"role": "assistant", "content": None, "tool_calls": calls}] + ([{"role": "tool", **result}]
                                                                                   if result else [])


def with_arguments(arguments):
    return {**CALL, "function": {"name": "get_weather", "arguments": arguments}}


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format"),
    (CHAT, {"regex": "(abc"}, "regex"),
    (CHAT, {"grammar": "start: foo"}, "grammar"),
    (CHAT, {"guided_json": "{not json"}, "guided_json"),
    (CHAT, {"response_format": {"type": "json_object"}, "regex": "a+"}, "regex"),
    (CHAT, {"logit_bias": {"999999": 5}}, "logit_bias"),
    (CHAT, {"logit_bias": {"abc": 5}}, "logit_bias"),
    (CHAT, {"logit_bias": {"5": "high"}}, "logit_bias"),
    (CHAT, {"logit_bias": {"5": 500}}, "logit_bias"),
    (CHAT, {"presence_penalty": 3}, "presence_penalty"),
    (CHAT, {"frequency_penalty": -2.5}, "frequency_penalty"),
    (CHAT, {"repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {"min_p": 1.5}, "min_p"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"top_logprobs": 3}, "top_logprobs"),
    (CHAT, {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "tools": TOOLS}, "tools"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, [2]]]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [49152]]}, "prompt"),  # SmolLM2's vocab_size
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": ["Hi", ""]}, "prompt"),
    ("/v1/completions", {"prompt": ["Hi"] * 17}, "prompt"),  # more prompts than choices a request
    ("/v1/completions", {"prompt": ["Hi"] * 5, "n": 4}, "n"),  # 20 choices
    ("/v1/completions", {"prompt": ["Hi", "Hi " * 600]}, "prompt"),  # the second too long for the context
    (CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (CHAT, {"tools": [{"type": "function"}], "tool_choice": "auto"}, "tools"),
    (CHAT, {"tools": "add"}, "tools"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
            "tool_choice": "required"}, "tools"),
    (CHAT, {"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
    (CHAT, {"messages": calling([CALL], tool_call_id="call_1")}, "messages"),  # a result without content
    (CHAT, {"messages": calling([CALL], tool_call_id="call_1", content=None)}, "messages"),
    (CHAT, {"messages": calling([CALL], content="18 degrees")}, "messages"),  # ... without its call's id
    (CHAT, {"messages": calling(CALL)}, "messages"),  # tool_calls not a list
    (CHAT, {"messages": calling("get_weather")}, "messages"),
    (CHAT, {"messages": calling([with_arguments('{"city": Paris}')])}, "messages"),  # arguments not JSON
    (CHAT, {"messages": calling([with_arguments("[1, 2]")])}, "messages"),  # ... not an object
    (CHAT, {"messages": calling([with_arguments(None)])}, "messages"),
    (CHAT, {"messages": calling([{"id": "call_1", "type": "function"}])}, "messages"),  # no function
    (CHAT, {"messages": calling([])}, "messages"),  # no call, no content
    (CHAT, {"messages": [{**ASKED, "tool_calls": [CALL]}]}, "messages"),  # a user's call
    (CHAT, {"messages": [ASKED], "tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    (CHAT, {"tool_choice": "none"}, "tool_choice"),  # as OpenAI: no tool_choice without tools
    (CHAT, {"tools": [], "tool_choice": "auto"}, "tool_choice"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options"),  # not streamed
    (CHAT, {"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"seed": 2 ** 64}, "seed"),
    (CHAT, {"seed": -2 ** 63 - 1}, "seed"),
    (CHAT, {"seed": 2 ** 64 - 2, "n": 3}, "seed"),  # the first two choices' seeds fit torch's range, the third not
])
def test_bad_input(server, path, body, param):
    body = {"messages": MESSAGES, **body} if path == CHAT else body
    code, reply = post(server, path, body)
    assert code == 400, reply
    error = reply["error"]
    assert error["param"] == param and error["message"] and "\n" not in error["message"]
    ok, good = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})  # served right after
    assert ok == 200 and good["choices"][0]["text"] is not None
    assert metrics(server)["minillm_requests_running"] == 0  # nothing of the refused request was queued


def test_cors(server):
    """--cors_origins: a browser's preflight from the origin is answered, its requests carry the header;
    another origin gets neither."""
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = urllib.request.urlopen(urllib.request.Request(server + CHAT, method="OPTIONS", headers=preflight))
    assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in r.headers["Access-Control-Allow-Methods"]
    assert "authorization" in r.headers["Access-Control-Allow-Headers"].lower()
    r = urllib.request.urlopen(urllib.request.Request(server + "/v1/models", headers={
        "Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}"}))
    assert r.headers["Access-Control-Allow-Origin"] == ORIGIN
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(server + CHAT, method="OPTIONS",
                                                      headers={**preflight, "Origin": "https://other.example"}))
    assert "Access-Control-Allow-Origin" not in refused.value.headers
