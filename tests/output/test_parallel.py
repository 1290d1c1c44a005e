"""n > 1 in the output processor (troupe.output.parallel): children of one parent, their outputs
gathered back per output kind, aborts and failures of the parent and of one child, the held children
of a shared prefill. Modelled on vLLM's test_parallel_sampling.py; a collector stands in for the
consumer's stream."""

from __future__ import annotations

from typing import Any

import pytest
from factories import add_request
from support.faults import _FailingDetokenizer

from troupe.actors.requests import RequestTable
from troupe.messages import EngineCoreOutput, FinishReason
from troupe.output.collector import RequestOutputCollector
from troupe.output.parallel import fan_out
from troupe.output.processor import OutputProcessor
from troupe.outputs import RequestOutput
from troupe.sampling_params import RequestOutputKind, SamplingParams

K = RequestOutputKind
WORDS = [" one", " two", " three", " four", " five", " six"]


def parent(processor: OutputProcessor, tokenizer: Any, n: int, kind: RequestOutputKind,
           held: bool = False, **params: Any) -> tuple[RequestOutputCollector, list[str], Any]:
    """Register parent "p" (user id "u") with n children; returns (queue, child ids, parent)."""
    req = add_request("p", [1, 2, 3], max_tokens=16, external_id="u", n=n, temperature=1.0, output_kind=kind,
                      **params)
    children = fan_out(req)
    queue = RequestOutputCollector(kind)
    state = processor.add_parent("p", "u", n, kind, queue=queue)
    for i, child in enumerate(children):
        processor.add_request(child.request_id, "u", None, child.prompt_token_ids, child.params, parent=state,
                              index=i)
    if held:
        state.held = children[1:]
    return queue, [c.request_id for c in children], state


def step(processor: OutputProcessor, queue: RequestOutputCollector,
         entries: list[EngineCoreOutput], engine_index: int = 0) -> tuple[RequestOutput | None, list[str]]:
    processed = processor.process_outputs(entries, engine_index=engine_index)
    return queue.get_nowait(), processed.release


def ids(tokenizer: Any, word: str) -> list[int]:
    return tokenizer.encode(word, add_special_tokens=False)


def test_fan_out_gives_vllm_ids_single_samples_and_per_child_seeds() -> None:
    """Children `<i>_<parent id>`, n=1 each, seed + i with a seed and no seed without one."""
    seeded = fan_out(add_request("p", n=3, seed=41, temperature=1.0))
    assert [c.request_id for c in seeded] == ["0_p", "1_p", "2_p"]
    assert [(c.params.n, c.params.seed) for c in seeded] == [(1, 41), (1, 42), (1, 43)]
    assert all(c.external_id == "p" and c.prompt_token_ids == [1, 2, 3] for c in seeded)
    assert [c.params.seed for c in fan_out(add_request("q", n=2, temperature=1.0))] == [None, None]


def test_final_only_is_one_output_with_every_sample_once_all_finished(tokenizer: Any) -> None:
    """FINAL_ONLY: nothing until the last child finishes, then one finished output with n
    completions sorted by index, each with its own text and finish reason."""
    processor = OutputProcessor(tokenizer)
    queue, (c0, c1, c2), _ = parent(processor, tokenizer, 3, K.FINAL_ONLY)
    assert step(processor, queue, [EngineCoreOutput(c2, ids(tokenizer, WORDS[2]), FinishReason.LENGTH),
                                   EngineCoreOutput(c0, ids(tokenizer, WORDS[0]))])[0] is None
    assert step(processor, queue, [EngineCoreOutput(c0, ids(tokenizer, WORDS[3]), FinishReason.LENGTH)])[0] is None
    out, _ = step(processor, queue, [EngineCoreOutput(c1, ids(tokenizer, WORDS[1]), FinishReason.LENGTH)])
    assert out is not None and out.finished and out.request_id == "u"
    assert [(c.index, c.text, c.finish_reason) for c in out.outputs] == [
        (0, " one four", "length"), (1, " two", "length"), (2, " three", "length")]
    assert out.metrics is not None and out.metrics.num_generation_tokens == 4
    assert not processor.has_unfinished_requests() and processor.engine_ids(["p"]) == []


@pytest.mark.parametrize("kind", [K.DELTA, K.CUMULATIVE])
def test_streaming_kinds_pass_each_childs_update_with_its_index(tokenizer: Any, kind: RequestOutputKind) -> None:
    """DELTA / CUMULATIVE: each update carries one child's completion and index; a child that finished
    is not reported again; `finished` only on the output that finishes the last child."""
    processor = OutputProcessor(tokenizer)
    queue, (c0, c1), _ = parent(processor, tokenizer, 2, kind)
    seen: list[RequestOutput] = []
    for entries in ([EngineCoreOutput(c0, ids(tokenizer, WORDS[0])), EngineCoreOutput(c1, ids(tokenizer, WORDS[1]))],
                    [EngineCoreOutput(c0, ids(tokenizer, WORDS[2]), FinishReason.LENGTH)],
                    [EngineCoreOutput(c1, ids(tokenizer, WORDS[3]))],
                    [EngineCoreOutput(c1, ids(tokenizer, WORDS[4]), FinishReason.LENGTH)]):
        out, _ = step(processor, queue, entries)
        assert out is not None
        seen.append(out)
    assert [o.finished for o in seen] == [False, False, False, True]
    assert [sorted(c.index for c in o.outputs) for o in seen] == [[0, 1], [0], [1], [1]]
    assert seen[-1].metrics is not None and seen[1].metrics is None
    texts: dict[int, str] = {0: "", 1: ""}
    for o in seen:
        for c in o.outputs:
            texts[c.index] = texts[c.index] + c.text if kind is K.DELTA else c.text
    assert texts == {0: " one three", 1: " two four five"}


