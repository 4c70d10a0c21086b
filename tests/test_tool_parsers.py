"""Function calls read from free text under tool_choice "auto" (tool_parsers.py), whole and streamed,
in each chat template family's format; and constrained calls that hold to their schema (chat_tools.py):
no properties the schema does not name, and a call cut by max_tokens still reported as a call."""
import json

import pytest

from tool_parsers import HERMES, LLAMA3_JSON, CallReader, call_format, read_calls

FUNCTIONS = {"get_weather", "add"}
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ADD = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
# the markers each family's template writes (abridged from Qwen2.5's, SmolLM3's and Llama 3.1's)
QWEN_TEMPLATE = ('For each function call, return a json object with function name and arguments within '
                 '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
                 '<args-json-object>}\n</tool_call><|im_end|>')
SMOLLM3_TEMPLATE = ('{%- if xml_tools -%}For each function call, return a json object with function name and '
                    'arguments within <tool_call></tool_call> XML tags{%- endif -%}<think>\n\n</think>')
LLAMA_TEMPLATE = ("{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{{- '<|python_tag|>' + "
                  "tool_call.name + '.call(' }}{{- '{\"name\": \"' + tool_call.name + '\", ' }}"
                  "{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}")


def pieces(text: str, size: int) -> list:
    return [text[k:k + size] for k in range(0, len(text), size)]


def streamed(fmt, text: str, size: int) -> tuple:
    """(the content as the deltas carry it, the calls as (name, arguments)) of `text` fed `size`
    characters at a time."""
    reader = CallReader(fmt, FUNCTIONS)
    events = [e for piece in pieces(text, size) for e in reader.feed(piece)] + reader.finish()
    content = [v for k, v in events if k == "content"]
    calls = [(v["function"]["name"], json.loads(v["function"]["arguments"])) for k, v in events if k == "call"]
    return "".join(content), calls


def whole(fmt, text: str) -> tuple:
    content, calls = read_calls(fmt, FUNCTIONS, text)
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert isinstance(call["function"]["arguments"], str)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_call_format_is_chosen_from_the_template():
    assert call_format(QWEN_TEMPLATE) is HERMES and call_format(SMOLLM3_TEMPLATE) is HERMES
    assert call_format(LLAMA_TEMPLATE) is LLAMA3_JSON
    assert call_format("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}") is None
    assert call_format(None) is None


CASES = [  # (format, reply, its content, its calls)
    (HERMES, f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", {"city": "Paris"})]),
    (HERMES, f"Let me look that up.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me look that up.",
     [("get_weather", {"city": "Paris"})]),
    (HERMES, f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{ADD}\n</tool_call>\n", None,
     [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})]),
    (HERMES, f"<tool_call>\n{WEATHER}\n", None, [("get_weather", {"city": "Paris"})]),  # ended before the close
    (HERMES, "Paris is sunny <3 today.", "Paris is sunny <3 today.", []),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call> ok',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call> ok', []),  # malformed JSON
    (HERMES, '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', []),  # not a function of `tools`
    (HERMES, f'Two: <tool_call>{{"name": "rm"}}</tool_call> <tool_call>{ADD}</tool_call>',
     'Two: <tool_call>{"name": "rm"}</tool_call>', [("add", {"a": 2, "b": 3})]),
    (HERMES, "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2", '<tool_call>\n{"name": "add", "arguments": '
     '{"a": 2', []),  # cut
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}', None, [("add", {"a": 2, "b": 3})]),
    (LLAMA3_JSON, 'Sure. <|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}', "Sure.",
     [("add", {"a": 2, "b": 3})]),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "parameters": '
                  '{"a": 2, "b": 3}}', None, [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})]),
    (LLAMA3_JSON, 'It is {"name": "add"} in JSON.', 'It is {"name": "add"} in JSON.', []),  # JSON inside text
    (LLAMA3_JSON, '{"city": "Paris"}', '{"city": "Paris"}', []),  # a JSON answer
    (LLAMA3_JSON, '{"name": "add", "parameters": {"a": 2', '{"name": "add", "parameters": {"a": 2', []),  # cut
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_calls_are_read_whole_and_streamed(fmt, text, content, calls):
    assert whole(fmt, text) == (content, calls)
    for size in (1, 3, 7, len(text)):  # the same, however the text arrives
        assert streamed(fmt, text, size) == (content or "", calls), size


def test_streamed_content_goes_out_before_the_call_ends():
    """Text before a call goes out as it comes, less what may begin a marker; a call goes out once whole."""
    reader = CallReader(HERMES, FUNCTIONS)
    assert reader.feed("Let me") == [("content", "Let me")]
    assert reader.feed(" check. <tool") == [("content", " check.")]  # "<tool" may begin <tool_call>
    assert reader.feed("_call>\n" + WEATHER[:20]) == []
    [(kind, call)] = reader.feed(WEATHER[20:] + "\n</tool_call>")
    assert kind == "call" and call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert reader.feed("\n") == [] and reader.finish() == []
    reader = CallReader(HERMES, FUNCTIONS)
    assert reader.feed("a <tool") == [("content", "a")] and reader.feed("box>") == [("content", " <toolbox>")]


