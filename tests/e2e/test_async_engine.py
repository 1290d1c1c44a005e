"""`async_scheduling` through the real engine: `LLM(async_scheduling=True)` and `troupe serve
--async-scheduling` (its engine in its own process) give the synchronous engine's tokens for greedy and
seeded requests, logprobs included, and for n=2 (the frontend's two children of one seed). The mode's own cases (stops, preemption, aborts, structured outputs, failures) run on the
engine core against a fake asynchronous device: tests/core/test_async_scheduling.py."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from server_process import ServerProcess

from troupe import LLM, SamplingParams

pytestmark = [pytest.mark.timeout(300)]

PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3,"]
OPTIONS = dict(dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=False)


def params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.9, seed=17, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.7, seed=3, top_k=40, max_tokens=9, ignore_eos=True, frequency_penalty=0.5)]


FORK = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)  # two children, one seed


def test_llm_and_server_with_async_scheduling_give_the_sync_tokens(tiny_llama: Path, tmp_path: Path) -> None:
    with LLM(str(tiny_llama), multiprocess=False, **OPTIONS) as llm:
        want = [o.outputs[0] for o in llm.generate(PROMPTS, params(), use_tqdm=False)]
        forks = [c.text for c in llm.generate(PROMPTS[:1], FORK, use_tqdm=False)[0].outputs]
    with LLM(str(tiny_llama), async_scheduling=True, multiprocess=False, **OPTIONS) as llm:
        assert llm.config.async_scheduling
        got = [o.outputs[0] for o in llm.generate(PROMPTS, params(), use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].logprobs == want[0].logprobs and all(len(o.token_ids) in (9, 12) for o in got)

    args = [str(tiny_llama), "--dtype", "float32", "--served-model-name", "m", "--async-scheduling",
            "--max-num-batched-tokens", "16", "--no-prefix-caching"]
    with ServerProcess(args, tmp_path) as srv, \
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        for prompt, p, expected in zip(PROMPTS, params(), want, strict=True):
            extra = {"ignore_eos": True, "top_k": p.top_k} if p.top_k else {"ignore_eos": True}
            out = client.completions.create(model="m", prompt=prompt, max_tokens=p.max_tokens,
                                            temperature=p.temperature, seed=p.seed,
                                            frequency_penalty=p.frequency_penalty, extra_body=extra)
            assert out.choices[0].text == expected.text, prompt
        out = client.completions.create(model="m", prompt=PROMPTS[0], n=2, temperature=1.0, seed=5, max_tokens=8,
                                        extra_body={"ignore_eos": True})
        assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == forks and forks[0] != forks[1]
