"""Prometheus metrics of the server, named after vLLM's where vLLM has one (prefix ``forerun:``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_PER_TOKEN = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class Metrics:
    """One registry per server (tests start several in one process)."""

    def __init__(self, engine):
        r = self.registry = CollectorRegistry()
        self.drafts = Counter("forerun:spec_decode_num_drafts", "Sequence-steps that verified at least one draft token", registry=r)
        self.draft_tokens = Counter("forerun:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted = Counter("forerun:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.per_pos = Counter("forerun:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft",
                               ["position"], registry=r)
        self.mean_len = Gauge("forerun:spec_decode_mean_accepted_length",
                              "Tokens produced per sequence per target pass (accepted drafts + 1), since start", registry=r)
        self.draft_len = Gauge("forerun:spec_decode_draft_tokens_per_sequence",
                               "Draft tokens per sequence in the last step (the load-aware draft length)", registry=r)
        self.steps = Counter("forerun:engine_steps", "Batched target passes", registry=r)
        self.batch = Histogram("forerun:batch_size", "Sequences per target pass", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        running = Gauge("forerun:num_requests_running", "Requests being decoded", registry=r)
        running.set_function(lambda: engine.n_running)
        waiting = Gauge("forerun:num_requests_waiting", "Requests waiting for a slot", registry=r)
        waiting.set_function(lambda: engine.n_waiting)
        self.ttft = Histogram("forerun:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY, registry=r)
        self.tpot = Histogram("forerun:time_per_output_token_seconds", "Mean time per output token after the first, per request",
                              buckets=_PER_TOKEN, registry=r)
        self.e2e = Histogram("forerun:e2e_request_latency_seconds", "Request latency", buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("forerun:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("forerun:generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("forerun:request_success", "Finished requests by finish reason", ["finished_reason"], registry=r)
        self.rejected = Counter("forerun:request_rejected", "Requests answered with an error, by HTTP status", ["status"], registry=r)
        cache = engine.prefix_cache
        if cache is not None:
            hits = Gauge("forerun:prefix_cache_hit_tokens", "Prompt positions taken from the prefix cache, since start",
                         registry=r)
            hits.set_function(lambda: cache.hit_positions)
            used = Gauge("forerun:prefix_cache_bytes", "Bytes held by the prefix cache", registry=r)
            used.set_function(lambda: cache.bytes)
        draft_cache = getattr(engine.drafter, "prefix_cache", None)
        if draft_cache is not None:
            dhits = Gauge("forerun:draft_prefix_cache_hit_tokens",
                          "Prompt positions the draft model took from its prefix cache, since start", registry=r)
            dhits.set_function(lambda: draft_cache.hit_positions)
            dused = Gauge("forerun:draft_prefix_cache_bytes", "Bytes held by the draft model's prefix cache", registry=r)
            dused.set_function(lambda: draft_cache.bytes)
        self._passes = 0
        self._produced = 0

    def on_step(self, rows: int, seconds: float, report) -> None:
        """Engine callback after every batched pass: report = [(request, drafted, accepted)]."""
        self.steps.inc()
        self.batch.observe(len(report))
        drafted = 0
        for _, k, n in report:
            drafted += k
            self._passes += 1
            self._produced += n + 1
            if k:
                self.drafts.inc()
                self.draft_tokens.inc(k)
                self.accepted.inc(n)
                for i in range(n):
                    self.per_pos.labels(position=str(i)).inc()
        self.draft_len.set(drafted / len(report) if report else 0.0)
        if self._passes:
            self.mean_len.set(self._produced / self._passes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
