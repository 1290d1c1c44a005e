"""logit_bias, allowed_token_ids, bad_words, structured outputs and the logprobs' output kinds through
the real engine (the tiny random model; JSON schemas also on the default model), mixed in batches with
plain requests, under chunked prefill and preemption; bad values are `InvalidInputError`s naming the
field, and a request whose grammar fails fails alone."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest
from factories import CORES

from troupe import (
    LLM,
    AsyncLLM,
    InvalidInputError,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from troupe.config import EngineConfig
from troupe.core.engine_core import EngineCore
from troupe.inputs import bad_words_token_ids
from troupe.messages import AddRequest, FinishReason
from troupe.models.loader import load_tokenizer

pytestmark = pytest.mark.timeout(600)  # engines on the tiny and the default model, grammar compiles

ENGINE: dict[str, Any] = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=48, num_kv_blocks=14,
                              block_size=8, num_threads=CORES)
SO = StructuredOutputsParams
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "n", "ok"]}
REGEX = r"[a-c]{2,4}-\d{2}"
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= "x" | "yy" | "zzz"'
CHOICES = ["alpha", "beta", "gamma delta"]
# a structural tag that must be taken: <answer>, text per REGEX, </answer> (a JSON body would let a sampled
# model write whitespace up to max_tokens: structural tags have no compact-JSON option; the JSON bodies are
# checked on strings in tests/structured/test_structural_tag.py)
TAGGED = json.dumps({"type": "structural_tag", "format": {
    "type": "tag", "begin": "<answer>", "end": "</answer>", "content": {"type": "regex", "pattern": REGEX}}})


@pytest.fixture(scope="module")
def llm(tiny_llama: Path, check_leftovers: Any) -> Iterator[LLM]:
    with LLM(str(tiny_llama), **ENGINE) as llm:
        yield llm
    check_leftovers()


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_bias_allowed_and_bad_words_are_enforced(llm: LLM, tokenizer: Any) -> None:
    """In one batch with plain requests: +100 bias forces a token, -100 bans the greedy one, sampled
    tokens stay inside allowed_token_ids over several seeds, and a bad word (one and two tokens, taken
    from the unconstrained greedy output) never appears while the same prompt without it does."""
    prompt = "The quick brown fox jumps over the lazy dog and then"
    base = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    one = tokenizer.decode(base[:1]).strip()
    two = tokenizer.decode(base[2:4]).strip()
    allowed = [28, 30, 260, 314, 216]
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    cases = [plain,
             SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias={260: 100}),
             SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias={base[0]: -100}),
             *[SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed)
               for s in range(4)],
             SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, bad_words=[one, two]),
             SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)]
    outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * len(cases), cases, use_tqdm=False)]
    assert outs[0] == base and outs[-1] != []
    assert outs[1] == [260] * 16
    assert outs[2][0] != base[0]
    for ids in outs[3:7]:
        assert set(ids) <= set(allowed)
    words = bad_words_token_ids(tokenizer, [one, two], len(tokenizer))
    assert any(contains(base, w) for w in words)
    for w in words:
        assert not contains(outs[7], w), (w, outs[7])


def check_structured(spec: StructuredOutputsParams, text: str) -> None:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), spec.json if isinstance(spec.json, dict) else json.loads(spec.json))
    elif spec.json_object:
        assert isinstance(json.loads(text), dict)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice
    elif spec.structural_tag is not None:
        assert re.fullmatch(f"<answer>{REGEX}</answer>", text), text
    else:
        assert re.fullmatch(r"\((x|yy|zzz)(,(x|yy|zzz))*\)", text), text


def test_structured_outputs_match_mixed_with_everything(llm: LLM) -> None:
    """Regex, choice, EBNF grammar, JSON schema and structural-tag requests over several seeds, batched with plain,
    penalized, biased and logprob requests, under chunked prefill (48-token budget) and a KV pool small
    enough to preempt: each structured output matches its constraint and ends with "stop" (the grammar's
    end), the others finish as asked."""
    specs = [SO(regex=REGEX), SO(choice=CHOICES), SO(grammar=GRAMMAR), SO(json=SCHEMA, disable_any_whitespace=True),
             SO(json=json.dumps(SCHEMA), disable_any_whitespace=True), SO(structural_tag=TAGGED)]
    prompts, params = [], []
    for seed in range(3):
        for spec in specs:
            prompts.append(f"Request {seed}: answer in the required format, please. " * (1 + seed))
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=64, structured_outputs=spec,
                                         logprobs=2 if seed == 1 else None,
                                         repetition_penalty=1.2 if seed == 2 else 1.0))
    others = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=4, max_tokens=20, ignore_eos=True, presence_penalty=1.0,
                             logit_bias={30: 2.0}, logprobs=3)]
    outs = llm.generate(prompts + ["a plain prompt"] * 2, params + others, use_tqdm=False)
    for out, p in zip(outs, params, strict=False):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", (p.structured_outputs, comp)
        assert p.structured_outputs is not None
        check_structured(p.structured_outputs, comp.text)
        assert (comp.logprobs is not None) == (p.logprobs is not None)
    assert [len(o.outputs[0].token_ids) for o in outs[-2:]] == [20, 20]
    assert any(o.metrics is not None and o.metrics.num_preemptions > 0 for o in outs)


def test_json_outputs_validate_on_the_default_model(tokenizer: Any) -> None:
    """The default model, sampling over several seeds and greedy: every JSON-schema output
    validates against its schema, every json_object output is a JSON object (never another JSON value),
    and each ends on the grammar's end."""
    schema = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                             "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
              "required": ["name", "age", "tags"]}

    def chat(text: str) -> str:
        return str(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True))

    person = chat("Describe a fictional person as JSON with name, age and tags.")
    city = chat("Give a JSON object with keys city and country for Paris.")
    compact = SO(json=schema, disable_any_whitespace=True)  # sampled whitespace could run past max_tokens
    cases = [(person, SamplingParams(temperature=t, seed=s, max_tokens=200, structured_outputs=compact))
             for t, s in [(1.0, s) for s in range(6)] + [(0.0, None)]]
    cases += [(city, SamplingParams(temperature=t, seed=s, max_tokens=200, structured_outputs=SO(json_object=True)))
              for t, s in [(0.5, 0), (0.5, 1), (0.0, None)]]  # hotter open-ended JSON can outrun max_tokens
    with LLM(dtype="float32", max_model_len=512, num_threads=CORES) as llm:
        outs = llm.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
    for out, (_, p) in zip(outs, cases, strict=True):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
        assert p.structured_outputs is not None
        check_structured(p.structured_outputs, out.outputs[0].text)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: SamplingParams(structured_outputs=SO(regex="(unclosed")), "structured_outputs.regex"),
        (lambda: SamplingParams(structured_outputs=SO(grammar="root ::= ")), "structured_outputs.grammar"),
        (lambda: SamplingParams(structured_outputs=SO(grammar="root ::= undefined_rule")),
         "structured_outputs.grammar"),
        (lambda: SamplingParams(structured_outputs=SO(json={"type": "object", "properties": {"a": {"$ref": "#/x"}}})),
         "structured_outputs.json"),
        (lambda: SamplingParams(structured_outputs=SO(json="{not json")), "structured_outputs.json"),
        (lambda: SamplingParams(structured_outputs=SO(choice=[])), "structured_outputs.choice"),
        (lambda: SamplingParams(structured_outputs=SO(regex="a", choice=["b"])), "structured_outputs"),
        (lambda: SamplingParams(structured_outputs=SO(json_object=True, whitespace_pattern=" ")),
         "structured_outputs.whitespace_pattern"),
        (lambda: SamplingParams(structured_outputs=SO(structural_tag="{}")), "structured_outputs.structural_tag"),
        (lambda: SamplingParams(structured_outputs=SO(structural_tag="[1")), "structured_outputs.structural_tag"),
        (lambda: SamplingParams(structured_outputs=SO(structural_tag=json.dumps(
            {"type": "structural_tag", "format": {"type": "no-such-format"}}))), "structured_outputs.structural_tag"),
        (lambda: SamplingParams(structured_outputs=SO(structural_tag=json.dumps(
            {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}]}))),  # no triggers
         "structured_outputs.structural_tag"),
        (lambda: SamplingParams(structured_outputs=SO(structural_tag=json.dumps(
            {"structures": [{"begin": "<f>", "schema": "object", "end": "</f>"}], "triggers": ["<f"]}))),
         "structured_outputs.structural_tag"),
        (lambda: SamplingParams(logit_bias={49152: 1.0}), "logit_bias"),
        (lambda: SamplingParams(allowed_token_ids=[5, 10**6]), "allowed_token_ids"),
        (lambda: SamplingParams(logprobs=21), "logprobs"),
        (lambda: SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
        (lambda: SamplingParams(logprobs=-3), "logprobs"),
        (lambda: SamplingParams(bad_words=["ok", ""]), "bad_words"),
        (lambda: SamplingParams(repetition_penalty=-1.0), "repetition_penalty"),
    ],
)
def test_bad_values_name_the_field(llm: LLM, make: Any, field: str) -> None:
    """A bad value raises InvalidInputError naming the field (at construction or at submission), and
    the engine serves the next request."""
    with pytest.raises(InvalidInputError) as info:
        llm.generate(["hello"], make(), use_tqdm=False)
    assert info.value.field == field, info.value
    out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_a_grammar_that_leaves_no_token_fails_only_its_request(llm: LLM) -> None:
    """A choice grammar that can only end while min_tokens forbids EOS leaves no token to sample: that
    request fails with finish_reason "error" and the reason; the rest of its batch finishes."""
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, structured_outputs=SO(choice=["ab"])),
              SamplingParams(temperature=1.0, seed=2, max_tokens=12, structured_outputs=SO(regex=REGEX))]
    outs = llm.generate(["one", "two", "three"], params, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 12
    assert outs[1].outputs[0].finish_reason == "error" and "masked" in (outs[1].error or "")
    assert outs[1].error_kind == "invalid_request" and outs[0].error_kind is None
    assert re.fullmatch(REGEX, outs[2].outputs[0].text)


@pytest.fixture
def core(tiny_llama: Path) -> Iterator[EngineCore]:
    c = EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32", max_model_len=128, num_kv_blocks=64))
    yield c
    c.close()


def run(core: EngineCore) -> dict[str, Any]:
    outs: dict[str, Any] = {}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            prev = outs.get(o.request_id)
            outs[o.request_id] = (prev[0] + o.new_token_ids if prev else o.new_token_ids, o)
    return outs


def test_engine_compiles_off_the_step_caches_and_isolates_failures(core: EngineCore) -> None:
    """In the engine: equal specs compile once (cache), a compilation that fails in the worker thread
    finishes only its request with an error, a request aborted while its grammar compiles leaves
    nothing behind, and the others finish under their grammars."""
    spec = SO(regex=REGEX)
    real = core.structured._compile
    compiled: list[str] = []

    def compile_or_fail(s: StructuredOutputsParams) -> Any:
        compiled.append(s.key())
        if s.regex == "b+":
            raise RuntimeError("injected compile failure")
        return real(s)

    core.structured._compile = compile_or_fail  # type: ignore[method-assign]
    for rid, s in (("a", spec), ("b", spec), ("bad", SO(regex="b+")), ("gone", SO(choice=["x", "y"]))):
        core.add_request(AddRequest(rid, [1, 2, 3], SamplingParams(temperature=1.0, seed=1, max_tokens=40,
                                                                   structured_outputs=s), 40, [2]))
    core.add_request(AddRequest("plain", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), 5))
    assert core.abort_requests(["gone"]) == ["gone"]
    outs = run(core)
    assert "gone" not in outs and not core.has_unfinished_requests() and core.structured.num_waiting == 0
    assert outs["bad"][1].finish_reason == FinishReason.ERROR and "injected" in outs["bad"][1].error
    assert outs["plain"][0] and len(outs["plain"][0]) == 5
    tokenizer = load_tokenizer(core.runner.model_path)
    for rid in ("a", "b"):
        ids, last = outs[rid]
        assert last.finish_reason == FinishReason.STOP
        assert re.fullmatch(REGEX, tokenizer.decode(ids, skip_special_tokens=True))
    assert compiled.count(spec.key()) == 1  # "a" and "b" share one compilation
    assert core.kv.usage == 0.0


