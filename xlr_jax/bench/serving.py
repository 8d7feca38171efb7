"""OpenAI-compatible servers as subprocesses on loopback, clients that time them, and the
agent workload: what experiments/serve_bench.py and serve_load.py measure with."""
from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

try:
    import httpx
except ImportError:  # the openai client's own HTTP library, where it is httpx2
    import httpx2 as httpx

from xlr_jax.loading.registry import resolve_model
from xlr_jax.server.replicas import free_port


class ServerError(RuntimeError):
    """A server subprocess exited or did not come up."""


class ServerProcess:
    """A server subprocess on a free loopback port, ready once `ready_path` answers 200."""

    def __init__(self, name: str, argv: list[str], log: Path, ready_path: str,
                 timeout_s: float = 600):
        self.port = free_port()
        self.name, self.log = name, log
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([a.replace("{port}", str(self.port)) for a in argv],
                                     stdout=subprocess.DEVNULL, stderr=log.open("w"))
        self.http = httpx.Client(base_url=self.base_url, timeout=600)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{name} exited:\n{log.read_text()[-3000:]}")
            try:
                if self.http.get(ready_path, timeout=2).status_code == 200:
                    self.model = self.get("/v1/models")["data"][0]["id"]
                    return
            except httpx.TransportError:
                time.sleep(0.5)
        self.stop()
        raise ServerError(f"{name} did not come up within {timeout_s:.0f} s")

    def get(self, path: str) -> dict:
        return self.http.get(path).json()

    def stop(self) -> None:
        self.http.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def xlr_server(cache_dir: Path, log: Path, *flags: str) -> ServerProcess:
    """`xlr serve` on the embedded model, `cache_dir` its cache (compiled steps, tiers)."""
    return ServerProcess("xlr serve", [sys.executable, "-m", "xlr_jax.cli", "serve", "--port",
                                       "{port}", "--cache-dir", str(cache_dir), *flags],
                         log, "/health")


def llama_cpp_available() -> bool:
    return (importlib.util.find_spec("llama_cpp") is not None
            and importlib.util.find_spec("llama_cpp.server") is not None)


def llama_cpp_server(log: Path, *flags: str, threads: int = 2,
                     n_ctx: int = 8192) -> ServerProcess:
    """llama-cpp-python's OpenAI server on the embedded model's GGUF (the file xlr-jax
    loads), as `python -m llama_cpp.server --n_threads 2 --n_ctx 8192`, with
    `--interrupt_requests False` (by default a new request cuts off the one streaming, so
    concurrent clients get empty answers) and `flags`."""
    return ServerProcess("llama.cpp server", [
        sys.executable, "-m", "llama_cpp.server", "--model", str(resolve_model("smollm2")),
        "--host", "127.0.0.1", "--port", "{port}", "--n_threads", str(threads),
        "--n_ctx", str(n_ctx), "--interrupt_requests", "False", *flags], log, "/v1/models")


