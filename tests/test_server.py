"""`xlr serve`: a live server in a subprocess on the embedded model, driven by real clients
(the `openai` package and an httpx client), plus unit tests of the tool-call parser.

One server (started with an API key, a request log and a small waiting queue) serves
every live test of this module; the SIGTERM test, last, stops it.
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import negative_data_rejection, positive_data_acceptance

try:
    import httpx
except ImportError:  # the openai client's own HTTP library, where it is httpx2
    import httpx2 as httpx

from xlr_jax.server import messages as chat_messages
from xlr_jax.server.protocol import ChatCompletionRequest
from xlr_jax.errors import XlrError
from xlr_jax.server.replicas import free_port, replica_devices
from xlr_jax.server.tiers import RecentHeads, marked_messages
from xlr_jax.server.tool_calls import ToolCallParser, parse_whole, render_tool, tools_block

KEY = "test-key-123"
MODEL = "smollm2"
MAX_WAITING = 64
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}]


# ------------------------------------------------------------------ the live server

class LiveServer:
    def __init__(self, proc, port, log_dir, stderr_path):
        self.proc, self.port, self.log_dir, self.stderr_path = proc, port, log_dir, stderr_path
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, timeout=120,
                                 headers={"Authorization": f"Bearer {KEY}"})

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0,
                             timeout=120, **kwargs)

    def metric(self, name: str, **labels) -> float:
        """One sample of /metrics (0 when absent)."""
        text = self.http.get("/metrics").text
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in text.splitlines():
            if line.startswith(name + "{") and all(p in line for p in want.split(",") if p):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def log_entries(self) -> list[dict]:
        path = self.log_dir / "requests.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] \
            if path.exists() else []


def _start(cache_dir, tmp, *extra, devices: int | None = None) -> LiveServer:
    """`xlr serve` on a free port; `devices`: that many virtual CPU devices."""
    port = free_port()
    stderr_path = tmp / "server.stderr"
    env = dict(os.environ)
    if devices is not None:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                            + f" --xla_force_host_platform_device_count={devices}").strip()
    proc = subprocess.Popen(
        [sys.executable, "-m", "xlr_jax.cli", "serve", MODEL, "--port", str(port),
         "--cache-dir", str(cache_dir), "--api-key", KEY, "--request-log", str(tmp / "log"),
         "--max-waiting", str(MAX_WAITING), "--drain-timeout", "60", *extra],
        stdout=subprocess.DEVNULL, stderr=stderr_path.open("w"), env=env)
    server = LiveServer(proc, port, tmp / "log", stderr_path)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"xlr serve exited: {stderr_path.read_text()[-3000:]}")
        try:
            if server.http.get("/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("xlr serve did not answer /health within 300 s")


@pytest.fixture(scope="module")
def server(cache_dir, tmp_path_factory):
    live = _start(cache_dir, tmp_path_factory.mktemp("serve"))
    yield live
    if live.proc.poll() is None:
        live.proc.kill()
        live.proc.wait(30)


def _chat(server, messages, **kwargs):
    body = {"model": MODEL, "messages": messages, "temperature": 0, **kwargs}
    return server.http.post("/v1/chat/completions", json=body)


def _sse_events(response) -> list:
    """The `data:` payloads of an SSE response, parsed ([DONE] kept as a string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _assert_openai_error(response, status: int):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_two_replicas_split_over_three_devices_each_behind_the_router(server, cache_dir,
                                                                      tmp_path):
    """`xlr serve --data-parallel 2 --tensor-parallel 3 --weights float`: two replicas,
    each a process with 3 virtual CPU devices (the file dequantized to f32, each layer
    split over them), behind sglang-router's cache_aware policy. It gives the same greedy
    answer, whole and streamed, as the server on the plan's weights and one device; an
    agent's second turn goes to the replica that answered its first and finds its whole
    stable tier and history cached; a replica that dies ends the router and the other."""
    dp = _start(cache_dir, tmp_path, "--weights", "float", "--data-parallel", "2",
                "--tensor-parallel", "3", "--router", "cache_aware")
    try:
        stderr = dp.stderr_path.read_text()
        for i in (0, 1):
            assert re.search(rf"\[replica {i}\] loaded in .*each layer split over 3 devices",
                             stderr), stderr[-2000:]
        assert [m.id for m in dp.openai().models.list().data] == [MODEL]  # via the router
        messages = [{"role": "user", "content": "Name three colors."}]
        want = _chat(server, messages, max_tokens=24).json()["choices"][0]["message"]
        got = _chat(dp, messages, max_tokens=24).json()["choices"][0]["message"]
        assert got["content"] == want["content"] and want["content"]
        with dp.http.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 24,
                "stream": True}) as response:
            events = _sse_events(response)
        text = "".join(e["choices"][0]["delta"].get("content") or ""
                       for e in events[:-1] if e["choices"])
        assert text == want["content"]
        urls = re.findall(r"\[replica \d\] serving .* on (\S+)/v1", stderr)
        assert len(urls) == 2
        for url in urls:  # each replica answers the same
            direct = httpx.post(url + "/v1/chat/completions", headers=dp.http.headers,
                                json={"model": MODEL, "messages": messages, "temperature": 0,
                                      "max_tokens": 24}, timeout=120)
            assert direct.json()["choices"][0]["message"]["content"] == want["content"]

        ids = {}  # two agents of different system prompts, two turns each
        for agent in ("Ada", "Grace"):
            history = [{"role": "system", "content": f"You are {agent}. " + "Be brief. " * 60}]
            for turn in ("Say hello.", "Now say goodbye."):
                history.append({"role": "user", "content": turn})
                body = _chat(dp, history, max_tokens=8).json()
                history.append(body["choices"][0]["message"])
                ids[agent, turn] = body["id"]
        children = _children(dp.proc.pid)  # the replicas and the router
        replicas = [pid for pid in children
                    if b"xlr_jax.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(replicas) == 2 and len(children) == 3

        def replica_logs() -> dict:
            found = {}
            for i in (0, 1):
                path = tmp_path / "log" / f"replica-{i}" / "requests.jsonl"
                if path.exists():
                    found.update({e["id"]: {**e, "replica": i}  # (the router's probes: 404)
                                  for e in map(json.loads, path.read_text().splitlines())
                                  if "id" in e})
            return found
        deadline = time.monotonic() + 30  # the logs are written beside the loop
        while not set(ids.values()) <= set(logs := replica_logs()) and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        for agent in ("Ada", "Grace"):
            first, second = logs[ids[agent, "Say hello."]], logs[ids[agent, "Now say goodbye."]]
            assert second["replica"] == first["replica"], (agent, first, second)
            assert second["stable_cached_tokens"] == second["stable_tokens"] > 64
            assert second["context_cached_tokens"] > 0

        os.kill(replicas[1], signal.SIGKILL)
        assert dp.proc.wait(120) == 1
        assert re.search(r"error: replica \d exited with code -9; stopping the others",
                         dp.stderr_path.read_text())
        assert all(map(_gone, children))
    finally:
        if dp.proc.poll() is None:
            dp.proc.kill()
            dp.proc.wait(30)


def test_replicas_that_cannot_start_end_the_server_with_the_reason(tmp_path):
    """A replica whose model is missing ends `xlr serve --data-parallel 2` with its error
    and the replica's name, without starting the router; SIGTERM while the replicas load
    stops them all and exits 0."""
    serve = [sys.executable, "-m", "xlr_jax.cli", "serve", "--data-parallel", "2",
             "--port", str(free_port())]
    bad = subprocess.run([*serve, "--model", str(tmp_path / "missing.gguf")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert re.search(r"\[replica \d\] error: .*missing.gguf", bad.stderr), bad.stderr
    assert re.search(r"error: replica \d exited with code 2 while starting", bad.stderr)

    loading = subprocess.Popen([*serve, "--cache-dir", str(tmp_path / "cache")],
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(replicas := _children(loading.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(replicas) == 2
    loading.send_signal(signal.SIGTERM)
    assert loading.wait(60) == 0
    assert all(map(_gone, replicas))


# ------------------------------------------------------------------ probes

def test_models_and_probe_endpoints(server):
    models = server.openai().models.list().data
    assert [m.id for m in models] == [MODEL]
    card = server.http.get(f"/v1/models/{MODEL}").json()
    assert card["context_length"] == card["max_model_len"] == 8192
    _assert_openai_error(server.http.get("/v1/models/nope"), 404)
    for path in ("/props", "/v1/props"):  # llama.cpp's probe, and where hermes-agent looks too
        assert server.http.get(path).json()["default_generation_settings"]["n_ctx"] == 8192
    assert server.http.get("/version").json()["version"]
    info = server.http.get("/server_info").json()  # what sglang-router names the model by
    assert info["served_model_name"] == MODEL and info["context_length"] == 8192
    schema = server.http.get("/openapi.json").json()
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    assert "422" not in chat["responses"] and "400" in chat["responses"]
    props = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "tools", "tool_choice", "stream_options", "max_completion_tokens",
            "top_k", "min_p", "speculative"} <= set(props)


# ------------------------------------------------------------------ OpenAI semantics

def test_openai_client_chat_whole_and_streamed(server):
    client = server.openai()
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                           temperature=0)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert 0 < whole.usage.completion_tokens <= 10

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: the same tokens either way
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == choice.finish_reason and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0

    with server.http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": 3, "stream": True}) as r:
        events = _sse_events(r)
    assert events[-1] == "[DONE]" and "usage" not in events[-2]  # no usage unless asked


def test_openai_client_completions(server):
    client = server.openai()
    whole = client.completions.create(model=MODEL, prompt="The capital of France is",
                                      max_tokens=6, temperature=0, logprobs=2)
    assert whole.choices[0].text and whole.usage.completion_tokens == 6
    assert whole.choices[0].finish_reason == "length"
    assert len(whole.choices[0].logprobs.tokens) == 6
    streamed = list(client.completions.create(model=MODEL, prompt="The capital of France is",
                                              max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_conversation_with_tool_messages_in_its_history(server):
    history = [{"role": "system", "content": "You are a weather assistant."},
               {"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'}]
    reply = server.openai().chat.completions.create(model=MODEL, messages=history,
                                                    tools=TOOLS, max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the tools block, the call and its result are all in the prompt
    bare = _chat(server, history[:2], max_tokens=1).json()["usage"]["prompt_tokens"]
    assert reply.usage.prompt_tokens > bare + 60


def test_second_turn_reuses_the_shared_system_prompt(server):
    system = (f"Session {uuid.uuid4().hex}. You are a careful assistant for a travel agency. "
              + "Answer briefly, politely and accurately; never invent facts. " * 12)
    first = [{"role": "system", "content": system},
             {"role": "user", "content": "Suggest one city to visit in Italy."}]
    one = server.openai().chat.completions.create(model=MODEL, messages=first, max_tokens=8,
                                                  temperature=0, tools=TOOLS)
    assert one.usage.prompt_tokens > 200
    second = first + [{"role": "assistant", "content": one.choices[0].message.content or ""},
                      {"role": "user", "content": "And one in Spain?"}]
    chunks = list(server.openai().chat.completions.create(
        model=MODEL, messages=second, max_tokens=8, temperature=0, tools=TOOLS, stream=True,
        stream_options={"include_usage": True}))
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert cached >= 192  # at least the system prompt's and tools' whole pages
    assert server.metric("xlr_prefix_cache_hits_total", tier="stable") >= 192


def test_concurrent_streams_equal_each_request_sent_alone(server):
    """64 streaming clients, 2 requests each, over 8 prompts: every answer equals the
    prompt's answer sent alone, and the server stays up."""
    prompts = [f"Count from {i} to {i + 5}." if i % 2 else f"Name a fruit that is number {i}."
               for i in range(8)]

    def stream(prompt):
        with server.http.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 8, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            events = _sse_events(r)
        assert events[-1] == "[DONE]"
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                       if e["choices"])

    def client(i):
        return [stream(prompts[(i + k) % len(prompts)]) for k in range(2)]

    alone = {p: stream(p) for p in prompts}
    with ThreadPoolExecutor(64) as pool:
        together = list(pool.map(client, range(64)))
    assert together == [[alone[prompts[(i + k) % len(prompts)]] for k in range(2)]
                        for i in range(64)]
    assert server.http.get("/health").status_code == 200


def test_a_full_waiting_queue_answers_503_with_retry_after(server):
    def send(i):
        return _chat(server, [{"role": "user", "content": f"Say {i}."}], max_tokens=4)

    with ThreadPoolExecutor(150) as pool:  # well past max_waiting + the batch
        responses = list(pool.map(send, range(150)))
    refused = [r for r in responses if r.status_code == 503]
    assert refused and all(r.status_code in (200, 503) for r in responses)
    assert refused[0].headers["retry-after"]
    _assert_openai_error(refused[0], 503)


CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}}}


def test_response_format_holds_the_output_to_json(server):
    """json_schema and json_object through the openai client, whole and streamed: the
    content parses (and validates); the masks show in /metrics."""
    import jsonschema

    client = server.openai()
    masks = server.metric("xlr_constraint_masks_total")
    user = [{"role": "user", "content": "Tell me about Paris."}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    for temperature in (0, 1):
        reply = client.chat.completions.create(
            model=MODEL, messages=user, max_tokens=40, temperature=temperature, seed=5,
            response_format=schema_format)
        jsonschema.validate(json.loads(reply.choices[0].message.content), CITY)
    chunks = client.chat.completions.create(model=MODEL, messages=user, max_tokens=40,
                                            response_format={"type": "json_object"},
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    assert server.metric("xlr_constraint_masks_total") > masks
    assert server.metric("xlr_constraint_mask_seconds_total") > 0


def test_tool_choice_required_or_named_gives_a_call(server):
    client = server.openai()
    user = [{"role": "user", "content": "Say hello."}]
    tools = TOOLS + [{"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "required": ["a", "b"],
                                      "properties": {"a": {"type": "number"},
                                                     "b": {"type": "number"}}}}}]
    reply = client.chat.completions.create(model=MODEL, messages=user, tools=tools,
                                           tool_choice="required", max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0].function
    assert call.name in ("get_weather", "add") and isinstance(json.loads(call.arguments), dict)
    named = {"type": "function", "function": {"name": "get_weather"}}
    # greedy: the server samples at temperature 1 with a random seed by default, and a
    # draw may well give the city as ""
    chunks = list(client.chat.completions.create(model=MODEL, messages=user, tools=tools,
                                                 tool_choice=named, max_tokens=60,
                                                 temperature=0, stream=True))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert calls and calls[0].function.name == "get_weather"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls))["city"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_constrained_requests_with_bad_fields_are_refused(server):
    user = [{"role": "user", "content": "Hi"}]
    url = "/v1/chat/completions"
    post = server.http.post
    error = _assert_openai_error(post(url, json={"messages": user,
                                                 "tool_choice": "required"}), 400)
    assert error["param"] == "tool_choice" and "needs tools" in error["message"]
    error = _assert_openai_error(post(url, json={
        "messages": user, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "nope"}}}), 400)
    assert "'nope'" in error["message"]
    error = _assert_openai_error(post(url, json={
        "messages": user, "response_format": {"type": "json_schema"}}), 400)
    assert error["param"] == "response_format"
    _assert_openai_error(post(url, json={"messages": user,
                                         "response_format": {"type": "yaml"}}), 400)
    error = _assert_openai_error(post(url, json={
        "messages": user, "response_format": {"type": "json_object"},
        "speculative": {"method": "exact", "draft": "ngram"}}), 400)
    assert "does not speculate" in error["message"]
    assert server.http.get("/health").json()["status"] == "ok"


def test_a_thought_is_reasoning_content_held_to_its_budget(model, cache_dir, tmp_path):
    """`xlr serve --chat-template T --reasoning-budget 8` with a template that opens a
    thought: whole and streamed, the thought is reasoning_content (8 tokens and the end
    marker, counted in usage and /metrics), and reasoning_effort "none" closes it at
    once."""
    start = "<|im_start|>assistant\n"
    template = model.tokenizer.chat_template
    assert start in template
    path = tmp_path / "thinking.jinja"
    path.write_text(template.replace(f"'{start}'", f"'{start}<think>\n'"))
    live = _start(cache_dir, tmp_path, "--chat-template", str(path), "--reasoning-budget", "8")
    try:
        close = len(model.tokenizer.encode("</think>", add_special_tokens=False))
        user = [{"role": "user", "content": "Why is the sea salty?"}]
        reply = live.http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": user, "max_tokens": 30, "temperature": 0}).json()
        message = reply["choices"][0]["message"]
        assert message["reasoning_content"] and "</think>" not in message["content"]
        assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 8 + close
        chunks = list(live.openai().chat.completions.create(
            model=MODEL, messages=user, max_tokens=30, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        assert streamed == message["reasoning_content"]
        assert "".join(d.content or "" for d in deltas) == message["content"]
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 8 + close
        none = live.http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": user, "max_tokens": 10, "temperature": 0,
            "reasoning_effort": "none"}).json()
        assert none["choices"][0]["message"]["reasoning_content"] == ""
        assert none["usage"]["completion_tokens_details"]["reasoning_tokens"] == close
        assert live.metric("xlr_reasoning_tokens_total") == 3 * (8 + close) - 8
    finally:
        live.proc.kill()
        live.proc.wait(30)


@pytest.fixture(scope="module")
def fuzz_schema(cache_dir, tmp_path_factory):
    """/openapi.json, as schemathesis reads it, of a server that caps every answer at 4
    tokens."""
    live = _start(cache_dir, tmp_path_factory.mktemp("fuzz"), "--max-tokens", "4")
    yield schemathesis.openapi.from_url(live.url + "/openapi.json")
    assert live.proc.poll() is None and live.http.get("/health").status_code == 200
    live.proc.kill()
    live.proc.wait(30)


fuzzed = schemathesis.pytest.from_fixture("fuzz_schema")


@fuzzed.parametrize()
@settings(max_examples=30, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_a_fuzzed_api_answers_every_request_by_its_schema(case):
    """schemathesis against /openapi.json, every operation: its examples, its coverage
    cases (bounds, missing and wrong fields, undeclared methods) and 30 generated
    requests get no 5xx, a status, content type and body the schema documents, and a
    405 with Allow. Two checks are left out: pydantic accepts lax input the schema does
    not (0 for false), and some schema-valid values are refused with a 400 that says why
    (n > 1, an empty prompt)."""
    # the first request of a kind may compile a step: a generous read timeout
    case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                           excluded_checks=[negative_data_rejection, positive_data_acceptance])


def test_bad_input_is_answered_in_openai_shape(server):
    user = [{"role": "user", "content": "Hi"}]
    post = server.http.post
    url = "/v1/chat/completions"
    _assert_openai_error(post(url, content=b'{"model": "smollm2", "messages": [',
                              headers={"content-type": "application/json"}), 400)
    error = _assert_openai_error(post(url, json={"messages": "hi"}), 400)
    assert error["param"] == "messages"
    _assert_openai_error(post(url, json={"messages": user, "temperature": "hot"}), 400)
    for field, value in (("temperature", 1e308), ("top_k", 313085343423)):  # fuzz found
        error = _assert_openai_error(post(url, json={"messages": user, field: value}), 400)
        assert field in error["message"] or error["param"] == field
    _assert_openai_error(post(url, json={"messages": user, "model": "gpt-9"}), 404)
    _assert_openai_error(post(url, json={"messages": []}), 400)
    for bad in (0, -5):
        error = _assert_openai_error(post(url, json={"messages": user, "max_tokens": bad}), 400)
        assert error["param"] == "max_tokens"
    assert "n must be 1" in _assert_openai_error(
        post(url, json={"messages": user, "n": 3}), 400)["message"]
    _assert_openai_error(post(url, content=b'{"messages": [{"role": "user", "content": '
                                           b'"\xff\xfe"}]}'), 400)
    _assert_openai_error(post(url, content=b"x" * (20 * 1024 * 1024)), 413)
    _assert_openai_error(post("/v1/completions", json={"prompt": ""}), 400)
    error = _assert_openai_error(post(url, json={"messages": [
        {"role": "user", "content": "hello " * 9000}]}), 400)
    assert re.search(r"This model's maximum context length is 8192 tokens\. However, your "
                     r"messages resulted in \d{4,} tokens\.", error["message"])
    # unknown fields are ignored; a huge max_tokens is clamped, not refused
    ok = _chat(server, user, max_tokens=10 ** 9, stop=["."], reasoning_effort="low",
               parallel_tool_calls=True, made_up={"x": 1})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    assert server.http.get("/health").json()["status"] == "ok"


def test_api_key_is_required_on_v1_routes(server):
    plain = httpx.Client(base_url=server.url, timeout=30)
    error = _assert_openai_error(plain.get("/v1/models"), 401)
    assert error["type"] == "authentication_error"
    _assert_openai_error(plain.post("/v1/chat/completions", json={},
                                    headers={"Authorization": "Bearer wrong"}), 401)
    assert plain.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}
                     ).status_code == 200
    assert plain.get("/health").status_code == 200  # probes stay open


