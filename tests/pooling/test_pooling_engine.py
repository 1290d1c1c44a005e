"""The pooling runner in the EngineCore against transformers' hidden states (float32 `AutoModel`,
`last_hidden_state` after the final norm, pooled the same way): on a tiny random Llama with every
pooling type, chunked prefill (a 16-token step budget that splits the longer prompts and mixes
requests in one step) and the per-request options; and on the default model, SmolLM2-135M, with its
default pooler (last token, normalized). Requests finish after their prefill with their blocks
freed and nothing left in the prefix cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import CORES
from pooling_oracle import hf_model, hf_pooled, stored_hf_last_pooled

from troupe.config import EngineConfig
from troupe.core.engine_core import EngineCore
from troupe.core.model_runner import ModelRunner
from troupe.messages import AddRequest, EngineCoreOutput, FinishReason
from troupe.models.loader import load_tokenizer
from troupe.pooling import PoolingParams
from troupe.sampling_params import SamplingParams

TEXT = ("Paged attention keeps the key and value cache in fixed blocks, so that requests of any length "
        "share one pool; a scheduler fills each step with prefill chunks and decodes up to a token budget.")
LENGTHS = [1, 5, 16, 23, 40]
ATOL = 1e-4  # float32 engine (float32 KV pool) vs float32 transformers
TINY = dict(dtype="float32", kv_cache_dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=16,
            runner="pooling", log_stats_interval_s=None)


@pytest.fixture(scope="module")
def tiny_matryoshka(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama, declaring Matryoshka sizes (so `dimensions` is accepted)."""
    from troupe.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-pool"), arch="llama", matryoshka_dimensions=[16, 32, 64])


@pytest.fixture(scope="module")
def runner(tiny_matryoshka: Path) -> ModelRunner:
    """One model runner (weights and KV pool) shared by the engines of this module."""
    torch.set_num_threads(CORES)
    return ModelRunner(EngineConfig(model=str(tiny_matryoshka), **TINY))


@pytest.fixture(scope="module")
def prompts(tiny_matryoshka: Path) -> list[list[int]]:
    ids = load_tokenizer(tiny_matryoshka)(TEXT)["input_ids"]
    assert len(ids) > max(LENGTHS)
    return [ids[i:i + n] for i, n in enumerate(LENGTHS)]


def pooled(core: EngineCore, prompts: list[list[int]], params: list[PoolingParams] | None = None
           ) -> dict[str, EngineCoreOutput]:
    """Every prompt through `core` at once; the final output of each, by request id ("0", "1", ...)."""
    for i, ids in enumerate(prompts):
        core.add_request(AddRequest(str(i), ids, SamplingParams(max_tokens=1), 1,
                                    pooling_params=params[i] if params else PoolingParams()))
    finals: dict[str, EngineCoreOutput] = {}
    for _ in range(100):
        for out in core.step().outputs:
            assert out.finished, "a pooling request sends one output, its last"
            finals[out.request_id] = out
        if not core.has_unfinished_requests():
            return finals
    raise AssertionError("the requests did not finish")


@pytest.mark.parametrize(("override", "kind", "normalize"), [
    (None, "LAST", True), ({"pooling_type": "MEAN"}, "MEAN", True), ({"pooling_type": "CLS", "normalize": False}, "CLS", False),
])
def test_tiny_model_equals_transformers(runner: ModelRunner, tiny_matryoshka: Path, prompts: list[list[int]],
                                        override: dict[str, Any] | None, kind: str, normalize: bool) -> None:
    """Each pooling type, prompts of 1..40 tokens in 16-token steps, equals transformers' pooled
    hidden states; every request stops with no token and its blocks freed, and a second run of the
    same prompts finds nothing in the prefix cache."""
    core = EngineCore(EngineConfig(model=str(tiny_matryoshka), pooler_config=override, **TINY), model_runner=runner)
    assert core.pooler is not None and core.pooler.config.pooling_type == kind
    hf = hf_model(tiny_matryoshka)
    for run in range(2):
        finals = pooled(core, prompts)
        assert core.kv.usage == 0.0
        for i, ids in enumerate(prompts):
            out = finals[str(i)]
            assert (out.finish_reason, out.new_token_ids, out.num_cached_tokens) == (FinishReason.STOP, [], 0), run
            assert out.pooled is not None
            torch.testing.assert_close(torch.tensor(out.pooled), hf_pooled(hf, ids, kind, normalize), atol=ATOL, rtol=0)


def test_per_request_options(runner: ModelRunner, tiny_matryoshka: Path, prompts: list[list[int]]) -> None:
    """normalize per request (either way), Matryoshka dimensions (cut, then normalized) and
    truncate_prompt_tokens (the frontend cuts; here the last 7 tokens as given) in one batch."""
    core = EngineCore(EngineConfig(model=str(tiny_matryoshka), **TINY), model_runner=runner)
    hf = hf_model(tiny_matryoshka)
    long = prompts[-1]
    params = [PoolingParams(normalize=False), PoolingParams(dimensions=16), PoolingParams(dimensions=32, normalize=False)]
    finals = pooled(core, [long, long, long[-7:]], params)
    expected = [hf_pooled(hf, long, "LAST", False), hf_pooled(hf, long, "LAST", True, 16),
                hf_pooled(hf, long[-7:], "LAST", False, 32)]
    for i, want in enumerate(expected):
        got = finals[str(i)].pooled
        assert got is not None and len(got) == want.shape[0]
        torch.testing.assert_close(torch.tensor(got), want, atol=ATOL, rtol=0)


def test_sentence_transformers_folder_sets_the_pooler(tiny_matryoshka: Path, prompts: list[list[int]],
                                                      tmp_path: Path) -> None:
    """The same weights as a sentence-transformers folder (modules.json: Transformer, mean Pooling,
    no Normalize): the engine pools the mean, unnormalized, as transformers does."""
    folder = tmp_path / "st"
    folder.mkdir()
    for f in tiny_matryoshka.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    core = EngineCore(EngineConfig(model=str(folder), **TINY))
    assert core.limits.pooler is not None
    assert (core.limits.pooler.pooling_type, core.limits.pooler.normalize) == ("MEAN", False)
    finals = pooled(core, prompts[-2:])
    hf = hf_model(tiny_matryoshka)
    for i, ids in enumerate(prompts[-2:]):
        got = finals[str(i)].pooled
        assert got is not None
        torch.testing.assert_close(torch.tensor(got), hf_pooled(hf, ids, "MEAN", False), atol=ATOL, rtol=0)


@pytest.mark.slow
def test_default_model_equals_transformers() -> None:
    """SmolLM2-135M (its GGUF, float32 activations) as an embedder: last token, normalized (vLLM's
    default), against transformers on the converted float32 folder, three prompts of 1..60 tokens."""
    from troupe.models.default_model import ensure_default_model

    torch.set_num_threads(CORES)
    folder = ensure_default_model()
    core = EngineCore(EngineConfig(runner="pooling", dtype="float32", kv_cache_dtype="float32", num_kv_blocks=16,
                                   max_num_batched_tokens=32, log_stats_interval_s=None, quantization="gguf"))
    ids = load_tokenizer(folder)(TEXT)["input_ids"]
    batch = [ids[:1], ids[:13], ids[:60]]
    finals = pooled(core, batch)
    for i, want in enumerate(stored_hf_last_pooled(folder, batch)):
        got = finals[str(i)].pooled
        assert got is not None and len(got) == 576
        torch.testing.assert_close(torch.tensor(got), want, atol=2e-3, rtol=0)
