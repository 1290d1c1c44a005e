"""`LLM.embed` / `encode` / `score` and `AsyncLLM.encode` on a pooling engine (tiny random Llama with
Matryoshka sizes, in-process engine, vLLM's default pooler: last token, normalized), each checked
against transformers' pooled hidden states; and the runner checks both ways."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pooling_oracle import hf_model, hf_pooled

from troupe.errors import InvalidInputError
from troupe.facades.async_llm import AsyncLLM
from troupe.facades.llm import LLM
from troupe.pooling import EmbeddingRequestOutput, PoolingParams, PoolingRequestOutput

ATOL = 1e-4
ENGINE = dict(dtype="float32", kv_cache_dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
              max_model_len=32, multiprocess=False, log_stats_interval_s=None)
TEXTS = ["The cat sat on the mat.", "Embeddings map text to vectors that a search can compare.", "Hi"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from troupe.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-embed"), arch="llama", matryoshka_dimensions=[16, 32, 64])


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    with LLM(str(model_dir), runner="pooling", **ENGINE) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> object:
    return hf_model(model_dir)


def test_embed_and_encode_equal_transformers(llm: LLM, hf: object) -> None:
    """embed gives vLLM's EmbeddingRequestOutput (a list of floats), encode PoolingRequestOutput (a
    float32 tensor), in input order, for text and token-id prompts, equal to transformers' vectors."""
    tok = llm.get_tokenizer()
    ids = [tok(t)["input_ids"] for t in TEXTS]
    embedded = llm.embed(TEXTS)
    encoded = llm.encode([{"prompt_token_ids": p} for p in ids])
    for i, prompt in enumerate(ids):
        want = hf_pooled(hf, prompt, "LAST", True)
        e, p = embedded[i], encoded[i]
        assert isinstance(e, EmbeddingRequestOutput) and isinstance(p, PoolingRequestOutput)
        assert e.prompt_token_ids == prompt == p.prompt_token_ids and e.finished and p.finished
        assert e.outputs.hidden_size == 64 and p.outputs.data.dtype == torch.float32
        torch.testing.assert_close(torch.tensor(e.outputs.embedding), want, atol=ATOL, rtol=0)
        torch.testing.assert_close(p.outputs.data, want, atol=ATOL, rtol=0)


def test_per_prompt_params_and_truncation(llm: LLM, hf: object) -> None:
    """One PoolingParams per prompt (dimensions, normalize off, truncate_prompt_tokens keeping the last
    3 tokens), and vLLM's keyword truncate_prompt_tokens over the params; a list of the wrong length
    names pooling_params; pooling_task other than embed is refused."""
    tok = llm.get_tokenizer()
    ids = tok(TEXTS[1])["input_ids"]
    outs = llm.encode([TEXTS[1]] * 3, [PoolingParams(dimensions=16), PoolingParams(normalize=False),
                                       PoolingParams(truncate_prompt_tokens=3)])
    torch.testing.assert_close(outs[0].outputs.data, hf_pooled(hf, ids, "LAST", True, 16), atol=ATOL, rtol=0)
    torch.testing.assert_close(outs[1].outputs.data, hf_pooled(hf, ids, "LAST", False), atol=ATOL, rtol=0)
    assert outs[2].prompt_token_ids == ids[-3:]
    torch.testing.assert_close(outs[2].outputs.data, hf_pooled(hf, ids[-3:], "LAST", True), atol=ATOL, rtol=0)
    embedded = llm.embed(TEXTS[1], pooling_params=PoolingParams(normalize=False), truncate_prompt_tokens=3,
                         use_tqdm=False)
    assert embedded[0].prompt_token_ids == ids[-3:]
    torch.testing.assert_close(torch.tensor(embedded[0].outputs.embedding), hf_pooled(hf, ids[-3:], "LAST", False),
                               atol=ATOL, rtol=0)
    with pytest.raises(InvalidInputError) as err:
        llm.encode(TEXTS, [PoolingParams()] * 2)
    assert err.value.field == "pooling_params"
    with pytest.raises(InvalidInputError) as task:
        llm.encode(TEXTS[0], pooling_task="classify")
    assert task.value.field == "pooling_task"
    with pytest.raises(InvalidInputError) as dims:
        llm.encode(TEXTS[0], PoolingParams(dimensions=20))
    assert dims.value.field == "dimensions"


def test_score_is_cosine_of_embeddings(llm: LLM, hf: object) -> None:
    """score pairs one text with many (or two lists index by index; other shapes name data_2) and gives
    the cosine similarity of transformers' embeddings, of the truncated prompts with truncate_prompt_tokens."""
    tok = llm.get_tokenizer()
    vec = [hf_pooled(hf, tok(t)["input_ids"], "LAST", True) for t in TEXTS]
    one_to_many = llm.score(TEXTS[0], TEXTS)
    assert [o.outputs.score for o in one_to_many] == pytest.approx(
        [float(vec[0] @ v) for v in vec], abs=ATOL)
    assert one_to_many[0].outputs.score == pytest.approx(1.0, abs=1e-6)
    pairwise = llm.score(TEXTS[:2], TEXTS[1:])
    assert [o.outputs.score for o in pairwise] == pytest.approx([float(vec[0] @ vec[1]), float(vec[1] @ vec[2])],
                                                                abs=ATOL)
    with pytest.raises(InvalidInputError) as err:
        llm.score(TEXTS[:2], TEXTS)
    assert err.value.field == "data_2"
    cut = llm.score(TEXTS[0], TEXTS[1], truncate_prompt_tokens=2, use_tqdm=False)[0]
    ends = [hf_pooled(hf, tok(t)["input_ids"][-2:], "LAST", True) for t in TEXTS[:2]]
    assert len(cut.prompt_token_ids) == 4 and cut.outputs.score == pytest.approx(float(ends[0] @ ends[1]), abs=ATOL)


def test_prompt_may_fill_the_context_and_generation_is_refused(llm: LLM) -> None:
    """A pooling prompt may be max_model_len tokens long (nothing is generated after it), one more is
    refused naming the prompt; generate on a pooling engine is refused naming the runner."""
    assert len(llm.encode({"prompt_token_ids": [5] * 32})[0].prompt_token_ids) == 32
    with pytest.raises(InvalidInputError) as long:
        llm.encode({"prompt_token_ids": [5] * 33})
    assert long.value.field == "prompt"
    with pytest.raises(InvalidInputError, match="runner='pooling'") as gen:
        llm.generate("Hello", use_tqdm=False)
    assert gen.value.field == "runner"


@pytest.mark.anyio
async def test_async_encode_and_the_generate_runner(model_dir: Path, hf: object) -> None:
    """AsyncLLM.encode yields one finished PoolingRequestOutput under the caller's request id; a
    generating engine refuses encode, naming the runner."""
    async with AsyncLLM(str(model_dir), runner="pooling", **ENGINE) as engine:
        outs = [out async for out in engine.encode(TEXTS[0], request_id="emb-1")]
        assert engine.pooler_config is not None and engine.pooler_config.pooling_type == "LAST"
        ids = engine.get_tokenizer()(TEXTS[0])["input_ids"]
    assert len(outs) == 1 and outs[0].request_id == "emb-1" and outs[0].finished
    torch.testing.assert_close(outs[0].outputs.data, hf_pooled(hf, ids, "LAST", True), atol=ATOL, rtol=0)
    async with AsyncLLM(str(model_dir), **ENGINE) as generating:
        assert generating.pooler_config is None
        with pytest.raises(InvalidInputError, match="--runner pooling") as err:
            async for _ in generating.encode(TEXTS[0]):
                pass
        assert err.value.field == "runner"
