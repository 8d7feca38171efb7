"""OpenAI chat messages -> the messages and tools the model's chat template renders.

- `developer` is a system message; content parts are text joined by newlines.
- A template that takes `tools` (it names the variable) renders tools, assistant
  `tool_calls` and `tool` messages itself; it gets the tools with their keys sorted
  and call arguments as objects, as Hugging Face templates expect.
- Any other template gets the Hermes-style fallback (see tool_calls.py): the tools
  block first in the system prompt, before the client's own system text (so it
  belongs to the stable tier and is byte-identical across turns), earlier calls
  written back as `<tool_call>` blocks in the assistant's text, and tool results as
  a user message of `<tool_response>` blocks (every template knows the user role).
"""
from __future__ import annotations

import functools
import json

import jinja2
from jinja2 import meta

from xlr_jax.server import tool_calls


@functools.lru_cache(maxsize=8)
def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable."""
    if not template:
        return False
    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False


def _sorted(value):
    """A JSON value with every object's keys sorted (deterministic rendering)."""
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def _text(content) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def _arguments_object(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def prepare(messages, tools, template: str | None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for `Model.encode`: plain dicts the template renders.
    `messages` are protocol.ChatMessage, `tools` protocol.Tool (or None)."""
    tool_dicts = [_sorted(t.model_dump(exclude_none=True)) for t in tools or []] or None
    if template_takes_tools(template):
        out = []
        for m in messages:
            d = {"role": "system" if m.role == "developer" else m.role,
                 "content": _text(m.content)}
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name,
                                                 "arguments": _arguments_object(
                                                     c.function.arguments)}}
                                   for c in m.tool_calls]
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
            out.append(d)
        return out, tool_dicts
    return _hermes(messages, tool_dicts), None


def _hermes(messages, tools: list[dict] | None) -> list[dict]:
    out: list[dict] = []
    for m in messages:
        role, content = ("system" if m.role == "developer" else m.role), _text(m.content)
        if role == "assistant" and m.tool_calls:
            calls = "\n".join(tool_calls.call_text(c.function.name, c.function.arguments)
                              for c in m.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        elif role == "tool":
            block = tool_calls.response_text(content or "")
            if out and out[-1].get("_tool_results"):  # consecutive results: one message
                out[-1]["content"] += "\n" + block
                continue
            out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        out.append({"role": role, "content": content or ""})
    for d in out:
        d.pop("_tool_results", None)
    if tools:
        block = tool_calls.tools_block(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{block}\n\n{out[0]['content']}"
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
