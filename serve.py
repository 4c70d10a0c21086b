"""An OpenAI-compatible HTTP server over engine.BatchEngine: continuous batching, prefix reuse.

    python serve.py --checkpoint checkpoints/smollm2-135m [--port 8000]
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

The official `openai` client works against it (base_url="http://127.0.0.1:8000/v1"):
/v1/completions and /v1/chat/completions, streamed (server-sent events) or not, /v1/models,
/health, and /metrics in Prometheus text. Sampling takes OpenAI's and vLLM's controls (penalties,
logit_bias, min_p, top_k, seed) and returns logprobs.

Structured output (grammar.py, llguidance): `response_format` json_object or json_schema (so
`client.chat.completions.parse(response_format=PydanticModel)` works), or the extra body fields
`regex` or `grammar` (llguidance's Lark; vLLM's `guided_regex`, `guided_grammar`, `guided_json` too).
Tools: the chat template is given `tools` (a template that describes tools puts them in the prompt);
with `tool_choice` "required" or naming a function, the output is constrained to a call (its
`parameters` schema) and comes back as `tool_calls`; with "auto" or "none" the reply is plain text
(no tool call is detected in free text). A conversation may carry an assistant's `tool_calls` and
the `tool` messages that answer them.

The main thread owns the model and calls BatchEngine.step() while there is work. The HTTP side
(Starlette on uvicorn's asyncio loop, in a thread of its own) checks each request, submits it,
and receives its text through an asyncio.Queue that the engine feeds with
loop.call_soon_threadsafe. Under
torchrun, rank 0 serves HTTP and sends every step's plan to the other ranks, which run the same
forward passes on their shards; send SIGTERM to rank 0's process for a graceful stop (torchrun
treats a SIGTERM of its own as a failure and ends every rank at once).
"""
import argparse
import asyncio
import gc
import json
import os
import signal
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

import checkpoint
import kernels
from engine import (COMPILE_MODES, BatchEngine, QueueFull, Request, StepPlan, buckets, check_longrope_batching,
                    check_vocabulary, decode_logits, load_model, log, longrope_switch, meta_model, parse_device,
                    parse_dtype, preflight, trained_context)
from errors import UserError, run_cli
from grammar import Grammars
from memory import Need, activation_bytes, kv_cache_bytes, logits_bytes
from model import param_bytes
from sampling import MAX_LOGPROBS, Sampling, check_sampling
from tokenizer import StopStrings, Tokenizer
from tp import MODES as TP_MODES, init_from_env

MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_N = 16
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions `logprobs`, as OpenAI allows (chat: `top_logprobs` up to MAX_LOGPROBS)
FIELDS = {  # accepted fields -> value kinds (a type is checked here; the others where they are read)
    "model": str, "max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int,
    "stop": "stop", "n": int, "stream": bool, "stream_options": dict, "ignore_eos": bool, "user": str,
    "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float, "min_p": float,
    "logit_bias": dict, "response_format": dict, "regex": str, "grammar": str,
    "guided_regex": str, "guided_grammar": str, "guided_json": "schema",
}
NEUTRAL = {  # not supported: accepted at the value that means "off", a 400 otherwise
    "best_of": (1,), "echo": (False,), "suffix": ("",), "top_logprobs": (0,), "tools": ([],),
    "tool_choice": ("none", "auto"), "parallel_tool_calls": (True, False), "store": (False,), "metadata": ({},),
    "service_tier": ("auto", "default"),
}
COMPLETION_FIELDS = {"prompt", "logprobs"}
CHAT_FIELDS = {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice"}
ROLES = ("system", "user", "assistant", "tool")
SAMPLING_FIELDS = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")
# extra body fields that constrain the output -> grammar.py's kind of their value (one constraint per request)
CONSTRAINT_FIELDS = {"regex": "regex", "grammar": "grammar", "guided_regex": "regex", "guided_grammar": "grammar",
                     "guided_json": "json_schema"}


class APIError(Exception):
    """An error for the client, as OpenAI's API writes it: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------- request checking

KIND_NAMES = {float: "a number", int: "an integer", bool: "a boolean", str: "a string", dict: "an object",
              list: "a list"}


def check_value(name: str, value, kind):
    if not isinstance(kind, type):  # checked where it is read
        return
    ok = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
    if not ok or (kind in (int, float) and isinstance(value, bool)):
        raise APIError(400, f"`{name}` must be {KIND_NAMES[kind]}", name)


def parse_stop(value) -> list:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, "`stop` must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP:
        raise APIError(400, f"`stop` takes at most {MAX_STOP} strings", "stop")
    return stops


def tool_functions(tools) -> dict:
    """A request's `tools` checked: function name -> its parameters' JSON schema."""
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, '`tools` must be a list of {"type": "function", "function": {...}}', "tools")
    functions = {}
    for i, tool in enumerate(tools or []):
        f = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise APIError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                                f'"parameters": {{...}}}}}}', "tools")
        parameters = f.get("parameters")
        if parameters is None:  # a function without arguments
            parameters = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(parameters, dict):
            raise APIError(400, f"tools[{i}]: `parameters` must be a JSON schema object", "tools")
        if f["name"] in functions:
            raise APIError(400, f"tools[{i}]: two functions are named {f['name']!r}", "tools")
        functions[f["name"]] = parameters
    return functions


def chat_messages(messages) -> list:
    """A request's `messages` as chat templates take them (transformers' format): text content, an
    assistant's `tool_calls` with their arguments as objects, a tool result with its `tool_call_id`."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "`messages` must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise APIError(400, f"messages[{i}] needs a `role` of {', '.join(ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}]: only text content parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        message = {"role": m["role"]}
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise APIError(400, f"messages[{i}]: only assistant messages carry `tool_calls`", "messages")
            calls = message_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
            if calls:
                message["tool_calls"] = calls
                if content is None:
                    content = ""  # templates that ignore tool calls concatenate the content, which None would break
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}] needs a string `content`", "messages")
        message["content"] = content
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise APIError(400, f"messages[{i}]: a tool result needs the `tool_call_id` of its call", "messages")
            message["tool_call_id"] = m["tool_call_id"]
        clean.append(message)
    return clean


