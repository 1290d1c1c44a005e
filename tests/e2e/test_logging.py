"""Structured logs (issue #6): what a user debugging a request can rely on.

- importing troupe configures nothing; a program's own structlog / stdlib set-up keeps control;
- JSON mode writes one JSON object per line;
- every line about a request carries its `request_id`, on both sides of the process boundary, and
  every line its `actor`; engine lines carry `engine` and `step`;
- the canonical "request finished" line has the right numbers, for finished, aborted and errored
  requests;
- trace level logs each hop of a request; disabled, nothing of it is logged;
- the stats line reports throughput and load, and nothing while idle.

Engine tests use the tiny random Llama in this process (one engine for the module) and capture
lines with `structlog.testing.capture_logs` (context merged); `log_level` sets troupe's level for one test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
from structlog.testing import capture_logs as _capture_logs

from troupe import AsyncLLM, RequestOutputKind, SamplingParams
from troupe.actors.engine_stats import EngineStats
from troupe.actors.requests import RequestTable
from troupe.actors.stats_logger import StatsLogger, stats_lines
from troupe.log import configure_logging, set_level, trace_enabled
from troupe.messages import AddRequest, EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats

ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=128,
              block_size=16, log_stats_interval_s=None)  # the stats tests run their own StatsLogger
# the hops of one request, in order, at trace level (the balancer's hop comes with data parallelism)
FRONTEND_HOPS = ["request submitted", "output ready", "output taken", "request finished"]
ENGINE_HOPS = ["request received", "request added", "request scheduled", "request finished in engine"]



@pytest.fixture(scope="module")
async def llm(tiny_llama: Path) -> AsyncIterator[AsyncLLM]:
    async with AsyncLLM(str(tiny_llama), multiprocess=False, **ENGINE) as engine:
        yield engine


@pytest.fixture
def log_level() -> Iterator[Any]:
    """`log_level("trace")` sets troupe's level for this test; it is restored afterwards."""
    configure_logging()  # troupe's configuration, unless the session has one already
    previous: list[int] = []

    def set_(name: str) -> None:
        previous.append(set_level(name))

    yield set_
    if previous:
        set_level(previous[0])


def capture_logs() -> Any:
    """`structlog.testing.capture_logs` with the bound context merged in (actor, request_id, ...),
    as troupe's configuration does first thing."""
    return _capture_logs(processors=[structlog.contextvars.merge_contextvars])


