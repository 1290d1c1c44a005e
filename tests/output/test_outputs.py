"""`RequestOutput` / `CompletionOutput`: merging, finished flags, repr."""

from __future__ import annotations

import pytest

from troupe.outputs import CompletionOutput, RequestMetrics, RequestOutput


def request(*completions: CompletionOutput, finished: bool = False, cached: int = 0) -> RequestOutput:
    return RequestOutput("ext", None, [7], list(completions), finished=finished, num_cached_tokens=cached)


@pytest.mark.parametrize(
    ("aggregate", "expected"),
    [
        (True, [(0, "ab", [1, 2], "stop", "x"), (1, "z", [9], None, None)]),
        (False, [(0, "b", [2], "stop", "x"), (1, "z", [9], None, None)]),
    ],
)
def test_add_merges_by_index(aggregate, expected):
    """`add` matches samples by index: aggregate concatenates text and ids and takes the newer
    finish/stop reasons; otherwise the newer sample replaces; unknown indices are appended."""
    first = request(CompletionOutput(0, "a", [1]))
    first.add(
        request(
            CompletionOutput(0, "b", [2], finish_reason="stop", stop_reason="x"),
            CompletionOutput(1, "z", [9]),
            finished=True,
            cached=4,
        ),
        aggregate,
    )
    got = [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in first.outputs]
    assert got == expected
    assert first.finished and first.num_cached_tokens == 4


def test_finished_is_sticky_and_metrics_kept():
    """A finished output stays finished after adding; metrics come from the output that has them."""
    metrics = RequestMetrics(arrival_time=1.0, first_token_time=1.5)
    done = request(CompletionOutput(0, "a", [1]), finished=True)
    done.metrics = metrics
    done.add(request(CompletionOutput(0, "", [])), aggregate=True)
    assert done.finished and done.metrics is metrics and metrics.time_to_first_token == 0.5


@pytest.mark.parametrize(("finish_reason", "finished"), [(None, False), ("stop", True), ("abort", True)])
def test_completion_finished(finish_reason, finished):
    """A sample is finished exactly when it has a finish reason."""
    assert CompletionOutput(0, "", [], finish_reason=finish_reason).finished() is finished


def test_repr_is_short():
    """Long texts and id lists are elided in the repr, so logs stay readable."""
    text = repr(request(CompletionOutput(0, "x" * 1000, list(range(1000)))))
    assert len(text) < 400 and "RequestOutput(request_id='ext'" in text and "more" in text
