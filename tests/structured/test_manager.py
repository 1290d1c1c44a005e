"""StructuredOutputManager's threads and deadline, with a stand-in compiler (no xgrammar): a slow
grammar delays no other, fails its request past `compile_timeout_s`, and an aborted request's
compilation that has not started is cancelled."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from troupe.structured import StructuredOutputsParams
from troupe.structured import manager as manager_mod
from troupe.structured.manager import StructuredOutputManager


class StandInManager(StructuredOutputManager):
    """Compiles a regex spec to itself; the regex "slow" blocks until `release` is set."""

    def __init__(self, timeout: float) -> None:
        super().__init__(lambda: None, 10, [0], compile_timeout_s=timeout)
        self.release = threading.Event()
        self.started: list[str] = []
        self._ready_at = 0.0  # no compiler to build

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        self.started.append(spec.regex or "")
        if spec.regex == "slow":
            assert self.release.wait(30)
        return spec.regex


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(manager_mod, "Matcher", lambda compiled: ("matcher", compiled))
    m = StandInManager(timeout=0.5)
    yield m
    m.release.set()
    m.close()


def poll_until(m: StructuredOutputManager, deadline: float) -> tuple[dict[str, Any], dict[str, str]]:
    ready: dict[str, Any] = {}
    failed: dict[str, str] = {}
    end = time.monotonic() + deadline
    while m.num_waiting and time.monotonic() < end:
        m.wait(0.05)
        r, f = m.poll()
        ready.update(r)
        failed.update(f)
    return ready, failed


def test_a_slow_grammar_delays_no_other_and_fails_past_the_deadline(manager: StandInManager) -> None:
    """"slow" holds one thread: "fast", submitted after it, is ready at once on the other; "slow"'s
    request fails naming the deadline once 0.5 s have passed."""
    started = time.monotonic()  # before the submission: the deadline counts from it
    manager.submit("a", StructuredOutputsParams(regex="slow"))
    manager.submit("b", StructuredOutputsParams(regex="fast"))
    ready, failed = poll_until(manager, 5)
    assert ready == {"b": ("matcher", "fast")}
    assert list(failed) == ["a"] and "grammar_compile_timeout_s" in failed["a"]
    assert 0.5 <= time.monotonic() - started < 3
    assert not manager.is_waiting("a")


def test_an_aborted_request_cancels_a_compilation_not_started(manager: StandInManager) -> None:
    """Both threads busy with "slow" grammars: a third request's compilation is queued; forgetting
    that request cancels it (it never runs), and an equal spec submitted later compiles afresh."""
    manager.compile_timeout_s = 30.0
    manager.submit("a", StructuredOutputsParams(regex="slow"))
    manager.submit("b", StructuredOutputsParams(regex="slow", disable_any_whitespace=True))
    deadline = time.monotonic() + 5
    while len(manager.started) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    manager.submit("c", StructuredOutputsParams(regex="queued"))
    manager.forget("c")
    manager.release.set()
    poll_until(manager, 5)
    assert "queued" not in manager.started
    manager.submit("d", StructuredOutputsParams(regex="queued"))
    ready, _ = poll_until(manager, 5)
    assert list(ready) == ["d"] and manager.started.count("queued") == 1


async def test_the_engine_fails_only_the_slow_grammars_request(tiny_llama: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real engine (in this process, grammar_compile_timeout_s=0.5): a request whose grammar
    never finishes compiling fails with an error naming grammar_compile_timeout_s, filed as its own
    fault (a 400 from the server); a structured request sent after it and a plain one finish; the
    engine stays healthy."""
    import anyio

    from troupe import AsyncLLM, SamplingParams

    release = threading.Event()
    compile_spec = StructuredOutputManager._compile

    def compile_or_hang(self: StructuredOutputManager, spec: StructuredOutputsParams) -> Any:
        if spec.regex == "slow(a|b)":
            release.wait(30)
        return compile_spec(self, spec)

    monkeypatch.setattr(StructuredOutputManager, "_compile", compile_or_hang)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    try:
        async with AsyncLLM(str(tiny_llama), multiprocess=False, dtype="float32", num_threads=1,
                            log_stats_interval_s=None, grammar_compile_timeout_s=0.5) as llm:
            slow = params.clone()
            slow.structured_outputs = StructuredOutputsParams(regex="slow(a|b)")
            fast = params.clone()
            fast.structured_outputs = StructuredOutputsParams(regex="[ab]{3}")
            warm = params.clone()  # the first builds the compiler (over 0.5 s here): not counted as its compile
            warm.structured_outputs = StructuredOutputsParams(regex="[cd]{3}")
            assert [o async for o in llm.generate("Hello", warm, "warm")][-1].outputs[0].finish_reason == "length"
            results: dict[str, Any] = {}

            async def run(name: str, p: SamplingParams) -> None:
                try:
                    results[name] = [o async for o in llm.generate("Hello", p, name)][-1]
                except Exception as exc:
                    results[name] = exc

            started = time.monotonic()
            async with anyio.create_task_group() as tg:
                for name, p in (("slow", slow), ("fast", fast), ("plain", params)):
                    tg.start_soon(run, name, p)
            assert time.monotonic() - started < 10
            slow_out = results["slow"]
            assert "grammar_compile_timeout_s" in str(slow_out.error), results
            assert slow_out.outputs[0].finish_reason == "error" and slow_out.error_kind == "invalid_request"
            assert results["fast"].outputs[0].text in {"aaa", "aab", "aba", "abb", "baa", "bab", "bba", "bbb"}
            assert len(results["plain"].outputs[0].token_ids) == 3
            await llm.check_health()
    finally:
        release.set()
