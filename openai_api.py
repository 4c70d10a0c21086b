"""The OpenAI-compatible HTTP API over engine.Engine, for serve.py: a request checked into Params
(its fields: openai_request.py; messages and tools: chat_tools.py) with its chat or completion prompt
and its constraint, each choice's text and logprobs as the engine produces them, and the Starlette
routes (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, and / for chat.html,
the chat page). Requests reach the engine through Engine.submit; the engine loop (serve.py) posts
each choice's events back to the request's coroutine with loop.call_soon_threadsafe.
"""
import asyncio
import hashlib
import json
import time
import traceback
import uuid
from itertools import zip_longest
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from chat_tools import chat_messages, parse_tools, tool_calls, tool_functions
from engine import Engine, log
from errors import UserError
from grammar import Grammars
from openai_request import (CONSTRAINT_FIELDS, APIError, Params, check_context, check_fields, parse_echo,
                            parse_logprobs, parse_n, parse_prompts, parse_sampling, parse_seed, parse_stop,
                            parse_stream_options)
from prompt_store import model_fingerprint
from serve_metrics import metrics_registry
from scheduler import QueueFull, Request
from tokenizer import StopStrings, StreamDecoder, Tokenizer
from tool_parsers import CallReader, call_format, read_calls

CHAT_PAGE = Path(__file__).parent / "chat.html"