def message_tool_calls(calls, where: str) -> list:
    """An assistant message's `tool_calls` checked, each call's `arguments` parsed from its JSON text
    (templates read them as an object, as transformers' docs ask)."""
    if not isinstance(calls, list):
        raise APIError(400, f"`{where}` must be a list of calls", "messages")
    out = []
    for k, call in enumerate(calls):
        f = call.get("function") if isinstance(call, dict) and call.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise APIError(400, f'`{where}[{k}]` must be {{"id": ..., "type": "function", "function": '
                                f'{{"name": ..., "arguments": ...}}}}', "messages")
        arguments = f.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise APIError(400, f"`{where}[{k}].function.arguments` is not valid JSON ({e})", "messages") from None
        if not isinstance(arguments, dict):
            raise APIError(400, f"`{where}[{k}].function.arguments` must be a JSON object", "messages")
        entry = {"id": call["id"]} if isinstance(call.get("id"), str) else {}
        out.append({**entry, "type": "function", "function": {"name": f["name"], "arguments": arguments}})
    return out


def call_schema(functions: dict) -> dict:
    """The JSON schema of a call to one of `functions` (name -> parameters' schema):
    {"name": <its name>, "arguments": <its parameters>}."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": name},
                                                         "arguments": rebase_refs(parameters,
                                                                                  f"#/anyOf/{i}/properties/arguments")},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for i, (name, parameters) in enumerate(functions.items())]}


def rebase_refs(schema, root: str):
    """A copy of `schema` for the place `root` (a JSON pointer) of another schema: its local $refs
    ("#/$defs/Item", as pydantic writes them) still point into it."""
    if isinstance(schema, dict):
        return {k: root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else rebase_refs(v, root)
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [rebase_refs(v, root) for v in schema]
    return schema


def tool_calls(params: "Params", text: str) -> Optional[list]:
    """A reply's `tool_calls` from the call's generated JSON; None if it is not a whole call."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if params.tool_name is not None:
        name, arguments = params.tool_name, text
    elif isinstance(value, dict) and isinstance(value.get("name"), str) and "arguments" in value:
        name, arguments = value["name"], json.dumps(value["arguments"], ensure_ascii=False)
    else:
        return None
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": name, "arguments": arguments}}]


@dataclass
class Params:
    """A checked request: its prompt token ids and generation settings."""
    prompt: list
    max_tokens: int
    sampling: Sampling
    n: int = 1
    seed: Optional[int] = None
    stop: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # each token's logprob and this many top ones; None: off
    grammar: Optional[str] = None  # compiled (grammar.Grammars.compile): every choice's output matches it
    tool_call: bool = False  # the output is a function call, returned as `tool_calls`
    tool_name: Optional[str] = None  # ... of this function (the output is its arguments); None: the output
                                     # is {"name": ..., "arguments": ...} (tool_choice "required")