def params(max_tokens: int, kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


async def run(llm: AsyncLLM, prompt: Any, request_id: str, max_tokens: int = 6) -> Any:
    with anyio.fail_after(60):
        outs = [o async for o in llm.generate(prompt, params(max_tokens), request_id=request_id)]
    return outs[-1]


def lines_of(logs: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    return [e for e in logs if e.get("request_id") == request_id]


def check_request_lines(logs: list[dict[str, Any]], request_id: str) -> None:
    """Every line naming one of the request's internal ids also names the request; each has an
    actor; engine lines have engine and step."""
    for e in logs:
        if str(e.get("internal_id", "")).startswith(f"{request_id}-"):
            assert e.get("request_id") == request_id, e
    for e in lines_of(logs, request_id):
        assert e.get("actor"), e
        if e["actor"] == "engine_core":
            assert e.get("engine") == 0 and isinstance(e.get("step"), int), e


# ---------------------------------------------------------------- global configuration


def test_importing_troupe_configures_nothing_and_a_program_keeps_control() -> None:
    """Importing troupe (every layer) leaves the root logger and structlog unconfigured; a program
    that configured structlog keeps its configuration when an engine configures logging; a program
    with stdlib handlers gets troupe's lines through them."""
    script = textwrap.dedent("""
        import io, logging, structlog
        root = logging.getLogger()
        before = (list(root.handlers), root.level, structlog.is_configured(), structlog.get_config())
        import troupe, troupe.log, troupe.actors.graph, troupe.facades.llm, troupe.engine.child
        import troupe.actors.stats_logger, troupe.server
        after = (list(root.handlers), root.level, structlog.is_configured(), structlog.get_config())
        assert before == after, (before, after)
        assert not structlog.is_configured()

        mine = dict(processors=[structlog.processors.KeyValueRenderer()],
                    logger_factory=structlog.PrintLoggerFactory(io.StringIO()))
        structlog.configure(**mine)
        config = structlog.get_config()
        assert troupe.log.configure_logging() is False
        assert structlog.get_config() == config

        structlog.reset_defaults()
        sink = io.StringIO()
        logging.basicConfig(stream=sink, level=logging.INFO, format="%(name)s|%(message)s")
        assert troupe.log.configure_logging() is True
        structlog.get_logger("troupe.test").info("via stdlib", request_id="r1")
        assert "troupe.test|" in sink.getvalue() and "request_id=r1" in sink.getvalue(), sink.getvalue()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.timeout(600)  # an engine in a subprocess
def test_json_mode_writes_one_json_object_per_line(tiny_llama: Path) -> None:
    """TROUPE_LOG_FORMAT=json: every stderr line of an engine run at trace level (an exception
    with its traceback included) parses as one JSON object with event, level and timestamp."""
    script = textwrap.dedent(f"""
        import anyio, structlog
        from troupe import AsyncLLM, SamplingParams

        async def main():
            async with AsyncLLM({str(tiny_llama)!r}, multiprocess=False, **{ENGINE!r}) as llm:
                p = SamplingParams(max_tokens=4, ignore_eos=True)
                async for _ in llm.generate("json lines", p, request_id="j1"):
                    pass
            try:
                raise RuntimeError("a multi-line\\nerror")
            except RuntimeError:
                structlog.get_logger("troupe.test").exception("boom", request_id="j1")

        anyio.run(main)
    """)
    env = {**os.environ, "TROUPE_LOG_FORMAT": "json", "TROUPE_LOG_LEVEL": "trace", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
    assert all(isinstance(e, dict) and {"event", "level", "timestamp"} <= e.keys() for e in lines)
    events = {e["event"] for e in lines if e.get("request_id") == "j1"}
    assert {*FRONTEND_HOPS, *ENGINE_HOPS, "boom"} <= events, events
    assert any(e["level"] == "trace" for e in lines)
    (boom,) = [e for e in lines if e["event"] == "boom"]
    assert "RuntimeError: a multi-line" in boom["exception"]


# ---------------------------------------------------------------- per-request lines


async def test_every_hop_of_a_request_is_traced_with_its_request_id(llm: AsyncLLM, log_level: Any) -> None:
    """At trace level each hop of a request is logged (input processor, engine, output handler,
    collector), every line about it carries its request_id, and the hops come in order."""
    log_level("trace")
    assert trace_enabled()
    with capture_logs() as logs:
        await run(llm, "trace me through the graph", "hop-1")
    check_request_lines(logs, "hop-1")
    events = [e["event"] for e in lines_of(logs, "hop-1")]
    for hop in [*FRONTEND_HOPS, *ENGINE_HOPS]:
        assert hop in events, (hop, events)
    order = ["request submitted", "request received", "request added", "request scheduled",
             "request finished in engine", "output ready", "output taken"]
    firsts = [events.index(hop) for hop in order]
    assert firsts == sorted(firsts), events
    assert any(e["log_level"] == "trace" and e["event"] == "step" and e["engine"] == 0 for e in logs)


async def test_disabled_trace_logs_no_hop(llm: AsyncLLM, log_level: Any) -> None:
    """At info level only the canonical line is logged for a request: no trace, no debug."""
    log_level("info")
    assert not trace_enabled()
    with capture_logs() as logs:
        await run(llm, "quiet please", "quiet-1")
    assert [e["event"] for e in lines_of(logs, "quiet-1")] == ["request finished"]
    assert all(e["log_level"] not in ("trace", "debug") for e in logs)


async def test_canonical_line_numbers_are_right(llm: AsyncLLM, log_level: Any) -> None:
    """The canonical line of a known request: its id, prompt and output tokens, finish reason,
    engine, preemptions, and the timings of its final output; the second run of the same prompt
    reports its prefix-cache hit (two full blocks of 16 of a 40-token prompt)."""
    log_level("info")
    prompt = {"prompt_token_ids": list(range(100, 140))}
    with capture_logs() as logs:
        first = await run(llm, prompt, "canon-1", max_tokens=7)
        second = await run(llm, prompt, "canon-2", max_tokens=7)
    for out, cached in ((first, 0), (second, 32)):
        (line,) = [e for e in lines_of(logs, out.request_id) if e["event"] == "request finished"]
        m = out.metrics
        assert line["log_level"] == "info" and line["actor"] == "output_handler"
        assert line["internal_id"].startswith(f"{out.request_id}-")
        assert (line["prompt_tokens"], line["output_tokens"], line["cached_tokens"]) == (40, 7, cached)
        assert out.num_cached_tokens == cached
        assert (line["finish_reason"], line["engine"], line["preemptions"]) == ("length", 0, 0)
        assert line["ttft_s"] == round(m.time_to_first_token, 4)
        assert line["total_s"] == round(m.finished_time - m.arrival_time, 4)
        assert 0 <= line["ttft_s"] <= line["total_s"]
        assert line["output_tokens_per_s"] == round(7 / (m.finished_time - m.arrival_time), 1)


async def test_an_aborted_request_gets_its_canonical_line(llm: AsyncLLM, log_level: Any) -> None:
    """A request aborted after its first output: one canonical line, finish_reason abort, with the
    tokens it got."""
    log_level("info")
    with capture_logs() as logs, anyio.fail_after(60):
        outs = []
        async for out in llm.generate("stop early", params(200, RequestOutputKind.DELTA), request_id="ab-1"):
            outs.append(out)
            if len(outs) == 1:
                await llm.abort("ab-1")
    assert outs[-1].outputs[0].finish_reason == "abort"
    (line,) = [e for e in lines_of(logs, "ab-1") if e["event"] == "request finished"]
    assert line["finish_reason"] == "abort" and line["output_tokens"] >= 1 and line["actor"]


def _table_with(request_id: str) -> RequestTable:
    table = RequestTable(tokenizer=None)
    table.register(AddRequest(f"{request_id}-0000", [1, 2, 3], SamplingParams(max_tokens=5), 5,
                              external_id=request_id), None)
    return table


def test_errored_requests_get_their_canonical_line() -> None:
    """A request the engine fails, and every request alive when the engine dies, get the canonical
    line with finish_reason error and the reason."""
    table = _table_with("err-1")
    with capture_logs() as logs:
        table.process_slice([EngineCoreOutput("err-1-0000", [], FinishReason.ERROR, error="bad input")], 3)
    (line,) = [e for e in logs if e["event"] == "request finished"]
    assert (line["request_id"], line["finish_reason"], line["error"], line["engine"]) == ("err-1", "error", "bad input", 3)

    table = _table_with("dead-1")
    with capture_logs() as logs:
        table.fail_all("engine process 1 was killed by SIGKILL")
    (line,) = [e for e in logs if e["event"] == "request finished"]
    assert (line["request_id"], line["finish_reason"], line["prompt_tokens"]) == ("dead-1", "error", 3)
    assert "SIGKILL" in line["error"]


# ---------------------------------------------------------------- the process boundary


async def test_request_id_on_both_sides_of_the_process_boundary(tiny_llama: Path, log_level: Any, ipc_root: str,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                check_leftovers: Any) -> None:
    """With the engine in its own process, its lines reach the frontend's logging (forwarded over
    the ZMQ channel) with request_id, actor, engine and step, next to the frontend's own lines."""
    monkeypatch.setenv("TROUPE_LOG_LEVEL", "trace")  # the engine process reads it
    log_level("trace")
    async with AsyncLLM(str(tiny_llama), multiprocess=True, ipc_dir=ipc_root, **ENGINE) as mp_llm:
        pids = mp_llm.engine_pids
        with capture_logs() as logs:
            await run(mp_llm, "across the boundary", "zmq-1")
            for _ in range(500):  # forwarded lines may trail the outputs by a little
                if any(e["event"] == "request finished in engine" for e in lines_of(logs, "zmq-1")):
                    break
                await anyio.sleep(0.02)
    check_request_lines(logs, "zmq-1")
    events = {e["event"] for e in lines_of(logs, "zmq-1")}
    assert {*FRONTEND_HOPS, *ENGINE_HOPS} <= events, events
    added = [e for e in lines_of(logs, "zmq-1") if e["event"] == "request added"]
    assert added and added[0]["actor"] == "engine_core" and added[0]["pid"] in pids
    check_leftovers(pids)


# ---------------------------------------------------------------- the stats line


def _step(engine: int, prompt: int, gen: int, running: int = 1, waiting: int = 0, queries: int = 0,
          hits: int = 0) -> EngineCoreOutputs:
    stats = SchedulerStats(num_running=running, num_waiting=waiting, kv_cache_usage=0.25, prefix_cache_queries=queries,
                           prefix_cache_hits=hits, num_prompt_tokens=prompt, num_generation_tokens=gen)
    return EngineCoreOutputs(engine_index=engine, scheduler_stats=stats)


def test_stats_lines_report_throughput_per_engine_and_in_total() -> None:
    """Two engines: one line each and a total; rates are tokens over the interval; the prefix-cache
    hit rate is over the interval's lookups; an idle interval gives no line."""
    engines = EngineStats(2)
    clock = [100.0]
    stats = StatsLogger(engines, lambda: 0, 2.0, clock=lambda: clock[0])
    engines.record(_step(0, 100, 0, queries=100, hits=0))
    engines.record(_step(1, 50, 2, running=2, waiting=3, queries=50, hits=25))
    engines.record(_step(0, 0, 4, queries=100, hits=0))
    clock[0] += 2.0
    with capture_logs() as logs:
        assert stats.log_interval()
    per_engine = {e["engine"]: e for e in logs if e["event"] == "engine stats"}
    (total,) = [e for e in logs if e["event"] == "stats"]
    assert per_engine[0]["prompt_tokens_per_s"] == 50.0 and per_engine[0]["generation_tokens_per_s"] == 2.0
    assert per_engine[1]["prompt_tokens_per_s"] == 25.0 and per_engine[1]["waiting"] == 3
    assert per_engine[0]["prefix_cache_hit_rate"] == 0.0 and per_engine[1]["prefix_cache_hit_rate"] == 0.5
    assert (total["engines"], total["prompt_tokens_per_s"], total["generation_tokens_per_s"]) == (2, 75.0, 3.0)
    assert (total["running"], total["waiting"], total["kv_cache_usage"]) == (3, 3, 0.25)
    assert total["prefix_cache_hit_rate"] == round(25 / 150, 3)
    clock[0] += 2.0
    with capture_logs() as logs:
        assert not stats.log_interval()  # nothing moved, nothing live
    assert logs == []
    assert stats_lines({}, {}, 1.0, live_requests=0) == []
    assert stats_lines({}, {}, 1.0, live_requests=2)[-1][1]["requests"] == 2  # live but stuck: still logged


async def test_stats_line_is_silent_while_idle(llm: AsyncLLM, log_level: Any) -> None:
    """The stats actor on a running engine: no line while idle, lines while a request runs, and
    none again once idle."""
    log_level("info")
    graph = llm._graph
    assert graph is not None
    stats = StatsLogger(graph.stats, lambda: graph.num_unfinished, 0.05)
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await tg.start(stats.run)
            await anyio.sleep(0.3)
            idle = [e for e in logs if e["event"] == "stats"]
            await run(llm, "count my tokens", "stats-1", max_tokens=30)
            await anyio.sleep(0.2)  # the interval with the last tokens is reported
            busy = [e for e in logs if e["event"] == "stats"]
            await anyio.sleep(0.3)
            after = [e for e in logs if e["event"] == "stats"]
            tg.cancel_scope.cancel()
    assert idle == []
    assert busy and sum(e["generation_tokens_per_s"] for e in busy) > 0
    assert all(e["actor"] == "stats_logger" and e["engines"] == 1 for e in busy)
    assert after == busy
    assert stats.statistics().skipped >= 6


def test_trace_lines_appear_at_trace_level_through_troupes_configuration(log_level: Any) -> None:
    """troupe's logger class filters at the level set now (loggers cached before included) and
    logs trace lines only at trace level."""
    from troupe.log import trace

    logger = structlog.get_logger("troupe.test")
    log_level("info")
    with capture_logs() as logs:
        logger.debug("hidden")
        trace(logger, "hidden too")
        logger.info("shown")
    assert [e["event"] for e in logs] == ["shown"]
    log_level("trace")
    with capture_logs() as logs:
        logger.debug("debug now")
        trace(logger, "trace now", request_id="t1")
    assert [(e["event"], e["log_level"]) for e in logs] == [("debug now", "debug"), ("trace now", "trace")]
