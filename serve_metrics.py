"""What serve.py's /metrics reports (Prometheus): the engine's gauges and counters, read when
scraped, and the latency histograms the server fills as tokens go out."""
from engine import Engine

BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)  # seconds


def metrics_registry(engine: Engine) -> tuple:
    """(registry, time-to-first-token histogram, inter-token latency histogram)."""
    from prometheus_client import CollectorRegistry, Histogram

    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    ttft = Histogram("minillm_time_to_first_token_seconds", "Time from arrival to the first token",
                     buckets=BUCKETS, registry=registry)
    itl = Histogram("minillm_inter_token_latency_seconds", "Time between a request's consecutive tokens",
                    buckets=BUCKETS, registry=registry)
    return registry, ttft, itl


class EngineCollector:
    """Prometheus figures read from the engine when /metrics is scraped."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        running, waiting = self.engine.counts()
        yield GaugeMetricFamily("minillm_requests_running", "Requests running", value=running)
        yield GaugeMetricFamily("minillm_requests_waiting", "Requests waiting to run", value=waiting)
        blocks = self.engine.blocks
        yield GaugeMetricFamily("minillm_kv_cache_usage", "Fraction of the KV cache's blocks held by requests",
                                value=blocks.used_count() / blocks.num_blocks)
        yield GaugeMetricFamily("minillm_kv_cache_blocks_total", "Blocks in the KV cache", value=blocks.num_blocks)
        yield GaugeMetricFamily("minillm_step_compiling", "Whether the eager step serves while the compiled one compiles",
                                value=int(self.engine.compiled and not self.engine.step_compiled))
        c = self.engine.counters
        for name, key, text in [
            ("minillm_generation_tokens", "generated_tokens", "Tokens generated"),
            ("minillm_prompt_tokens", "prompt_tokens", "Prompt tokens of admitted requests"),
            ("minillm_prefill_tokens", "prefilled_tokens", "Prompt tokens prefilled (not found in the prefix cache)"),
            ("minillm_prompt_tokens_cached", "cached_tokens", "Prompt tokens found in the prefix cache"),
            ("minillm_prefix_cache_queries", "prefix_queries", "Tokens looked up in the prefix cache"),
            ("minillm_prefix_cache_hits", "prefix_hits", "Tokens found in the prefix cache"),
            ("minillm_preemptions", "preemptions", "Requests preempted for want of KV cache blocks"),
            ("minillm_requests_finished", "requests_finished", "Requests finished, for any reason"),
        ]:
            yield CounterMetricFamily(name, text, value=c[key])
        spec = self.engine.speculation
        if spec is not None:  # serve.py --speculative
            yield CounterMetricFamily("minillm_speculative_verifies", "Verify rows run", value=spec.verifies)
            yield CounterMetricFamily("minillm_speculative_proposed_tokens", "Tokens proposed", value=spec.proposed)
            yield CounterMetricFamily("minillm_speculative_accepted_tokens", "Proposed tokens accepted",
                                      value=spec.accepted)