class Server:
    def __init__(self, engine: BatchEngine, tokenizer: Tokenizer, model_name: str, api_key: Optional[str] = None,
                 checkpoint_dir: Optional[Path] = None):
        from prometheus_client import CollectorRegistry, Histogram

        self.engine, self.tokenizer, self.model_name, self.api_key = engine, tokenizer, model_name, api_key
        self.checkpoint_dir, self._grammars = checkpoint_dir, None
        self.token_texts: dict = {}  # token id -> its text decoded alone (logprobs)
        self.created = int(time.time())
        self.stop_ids = frozenset(engine.model.args.eos_token_ids) | frozenset(tokenizer.eos_ids)
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        buckets = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("minillm_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=buckets, registry=self.registry)
        self.itl = Histogram("minillm_inter_token_latency_seconds", "Time between a request's consecutive tokens",
                             buckets=buckets, registry=self.registry)

    # ---- the engine loop (on the main thread: PyTorch's OpenMP compute runs about 1.5x slower
    # when started from another thread on this CPU; the HTTP server runs on its own thread)

    def engine_loop(self, serving: Callable[[], bool]):
        """Step the engine while `serving()` says so; then end what is left."""
        engine = self.engine
        idle = 0.0
        while serving():
            engine.wakeup.clear()
            if not engine.has_work():
                if engine.wakeup.wait(timeout=0.5):
                    idle = 0.0
                elif engine.broadcast is not None and (idle := idle + 0.5) >= 10:
                    idle = 0.0
                    engine.broadcast(StepPlan())  # idle: keep the other ranks' collective from timing out
                continue
            try:
                engine.step()
            except Exception:  # a bug in scheduling: end what runs, keep serving
                log("engine: " + traceback.format_exc())
                for slot in engine.slots:
                    if slot.request is not None:
                        slot.cached = []
                        engine._finish(slot.request, "error", "internal error in the engine")
        with engine.lock:  # shutting down: end what is left
            for req in list(engine.waiting) + [s.request for s in engine.slots if s.request is not None]:
                engine._finish(req, "cancelled")
            engine.waiting.clear()

    # ---- checking a request

    def authorize(self, request):
        if self.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            raise APIError(401, "invalid or missing API key (send `Authorization: Bearer KEY`)", code="invalid_api_key")

    async def read_body(self, request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    def parse(self, body: dict, chat: bool) -> Params:
        own = CHAT_FIELDS if chat else COMPLETION_FIELDS
        for name, value in body.items():
            if name in own:
                continue
            if name in NEUTRAL:
                if value is not None and value not in NEUTRAL[name]:
                    raise APIError(400, f"`{name}` is not supported by this server", name, "unsupported_parameter")
            elif name not in FIELDS:
                raise APIError(400, f"unknown field `{name}`", name, "unsupported_parameter")
            elif value is not None:
                check_value(name, value, FIELDS[name])
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"model `{model}` not found (this server runs `{self.model_name}`)", "model",
                           "model_not_found")
        prompt = self.chat_prompt(body) if chat else self.completion_prompt(body)
        limit = self.engine.max_seq_length
        if len(prompt) >= limit:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this server's context (--max_seq_length) "
                                f"is {limit} tokens", "messages" if chat else "prompt", "context_length_exceeded")
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = body.get(name)
        if max_tokens is None:
            max_tokens = limit - len(prompt) if chat else 16  # OpenAI's defaults: the context left; 16
        if max_tokens < 1:
            raise APIError(400, f"`{name}` must be at least 1", name)
        if len(prompt) + max_tokens > limit:
            raise APIError(400, f"the prompt ({len(prompt)} tokens) + `{name}` ({max_tokens}) exceeds this server's "
                                f"context of {limit} tokens", name, "context_length_exceeded")
        temperature = body.get("temperature")
        temperature = 1.0 if temperature is None else float(temperature)
        if not 0 <= temperature <= 2:
            raise APIError(400, "`temperature` must be in [0, 2]", "temperature")
        top_p = 1.0 if body.get("top_p") is None else float(body["top_p"])
        if not 0 < top_p <= 1:
            raise APIError(400, "`top_p` must be in (0, 1]", "top_p")
        top_k = body.get("top_k")
        if top_k is not None and top_k < 1 and top_k not in (0, -1):
            raise APIError(400, "`top_k` must be at least 1 (0 or -1: off)", "top_k")
        top_k = None if top_k in (None, 0, -1) else top_k
        n = 1 if body.get("n") is None else body["n"]
        if not 1 <= n <= MAX_N:
            raise APIError(400, f"`n` must be in [1, {MAX_N}]", "n")
        options = body.get("stream_options") or {}
        if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
            raise APIError(400, "`stream_options` takes only `include_usage` (a boolean)", "stream_options")
        sampling, logprobs = self.parse_sampling(body, temperature, top_k, top_p), self.parse_logprobs(body, chat)
        grammar, tool_call, tool_name = self.parse_constraint(body, chat)  # last: it compiles
        return Params(prompt=prompt, max_tokens=max_tokens, sampling=sampling, n=n, seed=body.get("seed"),
                      stop=parse_stop(body["stop"]) if body.get("stop") is not None else [],
                      stream=bool(body.get("stream")), include_usage=bool(options.get("include_usage")),
                      ignore_eos=bool(body.get("ignore_eos")), logprobs=logprobs, grammar=grammar,
                      tool_call=tool_call, tool_name=tool_name)

    def parse_sampling(self, body: dict, temperature: float, top_k: Optional[int], top_p: float) -> Sampling:
        bias = []
        for key, value in (body.get("logit_bias") or {}).items():  # OpenAI's {"token id": bias}
            try:
                token = int(key)
            except ValueError:
                raise APIError(400, f"`logit_bias` keys must be token ids (got {key!r})", "logit_bias") from None
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise APIError(400, f"`logit_bias` values must be numbers (token {key}: {value!r})", "logit_bias")
            bias.append((token, float(value)))
        given = {name: float(body[name]) for name in SAMPLING_FIELDS[:4] if body.get(name) is not None}
        sampling = Sampling(temperature, top_k, top_p, logit_bias=tuple(sorted(bias)), **given)
        try:
            check_sampling(sampling, self.engine.model.args.vocab_size)
        except UserError as e:
            raise APIError(400, str(e), next((f for f in SAMPLING_FIELDS if str(e).startswith(f)), None)) from None
        return sampling

    def parse_logprobs(self, body: dict, chat: bool) -> Optional[int]:
        """How many top tokens to return with each token's logprob; None: no logprobs. Chat asks with
        `logprobs: true` and `top_logprobs` (0-20), completions with `logprobs` (0-5)."""
        value = body.get("logprobs")
        if not chat:
            if value is None or value is False:
                return None
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COMPLETION_LOGPROBS:
                raise APIError(400, f"`logprobs` must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]", "logprobs")
            return value
        if value is not None and not isinstance(value, bool):
            raise APIError(400, "`logprobs` must be a boolean (the number of top tokens goes in `top_logprobs`)",
                           "logprobs")
        top = body.get("top_logprobs")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS):
            raise APIError(400, f"`top_logprobs` must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs")
        if top and not value:
            raise APIError(400, "`top_logprobs` needs `logprobs: true`", "top_logprobs")
        return (top or 0) if value else None

    def parse_constraint(self, body: dict, chat: bool) -> tuple:
        """(the compiled grammar every choice must match or None, whether the output is a tool call,
        the called function's name or None)."""
        found = []  # (the field, grammar.py's kind, its spec)
        form = body.get("response_format")
        if form is not None:
            kind = form.get("type")
            if kind == "json_object":
                found.append(("response_format", "json_object", None))
            elif kind == "json_schema":
                spec = form.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise APIError(400, "`response_format` of type json_schema needs "
                                        '`"json_schema": {"name": ..., "schema": {...}}`', "response_format")
                found.append(("response_format", "json_schema", spec["schema"]))
            elif kind != "text":
                raise APIError(400, f"`response_format` type must be text, json_object or json_schema (got {kind!r})",
                               "response_format")
        found += [(name, kind, body[name]) for name, kind in CONSTRAINT_FIELDS.items() if body.get(name) is not None]
        tool = self.parse_tools(body) if chat else None
        if tool is not None:
            found.append(("tool_choice", "json_schema", tool[0]))
        if len(found) > 1:
            raise APIError(400, f"one constraint per request: `{found[0][0]}` and `{found[1][0]}` both constrain "
                                "the output", found[1][0])
        if not found:
            return None, False, None
        name, kind, spec = found[0]
        try:
            grammar = self.grammars().compile(kind, spec)
        except UserError as e:
            raise APIError(400, str(e), "tools" if name == "tool_choice" else name) from None
        return grammar, tool is not None, tool[1] if tool is not None else None

    def parse_tools(self, body: dict) -> Optional[tuple]:
        """(the JSON schema of the call, the function's name or None when the output names it) under
        `tool_choice` "required" or a named function; None when the output is free text."""
        functions, choice = tool_functions(body.get("tools")), body.get("tool_choice")
        if choice is None or choice in ("none", "auto"):  # "auto": no tool call is detected in free text
            return None
        if choice == "required":
            if not functions:
                raise APIError(400, '`tool_choice` "required" needs `tools`', "tool_choice")
            return call_schema(functions), None
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
            name = choice["function"].get("name")
            if not isinstance(name, str) or name not in functions:
                raise APIError(400, f"`tool_choice` names the function {name!r}, which is not in `tools`",
                               "tool_choice")
            return functions[name], name
        raise APIError(400, '`tool_choice` must be "none", "auto", "required" or '
                            '{"type": "function", "function": {"name": ...}}', "tool_choice")

    def grammars(self) -> Grammars:
        """The model's grammar.Grammars, built on first use: a checkpoint without tokenizer.json
        serves every request but constrained ones (UserError)."""
        if self._grammars is None:
            if self.checkpoint_dir is None:
                raise UserError("constrained decoding needs the server's checkpoint directory")
            self._grammars = Grammars(self.checkpoint_dir, self.engine.model.args.vocab_size, sorted(self.stop_ids))
        return self._grammars

    def completion_prompt(self, body: dict) -> list:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "`prompt` is empty", "prompt")
            return self.tokenizer.encode(prompt)  # as generate.py encodes it
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.engine.model.args.vocab_size
            if not all(0 <= t < vocab for t in prompt):
                raise APIError(400, f"`prompt` token ids must be in [0, {vocab})", "prompt")
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
            raise APIError(400, "one prompt per request (send several requests)", "prompt", "unsupported_parameter")
        raise APIError(400, "`prompt` must be a non-empty string or a list of token ids", "prompt")

    def chat_prompt(self, body: dict) -> list:
        messages = chat_messages(body.get("messages"))
        tool_functions(body.get("tools"))  # checked before the template reads them
        try:
            # given whatever `tool_choice` says: "none" forbids a call, not knowing the tools
            text = self.tokenizer.apply_chat_template(messages, tools=body.get("tools") or None)
        except Exception as e:  # the template's own raise_exception (e.g. roles out of order)
            raise APIError(400, f"the chat template rejects these messages: {e}", "messages") from None
        return self.tokenizer.encode(text, add_bos=False)  # the template writes any BOS itself

    # ---- running a request

    def submit(self, params: Params) -> tuple[list, asyncio.Queue]:
        """Submit the request's n choices; their events arrive on the queue."""
        queue: asyncio.Queue = asyncio.Queue()
        choices = []
        for i in range(params.n):
            choice = Choice(i, params, self, queue)
            seed = None if params.seed is None else params.seed + i
            constraint = None
            if params.grammar is not None:
                try:
                    constraint = self.grammars().constraint(params.grammar)  # a matcher of its own
                except UserError as e:
                    raise APIError(400, str(e)) from None
            choice.request = Request(list(params.prompt), params.max_tokens, params.sampling, seed=seed,
                                     stop_ids=frozenset() if params.ignore_eos else self.stop_ids,
                                     on_token=choice.on_token, on_finish=choice.on_finish, constraint=constraint,
                                     logprobs=params.logprobs)
            choices.append(choice)
        submitted = []
        try:
            for choice in choices:
                self.engine.submit(choice.request)
                submitted.append(choice)
        except QueueFull as e:
            for choice in submitted:
                self.engine.cancel(choice.request)
            raise APIError(429, f"the server is busy ({e}); try again later", code="rate_limit_exceeded",
                           kind="rate_limit_error") from None
        except UserError as e:
            for choice in submitted:
                self.engine.cancel(choice.request)
            raise APIError(400, str(e)) from None
        return choices, queue

    def post(self, queue: asyncio.Queue, event: tuple):
        """From the engine loop: hand an event to the request's coroutine."""
        self.loop.call_soon_threadsafe(queue.put_nowait, event)


