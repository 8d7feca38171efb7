"""The OpenAI wire format the server accepts and sends, and its error shape.

The request models are what FastAPI validates and what /openapi.json publishes.
Unknown fields are accepted and ignored (`extra="allow"`): agent frameworks send
fields a strict server would refuse (`reasoning_effort`, `parallel_tool_calls`...).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    """A request object: unknown fields accepted and ignored."""
    model_config = ConfigDict(extra="allow")


# ------------------------------------------------------------------ errors

class APIError(Exception):
    """An error answered in OpenAI's shape with its HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def context_error(max_context: int, prompt_tokens: int) -> APIError:
    """vLLM's wording: clients (hermes-agent) look for "maximum context length" and the
    number to shrink their history."""
    return APIError(400, f"This model's maximum context length is {max_context} tokens. "
                         f"However, your messages resulted in {prompt_tokens} tokens. "
                         "Please reduce the length of the messages.",
                    param="messages", code="context_length_exceeded")


# ------------------------------------------------------------------ requests

class TextPart(_Open):
    type: Literal["text"] = "text"
    text: str


class FunctionCall(_Open):
    name: str
    arguments: str | dict = Field(
        "{}", description="the arguments as a JSON string (an object is accepted too)")


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="`developer` is treated as `system`")
    content: str | list[TextPart] | None = Field(
        None, description="a string or a list of text parts (joined by newlines); "
                          "null for an assistant message carrying tool_calls")
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionSpec(_Open):
    name: str
    description: str | None = None
    parameters: dict | None = None


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionSpec


class StreamOptions(_Open):
    include_usage: bool = False


class _Sampling(_Open):
    """Fields shared by chat completions and completions."""
    model: str | None = Field(None, description="the served model's id (default: it)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(
        None, description="clamped to the context left after the prompt (default: all "
                          "of it); must be >= 1")
    temperature: float | None = Field(None, ge=0, le=100,
                                      description="default 1.0; 0 is greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, description="default: random when sampling")
    stop: str | list[str] | None = None
    n: int | None = Field(None, description="only 1 is supported")
    presence_penalty: float | None = Field(None, description="accepted and ignored")
    frequency_penalty: float | None = Field(None, description="accepted and ignored")
    top_k: int | None = Field(None, ge=0, le=2**31 - 1,
                              description="extra: keep the k likeliest (0 off)")
    min_p: float | None = Field(None, ge=0, le=1, description="extra: min-p filtering")
    speculative: dict | None = Field(
        None, description='extra: speculative decoding, e.g. {"method": "exact", '
                          '"draft": "ngram", "gamma": 4} (see Model.generate)')


class NamedFunction(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Open):
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema", description="the JSON schema")
    strict: bool | None = Field(None, description="always strict: output is held to the "
                                                  "schema")


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(
        None, description='with type "json_schema": {"name", "schema"}')


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, description="wins over max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = Field(
        None, description='"auto" (default with tools), "none" (output is never parsed '
                          'for tool calls), "required" or {"type": "function", "function": '
                          '{"name": ...}} (decoding is held to one call of any tool, or '
                          "of the named one, its arguments valid under its parameters)")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="the thought's token budget: none 0 (the thought closes at "
                          "once), minimal 64, low 256, medium 1024, high 4096 (default: "
                          "the server's --reasoning-budget, else unlimited)")
    thinking_token_budget: int | None = Field(
        None, ge=0, description="extra: the thought's token budget (wins over "
                                "reasoning_effort); when it is spent the end marker is "
                                "written and the answer starts")
    response_format: ResponseFormat | None = Field(
        None, description='{"type": "json_object"} or {"type": "json_schema", '
                          '"json_schema": {"name", "schema"}}: decoding is held to one JSON '
                          "object (valid under the schema); such a request does not "
                          "speculate")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] = Field(
        description="one prompt: a string (or a list holding one) or token ids")
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = Field(False, description="only false is supported")


# ------------------------------------------------------------------ responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(metrics: dict, reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage; a chat answer's also counts its thought's tokens."""
    prompt, completion = metrics.get("prompt_tokens", 0), metrics.get("completion_tokens", 0)
    out = {"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": metrics.get("cached_tokens", 0)}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def sse(payload: dict | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "xlr-jax"
    context_length: int = Field(description="the context in tokens (prompt + completion)")
    max_model_len: int = Field(description="the same, as vLLM names it")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def openai_error_schema() -> dict[int | str, dict[str, Any]]:
    """The error responses every /v1 route may give, for /openapi.json."""
    shape = {"content": {"application/json": {"example": error_body("...")}}}
    return {400: {"description": "invalid request", **shape},
            401: {"description": "missing or wrong API key", **shape},
            404: {"description": "unknown model", **shape},
            413: {"description": "request body too large", **shape},
            503: {"description": "the waiting queue is full (Retry-After)", **shape}}


def generation_responses() -> dict[int | str, dict[str, Any]]:
    """A generating route's answers for /openapi.json: JSON, or with `stream` an SSE
    stream of chunks, and the errors."""
    return {200: {"description": "the answer (JSON), or with stream: true an SSE stream "
                                 "of chunks ending in `data: [DONE]`",
                  "content": {"application/json": {}, "text/event-stream": {}}},
            **openai_error_schema()}
