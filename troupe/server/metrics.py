"""Prometheus metrics of one server, in a per-app `CollectorRegistry` (never the global one).

Names follow vLLM's (`vllm:` becomes `troupe:`), labelled with `model_name`:

- gauges, read from `llm.engine_stats` at scrape time, per `engine`:
  `troupe:num_requests_running`, `troupe:num_requests_waiting`, `troupe:kv_cache_usage_perc`;
  and the engines' cumulative `troupe:prefix_cache_queries_total`, `troupe:prefix_cache_hits_total`,
  `troupe:num_preemptions_total`;
- counters kept by the server: `troupe:prompt_tokens_total`, `troupe:generation_tokens_total`,
  `troupe:request_success_total{finished_reason=stop|length|abort|error}`;
- histograms: `troupe:time_to_first_token_seconds`, `troupe:inter_token_latency_seconds`,
  `troupe:e2e_request_latency_seconds`.

Each served request is followed by a `RequestRecord` (`ServerMetrics.track`), fed every output the
server receives and closed when the request ends by any path: a finished output, an error, or the
client going away (then it counts as `abort`, since closing the stream aborted the request). A
request that fails before its first output (rejected at submission) is not counted at all. Token
counts are what the server saw, so they match the `usage` it reported. Times are measured from
the server's arrival of the HTTP request (`time.monotonic`); the first and last token times come
from the final output's `RequestMetrics` when there is one. A request with n > 1 tokens adds
n - 1 observations of its mean decode interval to the inter-token histogram.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from troupe.messages import SchedulerStats
from troupe.outputs import RequestOutput
from troupe.sampling_params import RequestOutputKind

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineStatsCollector(Collector):
    """Engine gauges read at scrape time from the latest `SchedulerStats` of each engine."""

    def __init__(self, model_name: str, engine_stats: Callable[[], dict[int, SchedulerStats]]) -> None:
        self._model = model_name
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._engine_stats() or {0: SchedulerStats()}
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily("troupe:num_requests_running", "Requests in the engine's running batch",
                                    labels=labels)
        waiting = GaugeMetricFamily("troupe:num_requests_waiting", "Requests waiting to be scheduled",
                                    labels=labels)
        kv = GaugeMetricFamily("troupe:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent",
                               labels=labels)
        queries = CounterMetricFamily("troupe:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels=labels)
        hits = CounterMetricFamily("troupe:prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                   labels=labels)
        preemptions = CounterMetricFamily("troupe:num_preemptions", "Requests preempted by the scheduler",
                                          labels=labels)
        for engine, s in sorted(stats.items()):
            values = [self._model, str(engine)]
            running.add_metric(values, s.num_running)
            waiting.add_metric(values, s.num_waiting)
            kv.add_metric(values, s.kv_cache_usage)
            queries.add_metric(values, s.prefix_cache_queries)
            hits.add_metric(values, s.prefix_cache_hits)
            preemptions.add_metric(values, s.num_preemptions)
        yield from (running, waiting, kv, queries, hits, preemptions)


class ServerMetrics:
    def __init__(self, model_name: str, engine_stats: Callable[[], dict[int, SchedulerStats]]) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter("troupe:prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.generation_tokens = Counter("troupe:generation_tokens", "Generated tokens sent by the server", m,
                                         registry=r)
        self.request_success = Counter("troupe:request_success", "Finished requests by finish reason",
                                       [*m, "finished_reason"], registry=r)
        self.ttft = Histogram("troupe:time_to_first_token_seconds", "Time to the first token", m,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("troupe:inter_token_latency_seconds", "Time between output tokens", m,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("troupe:e2e_request_latency_seconds", "Request latency, arrival to end", m,
                             buckets=_E2E_BUCKETS, registry=r)
        self.registry.register(_EngineStatsCollector(model_name, engine_stats))
        self.model_name = model_name
        for reason in ("stop", "length", "abort", "error"):  # present at 0 from the start
            self.request_success.labels(model_name, reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    @contextmanager
    def track(self, kind: RequestOutputKind, arrival: float) -> Iterator[RequestRecord]:
        """Follow one request; its counts are recorded when the block exits, however it exits."""
        record = RequestRecord(kind, arrival)
        try:
            yield record
        except Exception:  # cancellation (the client went away) is an abort, not an error
            record.errored = True
            raise
        finally:
            record.close(self)


class RequestRecord:
    """What the server saw of one request (see the module docstring)."""

    def __init__(self, kind: RequestOutputKind, arrival: float) -> None:
        self.kind = kind
        self.arrival = arrival
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finish_reason: str | None = None
        self.errored = False
        self.seen_output = False
        self._first: float | None = None
        self._last: float | None = None
        self._tokens: dict[int, int] = {}  # sample index -> tokens so far

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        self.seen_output = True
        if out.prompt_token_ids is not None:
            self.prompt_tokens = len(out.prompt_token_ids)
        for completion in out.outputs:  # one per sample (n > 1: each carries its index)
            new = len(completion.token_ids)
            if self.kind is RequestOutputKind.DELTA:
                self._tokens[completion.index] = self._tokens.get(completion.index, 0) + new
            else:
                self._tokens[completion.index] = new
            if new:
                self._first = self._first if self._first is not None else now
                self._last = now
            if completion.finish_reason is not None:
                self.finish_reason = completion.finish_reason
        self.generation_tokens = sum(self._tokens.values())
        if out.metrics is not None and out.metrics.first_token_time is not None:
            self._first = out.metrics.first_token_time
            self._last = out.metrics.last_token_time

    def close(self, metrics: ServerMetrics) -> None:
        if self.errored and not self.seen_output:
            return  # rejected at submission (a 4xx, or a dead engine): not a served request
        name = metrics.model_name
        reason = self.finish_reason or ("error" if self.errored else "abort")
        metrics.request_success.labels(name, reason).inc()
        metrics.prompt_tokens.labels(name).inc(self.prompt_tokens)
        metrics.generation_tokens.labels(name).inc(self.generation_tokens)
        metrics.e2e.labels(name).observe(time.monotonic() - self.arrival)
        if self._first is not None:
            metrics.ttft.labels(name).observe(max(0.0, self._first - self.arrival))
            if self._last is not None and self.generation_tokens > 1:
                mean = (self._last - self._first) / (self.generation_tokens - 1)
                itl = metrics.itl.labels(name)
                for _ in range(self.generation_tokens - 1):
                    itl.observe(mean)