@dataclass
class TokenLogprob:
    """An output token's logprobs (engine.token_logprobs) and where its text lies in the choice's text."""
    token: int
    logprob: float
    top: list  # [(token id, logprob)], the most likely first
    start: int
    end: int


class Choice:
    """One of a request's n sequences, fed by the engine loop's callbacks: its text so far (stop
    strings held back until they can no longer match), and its tokens' logprobs, which go out
    with the text they make."""

    def __init__(self, index: int, params: Params, server: Server, queue: asyncio.Queue):
        self.index, self.params, self.server, self.queue = index, params, server, queue
        self.stops = StopStrings(server.tokenizer, params.stop)
        self.sent = 0  # characters of the text sent
        self.request: Optional[Request] = None
        self.arrival, self.last = time.perf_counter(), None
        self.tokens: list = []  # TokenLogprob of each output token, with logprobs on
        self.emitted = 0  # of self.tokens, sent
        self.sampled = 0  # of request.token_logprobs, read

    def on_token(self, req: Request, token: int) -> bool:
        now = time.perf_counter()
        if self.last is None:
            self.server.ttft.observe(now - self.arrival)
        else:
            self.server.itl.observe(now - self.last)
        self.last = now
        entry = None
        if self.sampled < len(req.token_logprobs):  # the engine recorded the sampled token's logprobs
            entry = req.token_logprobs[self.sampled]
            self.sampled += 1
        if token in req.stop_ids:
            return False
        start = len(self.stops.text)
        stopped = self.stops.push(token)
        if entry is not None and (not stopped or start < len(self.stops.text)):  # its text is in the output
            self.tokens.append(TokenLogprob(token, entry[0], entry[1], start, len(self.stops.text)))
        if stopped:
            return True
        self.send(self.stops.ready())
        return False

    def on_finish(self, req: Request):
        final = req.finish_reason in ("stop", "length")
        self.send(self.stops.finish() if final else self.stops.ready(), final=True)
        self.server.post(self.queue, ("finish", self.index, req.finish_reason, req.error))

    def send(self, upto: str, final: bool = False):
        """Send the text up to `upto` that has not gone out, with the logprobs of the tokens whose
        text it completes (at the end: of every token whose text is in the output)."""
        if len(upto) <= self.sent and not final:
            return
        i = self.emitted
        while i < len(self.tokens) and (self.tokens[i].end <= len(upto) or final and self.tokens[i].start < len(upto)):
            i += 1
        entries, self.emitted = self.tokens[self.emitted:i], i
        if len(upto) > self.sent or entries:
            self.server.post(self.queue, ("text", self.index, upto[self.sent:], entries))
            self.sent = max(self.sent, len(upto))


