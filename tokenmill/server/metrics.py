"""Prometheus metrics with vLLM's names (prefix `tokenmill:`), so existing dashboards work.

One registry per server instance; the engine thread feeds it a StepStats after every step.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        p = "tokenmill:"
        self.running = Gauge(p + "num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)", labels, registry=r)
        self.preemptions = Counter(p + "num_preemptions", "Preemptions (requests evicted to be recomputed)", labels, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", labels, registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt tokens found in the prefix cache", labels,
                                   registry=r)
        self.success = Counter(p + "request_success", "Finished requests by finish reason",
                               labels + ["finished_reason"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between consecutive tokens", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to finish", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(p + "request_queue_time_seconds", "Arrival to first scheduled", labels,
                               buckets=_LATENCY_BUCKETS, registry=r)
        # speculative decoding, as vLLM counts it: verifications, drafts, accepted drafts (also by
        # position in the draft), and tokens emitted by verifications (accepted + one each)
        self.spec_drafts = Counter(p + "spec_decode_num_drafts", "Verifications of a request's draft", labels,
                                   registry=r)
        self.spec_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified", labels,
                                         registry=r)
        self.spec_accepted = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted", labels,
                                     registry=r)
        self.spec_emitted = Counter(p + "spec_decode_num_emitted_tokens", "Tokens emitted by verifications",
                                    labels, registry=r)
        self.spec_accepted_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by position in the draft", labels + ["position"],
                                         registry=r)
        self.kv_capacity = Gauge(p + "kv_cache_capacity_tokens", "Tokens the KV cache holds", labels, registry=r)
        # vLLM's cache_config_info: the cache's settings as labels, value 1
        self.cache_info = Gauge(p + "cache_config_info", "KV cache configuration", labels + ["block_size", "num_gpu_blocks",
                                                                                        "cache_dtype"], registry=r)
        # vLLM's lora_requests_info: the adapters of the running and waiting requests as labels (names
        # comma-separated), the slots as max_lora; value: when it was set. One series, the current one.
        self.lora_info = Gauge(p + "lora_requests_info", "Running and waiting LoRA adapters",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self.max_lora: int | None = None
        self.labels = {"model_name": model_name}
        for reason in ("stop", "length", "abort"):
            self.success.labels(**self.labels, finished_reason=reason)

    def set_cache_config(self, capacity_tokens: int, block_size: int, num_blocks: int, cache_dtype: str) -> None:
        """Once at start-up: what the KV cache holds (0 tokens for an encoder, which keeps none)."""
        self.kv_capacity.labels(**self.labels).set(capacity_tokens)
        self.cache_info.labels(**self.labels, block_size=str(block_size), num_gpu_blocks=str(num_blocks),
                               cache_dtype=cache_dtype).set(1)

    def set_max_loras(self, max_loras: int) -> None:
        """Once at start-up when the engine serves LoRA adapters."""
        self.max_lora = max_loras
        self.lora_info.labels(max_lora=str(max_loras), waiting_lora_adapters="", running_lora_adapters="").set_to_current_time()

    def record(self, st) -> None:
        """Called from the engine thread after each step with its StepStats."""
        lb = self.labels
        if self.max_lora is not None:
            self.lora_info.clear()
            self.lora_info.labels(max_lora=str(self.max_lora), waiting_lora_adapters=",".join(st.waiting_loras),
                                  running_lora_adapters=",".join(st.running_loras)).set_to_current_time()
        self.running.labels(**lb).set(st.num_running)
        self.waiting.labels(**lb).set(st.num_waiting)
        self.kv_usage.labels(**lb).set(st.kv_cache_usage)
        if st.num_preemptions:
            self.preemptions.labels(**lb).inc(st.num_preemptions)
        if st.num_prompt_tokens:
            self.prompt_tokens.labels(**lb).inc(st.num_prompt_tokens)
        if st.prefix_cache_queries:
            self.prefix_queries.labels(**lb).inc(st.prefix_cache_queries)
            self.prefix_hits.labels(**lb).inc(st.prefix_cache_hits)
        if st.num_generation_tokens:
            self.generation_tokens.labels(**lb).inc(st.num_generation_tokens)
        if st.num_drafts:
            self.spec_drafts.labels(**lb).inc(st.num_drafts)
            self.spec_draft_tokens.labels(**lb).inc(st.num_draft_tokens)
            self.spec_accepted.labels(**lb).inc(st.num_accepted_tokens)
            self.spec_emitted.labels(**lb).inc(st.num_accepted_tokens + st.num_drafts)
            for pos, n in enumerate(st.accepted_per_pos):
                self.spec_accepted_pos.labels(**lb, position=str(pos)).inc(n)
        for v in st.ttft:
            self.ttft.labels(**lb).observe(v)
        for v in st.itl:
            self.itl.labels(**lb).observe(v)
        for req in st.finished:
            m = req.metrics
            self.success.labels(**lb, finished_reason=req.finish_reason or "stop").inc()
            if m.finished_time is not None:
                self.e2e.labels(**lb).observe(m.finished_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.queue.labels(**lb).observe(m.first_scheduled_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