def test_logprobs_follow_the_output_kind(tiny_llama: Path) -> None:
    """Streaming: DELTA logprobs concatenate to the final ones and prompt logprobs come once; CUMULATIVE
    outputs carry all logprobs so far (aligned with token_ids) and the prompt logprobs every time."""
    async def collect(kind: RequestOutputKind) -> list[Any]:
        async with AsyncLLM(str(tiny_llama), **ENGINE) as allm:
            p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                               output_kind=kind)
            return [o async for o in allm.generate("one two three four", p)]

    delta, cumulative, final = (anyio.run(collect, k) for k in
                                (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY))
    want = final[-1].outputs[0].logprobs
    assert len(final) == 1 and want is not None and len(want) == 6
    assert [row for o in delta for row in o.outputs[0].logprobs] == want
    assert [o.prompt_logprobs is not None for o in delta] == [True] + [False] * (len(delta) - 1)
    for o in cumulative:
        assert o.outputs[0].logprobs == want[:len(o.outputs[0].token_ids)]
        assert o.prompt_logprobs == final[-1].prompt_logprobs
    assert cumulative[-1].outputs[0].cumulative_logprob == pytest.approx(final[-1].outputs[0].cumulative_logprob)


@pytest.mark.parametrize("budget", [8, 3, 64])
def test_prompt_logprobs_survive_any_chunking_and_preemption(tiny_llama: Path, budget: int) -> None:
    """In the engine, prompt logprobs come with the first token whatever the chunking (a last chunk of one
    token computes no prompt row; a one-token prompt has none) and under preemption, equal to those of one
    unchunked prefill, and the sampled tokens' logprobs equal too."""
    def rows(cfg: dict[str, Any]) -> dict[str, Any]:
        core = EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32", max_model_len=128, **cfg))
        p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2, logprobs=1)
        for rid, prompt in (("nine", list(range(3, 12))), ("one", [7]), ("long", list(range(20, 50)))):
            core.add_request(AddRequest(rid, prompt, p, 6))
        got: dict[str, Any] = {}
        preempted = 0
        while core.has_unfinished_requests():
            out = core.step()
            preempted = max(preempted, out.scheduler_stats.num_preemptions if out.scheduler_stats else 0)
            for o in out.outputs:
                entry = got.setdefault(o.request_id, {"prompt": None, "sample": []})
                if o.prompt_logprobs is not None:
                    assert entry["prompt"] is None  # sent once
                    entry["prompt"] = o.prompt_logprobs
                entry["sample"].append(o.new_logprobs)
        got["preempted"] = preempted
        core.close()
        return got

    ref = rows(dict(max_num_batched_tokens=256))
    got = rows(dict(max_num_batched_tokens=budget, num_kv_blocks=6, block_size=8))
    if budget == 8:  # its chunks run the three requests at once: the 6-block pool preempts
        assert got["preempted"] > 0
    for rid, n in (("nine", 8), ("one", 0), ("long", 29)):
        assert len(got[rid]["prompt"].token_ids) == n
        assert got[rid]["prompt"].token_ids == ref[rid]["prompt"].token_ids
        for a, b in zip(got[rid]["prompt"].logprobs, ref[rid]["prompt"].logprobs, strict=True):
            assert a == pytest.approx(b, abs=1e-4)
        assert [s.token_ids for s in got[rid]["sample"]] == [s.token_ids for s in ref[rid]["sample"]]
