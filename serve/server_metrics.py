"""The server's Prometheus metrics (``/metrics``), in a registry of its own, updated by the engine loop and the app.

Counters: HTTP responses by endpoint and status, prompt and generated tokens, finished sequences by reason,
preemptions, jump-forward tokens, speculative decoding's drafts (verifies, draft tokens checked, accepted),
constrained (grammar) requests and grammar failures. Gauges: requests waiting and running, sequences in the batch,
KV cache tokens in use and the capacity. Histograms: time to first token and inter-token latency.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    10.0, 30.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
#: Paths counted under their own name; any other path is counted as "other".
ENDPOINTS = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/health", "/metrics", "/tokenize",
             "/detokenize")


class ServerMetrics:
    """Every metric of one server; ``text()`` is the Prometheus exposition."""

    def __init__(self, engine: bool = True) -> None:
        """``engine=False``: a front without an engine of its own (the Ray ingress), whose ``/metrics`` shows only
        the HTTP responses here (the engine metrics are the replicas', ``ray_metrics.py``)."""
        self.registry = CollectorRegistry()
        p = "logitproc_"
        self.responses = Counter(p + "http_responses", "HTTP responses by endpoint and status code",
                                 ["endpoint", "status"], registry=self.registry)
        registry = self.registry if engine else CollectorRegistry()
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=registry)
        self.finished = Counter(p + "sequences_finished", "Finished sequences by finish reason", ["reason"],
                                registry=registry)
        self.preemptions = Counter(p + "preemptions", "Requests preempted (KV cache freed, prefilled again later)",
                                   registry=registry)
        self.jump_forward_tokens = Counter(p + "jump_forward_tokens", "Tokens appended by jump-forward",
                                           registry=registry)
        # vLLM's names for the same counts (spec_decode_num_drafts, ..._num_draft_tokens, ..._num_accepted_tokens)
        self.spec_drafts = Counter(p + "spec_decode_num_drafts", "Verifies of a sequence's draft tokens",
                                   registry=registry)
        self.spec_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens checked",
                                         registry=registry)
        self.spec_accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                            registry=registry)
        self.grammar_requests = Counter(p + "grammar_requests", "Requests with a response format or structured output",
                                        registry=registry)
        self.grammar_failures = Counter(p + "grammar_failures",
                                        "Constrained sequences ended by a dead end or a constraint error",
                                        registry=registry)
        self.waiting = Gauge(p + "requests_waiting", "Requests accepted, not started yet", registry=registry)
        self.running = Gauge(p + "requests_running", "Requests generating", registry=registry)
        self.batch = Gauge(p + "batch_sequences", "Sequences in the running batch", registry=registry)
        self.kv_tokens = Gauge(p + "kv_cache_tokens", "KV cache tokens held by running sequences", registry=registry)
        self.prefix_cache_tokens = Gauge(p + "prefix_cache_tokens", "KV cache tokens kept for prefix reuse",
                                         registry=registry)
        self.cached_prompt_tokens = Counter(p + "cached_prompt_tokens",
                                            "Prompt tokens forked from the prefix cache instead of prefilled",
                                            registry=registry)
        self.kv_capacity = Gauge(p + "kv_cache_capacity_tokens", "KV cache capacity in tokens", registry=registry)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "From arrival to the first generated token",
                              buckets=_TTFT_BUCKETS, registry=registry)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Between successive tokens of a sequence",
                             buckets=_LATENCY_BUCKETS, registry=registry)

    def response(self, path: str, status: int) -> None:
        self.responses.labels(path if path in ENDPOINTS else "other", str(status)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