def _idle(server, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (server.metric("xlr_num_requests_running") == 0
                and server.metric("xlr_num_requests_waiting") == 0
                and server.metric("xlr_kv_pages_held") == 0):
            return True
        time.sleep(0.2)
    return False


def test_a_client_that_disconnects_cancels_its_request(server):
    assert _idle(server)
    long = [{"role": "user", "content": "Write a very long story about a dragon."}]
    with server.http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": long, "max_tokens": 2000, "temperature": 0,
            "stream": True}) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        for _ in range(6):
            next(lines)
    # the stream was closed after a few tokens: the request stops, its pages come back
    assert _idle(server, 15)
    # a whole (non-streamed) request whose client gives up is cancelled too
    with pytest.raises(httpx.TimeoutException):
        server.http.post("/v1/chat/completions", timeout=1.5, json={
            "model": MODEL, "messages": long, "max_tokens": 2000, "temperature": 0})
    assert _idle(server, 15)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        aborted = [e for e in server.log_entries() if e.get("finish_reason") == "abort"]
        if len(aborted) >= 2:
            break
        time.sleep(0.2)
    ids = {e["id"] for e in aborted}
    assert first["id"] in ids
    assert all(e["completion_tokens"] < 200 for e in aborted)


def _logged(server, response_id: str) -> dict:
    """The request log's entry for a response (written by a background thread)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [e for e in server.log_entries() if e.get("id") == response_id]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"{response_id} is not in the request log")


def test_stable_tier_ends_where_recent_system_prompts_stop_agreeing(server):
    """An agent's system prompt that ends in a changing line (a date, a session id):
    from the second request on, the stable tier is the part the requests share, in
    whole pages, so it is pinned once and hit by every later request; a system part
    that repeats whole stays stable whole."""
    base = f"Agent {uuid.uuid4().hex}. You plan trips and answer in one line. " * 12

    def ask(tail: str) -> dict:
        r = _chat(server, [{"role": "system", "content": f"{base}\nToday is {tail}."},
                           {"role": "user", "content": "Hi"}], max_tokens=2)
        assert r.status_code == 200, r.text
        return _logged(server, r.json()["id"])

    first, second, third, again = (ask(f"day {n}") for n in (1, 2, 3, 3))
    page = 64  # the CPU plan's page size
    shared = second["stable_tokens"]
    assert first["stable_tokens"] > shared and shared % page == 0
    assert shared >= first["stable_tokens"] - 2 * page  # only the date's page(s) left out
    assert third["stable_tokens"] == shared and third["stable_cached_tokens"] == shared
    assert again["stable_tokens"] == first["stable_tokens"]  # a repeat keeps it all


def test_a_cache_control_part_ends_the_stable_tier(server):
    base = f"Agent {uuid.uuid4().hex}. Be brief and exact. " * 10

    def ask(tail: str, marked: bool) -> dict:
        parts = [{"type": "text", "text": base}, {"type": "text", "text": f"Today is {tail}."}]
        if marked:
            parts[0]["cache_control"] = {"type": "ephemeral"}
        # a user message of over a page: the prompt runs past the tier's partial last
        # page, which is published (and hit) only then
        r = _chat(server, [{"role": "system", "content": parts},
                           {"role": "user", "content": "Hi, please answer. " * 20}],
                  max_tokens=2)
        assert r.status_code == 200, r.text
        return _logged(server, r.json()["id"])

    whole = ask("May 1", marked=False)
    one, two = ask("May 2", marked=True), ask("June 3", marked=True)
    assert 0 < one["stable_tokens"] == two["stable_tokens"] < whole["stable_tokens"] - 3
    assert two["stable_cached_tokens"] == two["stable_tokens"]  # the marked tier hits


def test_metrics_and_request_log(server):
    assert server.metric("xlr_time_to_first_token_seconds_count") > 0
    assert server.metric("xlr_e2e_request_latency_seconds_count") > 0
    assert server.metric("xlr_request_queue_time_seconds_count") > 0
    # streamed requests add a sample per gap between pieces, whole ones their mean once
    assert server.metric("xlr_inter_token_latency_seconds_count") > \
        2 * server.metric("xlr_e2e_request_latency_seconds_count")
    assert server.metric("xlr_request_success_total", finished_reason="length") > 0
    assert server.metric("xlr_request_success_total", finished_reason="abort") >= 2
    assert server.metric("xlr_prompt_tokens_total") > server.metric(
        "xlr_prompt_cached_tokens_total") > 0
    assert server.metric("xlr_generation_tokens_total") > 0
    assert server.metric("xlr_kv_pages_total") == server.metric("xlr_kv_pages_free") + \
        server.metric("xlr_kv_pages_cached") + server.metric("xlr_kv_pages_held")
    assert server.metric("xlr_prefix_cache_queries_total", tier="volatile") > 0
    assert server.metric("xlr_request_errors_total", status="413") >= 1
    text = server.http.get("/metrics").text
    for name in ("xlr_request_queue_time_seconds", "xlr_kv_pages_pinned",
                 "xlr_kv_cache_usage_perc", "xlr_spec_decode_num_draft_tokens_total",
                 "xlr_spec_decode_num_accepted_tokens_total", "xlr_num_preemptions_total",
                 "xlr_spec_decode_num_target_passes_total"):
        assert name in text
    entries = [e for e in server.log_entries() if "request_id" in e]
    assert entries and all({"id", "ttft_s", "e2e_s", "prompt_tokens", "completion_tokens",
                            "cached_tokens", "finish_reason"} <= set(e) for e in entries
                           if e["finish_reason"] != "abort")
    raw = (server.log_dir / "requests.jsonl").read_text()
    assert "travel agency" not in raw and "dragon" not in raw  # no prompt text


def test_sigterm_drains_requests_in_flight(server):
    """Last: it stops the module's server."""
    got: dict = {}
    started = threading.Event()

    def stream():
        with server.http.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
                "max_tokens": 24, "temperature": 0, "stream": True}) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
            got["events"] = events

    worker = threading.Thread(target=stream)
    worker.start()
    assert started.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    worker.join(120)
    assert server.proc.wait(120) == 0
    events = got["events"]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("length", "stop")
    with pytest.raises(httpx.TransportError):  # the listener is gone
        httpx.get(server.url + "/health", timeout=2)
    assert "drained" in server.stderr_path.read_text()


