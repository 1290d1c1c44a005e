"""A GGUF file's tokenizer as HF tokenizer files: rebuilt from `tokenizer.ggml.*` once, cached.

`tokenizer_folder(gguf_path)` returns `<troupe cache>/tokenizers/<file stem>-<key>/` holding
tokenizer.json, tokenizer_config.json, special_tokens_map.json (and chat_template.jinja), which
`transformers.AutoTokenizer` loads; the key hashes the file's path, size and modification time and the
rebuild's version, so a changed file is rebuilt. Only tokenizer files are cached, never weights. The
folder is written next to its final place and renamed in, so concurrent first uses are safe.

The rebuild (`write_tokenizer`): llama.cpp's "gpt2" tokenizer model is a byte-level BPE; the vocabulary
and merges come from the file, the pre-tokenizer from `tokenizer.ggml.pre` (llama.cpp's names: `smollm`
splits each digit off first, then the GPT-2 regex; `qwen2` and `llama-bpe` are their models' split
regexes), and the control tokens (token type 3) become special tokens. Other tokenizer models (e.g.
SentencePiece "llama") are a `ModelLoadError`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from troupe.errors import ModelLoadError
from troupe.paths import cache_dir

TOKENIZER_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
MARKER = "troupe_tokenizer.json"  # written last: {"version", "source", "vocab_size"}

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_SPLIT_REGEX = {  # llama.cpp's llama-vocab.cpp, per pre-tokenizer
    "llama-bpe": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def tokenizer_folder(gguf_path: str | Path) -> Path:
    """The cached tokenizer folder of `gguf_path`, rebuilt from the file on first use (see the module
    docstring)."""

    path = Path(gguf_path).resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|{TOKENIZER_VERSION}".encode()).hexdigest()[:16]
    target = cache_dir() / "tokenizers" / f"{path.stem}-{key}"
    if (target / MARKER).is_file():
        return target
    from troupe.models.gguf_file import GGUFFile

    with GGUFFile(path) as f:
        meta = f.metadata
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write_tokenizer(tmp, meta, where=str(path))
        write_json(tmp / MARKER, {"version": TOKENIZER_VERSION, "source": str(path),
                                  "vocab_size": len(meta["tokenizer.ggml.tokens"])})
        for p in tmp.iterdir():
            p.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / MARKER).is_file():
                raise  # not a lost race: something else is in the way
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def special_tokens(meta: dict[str, Any]) -> dict[str, str]:
    """bos / eos / unk / pad token strings named by the file."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    keys = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"))
    return {name: tokens[meta[f"tokenizer.ggml.{key}"]] for name, key in keys if f"tokenizer.ggml.{key}" in meta}


def write_tokenizer(out: Path, meta: dict[str, Any], where: str = "GGUF") -> None:
    """Write the HF tokenizer files of a GGUF file's `meta` into the existing folder `out`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{where}: GGUF tokenizer model {kind!r} is not supported (only 'gpt2', byte-level BPE)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    special = special_tokens(meta)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token=special.get("unk_token"),
                     fuse_unk=False, byte_fallback=False)
    tk = Tokenizer(bpe)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in _SPLIT_REGEX:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
    else:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        if pre == "smollm":  # llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: "\p{N}" first, then the GPT-2 regex
            tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre in ("default", "gpt2"):
            tk.pre_tokenizer = byte_level
        else:
            raise ModelLoadError(f"{where}: GGUF pre-tokenizer {pre!r} is not supported "
                                 f"(supported: smollm, gpt2, {', '.join(_SPLIT_REGEX)})")
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == 3]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tk.save(str(out / "tokenizer.json"))

    arch = meta.get("general.architecture", "")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{arch}.context_length") or 2048),
        "additional_special_tokens": [t for t in control if t not in special.values()],
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
        (out / "chat_template.jinja").write_text(template)
    write_json(out / "tokenizer_config.json", config)
    write_json(out / "special_tokens_map.json", special)


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
