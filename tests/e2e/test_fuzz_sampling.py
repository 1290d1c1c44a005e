"""Property-based end-to-end tests of every `SamplingParams` field on the real default model.

One `LLM()` (the default model, SmolLM2-135M, its EngineCore in its own process) serves the
module, with `max_model_len=64` so that `max_tokens=None` stays cheap and
`scheduling_policy="priority"` so that every int64 `priority` is valid. Each case is a prompt, a
set of `SamplingParams` fields (each left at its default, set to a valid value, or set to an
invalid one; a few invalid ones are set after construction, which submission must catch) and a
priority. Cases run in batches, all at once through the `AsyncLLM` behind the `LLM` (so every
`output_kind` streams as it would for a user). For each case:

- invalid: `InvalidInputError` naming one of the fields made invalid, raised at construction or at
  submission, and nothing reached the engine (its `num_requests_added` counts only valid cases);
- valid: the finish reason and token count its parameters promise (`length` means exactly
  `max_tokens`, or the context's room when it is None; EOS and stop ids end it only past
  `min_tokens`, and never earlier; a stop id is the last token and the `stop_reason`; a stop string
  is in the text of the ids and cuts the text, or ends it with `include_stop_str_in_output`),
  the stream its `output_kind` promises (one final output; DELTA pieces add up; CUMULATIVE grows),
  no text with `detokenize=False`, else the tokenizer's own decoding of the ids;
- and after each batch the engine is healthy.

`test_every_field_alone` sweeps each field's edge values one at a time (deterministic coverage);
`test_random_combinations` draws combinations with hypothesis (derandomized, bounded) on top of an
explicit batch (`MIXED`) that holds, by construction, a case of each outcome the test promises: a
stop, a length, an invalid field refused at construction and one refused at submission. No
assertion counts what the generator happened to draw.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import time
import warnings
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from troupe import (
    LLM,
    AsyncLLM,
    InvalidInputError,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # hundreds of requests through the engine

MAX_MODEL_LEN = 64
VOCAB = 49152
I64 = 2**63
PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,", "Write a haiku about the sea.",
           "Q: What is 2 + 2?\nA:", {"prompt_token_ids": [1, 9690, 198, 19556, 314]}]
STOP_STRINGS = [" ", "e", "the", ".", "\n", ",", "a", "is", "<|im_end|>"]
COMMON_IDS = [2, 0, 1, 28, 30, 216, 260, 253, 314, 357, 198]  # eos/specials, punctuation, frequent words
KINDS = list(RequestOutputKind)
SO = StructuredOutputsParams

# field -> (valid values, invalid values). Floats include NaN/inf, ints the int64 edges, bools where
# numbers are expected and numbers where bools are.
FIELDS: dict[str, tuple[list[Any], list[Any]]] = {
    "n": ([1], [0, True, 1.0]),  # n > 1: tests/facades/test_parallel_sampling.py
    "presence_penalty": ([0.0, 0, 0.5, -2.0, 2], [-3.0, 2.01, math.nan, "0"]),
    "frequency_penalty": ([0.0, 1.0, -1.5], [2.5, math.inf, None]),
    "repetition_penalty": ([1.0, 1.2, 0.5, 3], [0.0, -1.0, math.inf, math.nan]),
    "temperature": ([0.0, 0, 1e-6, 0.005, 0.3, 0.7, 1.0, 1.5, 2, 1e6],
                    [-0.1, -math.inf, math.inf, math.nan, "1", True, None]),
    "top_p": ([1.0, 1, 0.9, 0.5, 0.05, 1e-9], [0.0, -0.5, 1.01, math.nan, math.inf, None, True]),
    "top_k": ([0, -1, 1, 2, 40, VOCAB, VOCAB + 1, I64 - 1], [-2, I64, 2.0, True, None, "5"]),
    "min_p": ([0.0, 0.05, 0.5, 1.0, 1], [-0.01, 1.01, math.nan, None, False]),
    "seed": ([None, -1, 0, 1, 12345, I64 - 1, -I64, -2], [I64, -I64 - 1, 2**70, 1.5, True, "7"]),
    "stop": ([None, [], *STOP_STRINGS, [" the", "."], ("\n", "is"), "é"],
             ["", [""], 5, [5], [None], {"a": 1}, "\ud800", ["ok", "a\udc80"]]),
    "stop_token_ids": ([None, [], [2], [28, 30], [216], [VOCAB - 1], [7777], COMMON_IDS],
                       [[-1], [VOCAB], [2**64], [True], "1", 5, [1.0]]),
    "ignore_eos": ([False, True], [0, 1, None, "yes"]),
    "max_tokens": ([1, 2, 3, 4, 5, 6, None], [0, -1, I64, 1.0, True, "3"]),
    "min_tokens": ([0, 1, 2, 3, 5], [-1, I64, 1.5, True, None]),
    "logprobs": ([None, 0, 1, 5, 20], [-2, 21, 1.5, True]),
    "prompt_logprobs": ([None, 0, 3], [-2, 25, "1"]),
    "logit_bias": ([None, {}, {260: 5.0}, {"28": -100}, {2: 1e9}, {VOCAB - 1: -0.5}],
                   [{-1: 1.0}, {VOCAB: 1.0}, {1: math.nan}, [1], {"x": 1}]),
    "allowed_token_ids": ([None, [1000, 1001, 1002, 5000], [7777]], [[], [VOCAB], [-1], "1"]),
    "bad_words": ([None, [], ["the"], "e", ["hello world"]], [[""], [5], 5]),
    "structured_outputs": ([None, SO(choice=["yes", "no"]), SO(regex="[a-z]{1,3}"), SO(json={"type": "integer"})],
                           [SO(regex="("), SO(grammar="root ::= nothing"), {"regex": "a"}]),
    "detokenize": ([True, False], [1, None]),
    "skip_special_tokens": ([True, False], ["no", 0]),
    "spaces_between_special_tokens": ([True, False], [None, 1]),
    "include_stop_str_in_output": ([False, True], [1, "true"]),
    "output_kind": ([*KINDS, 0, 1, 2], [3, -1, True, "DELTA", None, 1.0]),
    "priority": ([0, 1, -5, I64 - 1, -I64], [I64, -I64 - 1, 1.5, True, "0"]),  # an argument of generate
}
SUBMISSION_ONLY = {"priority"}  # not a SamplingParams field


@dataclasses.dataclass
class Case:
    """One request: the fields set, which of them are invalid, and what came back."""

    prompt: Any
    fields: dict[str, Any]
    invalid: set[str]
    mutate: dict[str, Any] = dataclasses.field(default_factory=dict)  # set after construction
    params: SamplingParams | None = None
    error: InvalidInputError | None = None
    outputs: list[RequestOutput] = dataclasses.field(default_factory=list)
    rid: str = ""

    def build(self) -> None:
        """Construct the params (an invalid field may raise here already), then apply `mutate`."""
        kwargs = {k: v for k, v in self.fields.items() if k not in SUBMISSION_ONLY}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # temperature < 0.01 is raised, with a warning
                self.params = SamplingParams(**kwargs)
        except InvalidInputError as exc:
            self.error = exc
            return
        for name, value in self.mutate.items():
            setattr(self.params, name, value)


def expected_invalid(fields: dict[str, Any]) -> set[str]:
    """The fields that make a combination invalid (the oracle, written from the documented ranges)."""
    bad = {name for name, value in fields.items() if not any(_same(value, v) for v in FIELDS[name][0])}
    max_tokens, min_tokens = fields.get("max_tokens", 16), fields.get("min_tokens", 0)
    if "max_tokens" not in bad and "min_tokens" not in bad and max_tokens is not None and min_tokens > max_tokens:
        bad.add("min_tokens")
    stop = fields.get("stop")
    if "stop" not in bad and "detokenize" not in bad and stop and fields.get("detokenize", True) is False:
        bad.add("stop")
    return bad


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same type (1 is not True, 1.0 is not 1 for an int field)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return bool(a == b)


# ---------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def llm(tokenizer: Any) -> Iterator[LLM]:
    with LLM(max_model_len=MAX_MODEL_LEN, scheduling_policy="priority") as llm:
        yield llm


@dataclasses.dataclass
class Totals:
    cases: int = 0
    valid: int = 0
    invalid: int = 0
    batches: int = 0
    finish: dict[str, int] = dataclasses.field(default_factory=dict)


TOTALS = Totals()
_ids = itertools.count()


async def _stream_all(engine: AsyncLLM, cases: list[Case]) -> None:
    async def one(case: Case) -> None:
        assert case.params is not None
        try:
            async for out in engine.generate(case.prompt, case.params, case.rid,
                                             priority=case.fields.get("priority", 0)):
                case.outputs.append(out)
        except InvalidInputError as exc:
            case.error = exc

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for case in cases:
                tg.start_soon(one, case)
        await engine.check_health()


def run_batch(llm: LLM, tokenizer: Any, cases: list[Case]) -> None:
    """Run every case at once and check each against its parameters' promises."""
    for case in cases:
        case.rid = f"fz{next(_ids)}"
        case.build()
    added_before = llm.get_stats()["num_requests_added"]
    llm._call(_stream_all, llm._engine, [c for c in cases if c.error is None])
    added = llm.get_stats()["num_requests_added"] - added_before
    eos = set(llm._engine._graph.limits.eos_token_ids)
    for case in cases:
        TOTALS.cases += 1
        if case.invalid:
            TOTALS.invalid += 1
            assert case.error is not None, f"accepted: {case}"
            assert case.error.field.split(".")[0] in case.invalid, (case.error, case)
            assert not case.outputs
        else:
            TOTALS.valid += 1
            assert case.error is None, (case.error, case)
            check_valid(case, tokenizer, eos)
    assert added == sum(1 for c in cases if not c.invalid)  # nothing invalid reached the engine
    TOTALS.batches += 1