# ------------------------------------------------------------------ tool calls (no server)

CALLS = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
         '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}'
         '</tool_call>\n')


def _feed(pieces):
    parser = ToolCallParser()
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    calls = [(e[1].index, e[1].name, e[1].arguments) for e in events if e[0] == "arguments"]
    starts = [e[1].index for e in events if e[0] == "start"]
    return content, calls, starts, events


def test_tool_calls_parse_from_whole_text():
    content, calls = parse_whole(CALLS)
    assert content == "I will check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert [c.index for c in calls] == [0, 1] and len({c.id for c in calls}) == 2
    assert all(c.id.startswith("call_") for c in calls)
    assert parse_whole('<tool_call>{"name": "f", "arguments": {}}')[1][0].name == "f"
    assert parse_whole("just text, a < sign and <tool") == ("just text, a < sign and <tool", [])


@pytest.mark.parametrize("text", [CALLS, "plain <b>text</b> with <tool_ and no call",
                                  '<tool_call>{"name": broken}</tool_call> tail'])
def test_tool_call_stream_split_at_every_position(text):
    whole_content, whole_calls, _, _ = _feed([text])
    for i in range(len(text) + 1):
        assert _feed([text[:i], text[i:]])[:2] == (whole_content, whole_calls), i
    content, calls, starts, events = _feed(list(text))  # one character at a time
    assert (content, calls) == (whole_content, whole_calls)
    assert starts == [c[0] for c in calls]
    # each call: its start event (index, id, name), then its arguments
    kinds = [e[0] for e in events if e[0] != "content"]
    assert kinds == ["start", "arguments"] * len(calls)


