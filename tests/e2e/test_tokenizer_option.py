"""`tokenizer` (vLLM's `--tokenizer`): a model folder without tokenizer files runs with the tokenizer of
another folder, through `LLM` (prompts, chat, a structured output compiled in the engine from that
tokenizer) and through `troupe serve --tokenizer` (`/tokenizer_info`, `/tokenize`); a tokenizer path
that does not exist fails the start-up with an error naming the field."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess

from troupe import LLM, SamplingParams
from troupe.errors import EngineStartupError, ModelLoadError
from troupe.models.loader import load_tokenizer
from troupe.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def split(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a copy of the tiny model with no tokenizer files, a folder holding only them)."""
    root = tmp_path_factory.mktemp("split")
    model, tok = root / "model", root / "tokenizer"
    shutil.copytree(tiny_llama, model)
    tok.mkdir()
    for name in TOKENIZER_FILES:
        if (model / name).exists():
            shutil.move(model / name, tok / name)
    return model, tok


def test_llm_runs_a_model_with_the_tokenizer_of_another_folder(split: tuple[Path, Path]) -> None:
    model, tok_dir = split
    tok = load_tokenizer(tok_dir)
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):  # the bare folder has none of its own
        LLM(model=str(model), multiprocess=False, dtype="float32", num_kv_blocks=64)
    with LLM(model=str(model), tokenizer=str(tok_dir), multiprocess=False, dtype="float32", num_kv_blocks=64) as llm:
        assert llm.get_tokenizer().name_or_path == tok.name_or_path
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        out = llm.generate(["Hello there"], greedy)[0]
        assert out.prompt_token_ids == tok("Hello there")["input_ids"]
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
        chat = llm.chat([{"role": "user", "content": "Hi"}], greedy)[0]
        rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           tokenize=False)
        assert chat.prompt_token_ids == tok(rendered, add_special_tokens=False)["input_ids"]
        choice = llm.generate(["Pick:"], SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=(
            StructuredOutputsParams(choice=["alpha", "beta"]))))[0]
        assert choice.outputs[0].text in ("alpha", "beta")


def test_a_missing_tokenizer_path_names_the_field(split: tuple[Path, Path], tmp_path: Path) -> None:
    model, _ = split
    with pytest.raises(EngineStartupError, match=r"tokenizer: .*nowhere.*does not exist"):
        LLM(model=str(model), tokenizer=str(tmp_path / "nowhere"), multiprocess=False, num_kv_blocks=64)


def test_serve_takes_the_tokenizer_flag(split: tuple[Path, Path], tmp_path: Path) -> None:
    model, tok_dir = split
    tok = load_tokenizer(tok_dir)
    args = [str(model), "--tokenizer", str(tok_dir), "--dtype", "float32", "--max-model-len", "256",
            "--enable-tokenizer-info-endpoint"]
    with ServerProcess(args, tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        info = http.get("/tokenizer_info").json()
        assert Path(info["name_or_path"]).resolve() == tok_dir.resolve()
        assert http.post("/tokenize", json={"prompt": "Hello there"}).json()["tokens"] == tok("Hello there")["input_ids"]
        resp = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["prompt_tokens"] == len(tok("Hello")["input_ids"])
        assert body["choices"][0]["text"] == tok.decode(tok(body["choices"][0]["text"])["input_ids"])
