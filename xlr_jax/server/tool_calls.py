"""Tool calls in the Hermes format: the block that tells a model its tools, and the
parser that turns the model's `<tool_call>` blocks into OpenAI `tool_calls`.

The model is told (by its chat template when that takes `tools`, else by
`tools_block` at the head of the system prompt):

    <tools>
    {"function": {...}, "type": "function"}      one JSON schema per line, keys sorted
    </tools>

and answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Streaming: text outside a call streams as content at once, except a tail that
may be the start of `<tool_call>` (held until the next piece says). A call's
body is held until its closing tag (or the end of the output), then parsed: a
well-formed call becomes a `start` event (index, id, name) and its arguments
(one `arguments` event); anything malformed is given back as content,
unchanged. Whitespace after a call is dropped unless more text follows it.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def render_tool(tool: dict) -> str:
    """One tool's schema as one line of JSON, keys sorted: the same tools give the same
    bytes on every request, so the prompt's stable tier stays cacheable."""
    return json.dumps(tool, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))


def tools_block(tools: list[dict]) -> str:
    """The instructions and schemas put first in the system prompt when the chat
    template cannot render tools itself."""
    schemas = "\n".join(render_tool(t) for t in tools)
    return ("You can call functions. Their signatures are listed as JSON schemas between "
            "<tools></tools> tags:\n<tools>\n" + schemas + "\n</tools>\n"
            "To call a function, answer with a JSON object holding its name and arguments "
            "between <tool_call></tool_call> tags, one block per call:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>")


def call_text(name: str, arguments: str | dict) -> str:
    """An earlier assistant tool call written back into the history, as the model
    would have written it."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # keep the client's text as it is
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def response_text(content: str) -> str:
    """A tool's result in the history (as Hermes-format models were trained to read it)."""
    return f"<tool_response>\n{content}\n</tool_response>"


@dataclass
class ParsedCall:
    index: int
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one call's body, or None when malformed."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    name = data.get("name")
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def _partial_open(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of OPEN."""
    for n in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Feed text pieces as they come; get events:
    ("content", text) | ("start", ParsedCall) | ("arguments", ParsedCall).
    `finish()` gives what is left at the end of the output."""

    def __init__(self):
        self._buffer = ""      # text not yet given out
        self._in_call = False  # the buffer is a call's body (after OPEN)
        self._emitted = False  # some content was given out
        self.calls: list[ParsedCall] = []

    def feed(self, piece: str) -> list[tuple]:
        self._buffer += piece
        events: list[tuple] = []
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    return events
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE):]
                self._in_call = False
                events += self._call(body, OPEN + body + CLOSE)
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                events += self._content(self._buffer[:start], next_to_call=True)
                self._buffer = self._buffer[start + len(OPEN):]
                self._in_call = True
                continue
            keep = _partial_open(self._buffer)
            ready = self._buffer[:len(self._buffer) - keep]
            if not ready.strip() and (self.calls or not self._emitted):
                return events  # whitespace that may only pad a call: wait and see
            events += self._content(ready, next_to_call=False)
            self._buffer = self._buffer[len(ready):]
            return events

    def finish(self) -> list[tuple]:
        """The end of the output: an unclosed call that parses still counts (models often
        stop after the JSON); anything else left is content (whitespace after a call is
        dropped)."""
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            return self._call(rest, OPEN + rest)
        if self.calls and not rest.strip():
            return []
        return self._content(rest, next_to_call=False)

    def _content(self, text: str, next_to_call: bool) -> list[tuple]:
        """Content, but not whitespace that only pads a call."""
        if not text or (not text.strip() and (self.calls or next_to_call and not self._emitted)):
            return []
        self._emitted = True
        return [("content", text)]

    def _call(self, body: str, raw: str) -> list[tuple]:
        parsed = parse_call(body.strip())
        if parsed is None:
            return [("content", raw)]  # malformed: the text as the model wrote it
        call = ParsedCall(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", *parsed)
        self.calls.append(call)
        return [("start", call), ("arguments", call)]


def parse_whole(text: str) -> tuple[str | None, list[ParsedCall]]:
    """A finished output's content (None when it is only calls) and its calls."""
    parser = ToolCallParser()
    events = parser.feed(text) + parser.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    return (content if content.strip() else None) if parser.calls else content, parser.calls
