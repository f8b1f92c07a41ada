"""`/metrics`: the landlord's gauges in Prometheus' text format, named as vLLM names them.

Each name is vLLM's with ``vllm:`` replaced by ``minikv:``, so a dashboard built for vLLM reads
these with one rename. Only the engine thread writes them (after each step, abort and finish);
`prometheus_client` makes the reads from the HTTP side safe.

* gauges: requests running / waiting (the engine's queues after the last step), KV blocks used
  (held by a sequence), cached (free but still holding a reusable prefix), free, and
  ``kv_cache_usage_perc`` (used / pool, a fraction in [0, 1] as in vLLM);
* counters: preemptions, prefix-cache queries and hits (in tokens), prompt and generated tokens;
* histograms: time to first token, inter-token latency, end-to-end latency (seconds).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from minikv.metrics import EngineStats

disable_created_metrics()   # no `_created` timestamp series: vLLM's text shows none either

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(f"minikv:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"minikv:{name}", doc, labels, registry=r).labels(model_name)

        def hist(name, doc):
            return Histogram(f"minikv:{name}", doc, labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Sequences running in the engine's batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be admitted (preempted ones included).")
        self.usage = gauge("kv_cache_usage_perc", "KV cache usage: blocks held by sequences / pool (1 = full).")
        self.blocks_used = gauge("kv_blocks_used", "KV blocks held by some sequence.")
        self.blocks_cached = gauge("kv_blocks_cached", "Free KV blocks still holding a cached prefix (evictable).")
        self.blocks_free = gauge("kv_blocks_free", "KV blocks an allocation could take now (cached ones included).")
        self.preemptions = counter("num_preemptions", "Sequences preempted (recompute or swap).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served by the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests admitted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.ttft = hist("time_to_first_token_seconds", "Time to first token (arrival to first token).")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish of a request.")
        self._queried = self._hit = self._preempted = 0

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def after_step(self, now: EngineStats, live: bool, stepped: bool = True) -> None:
        """Gauges from a snapshot of the engine (``engine.stats()``), counters by how much its totals grew.

        `stepped`: the engine ran a step since the last call (else the queue gauges keep their values
        while it is live: an abort or a finish between steps changes only the pool)."""
        self.preemptions.inc(now.preemptions - self._preempted)
        if stepped or not live:
            self.running.set(now.running if live else 0)
            self.waiting.set(now.waiting + now.swapped if live else 0)
        self.blocks_used.set(now.blocks_used)
        self.blocks_cached.set(now.blocks_cached)
        self.blocks_free.set(now.blocks_free)
        self.usage.set(now.blocks_used / now.num_blocks)
        self.prefix_queries.inc(now.prefix_tokens_queried - self._queried)
        self.prefix_hits.inc(now.prefix_tokens_hit - self._hit)
        self._queried, self._hit, self._preempted = now.prefix_tokens_queried, now.prefix_tokens_hit, now.preemptions

    def after_tokens(self, m, new_tokens: int, seen: int) -> int:
        """Observe TTFT at a request's first token and each new gap of sample 0; return the gaps seen."""
        self.generation_tokens.inc(new_tokens)
        times = m.token_times
        if seen == 0 and times and m.ttft is not None:
            self.ttft.observe(m.ttft)
            seen = 1
        for i in range(max(seen, 1), len(times)):
            self.itl.observe(times[i] - times[i - 1])
        return max(seen, len(times))

    def after_finish(self, m, now: float) -> None:
        self.e2e.observe(now - m.arrival_time)
