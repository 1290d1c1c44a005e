"""Prometheus metrics of one server, under vLLM's v1 names, in a per-app `CollectorRegistry`.

Every metric vLLM's `PrometheusStatLogger` exports that troupe can compute has its `vllm:` name,
type, help text, buckets and labels `model_name` (the first served name) and `engine` (the
engine's DP rank, "0" with one engine), so dashboards, autoscalers and gateways written for vLLM
read them unchanged. troupe's own extras are `troupe:` (the event-loop watchdog, `watchdog.py`).

- gauges, read from `llm.engine_stats` at scrape time: `vllm:num_requests_running`,
  `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`; and the engines' own cumulative counters
  `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`, `vllm:num_preemptions_total`;
- counters kept by the server: `vllm:prompt_tokens_total`, `vllm:generation_tokens_total` (raised
  as outputs arrive, so they move during a long generation), and
  `vllm:request_success_total{finished_reason=stop|length|abort|error}`;
- histograms of each finished request: `vllm:time_to_first_token_seconds`,
  `vllm:inter_token_latency_seconds` and its older name `vllm:time_per_output_token_seconds` (the
  same observations), `vllm:request_time_per_output_token_seconds` (one per request: its decode
  time over its tokens after the first), `vllm:e2e_request_latency_seconds`,
  `vllm:request_decode_time_seconds` (first to last token), `vllm:request_prompt_tokens`,
  `vllm:request_generation_tokens`, `vllm:request_max_num_generation_tokens`,
  `vllm:request_params_n` and `vllm:request_params_max_tokens`; the token-count histograms have
  vLLM's 1-2-5 buckets up to `max_model_len` (`ServerMetrics.configure`, when the engine is up).

Not exported: vLLM's `request_queue_time_seconds`, `request_prefill_time_seconds`,
`request_inference_time_seconds` and `time_per_prefill_token_request_seconds` split a request's
time at the step that first scheduled it, which troupe's engine does not report; its TTFT covers
queue and prefill together.

Each served request is followed by a `RequestRecord` (`ServerMetrics.track`), fed every output the
server receives and closed when the request ends by any path: a finished output, an error, or the
client going away (then it counts as `abort`, since closing the stream aborted the request). A
request that fails before its first output (rejected at submission) is not counted at all. One
record is one engine request: a prompt of a completions batch, with its n samples (vLLM counts
each of n samples as a request; troupe counts the prompt once, and its tokens are all n samples').
Token counts are what the server saw, so they match the `usage` it reported. Times are measured
from the server's arrival of the HTTP request (`time.monotonic`); the first and last token times
come from the final output's `RequestMetrics` when there is one. Each sample of k > 1 tokens adds
k - 1 observations of the request's mean interval (first to last token over the longest sample's
tokens after the first) to the inter-token histograms.
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
from troupe.sampling_params import RequestOutputKind, SamplingParams

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... while <= max_value."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class _EngineStatsCollector(Collector):
    """Engine gauges and counters read at scrape time from the latest `SchedulerStats` of each engine."""

    def __init__(self, model_name: str, engine_stats: Callable[[], dict[int, SchedulerStats]]) -> None:
        self._model = model_name
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._engine_stats() or {0: SchedulerStats()}
        labels = list(LABELS)
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                    labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                    labels=labels)
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                               labels=labels)
        queries = CounterMetricFamily("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.", labels=labels)
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                   labels=labels)
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
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
    """The registry and the server-kept metrics (see the module docstring)."""

    def __init__(self, model_name: str, engine_stats: Callable[[], dict[int, SchedulerStats]],
                 max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, list(LABELS)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", m,
                                         registry=r)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       [*m, "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              m, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             m, buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds. DEPRECATED: use "
                              "vllm:inter_token_latency_seconds.", m, buckets=ITL_BUCKETS, registry=r)
        self.request_tpot = Histogram("vllm:request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.", m,
                                      buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             m, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", m,
                                     buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.params_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", m,
                                  buckets=N_BUCKETS, registry=r)
        self.request_prompt_tokens: Histogram | None = None  # 1-2-5 buckets up to max_model_len: configure()
        self.request_generation_tokens: Histogram | None = None
        self.request_max_generation_tokens: Histogram | None = None
        self.params_max_tokens: Histogram | None = None
        self.registry.register(_EngineStatsCollector(model_name, engine_stats))
        self.ensure_engine(0)
        if max_model_len is not None:
            self.configure(max_model_len)

    def configure(self, max_model_len: int, num_engines: int = 1) -> None:
        """Create the token-count histograms (buckets up to `max_model_len`) and every engine's series."""
        if self.request_prompt_tokens is None:
            r, m, b = self.registry, list(LABELS), buckets_1_2_5(max_model_len)
            self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                                   m, buckets=b, registry=r)
            self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                       "Number of generation tokens processed.", m, buckets=b,
                                                       registry=r)
            self.request_max_generation_tokens = Histogram(
                "vllm:request_max_num_generation_tokens",
                "Histogram of maximum number of requested generation tokens.", m, buckets=b, registry=r)
            self.params_max_tokens = Histogram("vllm:request_params_max_tokens",
                                               "Histogram of the max_tokens request parameter.", m, buckets=b,
                                               registry=r)
        for engine in range(max(1, num_engines)):
            self.ensure_engine(engine)

    def _per_engine(self) -> list[Counter | Histogram]:
        return [m for m in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.tpot,
                            self.request_tpot, self.e2e, self.decode_time, self.params_n, self.request_prompt_tokens,
                            self.request_generation_tokens, self.request_max_generation_tokens,
                            self.params_max_tokens) if m is not None]

    def ensure_engine(self, engine: int) -> None:
        """Every series of `engine` present (at 0) from now on, as vLLM has them from the start."""
        values = (self.model_name, str(engine))
        for metric in self._per_engine():
            metric.labels(*values)
        for reason in FINISH_REASONS:
            self.request_success.labels(*values, reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    @contextmanager
    def track(self, kind: RequestOutputKind, arrival: float,
              params: SamplingParams | None = None) -> Iterator[RequestRecord]:
        """Follow one request; its counts are recorded when the block exits, however it exits."""
        record = RequestRecord(self, kind, arrival, params)
        try:
            yield record
        except Exception:  # cancellation (the client went away) is an abort, not an error
            record.errored = True
            raise
        finally:
            record.close()


class RequestRecord:
    """What the server saw of one request (see the module docstring)."""

    def __init__(self, metrics: ServerMetrics, kind: RequestOutputKind, arrival: float,
                 params: SamplingParams | None = None) -> None:
        self.metrics = metrics
        self.kind = kind
        self.arrival = arrival
        self.params = params
        self.engine = "0"
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finish_reason: str | None = None
        self.errored = False
        self.seen_output = False
        self._first: float | None = None
        self._last: float | None = None
        self._tokens: dict[int, int] = {}  # sample index -> tokens so far

    def _labels(self) -> tuple[str, str]:
        return self.metrics.model_name, self.engine

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        self.seen_output = True
        if out.metrics is not None and out.metrics.engine_index is not None:
            self.engine = str(out.metrics.engine_index)
        if out.prompt_token_ids is not None and not self.prompt_tokens:
            self.prompt_tokens = len(out.prompt_token_ids)
            self.metrics.prompt_tokens.labels(*self._labels()).inc(self.prompt_tokens)
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
        total = sum(self._tokens.values())
        if total > self.generation_tokens:
            self.metrics.generation_tokens.labels(*self._labels()).inc(total - self.generation_tokens)
        self.generation_tokens = total
        if out.metrics is not None and out.metrics.first_token_time is not None:
            self._first = out.metrics.first_token_time
            self._last = out.metrics.last_token_time

    def close(self) -> None:
        if self.errored and not self.seen_output:
            return  # rejected at submission (a 4xx, or a dead engine): not a served request
        m, labels = self.metrics, self._labels()
        m.ensure_engine(int(self.engine))
        reason = self.finish_reason or ("error" if self.errored else "abort")
        m.request_success.labels(*labels, reason).inc()
        m.e2e.labels(*labels).observe(time.monotonic() - self.arrival)
        if self.params is not None:
            m.params_n.labels(*labels).observe(self.params.n)
            if m.params_max_tokens is not None and self.params.max_tokens is not None:
                m.params_max_tokens.labels(*labels).observe(self.params.max_tokens)
        if m.request_prompt_tokens is not None:
            m.request_prompt_tokens.labels(*labels).observe(self.prompt_tokens)
        if m.request_generation_tokens is not None:
            m.request_generation_tokens.labels(*labels).observe(self.generation_tokens)
        if m.request_max_generation_tokens is not None:
            m.request_max_generation_tokens.labels(*labels).observe(max(self._tokens.values(), default=0))
        if self._first is None:
            return
        m.ttft.labels(*labels).observe(max(0.0, self._first - self.arrival))
        last = self._last if self._last is not None else self._first
        m.decode_time.labels(*labels).observe(max(0.0, last - self._first))
        longest = max(self._tokens.values(), default=0)  # n > 1: the samples decode side by side
        if longest > 1:
            mean = max(0.0, last - self._first) / (longest - 1)
            m.request_tpot.labels(*labels).observe(mean)
            itl, tpot = m.itl.labels(*labels), m.tpot.labels(*labels)
            for _ in range(sum(max(0, k - 1) for k in self._tokens.values())):
                itl.observe(mean)
                tpot.observe(mean)
