"""Chat messages and tools for the OpenAI API: `messages` checked into what chat templates take,
`tools` and `tool_choice` checked into the schema a call is constrained to, and the generated
call's JSON read back into a reply's `tool_calls`.
"""
import json
import re
from typing import Optional

from openai_request import APIError, Params
from tool_parsers import new_call

ROLES = ("system", "user", "assistant", "tool")
# JSON schema keywords that hold schemas (by name; in lists), and those that say or share an object's other properties
SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
COMPOSED = {"additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "if",
            "not", "$ref", "dependentSchemas"}
# the start of a call under tool_choice "required", as its grammar writes it (keys in order, fixed separators)
CALL_START = '{"name": "'
CUT_CALL = re.compile(r'\{"name": "(?P<name>[^"\\]*)(?P<closed>"(, "arguments": (?P<arguments>.*))?)?', re.DOTALL)


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
        if arguments == "":  # a function called without arguments
            arguments = {}
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
                                                         "arguments": rebase_refs(closed(parameters),
                                                                                  f"#/anyOf/{i}/properties/arguments")},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for i, (name, parameters) in enumerate(functions.items())]}


def closed(schema):
    """A copy of a parameters' schema whose objects with `properties` take no others where it does not
    say (as OpenAI's calls hold to the schema; JSON schema's default would let the model add any).
    Objects composed with others are left open: closing one part would forbid the other parts' properties."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed(v) for name, v in value.items()}
        elif key in SCHEMA_LISTS and isinstance(value, list) and (key == "prefixItems" or "properties" not in schema):
            out[key] = [closed(v) for v in value]
        elif key in ("items", "additionalProperties", "contains"):
            out[key] = closed(value)
    if isinstance(schema.get("properties"), dict) and not COMPOSED & set(schema):
        out["additionalProperties"] = False
    return out


def rebase_refs(schema, root: str):
    """A copy of `schema` for the place `root` (a JSON pointer) of another schema: its local $refs
    ("#/$defs/Item", as pydantic writes them) still point into it."""
    if isinstance(schema, dict):
        return {k: root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else rebase_refs(v, root)
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [rebase_refs(v, root) for v in schema]
    return schema

def parse_tools(body: dict) -> Optional[tuple]:
    """(the JSON schema of the call, the function's name or None when the output names it) under
    `tool_choice` "required" or a named function; None when the output is free text."""
    functions = tool_functions(body.get("tools"))
    for name in ("tool_choice", "parallel_tool_calls"):  # as OpenAI: tool_choice "none" and False too
        if body.get(name) is not None and not functions:
            raise APIError(400, f"`{name}` is only allowed when `tools` are specified", name)
    choice = body.get("tool_choice")
    if choice is None or choice in ("none", "auto"):  # "auto": calls are read from the free text (tool_parsers.py)
        return None
    if choice == "required":
        return call_schema(functions), None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in functions:
            raise APIError(400, f"`tool_choice` names the function {name!r}, which is not in `tools`",
                           "tool_choice")
        return closed(functions[name]), name
    raise APIError(400, '`tool_choice` must be "none", "auto", "required" or '
                        '{"type": "function", "function": {"name": ...}}', "tool_choice")


def tool_calls(params: Params, text: str, cut: bool = False) -> Optional[list]:
    """A reply's `tool_calls` from the call's generated JSON; None if it is not a call. A call cut by
    max_tokens (`cut`) is still one, with the arguments written so far, as OpenAI reports it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        if not cut:
            return None
        value = None
    if params.tool_name is not None:
        name, arguments = params.tool_name, text
    elif isinstance(value, dict) and isinstance(value.get("name"), str) and "arguments" in value:
        name, arguments = value["name"], json.dumps(value["arguments"], ensure_ascii=False)
    elif value is None and (begun := CUT_CALL.match(CALL_START if CALL_START.startswith(text) else text)):
        name, arguments = begun["name"], begun["arguments"] or ""
        if begun["closed"] is None:  # cut inside the name: the function whose name it begins, if one only
            names = [f for f in params.functions if f.startswith(name)]
            if len(names) != 1:
                return None
            name = names[0]
    else:
        return None
    return [new_call(name, arguments)]