def stream_chat(http, model: str, messages: list[dict], max_tokens: int,
                usage: bool = True) -> dict:
    """One greedy streaming chat completion, timed on the client: TTFT (sent to the first
    content chunk), every gap between content chunks, the reply's text, and the token
    counts of the usage chunk (`usage`: ask for one; without it, content chunks count as
    tokens and the prompt's are unknown) and the response's id (its chunks' one)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    sent = time.perf_counter()
    arrivals, text, counts, ids = [], [], {}, set()
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise ServerError(f"HTTP {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            ids.add(event.get("id"))
            if event.get("usage"):
                counts = event["usage"]
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
                text.append(event["choices"][0]["delta"]["content"])
    done = time.perf_counter()
    return {"ttft_s": arrivals[0] - sent if arrivals else done - sent,
            "latency_s": done - sent, "gaps_s": [float(g) for g in np.diff(arrivals)],
            "text": "".join(text), "id": ids.pop() if len(ids) == 1 else None,
            "completion_tokens": counts.get("completion_tokens", len(arrivals)),
            "prompt_tokens": counts.get("prompt_tokens"),
            "cached_tokens": (counts.get("prompt_tokens_details") or {}).get("cached_tokens")}


def on_threads(work, items) -> None:
    """`work(item)` for every item, each on its own thread, all started together; after
    every thread has ended, a RuntimeError naming each item that failed and why."""
    errors = []

    def guarded(item):
        try:
            work(item)
        except Exception as e:  # noqa: BLE001 - reported after the join
            errors.append(f"{item}: {e}")

    threads = [threading.Thread(target=guarded, args=(item,)) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))


def percentiles(values, name: str) -> dict:
    """{name_p50_s, name_p99_s} of `values` (None when there are none)."""
    values = [v for v in values if v is not None]
    return {f"{name}_p{q}_s": float(np.percentile(values, q)) if values else None
            for q in (50, 99)}


# ---------------------------------------------------------------- the workloads

QUESTIONS = [f"{ask} {topic}." for ask in ("Explain briefly", "Give one fact about",
                                           "Write a short line on", "Name a use of")
             for topic in ("the Moon", "rivers", "bread", "prime numbers", "glass", "owls")]
TOOLS = ["search_web", "read_file", "write_file", "run_shell", "http_get", "send_email",
         "create_issue", "list_directory"]
TURNS = ["Find the three most cited papers on speculative decoding.",
         "Summarize the second one in two sentences.",
         "Which datasets did it evaluate on?",
         "Write a shell command that downloads its PDF.",
         "Now read the file and list its section titles.",
         "Which section describes the acceptance rule?",
         "Draft an email to the lab about it.",
         "Create an issue to reproduce its main table."]


def agent_system_prompt(variant: str, rules: int = 12, tools: int = len(TOOLS)) -> str:
    """An agent's stable tier: rules and the first `tools` tool schemas, ~1.9k tokens for 12
    rules and all 8 tools; `variant` changes words, hardly the token count."""
    schemas = [{"type": "function", "function": {
        "name": f"{variant}_{name}",
        "description": f"Tool {name.replace('_', ' ')}: use it when the user asks to "
                       f"{name.replace('_', ' ')}. It returns JSON with fields status, result "
                       "and error; never call it twice with the same arguments.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "what to look for, in plain words"},
            "limit": {"type": "integer", "description": "results to return at most (1-50)"},
            "path": {"type": "string", "description": "a path relative to the workspace"}},
            "required": ["query"]}}} for name in TOOLS[:tools]]
    rules_text = "\n".join(f"{i}. Rule {i} for {variant}: think step by step, prefer tools "
                           "over guessing, cite sources, keep answers under five sentences, "
                           "and say when you are unsure." for i in range(1, rules + 1))
    return (f"You are {variant}, a local research agent. Follow the rules below.\n"
            f"{rules_text}\nTools available (JSON schemas):\n" + json.dumps(schemas, indent=1))


def agent_message(agent: int, turn: int) -> str:
    """Turn `turn`'s user message of agent `agent`: the last tool's output (~90 tokens, its
    own to each agent and turn), then the next request."""
    rng = np.random.default_rng(1000 * agent + turn)
    results = [{"id": int(rng.integers(10_000, 99_999)), "title": f"Result {k} of agent "
                f"{agent}, step {turn}", "score": round(float(rng.random()), 3)}
               for k in range(3)]
    return (f"Tool output ({TOOLS[turn % len(TOOLS)]}): "
            + json.dumps({"status": "ok", "results": results}) + f"\n{TURNS[turn % len(TURNS)]}")


def run_agent(http, model: str, system: str, agent: int, turns: int, max_tokens: int,
              usage: bool = True) -> dict:
    """One agent's conversation, turn after turn, each reply appended to its history; its
    turns' timings and its end-to-end time."""
    messages = [{"role": "system", "content": system}]
    records, start = [], time.perf_counter()
    for turn in range(turns):
        messages.append({"role": "user", "content": agent_message(agent, turn)})
        r = stream_chat(http, model, messages, max_tokens, usage)
        messages.append({"role": "assistant", "content": r["text"]})
        records.append(r)
    return {"agent": agent, "end_to_end_s": time.perf_counter() - start, "turns": records}
