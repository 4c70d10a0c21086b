"""A request to the OpenAI API, checked: the fields it may carry and their kinds, the checks that
need no model, the error the client gets (APIError) and what a checked request holds (Params).
"""
from dataclasses import dataclass, field
from typing import Optional

from choices import MAX_LOGPROBS
from errors import UserError
from sampling import Sampling, check_sampling
from tool_parsers import CallFormat

MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_N = 16  # choices per request: `n` times the number of prompts (a list `prompt` of /v1/completions)
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions `logprobs`, as OpenAI allows (chat: `top_logprobs` up to MAX_LOGPROBS)
# OpenAI's int64 `seed`; a prompt's choice j gets seed + j (< MAX_N): within manual_seed's [-2**63, 2**64)
SEED_MIN, SEED_MAX = -2 ** 63, 2 ** 63 - 1
FIELDS = {  # accepted fields -> value kinds (a type is checked here; the others where they are read)
    "model": str, "max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int,
    "stop": "stop", "n": int, "stream": bool, "stream_options": dict, "ignore_eos": bool, "user": str,
    "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float, "min_p": float,
    "logit_bias": dict, "response_format": dict, "regex": str, "grammar": str,
    "guided_regex": str, "guided_grammar": str, "guided_json": "schema",
    "speculative": bool,  # this server's extension: false runs the request without serve.py --speculative's proposals
}
NEUTRAL = {  # not supported: accepted at the value that means "off", a 400 otherwise
    "best_of": (1,), "echo": (False,), "suffix": ("",), "top_logprobs": (0,), "tools": ([],),
    "tool_choice": ("none", "auto"), "parallel_tool_calls": (True, False), "store": (False,), "metadata": ({},),
    "service_tier": ("auto", "default"),
}
COMPLETION_FIELDS = {"prompt", "logprobs", "echo"}
CHAT_FIELDS = {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice"}
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


@dataclass
class Params:
    """A checked request: its prompts' token ids (chat: one; completions: one or more, each with n
    choices) and generation settings."""
    prompts: list
    max_tokens: int
    sampling: Sampling
    n: int = 1
    seed: Optional[int] = None
    stop: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # each token's logprob and this many top ones; None: off
    echo: bool = False  # completions: the prompt's text before each choice's (with logprobs: its tokens' too)
    grammar: Optional[str] = None  # compiled (grammar.Grammars.compile): every choice's output matches it
    tool_call: bool = False  # the output is a function call, returned as `tool_calls`
    tool_name: Optional[str] = None  # ... of this function (the output is its arguments); None: the output
                                     # is {"name": ..., "arguments": ...} (tool_choice "required")
    functions: frozenset = frozenset()  # the names of the functions in `tools`
    call_format: Optional[CallFormat] = None  # tool_choice "auto": calls are read from the text in this format
    speculative: bool = True  # false: no proposals for it under serve.py --speculative (the output is the same)


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


def check_fields(body: dict, chat: bool):
    """Every field of `body` is one this server takes: an unsupported one only at its neutral value."""
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


def is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in value)


def parse_prompts(prompt, encode, vocab_size: int) -> list:
    """/v1/completions' `prompt` as a list of token-id lists: a string or a list of token ids is one
    prompt, a list of strings or of token-id lists is several."""
    many = prompt if isinstance(prompt, list) and not is_ids(prompt) else [prompt]
    if not many or not (all(isinstance(p, str) for p in many) or all(is_ids(p) for p in many)):
        raise APIError(400, "`prompt` must be a non-empty string, a list of token ids, or a non-empty list of "
                            "either (not mixed)", "prompt")
    if len(many) > MAX_N:
        raise APIError(400, f"`prompt` takes at most {MAX_N} prompts (got {len(many)})", "prompt")
    if not all(many):
        raise APIError(400, "`prompt` is empty" if len(many) == 1 else "a prompt of `prompt` is empty", "prompt")
    if not all(0 <= t < vocab_size for p in many if not isinstance(p, str) for t in p):
        raise APIError(400, f"`prompt` token ids must be in [0, {vocab_size})", "prompt")
    return [encode(p) if isinstance(p, str) else list(p) for p in many]  # strings as generate.py encodes them


def check_context(prompts: list, max_tokens: Optional[int], name: str, limit: int, chat: bool,
                  echo: bool = False) -> int:
    """`max_tokens` (None: OpenAI's default, chat's the context left, completions' 16), checked against
    the context (--max_seq_length, `limit`) with each prompt; 0 only with `echo` (the prompt alone)."""
    longest = max(len(p) for p in prompts)
    which = "the prompt" if len(prompts) == 1 else f"prompt {[len(p) for p in prompts].index(longest)}"
    if longest >= limit:
        raise APIError(400, f"{which} has {longest} tokens; this server's context (--max_seq_length) is {limit} "
                            "tokens", "messages" if chat else "prompt", "context_length_exceeded")
    if max_tokens is None:
        max_tokens = limit - longest if chat else 16
    if max_tokens < (0 if echo else 1):
        raise APIError(400, f"`{name}` must be at least {0 if echo else 1}" + ("" if chat or echo else
                            " (0 only with `echo`: the prompt alone)"), name)
    if longest + max_tokens > limit:
        raise APIError(400, f"{which} ({longest} tokens) + `{name}` ({max_tokens}) exceeds this server's "
                            f"context of {limit} tokens", name, "context_length_exceeded")
    return max_tokens


def parse_echo(body: dict, chat: bool) -> bool:
    echo = None if chat else body.get("echo")  # chat takes only `echo: false` (check_fields)
    if echo is not None and not isinstance(echo, bool):
        raise APIError(400, "`echo` must be a boolean", "echo")
    return bool(echo)


def parse_n(body: dict, prompts: int) -> int:
    n = 1 if body.get("n") is None else body["n"]
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"`n` must be in [1, {MAX_N}]", "n")
    if n * prompts > MAX_N:
        raise APIError(400, f"`n` ({n}) x {prompts} prompts exceeds {MAX_N} choices a request", "n")
    return n


def parse_seed(body: dict) -> Optional[int]:
    seed = body.get("seed")
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise APIError(400, f"`seed` must be an integer in [{SEED_MIN}, {SEED_MAX}]", "seed")
    return seed


def parse_stream_options(body: dict) -> bool:
    """Whether a streamed request asks for a last chunk with the usage."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not body.get("stream"):
        raise APIError(400, "`stream_options` is only allowed when `stream` is true", "stream_options")
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise APIError(400, "`stream_options` takes only `include_usage` (a boolean)", "stream_options")
    return bool(options.get("include_usage"))


def parse_sampling(body: dict, temperature: float, top_k: Optional[int], top_p: float, vocab_size: int) -> Sampling:
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
        check_sampling(sampling, vocab_size)
    except UserError as e:
        raise APIError(400, str(e), next((f for f in SAMPLING_FIELDS if str(e).startswith(f)), None)) from None
    return sampling


def parse_logprobs(body: dict, chat: bool) -> Optional[int]:
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
