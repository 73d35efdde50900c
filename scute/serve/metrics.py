"""Prometheus metrics of the server, with vLLM's names under the ``scute:`` prefix (one registry per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.running = Gauge("scute:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge("scute:num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r)
        self.kv_usage = Gauge("scute:kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = all).",
                              labels, registry=r)
        self.prompt_tokens = Counter("scute:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=r)
        self.generation_tokens = Counter("scute:generation_tokens", "Generated tokens of finished requests.",
                                         labels, registry=r)
        self.requests = Counter("scute:request_success", "Finished requests by finish reason.",
                                [*labels, "finished_reason"], registry=r)
        self.ttft = Histogram("scute:time_to_first_token_seconds", "Time to the first generated token.", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("scute:time_per_output_token_seconds", "Time per generated token after the first.",
                              labels, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("scute:e2e_request_latency_seconds", "Time from arrival to the last token.", labels,
                             buckets=LATENCY_BUCKETS + (160.0, 320.0), registry=r)
        self.adapters_resident = Gauge("scute:adapters_resident", "Adapters held in device slots.", labels,
                                       registry=r)
        self.adapter_memory = Gauge("scute:adapter_memory_used_bytes", "Device bytes of the adapters in the slots "
                                    "(shared tensors once; the budget is adapter_memory_bytes).", labels, registry=r)
        self.adapter_loads = Counter("scute:adapter_loads", "Runtime adapter loads by result.",
                                     [*labels, "result"], registry=r)
        self.adapter_load_seconds = Histogram(
            "scute:adapter_load_seconds", "Time from a request asking for an adapter not in a device slot to the end "
            "of its placement (read and conversion if not in the CPU tier, copy to the device, placement).", labels,
            buckets=LATENCY_BUCKETS, registry=r)
        self.adapters_loading = Gauge("scute:adapters_loading", "Adapters asked for and not yet placed.", labels,
                                      registry=r)
        self.adapters_cpu = Gauge("scute:adapters_cpu", "Adapters the CPU tier holds (named, and cached by folder).",
                                  labels, registry=r)
        self.adapter_evictions = Counter("scute:adapter_evictions", "Adapters let go of by a tier (device slots, "
                                         "CPU).", [*labels, "tier"], registry=r)
        self._evictions_seen = {"device": 0, "cpu": 0}  # the engine's counts already added to the counter
        self.adapter_load_seconds.labels(model_name)  # the adapters' series from the start, at zero
        for tier in self._evictions_seen:
            self.adapter_evictions.labels(model_name, tier)
        self.model_name = model_name

    def observe_step(self, engine, outputs) -> None:
        """After each step, on the engine thread: the gauges, the tokens reported (the server's outputs are deltas
        or final: each token once) and the counters of the requests that finished (aborted ones included: the
        engine reports those once more)."""
        m = self.model_name
        for out in outputs:
            self.generation_tokens.labels(m).inc(sum(len(d.token_ids) for d in out.outputs))
            if out.finished:
                c = out.outputs[0] if out.outputs else None
                self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
                self.requests.labels(m, (c.finish_reason if c else None) or "error").inc()
        self.observe_engine(engine)

    def observe_engine(self, engine) -> None:
        scheduler, blocks = engine.scheduler, engine.block_manager
        self.running.labels(self.model_name).set(len(scheduler.running))
        self.waiting.labels(self.model_name).set(len(scheduler.waiting))
        self.kv_usage.labels(self.model_name).set(1.0 - blocks.num_free_blocks / max(blocks.num_blocks, 1))
        m, adapters = self.model_name, engine.adapters
        self.adapters_resident.labels(m).set(len(adapters.memory.held.members))
        self.adapter_memory.labels(m).set(adapters.memory.used())
        self.adapters_loading.labels(m).set(adapters.loads_in_progress)
        self.adapters_cpu.labels(m).set(adapters.cpu_adapters)
        for seconds in adapters.take_load_seconds():
            self.adapter_load_seconds.labels(m).observe(seconds)
        for tier, seen in self._evictions_seen.items():
            if (now := adapters.evictions[tier]) > seen:
                self.adapter_evictions.labels(m, tier).inc(now - seen)
                self._evictions_seen[tier] = now

    def observe_latency(self, output_tokens: int, arrival: float, first_token: float | None, end: float) -> None:
        """The latencies of a request its client saw to the end."""
        m = self.model_name
        self.e2e.labels(m).observe(end - arrival)
        if first_token is not None:
            self.ttft.labels(m).observe(first_token - arrival)
            if output_tokens > 1:
                self.tpot.labels(m).observe((end - first_token) / (output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
