"""The HTTP routes of `xlr serve` over one loaded Model, and `serve` (uvicorn with a
graceful drain).

A request's life: FastAPI validates the body (protocol.py); chat templating and
tokenization run in a worker pool (`_encode`), never on the event loop; the ids
are submitted as a tiered prompt with `Model.asubmit`, whose handle wakes the
event loop as tokens come; the answer streams as SSE or comes whole. A client that
goes away cancels its request (its pages go back at the next step). Metrics and the
request log are recorded when a request ends.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

import xlr_jax
from xlr_jax.errors import (InvalidRequestError, PromptTooLongError, QueueFullError,
                            TokenizerError, XlrError)
from xlr_jax.runtime.request import token_budget
from xlr_jax.server import messages as chat_messages
from xlr_jax.server.constraints import (Constraint, Grammars, response_format_constraint,
                                        tool_choice_constraint)
from xlr_jax.server.metrics import CONTENT_TYPE, ServerMetrics
from xlr_jax.server.protocol import (SSE_DONE, APIError, ChatCompletionRequest,
                                     CompletionRequest, ModelCard, ModelList,
                                     context_error, error_body, error_response,
                                     generation_responses, new_id, now, openai_error_schema,
                                     sse, usage)
from xlr_jax.server.reasoning import (Markers, ReasoningSplitter, ThoughtBudget,
                                      opens_thought, request_budget, split_reasoning)
from xlr_jax.server.request_log import RequestLog
from xlr_jax.server.tiers import RecentHeads, marked_messages
from xlr_jax.server.tool_calls import ToolCallParser, parse_whole

MAX_BODY_BYTES = 8 * 1024 * 1024
RETRY_AFTER_S = 1
# why an answer ended "abort" when neither its client nor its own error ended it
ABORTED = "the model stopped before the answer was complete (the server is shutting down)"


# ------------------------------------------------------------------ middleware

class Guard:
    """Pure ASGI middleware in front of every route: the API key on /v1 (constant-time
    compare) and the body size limit, both answered before any parsing."""

    _DISCARD_CAP = 64 * 1024 * 1024  # read (and drop) an oversized body up to this much

    def __init__(self, app, api_key: str | None, max_body: int, metrics: ServerMetrics):
        self.app, self.max_body, self.metrics = app, max_body, metrics
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.key and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                return await self._refuse(send, APIError(
                    401, "invalid or missing API key: send 'Authorization: Bearer KEY'",
                    type="authentication_error", code="invalid_api_key"))
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        body, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size <= self.max_body:
                body.append(chunk)
            elif size > self._DISCARD_CAP:
                break
        if size > self.max_body:
            return await self._refuse(send, APIError(
                413, f"the request body is {size} bytes or more; the limit is "
                     f"{self.max_body} bytes", code="request_too_large"))
        try:
            b"".join(body).decode("utf-8")
        except UnicodeDecodeError as e:
            return await self._refuse(send, APIError(
                400, f"the body is not valid UTF-8 (byte {e.start}); send UTF-8 JSON"))
        if b"json" not in headers.get(b"content-type", b""):  # every body here is JSON
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"]
                                          if k != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _refuse(self, send, error: APIError) -> None:
        self.metrics.error(error.status)
        payload = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


# ------------------------------------------------------------------ the app's state

@dataclass(frozen=True)
class Defaults:
    """What a request gets for what it leaves out (the operator's `xlr serve --temperature
    / --max-tokens`): OpenAI's temperature 1.0, and as many tokens as the context holds.
    `max_tokens` also caps what a request may ask for."""
    temperature: float = 1.0
    max_tokens: int | None = None
    reasoning_budget: int | None = None  # a thought's tokens (None: unlimited)
    markers: Markers = Markers()  # where a thought starts and ends


@dataclass
class _Call:
    """One request's bookkeeping, for metrics and the request log."""
    endpoint: str
    stream: bool
    id: str
    arrival: float = field(default_factory=time.perf_counter)
    arrival_unix: float = field(default_factory=time.time)
    tokenize_s: float = 0.0
    constraint: Constraint | None = None  # the grammar its output is held to
    thought: ThoughtBudget | None = None  # holds its thought to a budget
    reasoning_tokens: int = 0


class Server:
    """Everything the routes share: the model, its name, metrics, log and worker pool."""

    def __init__(self, model, name: str, request_log: RequestLog | None, workers: int,
                 defaults: Defaults = Defaults()):
        self.model, self.name, self.log, self.defaults = model, name, request_log, defaults
        self.max_context = model.plan.max_context
        self.metrics = ServerMetrics(model, name)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="xlr-tokenize")
        self.created = now()
        self.max_stall = 0.0
        self._pending: set = set()  # tasks recording cancelled requests
        self.recent = RecentHeads(model.plan.page_size)  # system parts of recent requests
        self._grammars: Grammars | None = None  # built on the first constrained request
        self._grammars_lock = threading.Lock()

    # -------------------------------------------------------------- checks

    def check_model(self, requested: str | None) -> None:
        if requested not in (None, "", self.name):
            raise APIError(404, f"the model {requested!r} does not exist; this server "
                                f"serves {self.name!r} (GET /v1/models)",
                           param="model", code="model_not_found")

    @staticmethod
    def check_common(body) -> None:
        if body.n not in (None, 1):
            raise APIError(400, f"n must be 1 (got {body.n}); this server returns one "
                                "choice per request", param="n")
        spec = body.speculative
        if spec is not None:  # a client may not make the server open files as drafts
            draft = str(spec.get("draft", "ngram"))
            if draft != "ngram" and not draft.startswith("self:"):
                raise APIError(400, "speculative.draft must be 'ngram' or 'self:K' over "
                                    "HTTP (a draft model is chosen when the server starts)",
                               param="speculative")

    @staticmethod
    def requested_max_tokens(value: int | None, param: str) -> int | None:
        if value is not None and value < 1:
            raise APIError(400, f"{param} must be at least 1 (got {value})", param=param)
        return value

    # -------------------------------------------------------------- requests

    async def encode(self, call: _Call, encode, count) -> tuple[list[int], tuple[int, int]]:
        """Run `encode()` -> (ids, tiers) in the worker pool; a prompt over the context
        is the 400 clients look for (its size from `count()`, also off the loop)."""
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        try:
            ids, tiers = await loop.run_in_executor(self.pool, encode)
        except PromptTooLongError:
            raise context_error(self.max_context,
                                await loop.run_in_executor(self.pool, count)) from None
        except (InvalidRequestError, TokenizerError) as e:
            raise APIError(400, str(e)) from None
        finally:
            call.tokenize_s = time.perf_counter() - start
            self.metrics.tokenize.observe(call.tokenize_s)
        if len(ids) >= self.max_context:
            raise context_error(self.max_context, len(ids))
        return ids, tiers

    def encode_chat(self, body, template: str | None) -> tuple[list[int], tuple[int, int]]:
        """A conversation's (ids, tiers), on a worker thread: `Model.encode`'s, with the
        stable tier ending where the client marked it (`cache_control`) or where the
        system parts of recent requests stop agreeing (see tiers.py)."""
        msgs, tools = chat_messages.prepare(body.messages, body.tools, template)
        ids, tiers = self.model.encode(msgs, tools)
        marked = marked_messages(body.messages)
        if marked is None:
            return ids, self.recent.cut(ids, tiers)
        head_msgs, head_tools = chat_messages.prepare(marked, body.tools, template)
        stable = self.model.prompts.rendered_end(head_msgs, head_tools, ids)
        return ids, (stable, max(tiers[1], stable))

    def budget(self, ids, max_tokens: int | None) -> int:
        """The tokens a request may generate: what it asked for, at most the server's
        default, within the context."""
        return token_budget(len(ids), self.max_context, max_tokens, self.defaults.max_tokens)

    async def constraint(self, body, budget: int) -> Constraint | None:
        """The grammar a chat request holds its output to (tool_choice "required" or a
        named function, else response_format json_object / json_schema), built in the
        worker pool (llguidance's view of the tokenizer takes about 1 s, once)."""
        choice = body.tool_choice
        choice = choice.model_dump() if isinstance(choice, BaseModel) else choice
        form = body.response_format
        if choice in (None, "auto", "none") and (form is None or form.type == "text"):
            return None
        tools = [t.model_dump(by_alias=True) for t in body.tools or []]
        form = form.model_dump(by_alias=True) if form is not None else None

        def build():
            grammars = self.grammars()
            try:
                constraint = tool_choice_constraint(grammars, tools, choice, budget)
            except InvalidRequestError as e:
                raise APIError(400, str(e), param="tool_choice") from None
            try:  # a call wins over a response format
                return constraint or response_format_constraint(grammars, form, budget)
            except InvalidRequestError as e:
                raise APIError(400, str(e), param="response_format") from None

        return await asyncio.get_running_loop().run_in_executor(self.pool, build)

    def grammars(self) -> Grammars:
        with self._grammars_lock:
            if self._grammars is None:
                if self.model.tokenizer is None:
                    raise APIError(400, "constrained output (tool_choice, response_format) "
                                        "needs the model's tokenizer; this model has none")
                self._grammars = Grammars(self.model.tokenizer,
                                          self.model.engine.config.vocab_size)
            return self._grammars

    def thought_budget(self, call: _Call, body, ids, budget: int) -> bool:
        """Whether the prompt opens a thought. Where a thought can happen (the prompt
        opens one, or the chat template knows the start marker: a model that may open
        one itself), a request with a thought budget or a constraint gets a ThoughtBudget
        (`call.thought`): it holds the thought to the budget and hands the constraint the
        answer alone. Elsewhere it is not needed, and a processor would cost every token
        a call on the engine's loop thread."""
        tokenizer, markers = self.model.tokenizer, self.defaults.markers
        if tokenizer is None:
            return False
        opened = opens_thought(tokenizer, ids, markers)
        limit = request_budget(body.reasoning_effort, body.thinking_token_budget,
                               self.defaults.reasoning_budget)
        if self.may_think(opened) and (limit is not None or call.constraint is not None):
            call.thought = self.thought_counter(opened, budget, limit, call.constraint)
        return opened

    def may_think(self, opened: bool) -> bool:
        template = self.model.tokenizer.chat_template or ""
        return opened or self.defaults.markers.start in template

    def thought_counter(self, opened: bool, budget: int, limit: int | None = None,
                        inner=None) -> ThoughtBudget:
        return ThoughtBudget(self.model.tokenizer, self.model.engine.config.vocab_size,
                             self.defaults.markers, limit, opened, budget, inner)

    async def reasoning_tokens(self, call: _Call, result, opened: bool) -> int:
        """A finished answer's thought tokens (its end marker included): as its
        ThoughtBudget counted them, else counted the same way over its ids, off the loop."""
        if call.thought is None:
            if self.model.tokenizer is None or not self.may_think(opened):
                return 0
            counter = self.thought_counter(opened, len(result.token_ids))
            await asyncio.get_running_loop().run_in_executor(
                self.pool, counter.feed, list(result.token_ids))
            return counter.thought_tokens
        return call.thought.thought_tokens

    def submit(self, ids, tiers, body, budget: int, logprobs: int | None,
               constraint=None):
        """Queue the request on the model (cheap: the prompt is ids already)."""
        temperature = self.defaults.temperature if body.temperature is None else body.temperature
        if body.seed is not None:
            seed = body.seed % 2 ** 32
        else:
            seed = secrets.randbits(32) if temperature > 0 else 0
        stable, context = tiers
        prompt = {"stable": ids[:stable], "context": ids[stable:context],
                  "volatile": ids[context:]}
        try:
            return self.model.asubmit(
                prompt, max_tokens=budget, temperature=temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                min_p=body.min_p or 0.0, seed=seed, stop=body.stop,
                speculative=body.speculative, logprobs=logprobs, logits_processor=constraint)
        except QueueFullError as e:
            raise APIError(503, str(e), type="server_overloaded", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except PromptTooLongError as e:
            raise APIError(400, str(e), param="messages",
                           code="context_length_exceeded") from None
        except InvalidRequestError as e:
            raise APIError(400, str(e)) from None
        except XlrError as e:  # shut down (draining)
            raise APIError(503, str(e), type="server_error", code="unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    async def wait(self, call: _Call, handle, request: Request):
        """The whole result, cancelling the request if the client goes away first (its
        result is then "abort"). One the engine aborted for another reason is recorded
        and answered 503."""
        result_task = asyncio.ensure_future(handle.aresult())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({result_task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not result_task.done():
                handle.cancel()
            result = await result_task
            if result.finish_reason == "abort" and not gone.done():
                message = result.metrics.get("error") or ABORTED
                self.finished(call, handle, result, "abort", 0, message)
                raise APIError(503, f"the request was aborted: {message}",
                               type="server_error", code="aborted",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            return result
        except XlrError as e:
            raise APIError(500, f"generation failed: {e}", type="server_error") from None
        finally:
            gone.cancel()
            if not handle.done:  # this task itself was cancelled
                handle.cancel()

    async def pieces(self, handle):
        """A streamed request's text pieces as they come; every gap after the first is
        one inter-token latency sample."""
        last = None
        async for piece in handle:
            now = time.perf_counter()
            if last is not None:
                self.metrics.itl.observe(now - last)
            last = now
            yield piece

    def finished(self, call: _Call, handle, result, reason: str, tool_calls: int = 0,
                 error: str | None = None) -> None:
        e2e = time.perf_counter() - call.arrival
        if result is not None:
            self.metrics.finished(result, reason, e2e, call.stream)
        self.metrics.reasoning_tokens.inc(call.reasoning_tokens)
        if call.constraint is not None:
            self.metrics.constraint_masks.inc(call.constraint.masks)
            self.metrics.constraint_mask_seconds.inc(call.constraint.mask_seconds)
        if self.log is None:
            return
        m = result.metrics if result is not None else {}
        keep = ("prompt_tokens", "completion_tokens", "cached_tokens", "prefilled_tokens",
                "ttft_s", "itl_s", "total_s", "queue_s", "preemptions",
                "stable_tokens", "stable_cached_tokens", "context_tokens",
                "context_cached_tokens", "volatile_tokens", "volatile_cached_tokens",
                "target_passes", "acceptance_rate")
        self.log.write({"id": call.id, "request_id": getattr(handle, "id", None),
                        "endpoint": call.endpoint, "model": self.name, "stream": call.stream,
                        "arrival": call.arrival_unix, "tokenize_s": call.tokenize_s,
                        "e2e_s": e2e, "finish_reason": reason, "tool_calls": tool_calls,
                        **({"error": error} if error else {}),
                        **{k: m[k] for k in keep if k in m}})

    def finished_later(self, call: _Call, handle, tool_calls: int, error: str) -> None:
        """`finished` for a request cancelled mid-stream: its "abort" result comes from
        the scheduler at its next step; record it then, off this (ending) generator."""
        async def record():
            for _ in range(600):
                if handle.done:
                    break
                await asyncio.sleep(0.05)
            try:
                result = handle.result(timeout=0) if handle.done else None
            except Exception:  # noqa: BLE001 - it failed: nothing to count but the end
                result = None
            self.finished(call, handle, result, "abort", tool_calls, error)

        task = asyncio.ensure_future(record())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def refused(self, request: Request, status: int, message: str) -> None:
        self.metrics.error(status)
        if self.log is not None:
            self.log.write({"endpoint": request.url.path, "model": self.name,
                            "arrival": time.time(), "status": status,
                            "error": message[:200]})

    async def watch_loop(self, period: float = 0.05) -> None:
        """The event loop's largest stall: how late a short sleep wakes up."""
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(period)
            stall = loop.time() - start - period
            if stall > self.max_stall:
                self.max_stall = stall
                self.metrics.loop_stall.set(stall)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the ASGI disconnect message)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def chat_message_parts(text: str, markers, opened: bool, parse_tools: bool):
    """A whole answer's (reasoning_content or None, content, tool calls): the thought is
    split off first, and only the text after it is parsed for calls."""
    reasoning, answer = split_reasoning(text, markers, opened)
    content, calls = parse_whole(answer) if parse_tools else (answer, [])
    return reasoning, content, calls


def _finish_reason(result, calls) -> str:
    return "tool_calls" if calls else result.finish_reason


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _chat_logprobs(tokenizer, rows) -> dict | None:
    if rows is None:
        return None

    def entry(token_id, logprob):
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(r["token_id"], r["logprob"]),
                         "top_logprobs": [entry(t["token_id"], t["logprob"])
                                          for t in r["top_logprobs"]]} for r in rows]}


def _completion_logprobs(tokenizer, rows) -> dict | None:
    if rows is None:
        return None
    tokens = [_token_text(tokenizer, r["token_id"]) for r in rows]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [r["logprob"] for r in rows],
            "top_logprobs": [{_token_text(tokenizer, t["token_id"]): t["logprob"]
                              for t in r["top_logprobs"]} for r in rows],
            "text_offset": offsets}


# ------------------------------------------------------------------ the app

def create_app(model, *, served_model_name: str, api_key: str | None = None,
               request_log: RequestLog | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               workers: int = 4, cors_origins: list[str] | None = None,
               defaults: Defaults = Defaults()) -> FastAPI:
    """An ASGI app serving `model` under `served_model_name` (the app does not own the
    model: whoever loaded it shuts it down); `defaults` fill what requests leave out."""
    server = Server(model, served_model_name, request_log, workers, defaults)
    tokenizer = model.tokenizer
    template = tokenizer.chat_template if tokenizer is not None else None

    @asynccontextmanager
    async def lifespan(app):
        watcher = asyncio.ensure_future(server.watch_loop())
        try:
            yield
        finally:
            watcher.cancel()
            server.pool.shutdown(wait=False, cancel_futures=True)
            if request_log is not None:
                request_log.close()

    app = FastAPI(title="xlr-jax", version=xlr_jax.__version__, lifespan=lifespan,
                  description="An OpenAI-compatible server over one xlr-jax model. "
                              "Unknown request fields are accepted and ignored.")
    app.state.server = server
    errors = openai_error_schema()

    # -------------------------------------------------------------- errors

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, error: APIError):
        server.refused(request, error.status, error.message)
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, error: RequestValidationError):
        problems = error.errors()
        first = problems[0] if problems else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
            loc = []
        else:
            message = "; ".join(
                f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
                f"{e.get('msg')}" for e in problems[:5])
        return await on_api_error(request, APIError(400, message,
                                                    param=".".join(loc) or None))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, error: StarletteHTTPException):
        kind = {401: "authentication_error", 404: "not_found_error"}.get(
            error.status_code, "invalid_request_error" if error.status_code < 500
            else "server_error")
        # the exception's headers too: a 405 must say which methods are allowed (Allow)
        return await on_api_error(request, APIError(error.status_code, str(error.detail),
                                                    type=kind, headers=error.headers))

    @app.exception_handler(Exception)
    async def on_crash(request: Request, error: Exception):
        return await on_api_error(request, APIError(
            500, f"internal error: {type(error).__name__}: {error}", type="server_error"))

    # -------------------------------------------------------------- probes

    def card() -> ModelCard:
        return ModelCard(id=server.name, created=server.created,
                         context_length=server.max_context, max_model_len=server.max_context)

    @app.get("/v1/models", response_model=ModelList, responses=errors)
    async def list_models():
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=errors)
    async def get_model(model_id: str):
        server.check_model(model_id)
        return card()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.name,
                "event_loop_max_stall_s": round(server.max_stall, 4)}

    @app.get("/metrics", response_class=Response)
    async def metrics():
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(server.pool, server.metrics.render)
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/props")
    @app.get("/v1/props")
    async def props():
        """llama.cpp's probe: agent frameworks read the context from here."""
        return {"default_generation_settings": {"n_ctx": server.max_context,
                                                "model": server.name},
                "total_slots": model.plan.max_batch, "model_alias": server.name,
                "build_info": f"xlr-jax {xlr_jax.__version__}"}

    @app.get("/server_info")
    async def server_info():
        """SGLang's probe: sglang-router (`xlr serve --data-parallel`) lists the replicas'
        model under this name."""
        return {"served_model_name": server.name, "context_length": server.max_context,
                "version": xlr_jax.__version__}

    @app.get("/version")
    async def version():
        return {"version": xlr_jax.__version__, "name": "xlr-jax"}

    # -------------------------------------------------------------- completions

    @app.post("/v1/chat/completions", responses=generation_responses())
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        call = _Call("chat.completions", body.stream, new_id("chatcmpl"))
        server.check_model(body.model)
        server.check_common(body)
        max_tokens = server.requested_max_tokens(
            *((body.max_completion_tokens, "max_completion_tokens")
              if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens")))
        ids, tiers = await server.encode(
            call, lambda: server.encode_chat(body, template),
            lambda: len(tokenizer.encode(model.chat_prompt(
                *chat_messages.prepare(body.messages, body.tools, template)))))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        budget = server.budget(ids, max_tokens)
        call.constraint = await server.constraint(body, budget)
        opened = server.thought_budget(call, body, ids, budget)
        handle = server.submit(ids, tiers, body, budget, logprobs,
                               call.thought or call.constraint)
        parse_tools = bool(body.tools) and body.tool_choice != "none"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_chat_stream(server, call, handle, parse_tools, include_usage,
                                     tokenizer, opened))
        result = await server.wait(call, handle, request)
        reasoning, content, calls = chat_message_parts(result.text, server.defaults.markers,
                                                       opened, parse_tools)
        reason = _finish_reason(result, calls)
        call.reasoning_tokens = await server.reasoning_tokens(call, result, opened)
        server.finished(call, handle, result, reason, len(calls))
        message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        return {"id": call.id, "object": "chat.completion", "created": now(),
                "model": server.name, "system_fingerprint": None,
                "choices": [{"index": 0, "message": message, "finish_reason": reason,
                             "logprobs": _chat_logprobs(tokenizer, result.logprobs)}],
                "usage": usage(result.metrics, call.reasoning_tokens)}

    @app.post("/v1/completions", responses=generation_responses())
    async def completions(body: CompletionRequest, request: Request):
        call = _Call("completions", body.stream, new_id("cmpl"))
        server.check_model(body.model)
        server.check_common(body)
        max_tokens = server.requested_max_tokens(body.max_tokens, "max_tokens")
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request (got {len(prompt)})",
                               param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        ids, tiers = await server.encode(
            call, lambda: model.encode(prompt),
            lambda: len(prompt) if isinstance(prompt, list) else len(tokenizer.encode(prompt)))
        handle = server.submit(ids, tiers, body, server.budget(ids, max_tokens), body.logprobs)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_completion_stream(server, call, handle, include_usage, tokenizer))
        result = await server.wait(call, handle, request)
        server.finished(call, handle, result, result.finish_reason)
        return {"id": call.id, "object": "text_completion", "created": now(),
                "model": server.name, "system_fingerprint": None,
                "choices": [{"index": 0, "text": result.text,
                             "finish_reason": result.finish_reason,
                             "logprobs": _completion_logprobs(tokenizer, result.logprobs)}],
                "usage": usage(result.metrics)}

    def openapi():
        """FastAPI's schema, less the 422 it documents by default: validation errors
        are answered 400 in OpenAI's shape."""
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(Guard, api_key=api_key, max_body=max_body_bytes,
                       metrics=server.metrics)
    return app


def _sse(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _Aborted(XlrError):
    """The engine ended a request with finish_reason "abort" (the model shutting down)."""


def _ended(handle, outcome: "_Outcome"):
    """A finished stream's result; an aborted one raises `_Aborted` (sent as an error)."""
    result = handle.result()
    if result.finish_reason == "abort":
        outcome.result = result
        raise _Aborted(result.metrics.get("error") or ABORTED)
    return result


class _Outcome:
    """What a stream's body leaves for its ending: the result, the finish reason and how
    many tool calls it parsed (None result: the client went away first)."""
    result = None
    reason = "abort"
    calls = 0
    reasoning_tokens: int | None = None  # a chat answer's thought tokens


async def _guarded(server: Server, call: _Call, handle, body, outcome: _Outcome, base: dict,
                   include_usage: bool):
    """A stream's chunks from `body`, then usage (with include_usage) and [DONE]. A
    failure after the start is sent as a `data:` error object; a client that goes away
    cancels the request. The request is recorded either way."""
    error = None
    try:
        async for text in body:
            yield text
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(outcome.result.metrics,
                                                             outcome.reasoning_tokens)})
    except _Aborted as e:
        error = str(e)
        yield sse(error_body(f"the request was aborted: {e}", type="server_error",
                             code="aborted"))
    except XlrError as e:
        error = str(e)
        yield sse(error_body(f"generation failed: {e}", type="server_error"))
    finally:
        if outcome.result is None and error is None:  # the client went away
            handle.cancel()
            server.finished_later(call, handle, outcome.calls, "client disconnected")
        else:
            server.finished(call, handle, outcome.result, outcome.reason, outcome.calls, error)
    yield SSE_DONE


def _chat_stream(server: Server, call: _Call, handle, parse_tools: bool,
                 include_usage: bool, tokenizer, opened: bool):
    """OpenAI's chunk order: the role, content / tool-call deltas, the finish_reason,
    then usage and [DONE] (`_guarded`)."""
    base = {"id": call.id, "object": "chat.completion.chunk", "created": now(),
            "model": server.name, "system_fingerprint": None}

    def chunk(delta: dict, reason=None, **extra) -> str:
        return sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": reason, **extra}]})

    def deltas(events) -> list[str]:
        out = []
        for kind, value in events:
            if kind == "content":
                out.append(chunk({"content": value}))
            elif kind == "start":
                out.append(chunk({"tool_calls": [{
                    "index": value.index, "id": value.id, "type": "function",
                    "function": {"name": value.name, "arguments": ""}}]}))
            else:
                out.append(chunk({"tool_calls": [{
                    "index": value.index, "function": {"arguments": value.arguments}}]}))
        return out

    parser = ToolCallParser() if parse_tools else None
    splitter = ReasoningSplitter(server.defaults.markers, opened)
    outcome = _Outcome()

    def split(events) -> list[str]:
        """A thought streams as reasoning_content deltas; the answer as content or,
        parsed, tool-call deltas."""
        out = []
        for kind, text in events:
            if kind == "reasoning":
                out.append(chunk({"reasoning_content": text}))
            else:
                out += deltas(parser.feed(text)) if parser else [chunk({"content": text})]
        return out

    async def body():
        yield chunk({"role": "assistant", "content": ""})
        async for piece in server.pieces(handle):
            for text in split(splitter.feed(piece)):
                yield text
        result = _ended(handle, outcome)
        for text in split(splitter.finish()) + (deltas(parser.finish()) if parser else []):
            yield text
        call.reasoning_tokens = await server.reasoning_tokens(call, result, opened)
        outcome.reasoning_tokens = call.reasoning_tokens
        outcome.calls = len(parser.calls) if parser else 0
        outcome.reason = _finish_reason(result, parser.calls if parser else [])
        outcome.result = result
        yield chunk({}, outcome.reason, logprobs=_chat_logprobs(tokenizer, result.logprobs))

    return _guarded(server, call, handle, body(), outcome, base, include_usage)


def _completion_stream(server: Server, call: _Call, handle, include_usage: bool, tokenizer):
    """Text chunks, the finish_reason, then usage and [DONE] (`_guarded`)."""
    base = {"id": call.id, "object": "text_completion", "created": now(),
            "model": server.name, "system_fingerprint": None}

    def chunk(text: str, reason=None, logprobs=None) -> str:
        return sse({**base, "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                         "finish_reason": reason}]})

    outcome = _Outcome()

    async def body():
        async for piece in server.pieces(handle):
            yield chunk(piece)
        result = _ended(handle, outcome)
        outcome.reason, outcome.result = result.finish_reason, result
        yield chunk("", outcome.reason, _completion_logprobs(tokenizer, result.logprobs))

    return _guarded(server, call, handle, body(), outcome, base, include_usage)


# ------------------------------------------------------------------ running it

def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What to tell the operator who binds a non-loopback address without a key."""
    if api_key or host in ("127.0.0.1", "localhost", "::1"):
        return None
    return (f"warning: serving on {host} without --api-key: anyone who can reach this "
            "address can use the model")


def serve(model, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str = "smollm2", request_log_dir=None,
          drain_timeout: float = 30.0, max_body_bytes: int = MAX_BODY_BYTES,
          cors_origins: list[str] | None = None, log_level: str = "info",
          defaults: Defaults = Defaults()) -> int:
    """Serve `model` until SIGTERM or Ctrl-C. SIGTERM drains: the listener closes, requests
    in flight run to their end (at most `drain_timeout` seconds, then they are cancelled),
    then the model stops and this returns 0."""
    import uvicorn

    log = RequestLog(request_log_dir) if request_log_dir else None
    app = create_app(model, served_model_name=served_model_name, api_key=api_key,
                     request_log=log, max_body_bytes=max_body_bytes,
                     cors_origins=cors_origins, defaults=defaults)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout, access_log=False,
                            proxy_headers=False, server_header=False)
    # uvicorn re-raises the signal it caught once it has drained: a handler that ignores
    # it lets the model shut down below instead of the default one killing the process
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uvicorn.Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        model.shutdown()
    print("drained and stopped", file=sys.stderr, flush=True)
    return 0