class EngineCollector:
    """Prometheus figures read from the engine when /metrics is scraped."""

    def __init__(self, engine: BatchEngine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        running, waiting = self.engine.counts()
        yield GaugeMetricFamily("minillm_requests_running", "Requests in a slot", value=running)
        yield GaugeMetricFamily("minillm_requests_waiting", "Requests waiting for a slot", value=waiting)
        c = self.engine.counters
        for name, key, text in [
            ("minillm_generation_tokens", "generated_tokens", "Tokens generated"),
            ("minillm_prompt_tokens", "prompt_tokens", "Prompt tokens of admitted requests"),
            ("minillm_prefill_tokens", "prefilled_tokens", "Prompt tokens prefilled (not found in a slot's cache)"),
            ("minillm_prompt_tokens_cached", "cached_tokens", "Prompt tokens reused from a slot's cache"),
            ("minillm_requests_finished", "requests_finished", "Requests finished, for any reason"),
        ]:
            yield CounterMetricFamily(name, text, value=c[key])


# ---------------------------------------------------------------- responses

def usage(params: Params, choices: list) -> dict:
    completion = sum(len(c.request.out) for c in choices)
    prompt = len(params.prompt)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": choices[0].request.cached_tokens}}


def logprobs_body(server: Server, entries: list, chat: bool) -> dict:
    """OpenAI's logprobs of a choice (or of a chunk's tokens): chat's {"content": [...]}, or the
    legacy completions' parallel lists, whose top_logprobs include the chosen token."""
    def text(token: int) -> str:  # decoded alone, as OpenAI's `token`
        if token not in server.token_texts:
            server.token_texts[token] = server.tokenizer.decode([token])
        return server.token_texts[token]

    def one(token: int, logprob: float) -> dict:
        s = text(token)
        return {"token": s, "logprob": max(logprob, -9999.0), "bytes": list(s.encode())}  # JSON has no -inf

    def top(e: TokenLogprob) -> dict:
        tops = {text(t): max(lp, -9999.0) for t, lp in e.top}
        tops.setdefault(text(e.token), max(e.logprob, -9999.0))  # the chosen token, as OpenAI adds it
        return tops

    if chat:
        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}
    return {"tokens": [text(e.token) for e in entries], "token_logprobs": [max(e.logprob, -9999.0) for e in entries],
            "top_logprobs": [top(e) for e in entries], "text_offset": [e.start for e in entries]}


