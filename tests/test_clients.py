"""serve.py driven by the clients people put in front of an OpenAI-compatible server: LangChain's
ChatOpenAI and LiteLLM, one round trip each for a chat, a stream, structured output and a tool call
under "auto", each giving the same greedy text as the official `openai` client. One server of
SmolLM2's weights under a Hermes-style template; the call's text is forced with a grammar (an extra
body field), so the call is deterministic and still read from the generated text."""
import json
import os

import openai
import pytest

from test_serve import API_KEY, start_server, stop_server
from test_serve_structured import MODEL, ORDER_PROMPT, SAID, TOOLS, Order, hermes_checkpoint

PROMPT = "Write a haiku about the sea."
FORCED = {"grammar": "start: " + json.dumps(SAID)}  # SAID: some text, then a call of `add` in <tool_call> tags
ADD = {"a": 2, "b": 3}


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    root = hermes_checkpoint(smollm2_dir, tmp_path_factory.mktemp("hermes"))
    proc, url = start_server(root, "--max_batch_size", 2, "--max_seq_length", 512, "--no-compile",
                             "--model_name", MODEL)
    yield url + "/v1"
    assert stop_server(proc) == 0


@pytest.fixture(scope="module")
def expected(server):
    """The official client's greedy replies: the text, the Order and the call's text before the call."""
    client = openai.OpenAI(base_url=server, api_key=API_KEY, max_retries=0, timeout=300)
    text = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                          temperature=0, max_tokens=24).choices[0].message.content
    order = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": ORDER_PROMPT}],
                                          temperature=0, max_tokens=80, response_format=Order)
    return text, order.choices[0].message.parsed


def test_langchain_round_trip(server, expected):
    from langchain_openai import ChatOpenAI

    text, order = expected
    llm = ChatOpenAI(model=MODEL, base_url=server, api_key=API_KEY, temperature=0, max_tokens=24, max_retries=0,
                     timeout=300)
    assert llm.invoke(PROMPT).content == text
    assert "".join(chunk.content for chunk in llm.stream(PROMPT)) == text
    structured = llm.model_copy(update={"max_tokens": 80}).with_structured_output(Order)  # as client.parse sends it
    assert structured.invoke(ORDER_PROMPT) == order
    tooled = llm.bind_tools(TOOLS, tool_choice="auto").bind(max_tokens=60, extra_body=FORCED)
    reply = tooled.invoke("What is 2 + 3?")
    assert reply.content == "Let me add them." and reply.response_metadata["finish_reason"] == "tool_calls"
    [call] = reply.tool_calls
    assert call["name"] == "add" and call["args"] == ADD and call["id"].startswith("call_")
    streamed = None
    for chunk in tooled.stream("What is 2 + 3?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.content == "Let me add them."
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("add", ADD)]


@pytest.fixture(scope="module")
def litellm():
    # offline: the model-cost map that LiteLLM fetches at import comes from the package itself
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm
    return litellm


def test_litellm_round_trip(server, expected, litellm):
    text, order = expected

    def completion(content, **kw):
        return litellm.completion(model="openai/" + MODEL, api_base=server, api_key=API_KEY, temperature=0,
                                  messages=[{"role": "user", "content": content}], num_retries=0, timeout=300, **kw)

    assert completion(PROMPT, max_tokens=24).choices[0].message.content == text
    chunks = completion(PROMPT, max_tokens=24, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == text
    form = {"type": "json_schema", "json_schema": {"name": "Order", "schema": Order.model_json_schema()}}
    reply = completion(ORDER_PROMPT, max_tokens=80, response_format=form)
    assert Order.model_validate_json(reply.choices[0].message.content) == order
    reply = completion("What is 2 + 3?", max_tokens=60, tools=TOOLS, tool_choice="auto", extra_body=FORCED)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add them."
    [call] = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == ADD
