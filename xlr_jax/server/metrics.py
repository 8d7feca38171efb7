"""Prometheus metrics, named in vLLM's style with an `xlr_` prefix and a `model_name`
label, in one registry per app (two apps in a process never share counters).

Per-request figures (latencies, tokens, finish reasons) are recorded by the
handlers as requests end; the engine's own counters and gauges (KV pages, queue
lengths, prefix-cache tiers, speculation, preemptions) are read from
`Model.stats()` when /metrics is scraped, so the device loop never does metrics
work.
"""
from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                    80.0, 160.0, 320.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    """The app's registry, its per-request instruments, and the engine collector."""

    def __init__(self, model, model_name: str):
        disable_created_metrics()  # no `_created` series: scrapes stay short
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels, r = ["model_name"], self.registry

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        self.ttft = histogram("xlr_time_to_first_token_seconds",
                              "Time from a request's submission to its first token.",
                              _LATENCY_BUCKETS)
        self.itl = histogram("xlr_inter_token_latency_seconds",
                             "Time between a streamed request's text pieces (one sample per "
                             "gap); a whole request adds its mean gap once.", _ITL_BUCKETS)
        self.e2e = histogram("xlr_e2e_request_latency_seconds",
                             "Time from a request's arrival at the server to its end.",
                             _LATENCY_BUCKETS)
        self.queue = histogram("xlr_request_queue_time_seconds",
                               "Time a request waited before the model took it (recorded "
                               "when the engine reports it).", _LATENCY_BUCKETS)
        self.tokenize = histogram("xlr_request_tokenize_seconds",
                                  "Chat templating and tokenization time (worker threads).",
                                  _LATENCY_BUCKETS)
        self.prompt_tokens = counter("xlr_prompt_tokens", "Prompt tokens of finished requests.")
        self.cached_tokens = counter("xlr_prompt_cached_tokens",
                                     "Prompt tokens served from the prefix cache.")
        self.generation_tokens = counter("xlr_generation_tokens", "Generated tokens.")
        self.reasoning_tokens = counter(
            "xlr_reasoning_tokens", "Generated tokens of a thought (its end marker "
            "included), counted as chat answers end.")
        self.constraint_masks = counter(
            "xlr_constraint_masks", "Token masks computed for constrained output "
            "(tool_choice, response_format): one a generated token.")
        self.constraint_mask_seconds = counter(
            "xlr_constraint_mask_seconds", "Time spent computing those masks (on the "
            "engine's loop thread: while a decode step runs, else before it is dispatched).")
        self._finished = Counter("xlr_request_success", "Finished requests by finish reason.",
                                 ["model_name", "finished_reason"], registry=r)
        self._errors = Counter("xlr_request_errors", "Requests refused or failed, by status.",
                               ["model_name", "status"], registry=r)
        self.loop_stall = Gauge("xlr_event_loop_max_stall_seconds",
                                "The event loop's largest stall since the server started.",
                                labels, registry=r).labels(model_name)
        r.register(_EngineCollector(model, model_name))

    def finished(self, result, reason: str, e2e_s: float, streamed: bool) -> None:
        """A request's end; a streamed one's gaps were observed as its pieces came."""
        m = result.metrics
        if m.get("ttft_s") is not None:
            self.ttft.observe(m["ttft_s"])
        if not streamed and m.get("completion_tokens", 0) > 1:
            self.itl.observe(m["itl_s"])
        if m.get("queue_s") is not None:
            self.queue.observe(m["queue_s"])
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(m.get("prompt_tokens", 0))
        self.cached_tokens.inc(m.get("cached_tokens", 0))
        self.generation_tokens.inc(m.get("completion_tokens", 0))
        self._finished.labels(self.model_name, reason).inc()

    def error(self, status: int) -> None:
        self._errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        """The exposition text (reads `Model.stats()`: call it off the event loop)."""
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's counters and gauges, read from one `Model.stats()` snapshot per scrape."""

    def __init__(self, model, model_name: str):
        self._model, self._name = model, model_name

    def describe(self):
        return []  # read at scrape time only (nothing to ask the engine on register)

    def collect(self):
        try:
            s = self._model.stats()
        except Exception:  # noqa: BLE001 - the model was shut down: nothing to report
            return
        name = [self._name]

        def gauge(metric, doc, value):
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric(name, float(value))
            return g

        def counter(metric, doc, value):
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric(name, float(value))
            return c

        yield gauge("xlr_num_requests_running", "Requests in the running batch.", s["running"])
        yield gauge("xlr_num_requests_waiting", "Requests waiting for a batch slot.",
                    s["waiting"])
        yield gauge("xlr_kv_pages_total", "Usable KV pages.", s["pages_total"])
        yield gauge("xlr_kv_pages_free", "KV pages free.", s["pages_free"])
        yield gauge("xlr_kv_pages_cached",
                    "KV pages held only by the prefix cache (reusable, evictable).",
                    s["pages_cached"])
        yield gauge("xlr_kv_pages_pinned", "KV pages pinned by stable prompt tiers.",
                    s["pages_pinned"])
        yield gauge("xlr_kv_pages_held", "KV pages held by running requests.", s["pages_held"])
        total = s["pages_total"] or 1
        yield gauge("xlr_kv_cache_usage_perc", "Fraction of KV pages not free (0-1).",
                    (s["pages_total"] - s["pages_free"]) / total)
        yield counter("xlr_num_preemptions", "Requests preempted (recomputed later).",
                      s["preemptions"])
        spec = s.get("speculative") or {}
        yield counter("xlr_spec_decode_num_draft_tokens", "Draft tokens proposed.",
                      spec.get("draft_tokens", 0))
        yield counter("xlr_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      spec.get("accepted_tokens", 0))
        yield counter("xlr_spec_decode_num_target_passes", "Speculative target passes.",
                      spec.get("target_passes", 0))
        cache = s.get("prefix_cache")
        if cache:
            queries = CounterMetricFamily(
                "xlr_prefix_cache_queries", "Prompt tokens looked up in the prefix cache, "
                "by prompt tier.", labels=["model_name", "tier"])
            hits = CounterMetricFamily(
                "xlr_prefix_cache_hits", "Prompt tokens found in the prefix cache, by tier.",
                labels=["model_name", "tier"])
            for tier in ("stable", "context", "volatile"):
                queries.add_metric([self._name, tier], float(cache.get(f"{tier}_tokens", 0)))
                hits.add_metric([self._name, tier],
                                float(cache.get(f"{tier}_cached_tokens", 0)))
            yield queries
            yield hits
