"""`RequestOutputCollector`: one request's pending output for a consumer that may fall behind."""

from __future__ import annotations

import pytest

from troupe.output.collector import RequestOutputCollector
from troupe.outputs import CompletionOutput, RequestOutput
from troupe.sampling_params import RequestOutputKind

K = RequestOutputKind


def out(text: str, ids: list[int], index: int = 0, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(index, text, ids, finish_reason="length" if finished else None)
    return RequestOutput("ext", "prompt", [1, 2], [completion], finished=finished)


def texts(output: RequestOutput) -> list[tuple[int, str, list[int]]]:
    return [(c.index, c.text, c.token_ids) for c in output.outputs]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (K.DELTA, [(0, "Hello world!", [1, 2, 3])]),  # deltas are concatenated
        (K.CUMULATIVE, [(0, "!", [3])]),  # the newest replaces (it holds everything)
        (K.FINAL_ONLY, [(0, "!", [3])]),
    ],
)
def test_merge_rules(kind, expected):
    """Outputs put while the consumer is away merge: DELTA aggregates, the others replace; the
    merged output is finished when the last one was."""
    collector = RequestOutputCollector(kind)
    for output in (out("Hello", [1]), out(" world", [2]), out("!", [3], finished=True)):
        collector.put(output)
    got = collector.get_nowait()
    assert got is not None and texts(got) == expected and got.finished
    assert got.outputs[0].finish_reason == "length"
    assert collector.get_nowait() is None


@pytest.mark.parametrize("kind", list(K))
def test_samples_do_not_overwrite_each_other(kind):
    """Outputs of different samples (index) are kept side by side, whatever the kind."""
    collector = RequestOutputCollector(kind)
    collector.put(out("a", [1], index=0))
    collector.put(out("b", [2], index=1))
    collector.put(out("c", [3], index=0))
    got = collector.get_nowait()
    assert got is not None
    first = ("ac", [1, 3]) if kind is K.DELTA else ("c", [3])
    assert texts(got) == [(0, *first), (1, "b", [2])]


def test_merging_mutates_no_list_it_was_given():
    """Aggregating builds new lists: token-id lists handed in (which may be the engine's own)
    stay as they were."""
    collector = RequestOutputCollector(K.DELTA)
    given = [out("Hello", [1]), out(" world", [2]), out("!", [3])]
    lists = [o.outputs[0].token_ids for o in given]
    for output in given:
        collector.put(output)
    merged = collector.get_nowait()
    assert merged is not None and merged.outputs[0].token_ids == [1, 2, 3]
    assert lists == [[1], [2], [3]]


def test_get_when_empty_and_readiness():
    """get_nowait gives None when nothing is pending; `ready` says whether it would give something;
    on_ready fires only when the collector goes from empty to ready."""
    calls: list[None] = []
    collector = RequestOutputCollector(K.DELTA, on_ready=lambda: calls.append(None))
    assert collector.get_nowait() is None and not collector.ready
    collector.put(out("a", [1]))
    collector.put(out("b", [2]))
    assert collector.ready and len(calls) == 1
    assert collector.get_nowait() is not None and not collector.ready
    collector.put(out("c", [3]))
    assert len(calls) == 2


def test_error_wins_and_sticks():
    """An error replaces a pending output, is raised by every later get, and later puts are ignored."""
    calls: list[None] = []
    collector = RequestOutputCollector(K.CUMULATIVE, on_ready=lambda: calls.append(None))
    collector.put(out("a", [1]))
    collector.put_error(RuntimeError("engine died"))
    collector.put(out("b", [2]))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="engine died"):
            collector.get_nowait()
    assert collector.ready and len(calls) == 1  # already ready when the error came


def test_error_on_empty_collector_wakes_the_consumer():
    """An error put on an empty collector makes it ready and fires on_ready."""
    calls: list[None] = []
    collector = RequestOutputCollector(K.DELTA, on_ready=lambda: calls.append(None))
    collector.put_error(ValueError("bad"))
    assert collector.ready and len(calls) == 1
    with pytest.raises(ValueError, match="bad"):
        collector.get_nowait()
