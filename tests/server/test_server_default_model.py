"""`troupe serve` with no model argument: the real default model (SmolLM2-135M-Instruct), one server for
the module. A chat completion through the official openai client, and lm-evaluation-harness's
`local-completions` client with the remote tokenizer on two small local tasks, checked against
transformers float32 on the same weights. Slow: the model loads (and converts from its GGUF on first use)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from server_process import ServerProcess
from support.oracles import stored

from troupe.models.default_model import ensure_default_model

pytestmark = pytest.mark.timeout(600)  # the default model loads (and converts on first use)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The output-exact mode (`--quantization gguf`), whatever this CPU's default: the lm-eval test compares
    with transformers float32. On a CPU with AMX the default is gguf-bf16, whose steps of more than 8 rows
    round activations to bf16 (~0.03 on a loglikelihood), and whether two of lm-eval's concurrent requests
    share a prefill step, and so exceed 8 rows, depends on timing."""
    with ServerProcess(["--max-model-len", "1024", "--enable-tokenizer-info-endpoint", "--no-prefix-caching",
                        "--quantization", "gguf"], tmp_path_factory.mktemp("default-model-server")) as srv:
        yield srv


@pytest.mark.slow
def test_a_real_chat_completion(server: ServerProcess) -> None:
    """A greedy chat answer from the real model is on topic, and usage adds up."""
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id
        resp = client.chat.completions.create(
            model=model, temperature=0.0, max_tokens=40,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    answer = resp.choices[0].message.content or ""
    assert "Paris" in answer, answer
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage is not None and resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "seven", "ten"], "answer": 0},
    {"question": "The sky on a clear day is", "choices": ["green", "blue", "red"], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": ["Fahrenheit", "Celsius", "Kelvin"], "answer": 1},
]
MAX_GEN_TOKS = 8
TASKS = """\
    task: troupe_tiny_mc
    dataset_path: json
    dataset_kwargs:
      data_files:
        test: {data}
    test_split: test
    output_type: multiple_choice
    doc_to_text: "{{{{question}}}}"
    doc_to_choice: "{{{{choices}}}}"
    doc_to_target: "{{{{answer}}}}"
    metric_list:
      - metric: acc
    ---
    task: troupe_tiny_gen
    dataset_path: json
    dataset_kwargs:
      data_files:
        test: {data}
    test_split: test
    output_type: generate_until
    doc_to_text: "Q: {{{{question}}}}\\nA:"
    doc_to_target: "{{{{choices[answer]}}}}"
    generation_kwargs:
      until: ["\\n"]
      max_gen_toks: {max_gen_toks}
      do_sample: false
    metric_list:
      - metric: exact_match
"""


def write_tasks(folder: Path) -> None:
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    mc, gen = textwrap.dedent(TASKS).format(data=data, max_gen_toks=MAX_GEN_TOKS).split("---\n")
    (folder / "troupe_tiny_mc.yaml").write_text(mc)
    (folder / "troupe_tiny_gen.yaml").write_text(gen)


def hf_oracle(model_dir: Path) -> dict[str, Any]:
    """transformers float32 on the default model's weights: each (question, " " + choice) pair's
    continuation log-probability, split into tokens as lm-eval splits it (the whole and the context
    encoded, the continuation being the whole's tokens after the context's), and each generation prompt's
    greedy text up to the first newline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    loglikelihoods: list[list[float]] = []
    generations: list[str] = []
    with torch.inference_mode():
        for doc in DOCS:
            row = []
            for choice in doc["choices"]:
                context = tok(doc["question"], add_special_tokens=False)["input_ids"]
                whole = tok(doc["question"] + " " + choice, add_special_tokens=False)["input_ids"]
                logits = model(torch.tensor([whole])).logits[0].log_softmax(-1)
                row.append(sum(float(logits[i - 1, whole[i]]) for i in range(len(context), len(whole))))
            loglikelihoods.append(row)
            prompt = tok(f"Q: {doc['question']}\nA:", add_special_tokens=False, return_tensors="pt")["input_ids"]
            out = model.generate(prompt, max_new_tokens=MAX_GEN_TOKS, do_sample=False)
            generations.append(tok.decode(out[0, prompt.shape[1]:]).split("\n")[0])
    return {"loglikelihoods": loglikelihoods, "generations": generations}


@pytest.mark.slow
def test_lm_eval_local_completions_with_the_remote_tokenizer(server: ServerProcess, tmp_path: Path) -> None:
    """lm-evaluation-harness as its users point it at vLLM: `local-completions` with the remote tokenizer
    (`tokenizer_backend=remote`: /tokenizer_info, /tokenize, /detokenize, then token-id prompts), on two
    small local tasks. Its loglikelihoods (echo + prompt logprobs) and its greedy generations must be
    transformers' float32 ones on the same weights, and its scores follow."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_dir = ensure_default_model()
    oracle = stored(model_dir, ["lm-eval", DOCS, MAX_GEN_TOKS], lambda: hf_oracle(model_dir))
    write_tasks(tmp_path)
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={model},base_url={server.url}/v1/completions,tokenizer_backend=remote,"
                   "num_concurrent=2,max_retries=1",
        tasks=["troupe_tiny_mc", "troupe_tiny_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True)
    assert results is not None
    mc = sorted(results["samples"]["troupe_tiny_mc"], key=lambda s: s["doc_id"])
    got = [[float(r[0][0]) for r in s["resps"]] for s in mc]
    for doc, have, want in zip(DOCS, got, oracle["loglikelihoods"], strict=True):
        # the server's float16 KV cache (troupe's default on the CPU) moves a sum by a few 1e-3; a token
        # off by one in the context / continuation split would move it by whole units
        assert have == pytest.approx(want, rel=1e-3, abs=5e-3), (doc["question"], have, want)
    gen = sorted(results["samples"]["troupe_tiny_gen"], key=lambda s: s["doc_id"])
    assert [s["resps"][0][0] for s in gen] == oracle["generations"]
    # the scores follow from those: the right choice is the likeliest one (the oracle's argmax)
    want_acc = sum(max(range(3), key=row.__getitem__) == doc["answer"]
                   for doc, row in zip(DOCS, oracle["loglikelihoods"], strict=True))
    assert results["results"]["troupe_tiny_mc"]["acc,none"] == want_acc / len(DOCS)