def check_valid(case: Case, tokenizer: Any, eos: set[int]) -> None:
    p = case.params
    assert p is not None
    outs = case.outputs
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1]), case
    final = outs[-1]
    c = final.outputs[0]
    TOTALS.finish[str(c.finish_reason)] = TOTALS.finish.get(str(c.finish_reason), 0) + 1
    if p.structured_outputs is not None and check_structured(case, final):
        return
    assert final.error is None and c.finish_reason in ("stop", "length"), (final, case)
    # the stream its output kind promises
    if p.output_kind is RequestOutputKind.FINAL_ONLY:
        assert len(outs) == 1
        ids, text = c.token_ids, c.text
    elif p.output_kind is RequestOutputKind.DELTA:
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        text = "".join(o.outputs[0].text for o in outs)
    else:
        for before, after in itertools.pairwise(outs):
            assert after.outputs[0].token_ids[:len(before.outputs[0].token_ids)] == before.outputs[0].token_ids
        ids, text = c.token_ids, c.text
    prompt_len = len(final.prompt_token_ids or ())
    limit = MAX_MODEL_LEN - prompt_len if p.max_tokens is None else min(p.max_tokens, MAX_MODEL_LEN - prompt_len)
    n = len(ids)
    assert max(1, p.min_tokens if p.min_tokens <= limit else limit) <= n <= limit, (n, limit, case)
    stop_ids = set(p.stop_token_ids or ())
    ends = eos if not p.ignore_eos else set()
    for i, t in enumerate(ids):  # nothing that ends a request came before its end, nor under min_tokens
        if i < p.min_tokens or i < n - 1:
            assert t not in ends | stop_ids, (i, t, case)
    stopped_by_token = False
    if c.finish_reason == "length":
        assert n == limit, (n, limit, case)
    elif c.stop_reason is None:  # EOS
        assert ids[-1] in ends and n >= p.min_tokens, case
        stopped_by_token = True
    elif isinstance(c.stop_reason, int):
        assert c.stop_reason in stop_ids and ids[-1] == c.stop_reason and ids[-1] not in ends, case
        assert n >= p.min_tokens
        stopped_by_token = True
    else:
        assert c.stop_reason in p.stop_strings and p.detokenize and n > p.min_tokens, case
        decoded = tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        assert c.stop_reason in decoded, (decoded, case)
        if p.include_stop_str_in_output:
            assert text.endswith(c.stop_reason), (text, case)
        elif p.min_tokens == 0:
            assert c.stop_reason not in text, (text, case)
    if not p.detokenize:
        assert all(o.outputs[0].text == "" for o in outs)
    elif not isinstance(c.stop_reason, str) and p.spaces_between_special_tokens:
        shown = ids[:-1] if stopped_by_token and not p.include_stop_str_in_output else ids
        assert text == tokenizer.decode(shown, skip_special_tokens=p.skip_special_tokens), (text, case)


