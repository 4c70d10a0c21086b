"""A request to the OpenAI API, checked: the fields it may carry and their kinds, the checks that
need no model, the error the client gets (APIError) and what a checked request holds (Params).
"""
from dataclasses import dataclass, field
from typing import Optional

from errors import UserError
from sampling import MAX_LOGPROBS, Sampling, check_sampling

MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_N = 16
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions `logprobs`, as OpenAI allows (chat: `top_logprobs` up to MAX_LOGPROBS)
# OpenAI's int64 `seed`; choice i's seed + i (< MAX_N) stays within torch.Generator.manual_seed's [-2**63, 2**64)
SEED_MIN, SEED_MAX = -2 ** 63, 2 ** 63 - 1
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