def reply(params: Params, text: str, reason: str) -> tuple:
    """A chat choice's message and finish_reason: a tool call's JSON becomes `tool_calls` (one cut off
    by max_tokens stays text, with finish_reason "length")."""
    calls = tool_calls(params, text) if params.tool_call and reason == "stop" else None
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text}, reason


def build_app(server: Server):
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    def error_response(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def generate(request, chat: bool):
        try:
            server.authorize(request)
            params = server.parse(await server.read_body(request), chat)
            choices, queue = server.submit(params)
        except APIError as e:
            return error_response(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        base = {"id": rid, "created": int(time.time()), "model": server.model_name}
        if params.stream:
            return StreamingResponse(stream(choices, queue, params, chat, base), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        texts, reasons = [""] * len(choices), [None] * len(choices)
        entries = [[] for _ in choices]
        try:
            while None in reasons:
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return JSONResponse({}, status_code=499)
                    continue
                if event[0] == "text":
                    texts[event[1]] += event[2]
                    entries[event[1]] += event[3]
                else:
                    _, i, reason, error = event
                    if reason == "error":
                        return error_response(APIError(500, f"generation failed: {error}", kind="server_error"))
                    if reason == "cancelled":
                        return error_response(APIError(503, "the server is shutting down", kind="server_error"))
                    reasons[i] = reason
        finally:
            for c in choices:
                if c.request.finish_reason is None:
                    server.engine.cancel(c.request)
        out = []
        for i, (text, reason) in enumerate(zip(texts, reasons)):
            logprobs = None if params.logprobs is None else logprobs_body(server, entries[i], chat)
            if chat:
                message, reason = reply(params, text, reason)
                out.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
            else:
                out.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason})
        return JSONResponse({**base, "object": obj, "choices": out, "usage": usage(params, choices)})

    async def stream(choices, queue, params, chat, base):
        obj = "chat.completion.chunk" if chat else "text_completion"
        started = [False] * len(choices)
        held = [["", []] for _ in choices]  # a tool call's text and logprobs: sent whole at its end

        def chunk(i, text, entries, reason=None, calls=None):
            logprobs = logprobs_body(server, entries, chat) if params.logprobs is not None and entries else None
            if chat:
                delta = {"content": text} if text else {}
                if calls:
                    delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
                if not started[i]:
                    delta = {"role": "assistant", **delta}
                    started[i] = True
                body = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            else:
                body = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
            extra = {"usage": None} if params.include_usage else {}
            return "data: " + json.dumps({**base, "object": obj, "choices": [body], **extra}) + "\n\n"

        try:
            left = len(choices)
            while left:
                event = await queue.get()
                if event[0] == "text":
                    _, i, text, entries = event
                    if params.tool_call:
                        held[i][0] += text
                        held[i][1] += entries
                    else:
                        yield chunk(i, text, entries)
                    continue
                _, i, reason, error = event
                left -= 1
                if reason == "error":
                    yield "data: " + json.dumps(APIError(500, f"generation failed: {error}",
                                                         kind="server_error").body()) + "\n\n"
                    continue
                if reason == "cancelled":  # the server is shutting down
                    yield "data: " + json.dumps(APIError(503, "the server is shutting down",
                                                         kind="server_error").body()) + "\n\n"
                    continue
                if params.tool_call:
                    message, reason = reply(params, held[i][0], reason)
                    yield chunk(i, held[i][0] if message["content"] else "", held[i][1],
                                calls=message.get("tool_calls"))
                yield chunk(i, "", [], reason)
            if params.include_usage:
                yield "data: " + json.dumps({**base, "object": obj, "choices": [], "usage": usage(params, choices)}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the response ended): free the slots at the next step
            for c in choices:
                if c.request.finish_reason is None:
                    server.engine.cancel(c.request)

    async def completions(request):
        return await generate(request, chat=False)

    async def chat_completions(request):
        return await generate(request, chat=True)

    async def models(request):
        try:
            server.authorize(request)
        except APIError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [
            {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "minillm",
             "root": server.model_name, "max_model_len": server.engine.max_seq_length}]})

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def metrics(request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return PlainTextResponse(generate_latest(server.registry), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       kind=kind))

    async def server_error(request, exc: Exception):
        log("serve: " + "".join(traceback.format_exception(exc)))
        return error_response(APIError(500, f"internal error ({type(exc).__name__})", kind="server_error"))

    @asynccontextmanager
    async def lifespan(app):
        server.loop = asyncio.get_running_loop()  # where the engine loop posts each request's events
        yield

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, Exception: server_error})


