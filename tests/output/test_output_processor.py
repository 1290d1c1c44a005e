"""`OutputProcessor`: engine outputs -> user outputs (modelled on vLLM's test_output_processor.py).

A fake engine replays premade token lists as `EngineCoreOutput`s, `chunk` tokens per step, with
all requests interleaved in each step's batch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import pytest

from troupe.errors import InvalidInputError
from troupe.messages import EngineCoreOutput, FinishReason
from troupe.output.processor import OutputProcessor
from troupe.outputs import RequestOutput
from troupe.sampling_params import RequestOutputKind, SamplingParams

K = RequestOutputKind
SENTENCES = [
    "The quick brown fox jumps over the lazy dog. It was a sunny day in Paris.",
    "Héllo wörld! Ünïcödé — “quotes” and a naïve café façade.",
    "你好，世界。日本語のテキストも。한국어 문장도 있습니다.",
    "Rocket 🚀 party 🎉 family 👨‍👩‍👧 sparkles ✨!",
]
PROMPT = "<|im_start|>user\nTell me something.<|im_end|>\n<|im_start|>assistant\n"
EOS = 2  # <|im_end|>


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def engine_steps(
    requests: dict[str, list[int]],
    chunk: int = 1,
    finish: FinishReason = FinishReason.LENGTH,
    stop_reason: int | str | None = None,
) -> list[list[EngineCoreOutput]]:
    """One batch per engine step; each request ends with `finish` on its last tokens."""
    steps: list[list[EngineCoreOutput]] = []
    for rid, ids in requests.items():
        for i, start in enumerate(range(0, len(ids), chunk)):
            last = start + chunk >= len(ids)
            eco = EngineCoreOutput(
                rid, ids[start : start + chunk], finish if last else None, stop_reason if last else None
            )
            if i == len(steps):
                steps.append([])
            steps[i].append(eco)
    return steps


def run(processor: OutputProcessor, steps: Sequence[Sequence[EngineCoreOutput]]):
    """Process every step; returns (outputs per internal id, ids to abort per step)."""
    outs: dict[str, list[RequestOutput]] = defaultdict(list)
    aborts: list[list[str]] = []
    for batch in steps:
        processed = processor.process_outputs(list(batch))
        for rid, out in processed.request_outputs.items():
            outs[rid].append(out)
        aborts.append(processed.reqs_to_abort)
    return outs, aborts


def add(processor: OutputProcessor, tokenizer: Any, rid: str, **params: Any) -> None:
    processor.add_request(rid, f"ext-{rid}", PROMPT, encode(tokenizer, PROMPT), SamplingParams(**params))


def final_text_and_ids(outputs: list[RequestOutput], kind: RequestOutputKind) -> tuple[str, list[int]]:
    """The text and ids the user ends up with: joined deltas, or the last output's."""
    if kind is K.DELTA:
        return "".join(o.outputs[0].text for o in outputs), [
            t for o in outputs for t in o.outputs[0].token_ids
        ]
    return outputs[-1].outputs[0].text, outputs[-1].outputs[0].token_ids


def emitted_prefixes(outputs: list[RequestOutput], kind: RequestOutputKind) -> list[str]:
    """What the user has seen after each output."""
    if kind is not K.DELTA:
        return [o.outputs[0].text for o in outputs]
    seen, prefixes = "", []
    for o in outputs:
        seen += o.outputs[0].text
        prefixes.append(seen)
    return prefixes


def assert_well_formed(outputs: list[RequestOutput], kind: RequestOutputKind, external_id: str) -> None:
    """Only the last output is finished; FINAL_ONLY emits once; ids are external."""
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert all(o.request_id == external_id for o in outputs)
    if kind is K.FINAL_ONLY:
        assert len(outputs) == 1
    assert outputs[-1].metrics is not None and outputs[-1].metrics.finished_time is not None