def test_a_partial_tag_is_held_back_and_text_before_a_tag_streams():
    parser = ToolCallParser()
    assert parser.feed("Sure <tool_") == [("content", "Sure ")]
    assert parser.feed('call>{"name": "f", "arg') == []
    events = parser.feed('uments": {"a": 1}}</tool_call>')
    assert [e[0] for e in events] == ["start", "arguments"]
    assert events[0][1].name == "f" and json.loads(events[1][1].arguments) == {"a": 1}


def test_malformed_calls_stay_content():
    for text in ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
                 '<tool_call>not json</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name": "f", "arguments": {"a": 1}'):
        content, calls = parse_whole(text)
        assert calls == [] and content == text


def test_tools_render_deterministically_first_in_the_system_prompt():
    shuffled = [{"function": {"parameters": TOOLS[0]["function"]["parameters"],
                              "name": "get_weather",
                              "description": "The weather in a city"}, "type": "function"}]
    assert tools_block(TOOLS) == tools_block(shuffled)
    assert render_tool(TOOLS[0]).index('"function"') < render_tool(TOOLS[0]).index('"type"')
    body = ChatCompletionRequest(messages=[
        {"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"}], tools=TOOLS)
    simple = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    rendered, tools = chat_messages.prepare(body.messages, body.tools, simple)
    assert tools is None  # this template cannot take them: the Hermes block instead
    assert rendered[0]["role"] == "system"
    assert rendered[0]["content"].startswith("You can call functions")
    assert rendered[0]["content"].endswith("Be kind.")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in \
        rendered[2]["content"]
    assert rendered[3] == {"role": "user", "content": "<tool_response>\ncold\n</tool_response>"}
    native = "{% if tools %}{{ tools | tojson }}{% endif %}{{ messages | length }}"
    rendered, tools = chat_messages.prepare(body.messages, body.tools, native)
    assert tools and rendered[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert rendered[0]["role"] == "system" and rendered[3]["role"] == "tool"


def test_serve_help_and_the_exposure_warning():
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "xlr_jax.cli", "serve", *args],
                              capture_output=True, text=True, timeout=120)

    help_text = cli("--help").stdout
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--max-waiting",
                 "--request-log", "--cache-dir", "--no-prefix-cache", "--drain-timeout"):
        assert flag in help_text
    # a non-loopback address without a key is warned about (before any model loads)
    bad = cli("--host", "0.0.0.0", "--port", "70000")
    assert bad.returncode == 2 and "without --api-key" in bad.stderr
    assert "--port must be" in bad.stderr