def check_structured(case: Case, final: RequestOutput) -> bool:
    """A structured request: it ends on its grammar's end (the model's EOS, even with ignore_eos) with
    matching text, or at length, or, when the grammar and the other masks (min_tokens, allowed_token_ids,
    bad_words) leave no token, fails with "every token is masked"; True when that settled it (else the
    generic checks apply)."""
    p, c = case.params, final.outputs[0]
    assert p is not None and p.structured_outputs is not None
    spec = p.structured_outputs
    if c.finish_reason == "error":
        assert "masked" in (final.error or ""), (final, case)
        return True
    assert final.error is None and c.finish_reason in ("stop", "length"), (final, case)
    if c.finish_reason == "stop" and p.detokenize and p.output_kind is not RequestOutputKind.DELTA:
        if not isinstance(c.stop_reason, str):
            text = c.text
            if spec.choice is not None:
                assert text in spec.choice, (text, case)
            elif spec.regex is not None:
                assert re.fullmatch(spec.regex, text), (text, case)
            else:
                int(text)
    return c.finish_reason == "stop" and c.stop_reason is None


# ---------------------------------------------------------------------- the tests


def sweep_cases() -> list[Case]:
    """Each field's valid and invalid values one at a time (the others at their defaults), also
    set after construction for the invalid ones."""
    cases = []
    prompts = itertools.cycle(PROMPTS)
    base = {"max_tokens": 4, "ignore_eos": True}
    for name, (valid, invalid) in FIELDS.items():
        for value in valid:
            fields = {**base, name: value}
            if name == "min_tokens":
                fields["max_tokens"] = 6
            if name == "stop":
                fields["ignore_eos"] = False
            cases.append(Case(next(prompts), fields, expected_invalid(fields)))
        for value in invalid:
            fields = {**base, name: value}
            cases.append(Case(next(prompts), fields, {name}))
            if name not in SUBMISSION_ONLY:
                cases.append(Case(next(prompts), base.copy(), {name}, mutate={name: value}))
    cases.append(Case(PROMPTS[0], {"stop_token_ids": [VOCAB]}, {"stop_token_ids"}))
    cases.append(Case(PROMPTS[0], {"min_tokens": 5, "max_tokens": 4}, {"min_tokens"}))
    cases.append(Case(PROMPTS[0], {"stop": "x", "detokenize": False}, {"stop"}))
    return cases