@pytest.mark.parametrize("kind", list(K))
@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenization(tokenizer, kind, chunk, skip_special_tokens):
    """For every output kind the user ends up with `tokenizer.decode(ids)` and all ids; cumulative
    texts only grow; nothing mid-stream has a replacement character; the state is freed."""
    processor = OutputProcessor(tokenizer)
    gens = {str(i): [1] + encode(tokenizer, s) + [EOS] for i, s in enumerate(SENTENCES)}
    for rid in gens:
        add(processor, tokenizer, rid, output_kind=kind, skip_special_tokens=skip_special_tokens)
    outs, aborts = run(processor, engine_steps(gens, chunk))
    for rid, ids in gens.items():
        assert_well_formed(outs[rid], kind, f"ext-{rid}")
        assert final_text_and_ids(outs[rid], kind) == (
            tokenizer.decode(ids, skip_special_tokens=skip_special_tokens),
            ids,
        )
        prefixes = emitted_prefixes(outs[rid], kind)
        assert all(b.startswith(a) for a, b in zip(prefixes, prefixes[1:], strict=False))
        assert all("\ufffd" not in p for p in prefixes)
        assert outs[rid][-1].outputs[0].finish_reason == "length"
    assert aborts == [[] for _ in aborts]
    assert not processor.has_unfinished_requests() and processor.num_unfinished_requests == 0


# (sentence, stop strings, text before the stop string) — the stop strings span token boundaries.
STOP_CASES = [
    (0, ["fox jum"], "The quick brown "),
    (0, ["lazy dog", "sunny"], "The quick brown fox jumps over the "),
    (1, ["café"], "Héllo wörld! Ünïcödé — “quotes” and a naïve "),
    (2, ["世界"], "你好，"),
    (3, ["🎉 fam", "xyz"], "Rocket 🚀 party "),
]


@pytest.mark.parametrize("kind", list(K))
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize(("sentence", "stop", "before"), STOP_CASES)
def test_stop_string(tokenizer, kind, include, chunk, sentence, stop, before):
    """A stop string finishes the request with "stop" and the string as stop_reason, cuts the text
    before it (after it with include), asks the caller to abort it in the engine, keeps every
    generated token id, and no emitted text ever shows part of the stop string."""
    ids = encode(tokenizer, SENTENCES[sentence])
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, "r", output_kind=kind, stop=stop, include_stop_str_in_output=include)
    outs, aborts = run(processor, engine_steps({"r": ids}, chunk))
    matched = next(s for s in stop if SENTENCES[sentence].startswith(before + s))
    expected_text = before + matched if include else before
    # The request stops in the first step whose ids decode to text containing the stop string.
    n_steps = next(k for k in range(1, len(ids) + 1) if matched in tokenizer.decode(ids[: k * chunk]))
    out = outs["r"]
    assert_well_formed(out, kind, "ext-r")
    assert final_text_and_ids(out, kind) == (expected_text, ids[: n_steps * chunk])
    assert (out[-1].outputs[0].finish_reason, out[-1].outputs[0].stop_reason) == ("stop", matched)
    assert all(expected_text.startswith(p) for p in emitted_prefixes(out, kind))
    engine_finished = n_steps * chunk >= len(ids)  # then the engine has dropped it already
    assert [rid for step in aborts for rid in step] == ([] if engine_finished else ["r"])
    assert not processor.has_unfinished_requests()


@pytest.mark.parametrize("kind", list(K))
@pytest.mark.parametrize(
    ("stop_id", "include", "skip_special", "stop_text"),
    [
        (30, False, True, ""),  # a stop_token_ids entry ('.'): its text is left out...
        (30, True, True, "."),  # ...unless include_stop_str_in_output
        (EOS, False, False, ""),  # EOS with special tokens shown: still left out
        (EOS, True, False, "<|im_end|>"),
        (EOS, True, True, ""),  # skipped as a special token anyway
    ],
)
def test_stop_token(tokenizer, kind, stop_id, include, skip_special, stop_text):
    """The engine stopping on a stop token finishes with "stop" and the id as stop_reason (None for
    EOS); the token's id is kept, its text only with include_stop_str_in_output; no abort needed."""
    body = encode(tokenizer, SENTENCES[1])
    ids = body + [stop_id]
    processor = OutputProcessor(tokenizer)
    add(
        processor,
        tokenizer,
        "r",
        output_kind=kind,
        include_stop_str_in_output=include,
        skip_special_tokens=skip_special,
    )
    reason = None if stop_id == EOS else stop_id
    outs, aborts = run(processor, engine_steps({"r": ids}, 1, FinishReason.STOP, reason))
    assert_well_formed(outs["r"], kind, "ext-r")
    assert final_text_and_ids(outs["r"], kind) == (tokenizer.decode(body) + stop_text, ids)
    last = outs["r"][-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", reason)
    assert all(not step for step in aborts)


def test_stop_string_in_the_engines_last_step(tokenizer):
    """A stop string found in the step where the engine finished (for length) wins: finish "stop",
    and no abort is requested because the engine already dropped the request."""
    ids = encode(tokenizer, SENTENCES[0])
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, "r", stop=["sunny"])
    outs, aborts = run(processor, [[EngineCoreOutput("r", ids, FinishReason.LENGTH)]])
    last = outs["r"][-1].outputs[0]
    assert (last.text, last.finish_reason, last.stop_reason) == (
        SENTENCES[0].split("sunny")[0],
        "stop",
        "sunny",
    )
    assert aborts == [[]]


