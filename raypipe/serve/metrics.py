"""Prometheus metrics for `GET /metrics`.

Request-level metrics (counts, errors by code, latencies) are recorded by the ingress replica that
served the request, in its own registry — scrape every ingress replica (or sum them) when there are
several. Engine and encoder state (running/waiting sequences, cache hit rate, per-worker load) is
read from those deployments at scrape time, so it is the same whichever replica answers. The prefix
cache's query and hit token counts are counters (vLLM's `prefix_cache_queries` / `prefix_cache_hits`),
so a dashboard can show the recent hit rate as the ratio of their rates; the gauge
`raypipe_prefix_cache_hit_rate` is the lifetime ratio. Those engine numbers come from whichever
Decoder replica answered the scrape; with several replicas, the per-replica counters
`raypipe_decoder_requests_total`, `raypipe_decoder_prefix_cache_queries_total` and
`raypipe_decoder_prefix_cache_hits_total` (label `replica`: the Decoder replica's id, which each
request's first delta names) cover them all. They are request-level, so each ingress replica counts
the requests it sent, whatever router chose the replica.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServeMetrics:
    def __init__(self):
        disable_created_metrics()  # no `*_created` timestamp series: they only add noise here
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("raypipe_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.errors = Counter("raypipe_request_errors", "Failed requests by error code", ["code"], registry=r)
        self.ttft = Histogram("raypipe_time_to_first_token_seconds", "Request arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("raypipe_time_per_output_token_seconds", "Mean gap between output tokens, per request",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.latency = Histogram("raypipe_e2e_request_latency_seconds", "Request arrival to last token",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("raypipe_prompt_tokens", "Prompt tokens (image tokens included)", registry=r)
        self.generation_tokens = Counter("raypipe_generation_tokens", "Generated tokens", registry=r)
        self.resumed_choices = Counter("raypipe_resumed_choices", "Choices resumed on another Decoder replica after "
                                       "theirs died (each attempt)", registry=r)
        per_replica = ["replica"]
        self.decoder_requests = Counter("raypipe_decoder_requests", "Requests (choices) each Decoder replica ran",
                                        per_replica, registry=r)
        self.decoder_queries = Counter("raypipe_decoder_prefix_cache_queries",
                                       "Prompt tokens looked up in each Decoder replica's prefix cache", per_replica,
                                       registry=r)
        self.decoder_hits = Counter("raypipe_decoder_prefix_cache_hits",
                                    "Prompt tokens taken from each Decoder replica's prefix cache", per_replica,
                                    registry=r)
        self._live: dict = {}
        r.register(_LiveStats(self))

    def record_success(self, endpoint: str, arrival: float, first_token: float | None, finished: float,
                       prompt_tokens: int, completion_tokens: int) -> None:
        self.requests.labels(endpoint, "200").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.latency.observe(finished - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if completion_tokens > 1:
                self.tpot.observe((finished - first_token) / (completion_tokens - 1))

    def record_route(self, replica: str | None, prompt_tokens: int, cached_tokens: int) -> None:
        label = replica or "unknown"
        self.decoder_requests.labels(label).inc()
        self.decoder_queries.labels(label).inc(prompt_tokens)
        self.decoder_hits.labels(label).inc(cached_tokens)

    def record_error(self, endpoint: str, status: int, code: str) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.errors.labels(code).inc()

    def render(self, encoder_stats: dict | None, decoder_stats: dict | None) -> bytes:
        """Prometheus text, with the given deployment stats (None when that deployment did not answer)."""
        self._live = {"encoder": encoder_stats, "decoder": decoder_stats}
        return generate_latest(self.registry)


class _LiveStats:
    """Scrape-time gauges built from the stats the ingress just fetched."""

    def __init__(self, metrics: ServeMetrics):
        self.metrics = metrics

    def collect(self):
        live = self.metrics._live
        up = GaugeMetricFamily("raypipe_deployment_up", "1 if the deployment answered the scrape", labels=["deployment"])
        for name in ("encoder", "decoder"):
            up.add_metric([name], 0.0 if live.get(name) is None else 1.0)
        yield up
        if decoder := live.get("decoder"):
            for key, name, help_text in (
                    ("running", "num_requests_running", "Sequences being decoded"),
                    ("waiting", "num_requests_waiting", "Sequences waiting for a decode slot"),
                    ("max_running_seen", "decode_max_batch", "Most sequences decoded together in one round"),
                    ("mean_decode_batch", "decode_mean_batch", "Mean sequences per decode step"),
                    ("rounds", "decode_rounds", "Decode rounds run"),
                    ("requests_aborted", "decode_requests_aborted", "Requests aborted (e.g. client gone)"),
                    ("kv_cache_tokens", "kv_cache_tokens", "Tokens the paged KV cache holds"),
                    ("kv_blocks_total", "kv_blocks_total", "Blocks of the paged KV cache"),
                    ("kv_blocks_used", "kv_blocks_used", "KV blocks held by running sequences"),
                    ("kv_blocks_cached", "kv_blocks_cached", "KV blocks registered in the prefix cache (held or not)"),
                    ("prefix_cache_hit_rate", "prefix_cache_hit_rate",
                     "Prompt tokens taken from the prefix cache / prompt tokens to prefill"),
                    ("preemptions", "decode_preemptions", "Sequences preempted when the KV cache ran out"),
                    ("chunked_prefills", "decode_chunked_prefills", "Prompts prefilled over several rounds"),
                    ("state_snapshots_total", "state_snapshots_total",
                     "Slots of the state-snapshot pool (models with linear-attention layers)"),
                    ("state_snapshots_cached", "state_snapshots_cached",
                     "State snapshots registered in the prefix cache"),
                    ("state_snapshots_held", "state_snapshots_held", "State snapshots held by running sequences")):
                if key in decoder:
                    yield GaugeMetricFamily(f"raypipe_{name}", help_text, value=float(decoder[key]))
            for key, name, help_text in (
                    ("prefix_cache_query_tokens", "prefix_cache_queries",
                     "Prompt tokens looked up in the prefix cache"),
                    ("prefix_cache_hit_tokens", "prefix_cache_hits", "Prompt tokens taken from the prefix cache"),
                    ("snapshots_taken", "state_snapshots_taken", "State snapshots registered"),
                    ("snapshot_hits", "state_snapshot_hits", "Prefix hits restored from a state snapshot"),
                    ("snapshot_evictions", "state_snapshot_evictions", "State snapshots evicted"),
                    ("deferred_admissions", "decode_deferred_admissions",
                     "Admissions put off a round: a prefill under way was computing the same prefix")):
                if key in decoder:  # exposed as `<name>_total`
                    yield CounterMetricFamily(f"raypipe_{name}", help_text, value=float(decoder[key]))
        if encoder := live.get("encoder"):
            yield from _encoder_families(encoder)


def _encoder_families(encoder: dict):
    cache = encoder.get("cache", {})
    yield GaugeMetricFamily("raypipe_encoder_cache_hit_rate", "Embedding-cache hits / lookups",
                            value=float(cache.get("hit_rate", 0.0)))
    load = GaugeMetricFamily("raypipe_encoder_worker_load", "Total balancer cost sent to each encoder worker",
                             labels=["worker"])
    for index, value in enumerate(encoder.get("worker_total_load", [])):
        load.add_metric([str(index)], float(value))
    yield load
    yield GaugeMetricFamily("raypipe_encoder_load_imbalance", "Max worker load / mean worker load (1 = even)",
                            value=float(encoder.get("total_imbalance", 1.0)))
    yield GaugeMetricFamily("raypipe_encoder_workers_replaced", "Encoder workers restarted after dying",
                            value=float(encoder.get("workers_replaced", 0)))
    batching = encoder.get("batching", {})
    for key, help_text in (("batches", "Encoder micro-batches run"),
                           ("requests", "Requests whose images went through the encoder"),
                           ("images", "Images sent to the coordinator"),
                           ("max_requests_per_batch", "Most requests encoded together in one micro-batch")):
        if key in batching:
            yield GaugeMetricFamily(f"raypipe_encoder_batch_{key}", help_text, value=float(batching[key]))