# ---------------------------------------------------------------- start-up

def memory_needs(model, args, dtype) -> list:
    """What BatchEngine allocates beside the weights, given the model as load_model builds it (a
    rank's shard): a cache row per slot and a scratch row, a step's logits (a row per slot), and a
    step's activations (a prefill chunk, or a row per slot) with one layer's keys and values that
    the slots' rows gather."""
    rows, length = args.max_batch_size + 1, args.max_seq_length
    cache = kv_cache_bytes(model, rows, length, dtype)
    step = max(min(args.prefill_chunk, length), rows)  # tokens in one forward
    return [Need("the KV cache", cache, "lower --max_batch_size or --max_seq_length",
                 f" for {args.max_batch_size} + 1 rows of {length} tokens"),
            Need("the logits", logits_bytes(model.args.vocab_size, rows), "lower --max_batch_size", f" of {rows} rows"),
            Need("a step's activations", activation_bytes(model.args, step, length, dtype) + cache // len(model.layers),
                 "lower --prefill_chunk, --max_batch_size or --max_seq_length"),
            Need("oneDNN's copy of the float weights", kernels.prepack_bytes(model, parse_device(args.device), dtype)
                 if args.prepack else 0, "pass --no-prepack")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Serve a checkpoint over an OpenAI-compatible HTTP API, "
                                            "with continuous batching and prefix reuse.",
                                epilog="Structured output: send response_format json_object or json_schema "
                                       "(client.chat.completions.parse works), or the extra fields `regex` or "
                                       "`grammar` (llguidance Lark); tools with tool_choice \"required\" or a named "
                                       "function come back as tool_calls. Needs the checkpoint's tokenizer.json.")
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max_batch_size", type=int, default=16, help="requests decoded together (cache rows)")
    p.add_argument("--max_seq_length", type=int, default=None,
                   help="tokens per request: prompt + output (default: 4096, or the model's trained context if shorter)")
    p.add_argument("--extend_context", action="store_true",
                   help="allow a --max_seq_length past the model's trained context (max_position_embeddings, or what "
                        "its RoPE scaling extends it to), with a warning: the output usually degrades there")
    p.add_argument("--max_waiting", type=int, default=64, help="requests queued for a slot; more get a 429")
    p.add_argument("--prefill_chunk", type=int, default=256,
                   help="prompt tokens prefilled per step, between decode steps")
    p.add_argument("--prepack", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU, float weights: keep a second copy of the weights in oneDNN's layout, for faster steps of "
                        "many rows (--no-prepack saves that memory)")
    p.add_argument("--prefix_reuse", action=argparse.BooleanOptionalAction, default=True,
                   help="a request takes the free slot whose cache shares the longest beginning with its prompt "
                        "and prefills only the rest (default: on)")
    p.add_argument("--tp_mode", choices=TP_MODES, default="auto",
                   help="under torchrun: exact all-gathers so that a quantized model's ranks give one "
                        "process's output bit for bit; allreduce is Megatron's two all-reduces per layer, "
                        "fewer collectives, but a quantized model's text may drift from one process's; "
                        "auto (default): exact for quantized checkpoints, else allreduce (tp.py)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32" if not torch.cuda.is_available() else "bfloat16")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the decode step (default: on; compiles at start-up)")
    p.add_argument("--compile_mode", choices=COMPILE_MODES, default="default",
                   help="regional: compile one layer and reuse it for every layer, a fraction of the startup; "
                        "max: see generate.py --help")
    p.add_argument("--api_key", default=os.environ.get("MINILLM_API_KEY"),
                   help="require `Authorization: Bearer KEY` (default: $MINILLM_API_KEY, or none)")
    p.add_argument("--model_name", default=None, help="the model id clients name (default: the checkpoint's name)")
    p.add_argument("--shutdown_timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let running requests finish")
    return p