def test_aborting_the_parent_aborts_every_child_and_ends_once(tokenizer: Any) -> None:
    """The parent's id expands to its live children (what the engine must abort); each ends with
    "abort"; FINAL_ONLY gets one output with all n, the partial text included."""
    processor = OutputProcessor(tokenizer)
    queue, (c0, c1, c2), _ = parent(processor, tokenizer, 3, K.FINAL_ONLY)
    step(processor, queue, [EngineCoreOutput(c1, ids(tokenizer, WORDS[1]), FinishReason.LENGTH),
                            EngineCoreOutput(c0, ids(tokenizer, WORDS[0]))])
    assert processor.engine_ids(["p"]) == [c0, c2]
    finals = processor.abort_requests(processor.engine_ids(["p"]))
    out = queue.get_nowait()
    assert out is not None and out is finals["p"] and out.finished
    assert [(c.index, c.text, c.finish_reason) for c in out.outputs] == [
        (0, " one", "abort"), (1, " two", "length"), (2, "", "abort")]
    assert not processor.has_unfinished_requests()


def test_one_child_failing_finishes_that_child_alone(tokenizer: Any) -> None:
    """Child 1's detokenizer raises: it finishes with "error" (and is listed to abort), child 0 goes on;
    the final output says which sample failed."""
    processor = OutputProcessor(tokenizer)
    queue, (c0, c1), _ = parent(processor, tokenizer, 2, K.CUMULATIVE)

    state = processor._states[c1]
    state.detokenizer = _FailingDetokenizer(state.detokenizer, 0)  # the test-only fault: raises on its first token
    processed = processor.process_outputs([EngineCoreOutput(c0, ids(tokenizer, WORDS[0])),
                                           EngineCoreOutput(c1, ids(tokenizer, WORDS[1]))])
    assert processed.reqs_to_abort == [c1] and list(processed.failed) == [c1]
    out = queue.get_nowait()
    assert out is not None and not out.finished
    assert {c.index: c.finish_reason for c in out.outputs} == {0: None, 1: "error"}
    processor.process_outputs([EngineCoreOutput(c0, ids(tokenizer, WORDS[2]), FinishReason.LENGTH)])
    final = queue.get_nowait()
    assert final is not None and final.finished and final.error is not None and final.error.startswith("sample 1:")
    assert [(c.index, c.text) for c in final.outputs] == [(0, " one three")]


def test_held_children_are_released_once_to_child_0s_engine(tokenizer: Any) -> None:
    """With a shared prefill the first output of child 0 releases the parent once; `take_held` gives
    the still-live held children pinned to that engine (aborted ones are dropped)."""
    processor = OutputProcessor(tokenizer)
    queue, (c0, c1, c2), _ = parent(processor, tokenizer, 3, K.DELTA, held=True)
    processor.abort_requests([c2])
    _, release = step(processor, queue, [EngineCoreOutput(c0, ids(tokenizer, WORDS[0]))], engine_index=1)
    assert release == ["p"]
    assert [(r.request_id, r.data_parallel_rank) for r in processor.take_held("p")] == [(c1, 1)]
    assert processor.take_held("p") == []
    assert step(processor, queue, [EngineCoreOutput(c0, ids(tokenizer, WORDS[1]))])[1] == []


def test_n_above_one_with_greedy_sampling_is_refused() -> None:
    """n > 1 samples at temperature 0 would all be equal: refused, naming the field."""
    with pytest.raises(ValueError, match="n"):
        SamplingParams(n=2, temperature=0.0)
    assert SamplingParams(n=2, temperature=0.5).n == 2


def test_a_parent_whose_children_cannot_all_register_leaves_nothing_behind() -> None:
    """Stop strings without a tokenizer are refused on the first child: the request is rejected and
    neither the parent nor any child stays registered."""
    table = RequestTable(tokenizer=None)
    with pytest.raises(ValueError, match="stop"):
        table.register(add_request("p", n=2, temperature=1.0, stop=["x"]), None)
    assert table.num_unfinished == 0 and table.processor.engine_ids(["p"]) == []
    stream, to_send = table.register(add_request("p", n=2, temperature=1.0), None)
    assert [r.request_id for r in to_send] == ["0_p", "1_p"]  # a prompt shorter than a block: no hold