def test_every_field_alone(llm: LLM, tokenizer: Any) -> None:
    """Every valid and invalid value of every field, alone, in batches of 16: invalid ones are
    refused before the engine naming the field, valid ones end as promised, the engine stays healthy."""
    started = time.monotonic()
    cases = sweep_cases()
    for i in range(0, len(cases), 16):
        run_batch(llm, tokenizer, cases[i:i + 16])
    print(f"\nsweep: {len(cases)} cases in {time.monotonic() - started:.1f} s")


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """A combination: 0-2 invalid fields (most cases valid), every other field default or valid."""
    names = list(FIELDS)
    n_invalid = draw(st.sampled_from([0, 0, 0, 0, 0, 1, 1, 2]))
    bad = draw(st.lists(st.sampled_from(names), min_size=n_invalid, max_size=n_invalid, unique=True))
    fields: dict[str, Any] = {}
    for name in names:
        valid, invalid = FIELDS[name]
        if name in bad:
            fields[name] = draw(st.sampled_from(invalid))
        elif draw(st.booleans()):
            fields[name] = draw(st.sampled_from(valid))
    max_tokens = fields.get("max_tokens", "unset")
    if max_tokens == "unset" or (max_tokens is None and draw(st.integers(0, 3)) > 0):
        fields["max_tokens"] = draw(st.integers(1, 6))  # None stays rare: it runs to the context's end
    mutate = {}
    if bad and bad[0] not in SUBMISSION_ONLY and draw(st.booleans()):
        mutate[bad[0]] = fields.pop(bad[0])
    prompt = draw(st.sampled_from(PROMPTS))
    invalid = expected_invalid(fields) | set(mutate)
    return Case(prompt, fields, invalid, mutate)