def check_args(args):
    for name in ("max_batch_size", "max_waiting", "prefill_chunk"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1")
    if args.max_seq_length is not None and args.max_seq_length < 2:
        raise UserError("--max_seq_length must be at least 2")
    if not 0 < args.port < 65536:
        raise UserError("--port must be in 1..65535")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise UserError("--shutdown_timeout must be a finite number of seconds >= 0")


def check_context(args, config):
    """--max_seq_length within the model's trained context, unless --extend_context (with a warning)."""
    context = trained_context(config)
    if args.max_seq_length > context:
        where = f"--max_seq_length {args.max_seq_length} is past the model's trained context of {context} tokens"
        if not args.extend_context:
            raise UserError(f"{where}: lower it, or pass --extend_context to go past it anyway")
        log(f"warning: {where}; the output usually degrades there")


def warm_up(engine: BatchEngine):
    """Compile the decode step before serving (a request would otherwise wait for the compiler in
    the middle of serving), on the scratch row. On CPU: two batch sizes (one with prompt rows,
    which need no logits) and two cache lengths, the second step changing all three at once so
    that one recompile makes the graph general in them; then steps of as many rows, and as many
    logits, as make the float products change kernels (kernels.compiled_onednn_min_tokens), which
    compile apart. On CUDA the step is general from the first compile: every shape a step takes
    (power-of-two rows, each cache bucket), twice, so that each is recorded as a CUDA graph."""
    if engine.decode is decode_logits:  # not compiled
        return
    start = time.perf_counter()
    log("compiling the decode step (a minute or more the first time, cached on disk afterwards)...")
    row, B, fused = engine.scratch_row, engine.max_batch_size, engine.fused_rows

    def step(decoding: int, prompt: int, pos: int) -> StepPlan:
        return StepPlan(decode=[(row, 0, pos)] * decoding, fused=[(row, [0] * prompt, pos)] if prompt else [])

    if engine.pad_rows:
        widths = sorted({engine.step_width(n) for n in range(1, B + 1)})
        plans = [step(w, 0, kv - 1) for w in widths for kv in buckets(engine.max_seq_length) for _ in range(2)]
    else:
        # a prompt chunk of two tokens: one more logit-less row
        grow = (engine.min_rows, 2) if fused else (min(engine.min_rows + 1, B + 1), 0)
        plans = [step(engine.min_rows, 0, 0), step(*grow, min(200, engine.max_seq_length - 3)), step(*grow, 0)]
        wide = kernels.compiled_onednn_min_tokens(engine.model.norm.weight.dtype)
        pos = max(0, engine.max_seq_length - wide - 1)
        if fused >= wide:  # many rows, few logits: prompt tokens beside a few streams
            plans.append(step(1, wide - 1, pos))
        elif B + 1 >= wide:
            plans.append(step(wide, 0, pos))
        if B >= wide:  # many rows and many logits: as many streams
            plans.append(step(wide, 2 if fused >= wide + 2 else 0, pos))
    with torch.inference_mode():
        for plan in plans:
            if engine.broadcast is not None:
                engine.broadcast(plan)
            engine.run(plan)
    log(f"compiled in {time.perf_counter() - start:.1f} s")


def main(argv=None):
    args = build_parser().parse_args(argv)
    check_args(args)
    tp, args.device = init_from_env(args.device, args.tp_mode)
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    checkpoint.require_dir(args.checkpoint)
    config = checkpoint.read_config(args.checkpoint)
    args.max_seq_length = args.max_seq_length or min(4096, trained_context(config), longrope_switch(config) or 4096)
    check_longrope_batching(config, args.max_seq_length)  # before the model loads
    needs = lambda model: memory_needs(model, args, dtype)  # noqa: E731
    # before the context check, as the memory error names both flags that lower it; under torchrun
    # each rank checks its own shard as it loads
    if tp is None:
        preflight(meta_model(config), args.checkpoint, device, dtype, needs)
    check_context(args, config)
    tokenizer = Tokenizer(args.checkpoint)
    check_vocabulary(tokenizer, config, args.checkpoint)
    start = time.perf_counter()
    model = (tp.all_ranks_ok(load_model, args.checkpoint, device, dtype, tp=tp, needs=needs) if tp is not None
             else load_model(args.checkpoint, device, dtype))
    size = param_bytes(model, tokens=model.args.n_experts or 1)  # every expert, not the ones a step reads
    log(f"loaded {args.checkpoint} ({model.args.architecture}, {size / 1e6:.0f} MB of weights in "
        f"{args.dtype} on {device}) in {time.perf_counter() - start:.1f} s")
    engine = BatchEngine(model, args.max_batch_size, args.max_seq_length, compile=args.compile,
                         compile_mode=args.compile_mode, prefill_chunk=args.prefill_chunk, max_waiting=args.max_waiting,
                         prefix_reuse=args.prefix_reuse, prepack=args.prepack)
    if tp is not None:
        import torch.distributed as dist

        def broadcast(plan):
            dist.broadcast_object_list([plan], src=0, group=tp.group)

        def receive():
            box = [None]
            dist.broadcast_object_list(box, src=0, group=tp.group)
            return box[0]

        if tp.rank != 0:
            engine.follow(receive)  # the warm-up's steps first, then every step rank 0 plans
            return
        engine.broadcast = broadcast
    if args.compile:
        warm_up(engine)
    import uvicorn

    name = args.model_name or Path(args.checkpoint).resolve().name
    server = Server(engine, tokenizer, name, args.api_key, args.checkpoint)
    try:
        server.grammars()  # now rather than in the first constrained request
    except UserError as e:
        log(f"constrained output is off: {e}")
    # loading and compiling leave ~700,000 objects that live as long as the server; frozen, the
    # cyclic collector stops walking them (a full collection over them pauses every stream ~0.5 s)
    gc.collect()
    gc.freeze()
    log(f"serving {name} on http://{args.host}:{args.port}/v1 ({args.max_batch_size} slots x "
        f"{args.max_seq_length} tokens)")
    config = uvicorn.Config(build_app(server), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    http = uvicorn.Server(config)
    http_thread = threading.Thread(target=http.run, name="http")
    http_thread.start()

    def on_signal(sig, frame):  # stop accepting; running requests finish (for --shutdown_timeout at most)
        http.should_exit = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.engine_loop(http_thread.is_alive)
    finally:
        http.should_exit = True
        http_thread.join(timeout=args.shutdown_timeout + 5)
        if engine.broadcast is not None:
            engine.broadcast(None)  # the other ranks stop following
    log("serve: stopped")


if __name__ == "__main__":
    run_cli(main)
