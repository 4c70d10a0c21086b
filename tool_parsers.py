"""Function calls read from a model's free text (`tool_choice` "auto"), in the format its chat
template teaches it:

    fmt = call_format(tokenizer.chat_template)       # None: the template defines no call format
    content, calls = read_calls(fmt, {"add"}, text)   # calls: OpenAI's `tool_calls`, content: the rest

    reader = CallReader(fmt, {"add"})                 # streamed: one per choice
    for piece in pieces:
        events = reader.feed(piece)                   # [("content", text) | ("call", call)]
    events += reader.finish()

Hermes (Qwen2.5, Qwen3, SmolLM3, NousResearch Hermes) wraps each call in <tool_call>...</tool_call>;
Llama 3.1-3.3 write bare JSON ({"name": ..., "parameters": ...}), at the start of the reply or
after <|python_tag|>, several separated by ";". A call that does not parse, or names a function
not in `tools`, stays text; the text around calls is the reply's content.
"""
import json
import uuid
from dataclasses import dataclass
from typing import Optional

SPACE = " \t\r\n"


@dataclass(frozen=True)
class CallFormat:
    """How a chat template's model writes a function call."""
    name: str
    opens: tuple  # text that opens a call anywhere in the reply
    closes: Optional[str]  # text that closes a call; None: the end of its JSON object
    bare_json: bool = False  # a JSON object at the start of the reply (or after a call) is a call too
    between: str = SPACE  # what may separate calls, not content


HERMES = CallFormat("hermes", ("<tool_call>",), "</tool_call>")
LLAMA3_JSON = CallFormat("llama3_json", ("<|python_tag|>",), None, bare_json=True, between=SPACE + ";")


def call_format(template: Optional[str]) -> Optional[CallFormat]:
    """The call format a chat template describes, from the markers it writes; None if it writes none."""
    if not template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or '"parameters": ' in template:  # Llama 3's tool prompt and call rendering
        return LLAMA3_JSON
    return None


def new_call(name: str, arguments: str) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_call(body: str, functions) -> Optional[dict]:
    """An OpenAI tool call from a call's JSON text ({"name": ..., "arguments" or "parameters": {...}});
    None if it is not one, or names a function not in `functions`."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in functions:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return new_call(value["name"], json.dumps(arguments, ensure_ascii=False))


def held_prefix(text: str, markers) -> int:
    """How many characters at the end of `text` may begin one of `markers`."""
    return max((k for m in markers for k in range(min(len(m) - 1, len(text)), 0, -1) if text.endswith(m[:k])),
               default=0)


class CallReader:
    """A reply's text as it streams, split into content and calls. Text that may begin a call marker
    is held back, and so is trailing whitespace, which a call that follows drops."""

    def __init__(self, fmt: CallFormat, functions):
        self.fmt, self.functions = fmt, frozenset(functions)
        self.buf = ""  # text not yet resolved
        self.gap = ""  # whitespace before the call being read: dropped if it parses, sent if not
        self.opener: Optional[str] = None  # the marker of the call being read ("" for bare JSON)
        self.calls = 0
        self.scanned = 0  # of a bare JSON call's text, decoded in vain: it ends only with a "}" after this
        self.expect_json = fmt.bare_json  # a JSON object here would be a call

    def feed(self, text: str) -> list:
        """Events for the text so far: ("content", text) and ("call", an OpenAI tool call)."""
        self.buf += text
        events: list = []
        while self.step(events, final=False):
            pass
        return events

    def finish(self) -> list:
        """The events left once the reply has ended."""
        events: list = []
        while self.step(events, final=True):
            pass
        if self.buf and (self.buf.strip(self.fmt.between) or not self.calls):
            events.append(("content", self.buf))
        self.buf = ""
        return events

    def step(self, events: list, final: bool) -> bool:
        """Resolve what the buffer allows; True if something was."""
        if self.opener is not None:
            return self.read_call(events, final)
        if self.expect_json:
            body = self.buf.lstrip(self.fmt.between if self.calls else SPACE)
            if not body and not final:
                return False
            self.expect_json = False
            if body.startswith("{"):
                self.gap, self.opener, self.buf = self.buf[:len(self.buf) - len(body)], "", body
            return True
        found = [(i, m) for m in self.fmt.opens if (i := self.buf.find(m)) >= 0]
        if found:
            i, marker = min(found)
            before = self.buf[:i].rstrip(SPACE)
            if before:
                events.append(("content", before))
            self.gap, self.opener, self.buf = self.buf[len(before):i], marker, self.buf[i + len(marker):]
            return True
        if not final:
            ready = self.buf[:len(self.buf) - held_prefix(self.buf, self.fmt.opens)].rstrip(SPACE)
            if ready:
                events.append(("content", ready))
                self.buf = self.buf[len(ready):]
        return False

    def read_call(self, events: list, final: bool) -> bool:
        """The call being read, once its end is in the buffer (or the reply has ended)."""
        if self.fmt.closes is not None:
            end = self.buf.find(self.fmt.closes)
            if end < 0 and not final:
                return False
            body = self.buf if end < 0 else self.buf[:end]
            stop = len(self.buf) if end < 0 else end + len(self.fmt.closes)
        else:
            if not final and "}" not in self.buf[self.scanned:]:
                return False
            self.scanned = len(self.buf)
            space = len(self.buf) - len(self.buf.lstrip(SPACE))
            try:
                stop = space + json.JSONDecoder().raw_decode(self.buf[space:])[1]
            except json.JSONDecodeError:  # not yet whole, or not JSON
                if not final:
                    return False
                stop = len(self.buf)
            body = self.buf[:stop]
        call = parse_call(body, self.functions)
        if call is not None:
            events.append(("call", call))
            self.calls += 1
            self.expect_json = self.fmt.bare_json
        else:
            events.append(("content", self.gap + self.opener + self.buf[:stop]))
        self.gap, self.opener, self.buf, self.scanned = "", None, self.buf[stop:], 0
        return True


def read_calls(fmt: CallFormat, functions, text: str) -> tuple:
    """(the content, or None if it is empty beside calls; the calls) of a whole reply."""
    reader = CallReader(fmt, functions)
    events = reader.feed(text) + reader.finish()
    calls = [value for kind, value in events if kind == "call"]
    content = "".join(value for kind, value in events if kind == "content")
    return (content or None) if calls else text, calls