EXAMPLES = 60
# One explicit batch with every outcome the test promises, whatever hypothesis draws: a stop (the
# only allowed token is a stop id), a length (EOS ignored), an invalid field refused at construction
# and one set after construction and refused at submission.
MIXED = [
    Case(PROMPTS[0], {"allowed_token_ids": [7777], "stop_token_ids": [7777], "max_tokens": 4}, set()),
    Case(PROMPTS[1], {"max_tokens": 3, "ignore_eos": True, "temperature": 0.0}, set()),
    Case(PROMPTS[2], {"max_tokens": 2, "top_p": math.nan}, {"top_p"}),
    Case(PROMPTS[3], {"max_tokens": 2}, {"min_p"}, mutate={"min_p": 1.01}),
]


@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, print_blob=True,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
@given(batch=st.lists(cases(), min_size=1, max_size=8))
@example(batch=MIXED)
def _combinations(llm: LLM, tokenizer: Any, batch: list[Case]) -> None:
    run_batch(llm, tokenizer, batch)


def test_random_combinations(llm: LLM, tokenizer: Any) -> None:
    """Random combinations of every field's valid and invalid values (hypothesis, derandomized:
    EXAMPLES batches of up to 8, each one engine round) after the explicit `MIXED` batch: each
    ends as its parameters promise, or is refused naming a field that made it invalid; `MIXED` ended
    with its four outcomes; the engine is idle and healthy after all of them."""
    started, before = time.monotonic(), dataclasses.replace(TOTALS, finish=dict(TOTALS.finish))
    _combinations(llm, tokenizer)
    cases, valid, invalid = (TOTALS.cases - before.cases, TOTALS.valid - before.valid,
                             TOTALS.invalid - before.invalid)
    finish = {k: v - before.finish.get(k, 0) for k, v in TOTALS.finish.items()}
    print(f"\nhypothesis: {TOTALS.batches - before.batches} batches, {cases} cases ({valid} valid, "
          f"{invalid} invalid), finish reasons {finish}, in {time.monotonic() - started:.1f} s")
    stop, length, refused, refused_late = MIXED
    assert [o.finish_reason for o in stop.outputs[-1].outputs] == ["stop"]
    assert stop.outputs[-1].outputs[0].stop_reason == 7777
    assert [o.finish_reason for o in length.outputs[-1].outputs] == ["length"]
    assert refused.params is None and refused.error is not None and refused.error.field == "top_p"
    assert refused_late.params is not None and refused_late.error is not None and refused_late.error.field == "min_p"
    stats = llm.get_stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert llm._engine.num_unfinished_requests == 0 and not llm._engine.errored