def test_replicas_take_their_slice_of_the_devices(monkeypatch):
    """GPUs in groups of --tensor-parallel (an equal share by default); on the CPU, each
    replica process gets its own virtual devices."""
    gpus = [str(i) for i in range(8)]
    assert replica_devices(2, 4, gpus) == [{"CUDA_VISIBLE_DEVICES": "0,1,2,3"},
                                           {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}]
    assert replica_devices(4, None, gpus)[3] == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert replica_devices(2, 1, ["GPU-a", "GPU-b"]) == [{"CUDA_VISIBLE_DEVICES": "GPU-a"},
                                                        {"CUDA_VISIBLE_DEVICES": "GPU-b"}]
    with pytest.raises(XlrError, match=r"--data-parallel 3 x 4 devices a replica \(--tensor-"
                                       r"parallel \+ --prefill-devices\) needs 12 GPUs; 8 "
                                       "visible"):
        replica_devices(3, 4, gpus)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert replica_devices(2, 3, []) == [{"XLA_FLAGS": "--xla_cpu_enable_fast_math=false "
                                          "--xla_force_host_platform_device_count=3"}] * 2
    assert replica_devices(2, None, []) == [{}, {}]


def test_data_parallel_and_several_processes_are_refused_together():
    run = subprocess.run([sys.executable, "-m", "xlr_jax.cli", "serve", "--data-parallel",
                          "2", "--coordinator", "127.0.0.1:1", "--num-processes", "2",
                          "--process-id", "0"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--data-parallel and --coordinator" in run.stderr


def test_recent_heads_cut_the_stable_tier_to_the_shared_pages():
    recent = RecentHeads(page_size=4)
    one = list(range(100, 110)) + [1, 2]          # 10 shared tokens, then a tail
    two = list(range(100, 110)) + [3, 4, 5]
    assert recent.cut(one + [9, 9], (12, 13)) == (12, 13)  # the first of its kind: whole
    assert recent.cut(two + [9], (13, 13)) == (8, 13)       # 10 shared -> 2 whole pages
    assert recent.cut(one + [7], (12, 12)) == (12, 12)      # it repeats whole
    assert recent.cut([100, 101, 5, 6, 7], (5, 5)) == (5, 5)  # shares under a page
    assert recent.cut([1, 2], (0, 1)) == (0, 1)             # no system part


def test_cache_control_marks_cut_the_leading_system_messages():
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "a"},
                                       {"type": "text", "text": "b",
                                        "cache_control": {"type": "ephemeral"}},
                                       {"type": "text", "text": "c"}]},
        {"role": "user", "content": [{"type": "text", "text": "u",
                                      "cache_control": {"type": "ephemeral"}}]}]})
    cut = marked_messages(body.messages)
    assert len(cut) == 1 and [p.text for p in cut[0].content] == ["a", "b"]
    plain = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
    assert marked_messages(plain.messages) is None


