"""`load_tokenizer` hands `AutoTokenizer` a bare config where tokenizer_config.json names the class (no
model config class to import: 0.6 s of every process that loads a tokenizer); the tokenizer it gets is
the one `AutoTokenizer` picks by itself, whatever transformers decides from the class and model type."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from troupe.models import loader

TEXT = "Hello world, <|im_start|>user\nhow are you?<|im_end|> 123 café"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def variant(src: Path, dst: Path, tokenizer_class: str, model_type: str, **extra: Any) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    tok_cfg = json.loads((dst / "tokenizer_config.json").read_text())
    tok_cfg.update(tokenizer_class=tokenizer_class, **extra)
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model_type"] = model_type
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def outcome(load: Any) -> tuple[Any, ...]:
    try:
        tok = load()
    except Exception as e:  # both paths must fail alike where transformers refuses the combination
        return ("error", type(e).__name__)
    chat = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) if tok.chat_template else None
    return (type(tok).__name__, tok(TEXT).input_ids, tok.decode(tok(TEXT).input_ids), len(tok), chat,
            tok.eos_token, tok.bos_token)


@pytest.mark.parametrize(("tokenizer_class", "model_type"), [
    ("PreTrainedTokenizerFast", "llama"),  # the default model's
    ("LlamaTokenizerFast", "llama"),  # declared Llama, but a ByteLevel tokenizer.json: transformers overrides
    ("Qwen2Tokenizer", "qwen2"),
    ("GPT2Tokenizer", "qwen3"),
    ("PreTrainedTokenizerFast", "gemma3"),
    ("LlamaTokenizer", "mistral"),
    ("GPT2TokenizerFast", "phi3"),
])
def test_the_tokenizer_is_the_one_autotokenizer_picks(tiny_llama: Path, tmp_path: Path, tokenizer_class: str,
                                                      model_type: str) -> None:
    from transformers import AutoTokenizer

    folder = variant(tiny_llama, tmp_path / "tok", tokenizer_class, model_type)
    hint = loader._tokenizer_config_hint(folder)
    assert hint["config"].model_type == model_type  # the bare config is what troupe uses here
    assert outcome(lambda: loader.load_tokenizer(folder)) == outcome(
        lambda: AutoTokenizer.from_pretrained(str(folder), local_files_only=True))


def test_remote_code_or_no_class_named_is_left_to_autotokenizer(tiny_llama: Path, tmp_path: Path) -> None:
    """No hint where AutoTokenizer needs the model's config class: tokenizer_config.json without a class,
    or an `auto_map` (remote code) in either file."""
    plain = variant(tiny_llama, tmp_path / "a", "PreTrainedTokenizerFast", "llama")
    assert loader._tokenizer_config_hint(plain)
    tok_cfg = json.loads((plain / "tokenizer_config.json").read_text())
    del tok_cfg["tokenizer_class"]
    (plain / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    assert loader._tokenizer_config_hint(plain) == {}
    remote = variant(tiny_llama, tmp_path / "b", "PreTrainedTokenizerFast", "llama",
                     auto_map={"AutoTokenizer": [None, "tok.MyTokenizer"]})
    assert loader._tokenizer_config_hint(remote) == {}
    cfg_remote = variant(tiny_llama, tmp_path / "c", "PreTrainedTokenizerFast", "llama")
    cfg = json.loads((cfg_remote / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "conf.MyConfig"}
    (cfg_remote / "config.json").write_text(json.dumps(cfg))
    assert loader._tokenizer_config_hint(cfg_remote) == {}
    assert loader._tokenizer_config_hint(tmp_path / "missing") == {}
