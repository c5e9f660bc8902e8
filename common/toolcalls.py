"""Tool calls in the Hermes format (Qwen2.5, Hermes, many fine-tunes): what the model is
given and what its reply is read back as.

A chat template that takes `tools` renders their JSON schemas into the prompt; a model
trained on the format answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and the server returns each block as an OpenAI `tool_calls` entry, the rest as content.
A template that takes no tools, or writes calls some other way, gets a 400 that says so
(only the Hermes format is read back). Pure: no sockets, no torch.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from memspec.common.errors import RequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
CHOICES = ("auto", "none", "required")  # or "function:NAME"
FUNCTION = "function:"


def submit_choice(choice: str | None, named: bool = False) -> str:
    """Submit.tool_choice from a caller's choice: "auto" (or none given) is "", "none" and
    "required" stay, anything else (`named`: always) is that tool's name, as FUNCTION+NAME."""
    if not named and choice in (None, "auto"):
        return ""
    return choice if not named and choice in ("none", "required") else f"{FUNCTION}{choice}"


def reads_calls(tools: str, choice: str) -> bool:
    """Whether a request's reply is read back for calls (Submit's tools and tool_choice):
    tools offered and not switched off. The decoder renders and parses them, HTTP holds the
    streamed text back until the calls are out."""
    return bool(tools) and choice != "none"


def check_template(template: str | None) -> None:
    """The target's chat template renders tools and writes calls in the Hermes format."""
    if not template or "tools" not in template:
        raise RequestError("the target's chat template takes no tools",
                           "omit tools, or use a model whose template renders them "
                           "(Qwen2.5, Hermes)")
    if OPEN not in template:
        raise RequestError("the target's chat template writes tool calls in a format memspec "
                           "does not read (only <tool_call> blocks, Hermes / Qwen2.5)",
                           "omit tools, or use a Hermes-format model")


def parse_tools(text: str) -> list[dict[str, Any]]:
    """Submit.tools (OpenAI's list of {"type": "function", "function": {...}}), checked: a
    name each, unique, parameters an object schema."""
    try:
        tools = json.loads(text)
    except ValueError as exc:
        raise RequestError(f"tools are not JSON ({exc})", "send a list of tools") from None
    if not isinstance(tools, list) or not tools:
        raise RequestError("tools is not a non-empty list", "send a list of tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function" \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{i}] is not a function with a name",
                               'send {"type": "function", "function": {"name": ...}}')
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise RequestError(f"tools[{i}].function.parameters is not a JSON schema",
                               "send an object schema, or omit it")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise RequestError("two tools share a name", "give each tool its own name")
    return tools


def call_schema(tools: list[dict[str, Any]], choice: str) -> dict[str, Any]:
    """The JSON schema of one call the `choice` allows ("required": any tool; a name: that
    one), as the Hermes block holds it."""
    names = [t["function"]["name"] for t in tools]
    if choice.startswith(FUNCTION):
        wanted = choice[len(FUNCTION):]
        if wanted not in names:
            raise RequestError(f"tool_choice names '{wanted[:40]}', which is not in tools",
                               "name one of the tools")
        names = [wanted]
    one = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": t["function"]["name"]},
                           "arguments": t["function"].get("parameters", {"type": "object"})}}
           for t in tools if t["function"]["name"] in names]
    return one[0] if len(one) == 1 else {"anyOf": one}


def parse_calls(text: str) -> tuple[str, list[tuple[str, str, str]]]:
    """(content, [(id, name, arguments as JSON text)]) of a reply: every well-formed block a
    call, the text around them the content (a block that does not parse stays content)."""
    calls: list[tuple[str, str, str]] = []

    def take(m: re.Match) -> str:
        try:
            body = json.loads(m.group(1))
        except ValueError:
            return m.group(0)
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return m.group(0)
        args = body.get("arguments", body.get("parameters", {}))
        calls.append((f"call_{secrets.token_hex(12)}", body["name"],
                      args if isinstance(args, str) else json.dumps(args)))
        return ""

    content = _BLOCK.sub(take, text).strip()
    return content, calls
