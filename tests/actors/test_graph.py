"""The graph's supervision, through a real (tiny, in-process) engine: every task is started and
watched the same way; a crash of an optional observer (stats logger, progress watch) is logged and
the graph goes on, a crash of an essential actor ends every request with `EngineDeadError` without
cancelling the caller's code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import TaskStatus
from factories import TINY_ENGINE
from structlog.testing import capture_logs

from troupe import AsyncLLM, EngineDeadError, SamplingParams
from troupe.actors.graph import Graph
from troupe.actors.output_handler import OutputHandler
from troupe.actors.stats_logger import StatsLogger
from troupe.config import EngineConfig

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_the_request_table_and_engine_stats_exist_before_the_start() -> None:
    """A crash at any point of the start-up finds the table and the stats object to report to."""
    graph = Graph(EngineConfig(data_parallel_size=2, multiprocess=False))
    assert graph.num_unfinished == 0 and graph.dead_error is None
    assert sorted(graph.stats.latest) == [0, 1]


@pytest.mark.parametrize("observer", ["stats_logger", "progress_watch"])
async def test_a_crashing_observer_is_logged_and_the_graph_goes_on(tiny_llama: Path, observer: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The observer raises after it started: "observer crashed" names it, requests still finish,
    the engine stays healthy."""
    crashed = anyio.Event()  # set just before the raise; the supervisor logs before anyone else runs
    if observer == "stats_logger":
        def boom(self: StatsLogger) -> bool:
            crashed.set()
            raise RuntimeError("bug in the stats logger")

        monkeypatch.setattr(StatsLogger, "log_interval", boom)
    else:
        async def crashing_watch(self: Graph, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
            task_status.started()
            await anyio.sleep(0.05)
            crashed.set()
            raise RuntimeError("bug in the progress watch")

        monkeypatch.setattr(Graph, "_watch_progress", crashing_watch)
    # built before capture_logs: AsyncLLM configures troupe's logging, which capture_logs then restores
    engine = AsyncLLM(str(tiny_llama), multiprocess=False, log_stats_interval_s=0.05, engine_hang_timeout_s=30,
                      **TINY_ENGINE)
    with capture_logs() as logs, anyio.fail_after(60):
        async with engine as llm:
            await crashed.wait()
            outs = [o async for o in llm.generate({"prompt_token_ids": [1, 2, 3]}, PARAMS)]
            await llm.check_health()
            assert not llm.errored
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    (line,) = [e for e in logs if e["event"] == "observer crashed"]
    assert line["crashed_actor"] == observer and line["log_level"] == "error"
    assert not [e for e in logs if e["event"] == "actor crashed"]


async def test_a_crashing_essential_actor_fails_every_request(tiny_llama: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The output handler raises on the first step's outputs: the live request and every later one
    get `EngineDeadError` naming it; the body of `async with` is not cancelled and the exit is clean."""
    async def boom(self: OutputHandler, msg: Any) -> None:
        raise RuntimeError("bug in the output handler")

    monkeypatch.setattr(OutputHandler, "_process", boom)
    engine = AsyncLLM(str(tiny_llama), multiprocess=False, **TINY_ENGINE)  # before capture_logs, as above
    with capture_logs() as logs, anyio.fail_after(60):
        async with engine as llm:
            with pytest.raises(EngineDeadError, match="output_handler crashed: RuntimeError: bug in the output handler"):
                async for _ in llm.generate({"prompt_token_ids": [1, 2, 3]}, PARAMS):
                    pass
            assert llm.errored
            with pytest.raises(EngineDeadError):
                await llm.check_health()
            with pytest.raises(EngineDeadError):
                async for _ in llm.generate({"prompt_token_ids": [4, 5, 6]}, PARAMS):
                    pass
            body_done = True
    assert body_done
    assert [e["crashed_actor"] for e in logs if e["event"] == "actor crashed"] == ["output_handler"]
