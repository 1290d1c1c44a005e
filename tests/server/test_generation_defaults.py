"""A model folder's `generation_config.json` sampling defaults, through the real engine: `LLM.generate`
without SamplingParams uses them (`get_default_sampling_params`), and so does the server for every
field a request leaves unset, never over one it sets (vLLM's `--generation-config auto`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
from server_process import ServerProcess

from troupe import LLM, SamplingParams
from troupe.models.generation_config import read_generation_defaults

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def model_with_defaults(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with generation_config.json recommending greedy decoding and 3 new tokens."""
    folder = tmp_path_factory.mktemp("defaults") / "model"
    shutil.copytree(tiny_llama, folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, "temperature": 0.0, "top_k": 7, "max_new_tokens": 3, "do_sample": False}))
    return folder


def test_reading_the_defaults(model_with_defaults: Path, tmp_path: Path) -> None:
    """Only the sampling keys are read, max_new_tokens as max_tokens; a wrong type names the key."""
    assert read_generation_defaults(model_with_defaults) == {"temperature": 0.0, "top_k": 7, "max_tokens": 3}
    assert read_generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text('{"top_p": "high"}')
    with pytest.raises(ValueError, match="top_p"):
        read_generation_defaults(tmp_path)


def test_llm_without_sampling_params_uses_them(model_with_defaults: Path) -> None:
    """LLM.generate(prompts) without SamplingParams: greedy, at most 3 tokens: the same tokens as
    the explicit greedy request; explicit SamplingParams are taken as given."""
    with LLM(str(model_with_defaults), dtype="float32", multiprocess=False) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 0, 3)  # greedy clears top_k
        implicit = llm.generate(["Hello there"], use_tqdm=False)[0].outputs[0]
        explicit = llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
        longer = llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                              use_tqdm=False)
    assert implicit.token_ids == explicit[0].outputs[0].token_ids and len(implicit.token_ids) <= 3
    assert len(longer[0].outputs[0].token_ids) == 6


def test_the_server_applies_them_to_unset_fields(model_with_defaults: Path, tmp_path: Path) -> None:
    """A request without temperature / max_tokens gets greedy decoding and 3 tokens (completions and
    chat); one that sets them gets what it asked for."""
    with ServerProcess([str(model_with_defaults), "--dtype", "float32", "--served-model-name", "m"], tmp_path) as srv:
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120) as client:
            ignore = {"ignore_eos": True}
            unset = client.completions.create(model="m", prompt="Hello there", extra_body=ignore)
            greedy = client.completions.create(model="m", prompt="Hello there", temperature=0.0, max_tokens=3,
                                               extra_body=ignore)
            chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                  extra_body=ignore)
            chosen = client.completions.create(model="m", prompt="Hello there", max_tokens=5, extra_body=ignore)
    assert unset.usage is not None and unset.usage.completion_tokens == 3
    assert unset.choices[0].text == greedy.choices[0].text
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    assert chosen.usage is not None and chosen.usage.completion_tokens == 5