class Server:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str, api_key: Optional[str] = None,
                 checkpoint_dir: Optional[Path] = None):
        self.engine, self.tokenizer, self.model_name, self.api_key = engine, tokenizer, model_name, api_key
        self.checkpoint_dir, self._grammars = checkpoint_dir, None
        self.call_format = call_format(tokenizer.chat_template)  # how the model writes calls under tool_choice "auto"
        self.token_texts: dict = {}  # token id -> its text decoded alone (logprobs)
        self.created = int(time.time())
        self.fingerprint = system_fingerprint(engine, checkpoint_dir)
        self.stop_ids = frozenset(engine.model.args.eos_token_ids) | frozenset(tokenizer.eos_ids)
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.registry, self.ttft, self.itl = metrics_registry(engine)


    # ---- checking a request

    def authorize(self, request):
        if self.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            raise APIError(401, "invalid or missing API key (send `Authorization: Bearer KEY`)", code="invalid_api_key")

    async def read_body(self, request) -> dict:
        kind = request.headers.get("content-type")  # none at all is read as JSON: a hand-made request may name none
        if kind is not None and kind.split(";")[0].strip().lower() != "application/json":
            raise APIError(415, f"the request body must be JSON (Content-Type: application/json), not {kind!r}")
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    def parse(self, body: dict, chat: bool) -> Params:
        check_fields(body, chat)
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"model `{model}` not found (this server runs `{self.model_name}`)", "model",
                           "model_not_found")
        vocab_size = self.engine.model.args.vocab_size
        prompts = [self.chat_prompt(body)] if chat else parse_prompts(body.get("prompt"), self.tokenizer.encode,
                                                                      vocab_size)
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        echo = parse_echo(body, chat)
        max_tokens = check_context(prompts, body.get(name), name, self.engine.max_seq_length, chat, echo)
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
        n = parse_n(body, len(prompts))
        include_usage, seed = parse_stream_options(body), parse_seed(body)
        sampling = parse_sampling(body, temperature, top_k, top_p, vocab_size)
        logprobs = parse_logprobs(body, chat)
        grammar, tool_call, tool_name = self.parse_constraint(body, chat)  # last: it compiles
        functions = frozenset(tool_functions(body.get("tools"))) if chat else frozenset()
        reads_calls = bool(functions) and body.get("tool_choice") in (None, "auto") and self.call_format is not None
        return Params(prompts=prompts, max_tokens=max_tokens, sampling=sampling, n=n, seed=seed,
                      stop=parse_stop(body["stop"]) if body.get("stop") is not None else [],
                      stream=bool(body.get("stream")), include_usage=include_usage,
                      ignore_eos=bool(body.get("ignore_eos")), logprobs=logprobs, echo=echo, grammar=grammar,
                      tool_call=tool_call, tool_name=tool_name, functions=functions,
                      call_format=self.call_format if reads_calls else None,
                      speculative=body.get("speculative") is not False)

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
        tool = parse_tools(body) if chat else None
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

    def grammars(self) -> Grammars:
        """The model's grammar.Grammars, built on first use: a checkpoint without tokenizer.json
        serves every request but constrained ones (UserError)."""
        if self._grammars is None:
            if self.checkpoint_dir is None:
                raise UserError("constrained decoding needs the server's checkpoint directory")
            self._grammars = Grammars(self.checkpoint_dir, self.engine.model.args.vocab_size, sorted(self.stop_ids))
        return self._grammars

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
        """Submit the request's n choices of each prompt, choice p * n + j the j-th of prompt p (OpenAI's
        order), all at once so that they run in the same steps; their events arrive on the queue."""
        queue: asyncio.Queue = asyncio.Queue()
        choices = []
        for i in range(len(params.prompts) * params.n):
            prompt, j = params.prompts[i // params.n], i % params.n
            choice = Choice(i, params, self, queue)
            seed = None if params.seed is None else params.seed + j  # each prompt's choices as it alone would get
            constraint = None
            if params.grammar is not None:
                try:
                    constraint = self.grammars().constraint(params.grammar)  # a matcher of its own
                except UserError as e:
                    raise APIError(400, str(e)) from None
            choice.request = Request(list(prompt), params.max_tokens, params.sampling, seed=seed,
                                     stop_ids=frozenset() if params.ignore_eos else self.stop_ids,
                                     on_token=choice.on_token, on_finish=choice.on_finish, constraint=constraint,
                                     logprobs=params.logprobs,
                                     prompt_logprobs=params.logprobs if params.echo else None,
                                     speculative=params.speculative)
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


def system_fingerprint(engine: Engine, checkpoint_dir: Optional[Path]) -> str:
    """OpenAI's `system_fingerprint`: a digest of what sets the outputs, the weights, their dtype and the device."""
    weights = model_fingerprint(checkpoint_dir) if checkpoint_dir is not None else engine.model.args.architecture
    parts = (weights, str(engine.model.norm.weight.dtype), engine.device.type)
    return "fp_" + hashlib.sha256("-".join(parts).encode()).hexdigest()[:10]


@dataclass
class TokenLogprob:
    """A token's logprobs (engine.token_logprobs) and where its text lies in the choice's text."""
    token: int
    logprob: Optional[float]  # None: an echoed prompt's first token, which has no context
    top: Optional[list]  # [(token id, logprob)], the most likely first
    start: int
    end: int


class Choice:
    """One of a request's n sequences, fed by the engine loop's callbacks: its text so far (stop
    strings held back until they can no longer match), and its tokens' logprobs, which go out
    with the text they make; with echo, the prompt's text and logprobs go out first."""

    def __init__(self, index: int, params: Params, server: Server, queue: asyncio.Queue):
        self.index, self.params, self.server, self.queue = index, params, server, queue
        self.stops = StopStrings(server.tokenizer, params.stop)
        self.sent = 0  # characters of the text sent
        self.request: Optional[Request] = None
        self.arrival, self.last = time.perf_counter(), None
        self.tokens: list = []  # TokenLogprob of each output token, with logprobs on
        self.emitted = 0  # of self.tokens, sent
        self.sampled = 0  # of request.token_logprobs, read
        self.echoed, self.shift = not params.echo, 0  # shift: the echoed prompt's characters, before the output

    def echo_prompt(self, req: Request):
        """Once, before any output: the prompt's text, and its tokens' logprobs (the first has none)."""
        if self.echoed:
            return
        self.echoed, decoder, text, entries = True, StreamDecoder(self.server.tokenizer), "", []
        for token, (logprob, top) in zip_longest(req.prompt, [(None, None)] + req.prompt_token_logprobs,
                                                 fillvalue=(None, None)):
            start = len(text)
            text += decoder.push(token)
            entries.append(TokenLogprob(token, logprob, top, start, len(text)))
        text += decoder.flush()
        self.shift = len(text)
        self.server.post(self.queue, ("text", self.index, text, entries if self.params.logprobs is not None else []))

    def on_token(self, req: Request, token: int) -> bool:
        now = time.perf_counter()
        if self.last is None:
            self.server.ttft.observe(now - self.arrival)
        else:
            self.server.itl.observe(now - self.last)
        self.last = now
        self.echo_prompt(req)
        entry = None
        if self.sampled < len(req.token_logprobs):  # the engine recorded the sampled token's logprobs
            entry = req.token_logprobs[self.sampled]
            self.sampled += 1
        if token in req.stop_ids:
            end = len(self.stops.text)
            if entry is not None and self.params.echo:  # echo lists every token (a scorer counts them): this one too
                self.tokens.append(TokenLogprob(token, entry[0], entry[1], end, end))
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
        if final:
            self.echo_prompt(req)
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
        entries = [replace(e, start=e.start + self.shift, end=e.end + self.shift) for e in self.tokens[self.emitted:i]]
        self.emitted = i
        if len(upto) > self.sent or entries:
            self.server.post(self.queue, ("text", self.index, upto[self.sent:], entries))
            self.sent = max(self.sent, len(upto))


# ---------------------------------------------------------------- responses

def usage(params: Params, choices: list) -> dict:
    """Each prompt's tokens and cached tokens counted once (as its first choice's), every choice's output."""
    completion = sum(len(c.request.out) for c in choices)
    prompt = sum(len(p) for p in params.prompts)
    cached = sum(c.request.cached_tokens for c in choices[::params.n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def logprobs_body(server: Server, entries: list, chat: bool) -> dict:
    """OpenAI's logprobs of a choice (or of a chunk's tokens): chat's {"content": [...]}, or the
    legacy completions' parallel lists, whose top_logprobs include the chosen token."""
    def text(token: int) -> str:  # decoded alone, as OpenAI's `token`
        if token not in server.token_texts:
            server.token_texts[token] = server.tokenizer.decode([token])
        return server.token_texts[token]

    def clip(logprob: Optional[float]) -> Optional[float]:
        return None if logprob is None else max(logprob, -9999.0)  # JSON has no -inf

    def one(token: int, logprob: float) -> dict:
        s = text(token)
        return {"token": s, "logprob": clip(logprob), "bytes": list(s.encode())}

    def top(e: TokenLogprob) -> Optional[dict]:
        if e.top is None:  # an echoed prompt's first token
            return None
        tops = {text(t): clip(lp) for t, lp in e.top}
        tops.setdefault(text(e.token), clip(e.logprob))  # the chosen token, as OpenAI adds it
        return tops

    if chat:
        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}
    return {"tokens": [text(e.token) for e in entries], "token_logprobs": [clip(e.logprob) for e in entries],
            "top_logprobs": [top(e) for e in entries], "text_offset": [e.start for e in entries]}


def reply(params: Params, text: str, reason: str) -> tuple:
    """A chat choice's message and finish_reason: a constrained call's JSON, or the calls the text
    holds under tool_choice "auto", become `tool_calls` (finish_reason "tool_calls", or "length" when
    max_tokens cut the reply: a cut constrained call is still reported as one)."""
    content, calls = None, None
    if params.tool_call:
        calls = tool_calls(params, text, cut=reason == "length")
    elif params.call_format is not None:
        content, calls = read_calls(params.call_format, params.functions, text)
    if calls:
        return {"role": "assistant", "content": content, "tool_calls": calls}, \
            "length" if reason == "length" else "tool_calls"
    return {"role": "assistant", "content": text}, reason


# ---------------------------------------------------------------- routes

def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def failure(reason: str, error: Optional[str]) -> Optional[APIError]:
    """The error a choice's finish_reason reports to the client: a failed step, or a shutdown."""
    if reason == "error":
        return APIError(500, f"generation failed: {error}", kind="server_error")
    if reason == "cancelled":
        return APIError(503, "the server is shutting down", kind="server_error")
    return None


class Stream:
    """A streamed request's server-sent events: a chunk per piece of a choice's text (a constrained
    call's text held back and sent whole at its end; under tool_choice "auto", the content and then
    each call once whole), each choice's finish_reason, then usage if asked."""

    def __init__(self, request, server: Server, choices: list, queue: asyncio.Queue, params: Params, chat: bool,
                 base: dict):
        self.request, self.server, self.choices, self.queue, self.params, self.chat, self.base = \
            request, server, choices, queue, params, chat, base
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.held = [["", []] for _ in choices]  # text and logprobs not sent yet (a constrained call's: all)
        self.readers = [CallReader(params.call_format, params.functions) if params.call_format else None
                        for _ in choices]
        self.calls = [0] * len(choices)  # tool calls sent, per choice

    def chunk(self, i, text, entries, reason=None, calls=None, role=False) -> str:
        params = self.params
        logprobs = logprobs_body(self.server, entries, self.chat) if params.logprobs is not None and entries else None
        if self.chat:
            delta = {"content": text} if text else {}
            if calls:
                delta = {"tool_calls": [{"index": self.calls[i] + k, **call} for k, call in enumerate(calls)]}
                self.calls[i] += len(calls)
            if role:
                delta = {"role": "assistant", "content": ""}
            body = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            body = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
        extra = {"usage": None} if params.include_usage else {}
        return "data: " + json.dumps({**self.base, "object": self.obj, "choices": [body], **extra}) + "\n\n"

    def read(self, i: int, events: list) -> list:
        """Chunks of a choice's CallReader events, each with the logprobs held until it."""
        out = []
        for kind, value in events:
            entries, self.held[i][1] = self.held[i][1], []
            out.append(self.chunk(i, value, entries) if kind == "content" else
                       self.chunk(i, "", entries, calls=[value]))
        return out

    async def events(self):
        params, held = self.params, self.held
        async with cancelled_on_disconnect(self.request, self.server, self.choices):
            for i in range(len(self.choices) if self.chat else 0):  # as OpenAI: the role alone first
                yield self.chunk(i, "", [], role=True)
            left = len(self.choices)
            while left:
                event = await self.queue.get()
                if event[0] == "text":
                    _, i, text, entries = event
                    if params.tool_call:
                        held[i][0] += text
                        held[i][1] += entries
                    elif self.readers[i]:
                        held[i][1] += entries
                        for chunk in self.read(i, self.readers[i].feed(text)):
                            yield chunk
                    else:
                        yield self.chunk(i, text, entries)
                    continue
                _, i, reason, error = event
                left -= 1
                if (failed := failure(reason, error)) is not None:
                    yield "data: " + json.dumps(failed.body()) + "\n\n"
                    continue
                if params.tool_call:
                    message, reason = reply(params, held[i][0], reason)
                    yield self.chunk(i, held[i][0] if message["content"] else "", held[i][1],
                                     calls=message.get("tool_calls"))
                    held[i][1] = []
                elif self.readers[i]:
                    for chunk in self.read(i, self.readers[i].finish()):
                        yield chunk
                    reason = reason if reason == "length" or not self.calls[i] else "tool_calls"
                yield self.chunk(i, "", held[i][1], reason)
            if params.include_usage:
                yield "data: " + json.dumps({**self.base, "object": self.obj, "choices": [],
                                             "usage": usage(params, self.choices)}) + "\n\n"
            yield "data: [DONE]\n\n"


@asynccontextmanager
async def cancelled_on_disconnect(request, server: Server, choices: list):
    """While the reply is made, a client that goes away (its `http.disconnect`, which the server
    sends as soon as the connection closes) cancels the choices: their rows are free at the next
    step, tokens flowing or not. On leaving, whatever is unfinished is cancelled too."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":  # the body is read: nothing else comes
            pass
        cancel_unfinished(server, choices)

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        cancel_unfinished(server, choices)


def cancel_unfinished(server: Server, choices: list):
    for c in choices:
        if c.request.finish_reason is None:
            server.engine.cancel(c.request)


class Routes:
    """The HTTP endpoints over a Server, as Starlette handlers."""

    def __init__(self, server: Server):
        self.server = server

    async def completions(self, request):
        return await self.generate(request, chat=False)

    async def chat_completions(self, request):
        return await self.generate(request, chat=True)

    async def generate(self, request, chat: bool):
        server = self.server
        try:
            server.authorize(request)
            params = server.parse(await server.read_body(request), chat)
            choices, queue = server.submit(params)
        except APIError as e:
            return error_response(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        base = {"id": rid, "created": int(time.time()), "model": server.model_name,
                "system_fingerprint": server.fingerprint}
        if params.stream:
            return StreamingResponse(Stream(request, server, choices, queue, params, chat, base).events(),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self.whole(request, choices, queue, params, chat, base)

    async def whole(self, request, choices: list, queue: asyncio.Queue, params: Params, chat: bool, base: dict):
        """A request's reply, not streamed: every choice once all have finished."""
        texts, reasons = [""] * len(choices), [None] * len(choices)
        entries = [[] for _ in choices]
        async with cancelled_on_disconnect(request, self.server, choices):
            while None in reasons:
                event = await queue.get()
                if event[0] == "text":
                    texts[event[1]] += event[2]
                    entries[event[1]] += event[3]
                else:
                    _, i, reason, error = event
                    if (failed := failure(reason, error)) is not None:
                        return error_response(failed)
                    reasons[i] = reason
        out = []
        for i, (text, reason) in enumerate(zip(texts, reasons)):
            logprobs = None if params.logprobs is None else logprobs_body(self.server, entries[i], chat)
            if chat:
                message, reason = reply(params, text, reason)
                out.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
            else:
                out.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason})
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({**base, "object": obj, "choices": out, "usage": usage(params, choices)})

    async def models(self, request):
        server = self.server
        try:
            server.authorize(request)
        except APIError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [
            {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "minillm",
             "root": server.model_name, "max_model_len": server.engine.max_seq_length}]})

    async def health(self, request):
        return JSONResponse({"status": "ok"})

    async def metrics(self, request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return PlainTextResponse(generate_latest(self.server.registry), media_type=CONTENT_TYPE_LATEST)

    async def page(self, request):
        return FileResponse(CHAT_PAGE)  # no key needed: the page asks for it and sends it with each request

    async def http_error(self, request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       kind=kind))

    async def server_error(self, request, exc: Exception):
        log("serve: " + "".join(traceback.format_exception(exc)))
        return error_response(APIError(500, f"internal error ({type(exc).__name__})", kind="server_error"))

    @asynccontextmanager
    async def lifespan(self, app):
        self.server.loop = asyncio.get_running_loop()  # where the engine loop posts each request's events
        yield


def build_app(server: Server) -> Starlette:
    api = Routes(server)
    routes = [Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
              Route("/v1/models", api.models, methods=["GET"]),
              Route("/health", api.health, methods=["GET"]),
              Route("/metrics", api.metrics, methods=["GET"]),
              Route("/", api.page, methods=["GET"])]
    return Starlette(routes=routes, lifespan=api.lifespan,
                     exception_handlers={HTTPException: api.http_error, Exception: api.server_error})
