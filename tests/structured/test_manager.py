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


def poll_until(m: StructuredOutputManager, deadline: float) -> tuple[list[str], dict[str, str]]:
    ready: list[str] = []
    failed: dict[str, str] = {}
    end = time.monotonic() + deadline
    while m.num_waiting and time.monotonic() < end:
        m.wait(0.05)
        r, f = m.poll()
        ready += r
        failed.update(f)
    return ready, failed


def test_a_slow_grammar_delays_no_other_and_fails_past_the_deadline(manager: StandInManager) -> None:
    """"slow" holds one thread: "fast", submitted after it, is ready at once on the other; "slow"'s
    request fails naming the deadline once 0.5 s have passed."""
    manager.submit("a", StructuredOutputsParams(regex="slow"))
    manager.submit("b", StructuredOutputsParams(regex="fast"))
    started = time.monotonic()
    ready, failed = poll_until(manager, 5)
    assert ready == ["b"] and manager.matcher("b") == ("matcher", "fast")
    assert list(failed) == ["a"] and "grammar_compile_timeout_s" in failed["a"]
    assert 0.5 <= time.monotonic() - started < 3
    assert manager.matcher("a") is None and not manager.is_waiting("a")


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
    assert ready == ["d"] and manager.started.count("queued") == 1