def test_operator_defaults_fill_what_requests_leave_out(model):
    """`xlr serve --temperature 0 --max-tokens 5`: a request with no temperature decodes
    greedily, and none generates more than 5 tokens, whatever it asks."""
    import asyncio

    from xlr_jax.server.app import Defaults, Server

    server = Server(model, MODEL, None, 1, Defaults(temperature=0.0, max_tokens=5))
    messages = [{"role": "user", "content": "Write a long poem about the sea."}]
    ids, tiers = model.encode(messages)

    def ask(**fields):
        body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages,
                                                     **fields})

        async def run():
            budget = server.budget(ids, body.max_tokens)
            return await server.submit(ids, tiers, body, budget, None).aresult()

        return asyncio.run(run())

    greedy = model.chat(messages, max_tokens=5)
    for fields in ({"seed": 1}, {"seed": 2, "max_tokens": 10 ** 6}):
        result = ask(**fields)
        assert result.token_ids == greedy.token_ids and len(result.token_ids) <= 5
    assert ask(temperature=1.0, seed=3, max_tokens=3).metrics["completion_tokens"] <= 3
    server.pool.shutdown()


def test_answers_the_model_aborts_end_in_an_error(cache_dir):
    """The model stops (shuts down) under two requests in flight: the stream ends with a
    `data:` error object and [DONE], the whole request gets a 503 in OpenAI's shape."""
    import asyncio

    import xlr_jax
    from xlr_jax.server.app import create_app

    own = xlr_jax.load_model("smollm2", dtype="float32", cache_dir=cache_dir)
    app = create_app(own, served_model_name=MODEL)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 400, "temperature": 0}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://xlr", timeout=120) as client:
            stream = asyncio.ensure_future(client.post(
                "/v1/chat/completions", json={**body, "stream": True}))
            whole = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
            while (await asyncio.to_thread(own.stats))["running"] < 2:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(own.shutdown)
            return await stream, await whole

    stream, whole = asyncio.run(run())
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "aborted" and "shutting down" in error["message"]
    assert not any('"finish_reason":"abort"' in e for e in events)
    assert _assert_openai_error(whole, 503)["code"] == "aborted"