# ---------------------------------------------------------------- constrained calls hold to their schema

OPEN_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


@pytest.fixture(scope="module")
def grammars(smollm2_dir):
    from grammar import Grammars
    from tokenizer import Tokenizer
    tokenizer = Tokenizer(smollm2_dir)
    return Grammars(smollm2_dir, tokenizer.vocab_size, tokenizer.eos_ids), tokenizer


@pytest.mark.parametrize("choice,ok,extra", [
    ({"type": "function", "function": {"name": "add"}}, '{"a": 2, "b": 3}', '{"a": 2, "b": 3, "c": 4}'),
    ("required", '{"name": "add", "arguments": {"a": 2, "b": 3}}',
     '{"name": "add", "arguments": {"a": 2, "b": 3, "c": 4}}'),
    ("required", '{"name": "nest", "arguments": {"x": {"y": 1}}}',
     '{"name": "nest", "arguments": {"x": {"y": 1, "z": 2}}}'),
])
def test_call_grammar_forbids_properties_the_schema_lacks(grammars, choice, ok, extra):
    """A schema without `additionalProperties` takes no others in a call (as OpenAI's), nested ones neither."""
    from chat_tools import parse_tools

    grammars, tokenizer = grammars
    nested = {"type": "object", "properties": {"x": {"type": "object", "properties": {"y": {"type": "integer"}}}}}
    tools = OPEN_TOOLS + [{"type": "function", "function": {"name": "nest", "parameters": nested}}]
    grammar = grammars.compile("json_schema", parse_tools({"tools": tools, "tool_choice": choice})[0])
    ok, extra = tokenizer.encode(ok, add_bos=False), tokenizer.encode(extra, add_bos=False)
    assert grammars.constraint(grammar).valid_prefix(ok) == len(ok)
    assert grammars.constraint(grammar).valid_prefix(extra) < len(extra)


def test_closed_leaves_composed_and_free_objects_open():
    from chat_tools import closed
    free = {"type": "object"}
    said = {"type": "object", "properties": {"a": {}}, "additionalProperties": True}
    composed = {"properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}]}
    assert closed(free) == free and closed(said) == said and closed(composed) == composed
    listed = closed({"type": "array", "items": {"properties": {"a": {}}}, "$defs": {"properties": {"type": "object",
                                                                                                "properties": {}}}})
    assert listed["items"]["additionalProperties"] is False and "additionalProperties" not in listed
    assert listed["$defs"]["properties"]["additionalProperties"] is False  # a definition named "properties"


def test_cut_call_is_still_a_call():
    """A constrained call cut by max_tokens: tool_calls with the arguments so far, finish_reason "length"."""
    from openai_api import reply
    from openai_request import Params
    from sampling import Sampling

    named = Params(prompts=[[1]], max_tokens=8, sampling=Sampling(), tool_call=True, tool_name="add",
                   functions=frozenset({"add", "get_weather"}))
    message, reason = reply(named, '{"a": 2, "b"', "length")
    assert reason == "length" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b"'}
    required = Params(prompts=[[1]], max_tokens=8, sampling=Sampling(), tool_call=True,
                      functions=frozenset({"add", "get_weather"}))
    for text, name, arguments in [('{"name": "add", "arguments": {"a": 2', "add", '{"a": 2'),
                                  ('{"name": "get_weather"', "get_weather", ""),
                                  ('{"name": "get_w', "get_weather", "")]:
        message, reason = reply(required, text, "length")
        assert reason == "length" and message["tool_calls"][0]["function"] == {"name": name, "arguments": arguments}
    message, reason = reply(required, '{"na', "length")  # no name yet: not a call
    assert reason == "length" and message == {"role": "assistant", "content": '{"na'}
    message, reason = reply(required, '{"name": "add", "arguments": {"a": 2, "b": 3}}', "stop")
    assert reason == "tool_calls" and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 3}


def test_auto_reply_reads_calls():
    from openai_api import reply
    from openai_request import Params
    from sampling import Sampling

    auto = Params(prompts=[[1]], max_tokens=8, sampling=Sampling(), functions=frozenset(FUNCTIONS),
                  call_format=HERMES)
    message, reason = reply(auto, f"Adding.\n<tool_call>\n{ADD}\n</tool_call>", "stop")
    assert reason == "tool_calls" and message["content"] == "Adding." and len(message["tool_calls"]) == 1
    assert reply(auto, "No call.", "stop") == ({"role": "assistant", "content": "No call."}, "stop")