@pytest.mark.parametrize("kind", [K.DELTA, K.CUMULATIVE])
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_min_tokens_delays_stop_strings(tokenizer, kind, chunk):
    """Stop strings in the text of the first min_tokens tokens are ignored; the next one stops."""
    text = "Tom and Ann and Bob and Eve went home."
    ids = encode(tokenizer, text)
    first = next(k for k in range(len(ids)) if " and" in tokenizer.decode(ids[:k]))
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, "r", output_kind=kind, stop=[" and"], min_tokens=first + 1)
    outs, _ = run(processor, engine_steps({"r": ids}, chunk))
    assert final_text_and_ids(outs["r"], kind)[0] == "Tom and Ann"
    assert outs["r"][-1].outputs[0].stop_reason == " and"


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("include", [False, True])
def test_delta_concatenation_equals_cumulative(tokenizer, chunk, include):
    """Joined DELTA texts and ids equal the final CUMULATIVE text and ids, with stop strings held back."""
    finals = {}
    for kind in (K.DELTA, K.CUMULATIVE):
        processor = OutputProcessor(tokenizer)
        gens = {str(i): encode(tokenizer, s) for i, s in enumerate(SENTENCES)}
        for rid in gens:
            add(
                processor,
                tokenizer,
                rid,
                output_kind=kind,
                stop=["sunny", "façade", "ext", "✨"],
                include_stop_str_in_output=include,
            )
        outs, _ = run(processor, engine_steps(gens, chunk))
        finals[kind] = {rid: final_text_and_ids(o, kind) for rid, o in outs.items()}
    assert finals[K.DELTA] == finals[K.CUMULATIVE]


@pytest.mark.parametrize("kind", list(K))
@pytest.mark.parametrize("by", ["internal", "external"])
def test_abort(tokenizer, kind, by):
    """An abort ends the request with finish_reason "abort" and stop_reason None. FINAL_ONLY and
    CUMULATIVE get all partial text (held-back text included), DELTA only what was not sent yet;
    later outputs for the id are dropped and the state is gone."""
    ids = encode(tokenizer, SENTENCES[0])
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, "r", output_kind=kind, stop=["never-matches"])
    add(processor, tokenizer, "other", output_kind=kind)
    steps = engine_steps({"r": ids, "other": ids}, 1)
    outs, _ = run(processor, steps[:6])
    finals = processor.abort_requests(["r"] if by == "internal" else ["ext-r"], internal=by == "internal")
    assert list(finals) == ["r"]
    outs["r"].append(finals["r"])
    assert_well_formed(outs["r"], kind, "ext-r")
    text, token_ids = final_text_and_ids(outs["r"], kind)
    assert (text, token_ids) == (tokenizer.decode(ids[:6]), ids[:6])
    assert (finals["r"].outputs[0].finish_reason, finals["r"].outputs[0].stop_reason) == ("abort", None)
    later, _ = run(processor, steps[6:])
    assert "r" not in later and later["other"][-1].finished
    assert processor.abort_requests(["r", "unknown"]) == {}
    assert not processor.has_unfinished_requests()


def test_unknown_ids_are_dropped(tokenizer):
    """Outputs for ids that were never added produce nothing and raise nothing."""
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, "r")
    processed = processor.process_outputs(
        [
            EngineCoreOutput("ghost", [5, 6]),
            EngineCoreOutput("r", [5]),
            EngineCoreOutput("ghost", [], FinishReason.STOP),
        ]
    )
    assert list(processed.request_outputs) == ["r"] and processed.reqs_to_abort == []


