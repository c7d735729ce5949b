"""Tool-call parsing: the model's text -> OpenAI `tool_calls` (pluggable per deployment).

The front door generates token-in/token-out, so it parses tool calls itself, as vLLM's
`--tool-call-parser` does inside its own chat endpoint. The default format is Hermes, which Qwen,
Hermes and many other chat templates teach their models to emit:

    some optional text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each `<tool_call>` block holds one JSON object with `name` and `arguments` (an object, or a string
holding one). Text before the first block is the message content. A block that is not valid JSON
makes the whole output plain content (no tool calls), as vLLM's Hermes parser does: the trainer
still gets the exact tokens, and the harness sees what the model wrote. Register other formats in
`PARSERS`.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Protocol

import orjson


@dataclass(slots=True)
class ToolCall:
    """One call in OpenAI's shape: `arguments` is a JSON string, as the API defines it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self) -> dict[str, object]:
        """The `tool_calls[]` element of an assistant message."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ParsedOutput:
    """The assistant message the model's text stands for."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser(Protocol):
    """Turns a complete model output into content and tool calls."""

    #: The text that opens a tool call; streamed text is held back from here on.
    start_marker: str

    def parse(self, text: str) -> ParsedOutput: ...


class NoToolParser:
    """Never finds tool calls: the output is the content."""

    start_marker = ""

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput(content=text)


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks (see the module docstring)."""

    start_marker = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        first = text.find(self.start_marker)
        if first < 0:
            return ParsedOutput(content=text)
        calls: list[ToolCall] = []
        for match in self._block.finditer(text, first):
            call = _call_from_json(match.group(1))
            if call is None:
                return ParsedOutput(content=text)
            calls.append(call)
        content = text[:first].strip()
        return ParsedOutput(content=content or None, tool_calls=calls)


def _call_from_json(raw: str) -> ToolCall | None:
    """One call from a block's JSON, None when it is not a `{"name", "arguments"}` object."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return None
        return ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], orjson.dumps(arguments).decode())


#: Parsers by name (`FrontDoorConfig.tool_parser`).
PARSERS: dict[str, type[HermesToolParser] | type[NoToolParser]] = {
    "hermes": HermesToolParser,
    "none": NoToolParser,
}


def get_parser(name: str) -> ToolCallParser:
    """The parser registered as `name`."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of streamed `text` may start `marker` (kept until known)."""
    if not marker:
        return 0
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