def test_state_freed_after_every_kind_of_finish(tokenizer):
    """Requests ending by length, stop token, stop string, error and abort leave no state behind."""
    processor = OutputProcessor(tokenizer)
    for rid in ("length", "token", "string", "error", "abort"):
        add(processor, tokenizer, rid, stop=["over"])
    ids = encode(tokenizer, SENTENCES[0])
    processor.process_outputs(
        [EngineCoreOutput(rid, ids[:2]) for rid in ("length", "token", "string", "error", "abort")]
    )
    processed = processor.process_outputs(
        [
            EngineCoreOutput("length", ids[2:4], FinishReason.LENGTH),
            EngineCoreOutput("token", ids[2:4], FinishReason.STOP, 7),
            EngineCoreOutput("string", ids[2:]),
            EngineCoreOutput("error", [], FinishReason.ERROR, error="boom"),
        ]
    )
    reasons = {rid: o.outputs[0].finish_reason for rid, o in processed.request_outputs.items()}
    assert reasons == {"length": "length", "token": "stop", "string": "stop", "error": "error"}
    assert processed.reqs_to_abort == ["string"]
    assert processor.num_unfinished_requests == 1
    processor.abort_requests(["abort"])
    assert not processor.has_unfinished_requests()
    assert list(processor.request_ids()) == [] and processor.internal_ids("ext-abort") == []


@pytest.mark.parametrize("kind", list(K))
def test_slices_give_the_same_outputs(tokenizer, kind):
    """Processing a big batch in slices (any split) gives what processing it whole gives."""
    gens = {str(i): encode(tokenizer, SENTENCES[i % len(SENTENCES)]) for i in range(40)}
    results = []
    for slice_size in (None, 7):
        processor = OutputProcessor(tokenizer)
        for rid in gens:
            add(processor, tokenizer, rid, output_kind=kind, stop=["sunny"])
        outs: dict[str, list[RequestOutput]] = defaultdict(list)
        for batch in engine_steps(gens, 2):
            size = slice_size or len(batch)
            for start in range(0, len(batch), size):
                for rid, out in processor.process_outputs(
                    batch[start : start + size]
                ).request_outputs.items():
                    outs[rid].append(out)
        results.append(
            {
                rid: [(o.outputs[0].text, o.outputs[0].token_ids, o.finished) for o in v]
                for rid, v in outs.items()
            }
        )
    assert results[0] == results[1]


@pytest.mark.parametrize("kind", [K.DELTA, K.CUMULATIVE])
def test_same_request_twice_in_one_batch(tokenizer, kind):
    """Two entries for one request in one list give one output holding both (DELTA concatenates,
    CUMULATIVE keeps the later, which already holds everything)."""
    ids = encode(tokenizer, "Hello world")
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, "r", output_kind=kind)
    processed = processor.process_outputs([EngineCoreOutput("r", ids[:1]), EngineCoreOutput("r", ids[1:])])
    assert processed.request_outputs["r"].outputs[0].text == "Hello world"
    assert processed.request_outputs["r"].outputs[0].token_ids == ids


def test_duplicate_external_ids_and_metadata(tokenizer):
    """Two live requests may share an external id; outputs carry it, the prompt, the cached-token
    count and (on the final output) timing metrics."""
    processor = OutputProcessor(tokenizer)
    prompt_ids = encode(tokenizer, PROMPT)
    for rid in ("a", "b"):
        processor.add_request(rid, "same", PROMPT, prompt_ids, SamplingParams(), arrival_time=10.0)
    assert processor.internal_ids("same") == ["a", "b"]
    with pytest.raises(ValueError, match="already live"):
        processor.add_request("a", "x", None, prompt_ids, SamplingParams())
    first = processor.process_outputs([EngineCoreOutput("a", [5], num_cached_tokens=16)], now=11.0)
    last = processor.process_outputs([EngineCoreOutput("a", [6], FinishReason.LENGTH)], now=12.5)
    out = last.request_outputs["a"]
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.num_cached_tokens) == (
        "same",
        PROMPT,
        prompt_ids,
        16,
    )
    assert first.request_outputs["a"].metrics is None
    assert out.metrics is not None and out.metrics.time_to_first_token == 1.0
    assert (out.metrics.num_generation_tokens, out.metrics.last_token_time) == (2, 12.5)
    assert processor.internal_ids("same") == ["b"]


def test_stop_strings_need_a_tokenizer():
    """Without a tokenizer there is no text: stop strings are rejected, ids still flow."""
    processor = OutputProcessor()
    with pytest.raises(InvalidInputError, match="stop"):
        processor.add_request("r", "r", None, [1, 2], SamplingParams(stop=["x"]))
    processor.add_request("r", "r", None, [1, 2], SamplingParams(output_kind=K.DELTA))
    out = processor.process_outputs([EngineCoreOutput("r", [3, 4], FinishReason.LENGTH)]).request_outputs["r"]
    assert (out.outputs[0].text, out.outputs[0].token_ids, out.finished) == ("", [3, 4], True)
