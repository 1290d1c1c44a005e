"""A GGUF file's tokenizer as HF tokenizer files: rebuilt from `tokenizer.ggml.*` once, cached.

`tokenizer_folder(gguf_path)` returns `<troupe cache>/tokenizers/<file stem>-<key>/` holding
tokenizer.json, tokenizer_config.json, special_tokens_map.json (and chat_template.jinja), which
`transformers.AutoTokenizer` loads; the key hashes the file's path, size and modification time and the
rebuild's version, so a changed file is rebuilt. Only tokenizer files are cached, never weights. The
folder is written next to its final place and renamed in, so concurrent first uses are safe. Each
rebuild also removes the folders no file maps to any more: their file deleted, or changed since (a
folder of another rebuild version, another troupe install's, goes only with its file). A folder per
temporary GGUF would otherwise pile up, 3.4 MB each for the default model's vocabulary.

The rebuild (`write_tokenizer`) tokenizes as llama.cpp's `llama_vocab::tokenize` with special tokens
parsed (what its server does with a prompt):

- "gpt2" (byte-level BPE): the vocabulary and merges come from the file, the pre-tokenizer from
  `tokenizer.ggml.pre` (llama.cpp's names: `smollm` splits each digit off first, then the GPT-2 regex;
  `qwen2` and `llama-bpe` are their models' split regexes; `llama-bpe` also takes a whole pre-token that
  is in the vocabulary as it is, llama.cpp's `ignore_merges`).
- "llama" (SentencePiece, llama.cpp's `llm_tokenizer_spm`: Llama 2, Mistral 7B, TinyLlama, Gemma): each
  piece of text between special tokens gets a leading "▁" (unless `tokenizer.ggml.add_space_prefix` is
  false) and its spaces become "▁"; then adjacent symbols, starting from single characters, are merged
  while some adjacent pair concatenates to a vocabulary token, the pair whose token has the highest
  `tokenizer.ggml.scores` first; a character that no token covers becomes its UTF-8 bytes' `<0xXX>`
  tokens. Written as a `tokenizers` BPE with byte fallback whose merges are every split of every token
  into two tokens, ranked by the whole token's score (transformers' GGUF conversion builds the same kind
  of model). Where llama.cpp breaks a tie in score by position (leftmost pair first), the BPE breaks it
  by rank (the lower token id); SentencePiece vocabularies give their pieces distinct scores. Decoding
  turns "▁" back into spaces, `<0xXX>` tokens into their bytes, and drops the one leading space.

Token types (`tokenizer.ggml.token_type`, llama.cpp's numbering): control (3) and unknown (2) tokens are
special tokens, user-defined ones (4) plain added tokens; all three are matched whole in the text before
the model sees the rest, as llama.cpp's partition does. Normal (1), unused (5) and byte (6) tokens are
vocabulary entries.

BOS and EOS: `tokenizer.ggml.add_bos_token` / `add_eos_token` say whether encoding a text with special
tokens (`add_special_tokens=True`, a plain text prompt) adds them, through a `TemplateProcessing`
post-processor. Absent, llama.cpp's defaults hold: BOS for "llama" and for the Llama 3 pre-tokenizers
(`llama-bpe`, `llama3`, `llama-v3`, `falcon3`), no EOS. A rendered chat template already holds its BOS
text and is encoded without special tokens (`troupe.inputs.tokenize`).
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

TOKENIZER_VERSION = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
MARKER = "troupe_tokenizer.json"  # written last: {"version", "source", "vocab_size"}
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # llama.cpp's token types (1 normal, 5 unused, 6 byte)
SPACE = "\u2581"  # "▁", SentencePiece's space
SUPPORTED_MODELS = ("gpt2", "llama")

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "falcon3")  # llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3
_SPLIT_REGEX = {  # llama.cpp's llama-vocab.cpp, per pre-tokenizer
    **dict.fromkeys(_LLAMA3_PRE, _LLAMA3),
    "qwen2": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def tokenizer_folder(gguf_path: str | Path) -> Path:
    """The cached tokenizer folder of `gguf_path`, rebuilt from the file on first use (see the module
    docstring)."""

    path = Path(gguf_path).resolve()
    target = cache_dir() / "tokenizers" / _entry_name(path)
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
    _prune(target.parent)
    return target


def _entry_name(path: Path) -> str:
    """The cache folder's name for the GGUF file at `path` (resolved) as it is now."""
    st = path.stat()
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|{TOKENIZER_VERSION}".encode()).hexdigest()[:16]
    return f"{path.stem}-{key}"


def _prune(root: Path) -> None:
    """Remove the folders under `root` that no file maps to any more: their GGUF file deleted, or (for
    folders of this rebuild version; another troupe install sharing the cache keeps its own) changed.
    Folders being written (dot names) and folders without a readable marker are left alone."""
    for entry in root.iterdir():
        if entry.name.startswith("."):
            continue
        try:
            marker = json.loads((entry / MARKER).read_text())
            source, version = Path(marker["source"]), marker["version"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        try:
            stale = version == TOKENIZER_VERSION and _entry_name(source) != entry.name
        except FileNotFoundError:
            stale = True
        except OSError:
            continue
        if stale:
            shutil.rmtree(entry, ignore_errors=True)


def special_tokens(meta: dict[str, Any]) -> dict[str, str]:
    """bos / eos / unk / pad token strings named by the file."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    keys = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"))
    return {name: tokens[meta[f"tokenizer.ggml.{key}"]] for name, key in keys if f"tokenizer.ggml.{key}" in meta}


def adds_bos_eos(meta: dict[str, Any]) -> tuple[bool, bool]:
    """(add BOS, add EOS) when a text is encoded with special tokens: the file's flags, else llama.cpp's
    defaults for its tokenizer model and pre-tokenizer."""
    default_bos = meta.get("tokenizer.ggml.model") == "llama" or meta.get("tokenizer.ggml.pre") in _LLAMA3_PRE
    return (bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)),
            bool(meta.get("tokenizer.ggml.add_eos_token", False)))


def write_tokenizer(out: Path, meta: dict[str, Any], where: str = "GGUF") -> None:
    """Write the HF tokenizer files of a GGUF file's `meta` into the existing folder `out`."""
    from tokenizers import AddedToken

    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_MODELS:
        raise ModelLoadError(f"{where}: tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2', "
                             "byte-level BPE; 'llama', SentencePiece)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    special = special_tokens(meta)
    tk = _byte_level(meta, tokens, special, where) if kind == "gpt2" else _sentencepiece(meta, tokens, special, where)
    control = [t for t, ttype in zip(tokens, types, strict=True) if ttype in (CONTROL, UNKNOWN)]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tk.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, ttype in zip(tokens, types, strict=True) if ttype == USER_DEFINED])
    add_bos, add_eos = adds_bos_eos(meta)
    tk.post_processor = _post_processor(kind, meta, special, add_bos, add_eos, where)
    tk.save(str(out / "tokenizer.json"))

    arch = meta.get("general.architecture", "")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": add_bos,  # informative: tokenizer.json's post-processor is what adds them
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{arch}.context_length") or 2048),
        "additional_special_tokens": [t for t in control if t not in special.values()],
    }
    template_text = meta.get("tokenizer.chat_template")
    if template_text:
        config["chat_template"] = template_text
        (out / "chat_template.jinja").write_text(template_text)
    write_json(out / "tokenizer_config.json", config)
    write_json(out / "special_tokens_map.json", special)


def _post_processor(kind: str, meta: dict[str, Any], special: dict[str, str], add_bos: bool, add_eos: bool,
                    where: str) -> Any:
    """BOS / EOS around a text encoded with special tokens (a `TemplateProcessing`); "gpt2" keeps its
    `ByteLevel` step first (offsets untrimmed, ids unchanged), alone when nothing is added."""
    from tokenizers import processors

    ends = []
    for on, name in ((add_bos, "bos"), (add_eos, "eos")):
        if on and f"{name}_token" not in special:
            raise ModelLoadError(f"{where}: tokenizer.ggml.add_{name}_token is set (or llama.cpp's default) but "
                                 f"the file has no tokenizer.ggml.{name}_token_id")
        if on:
            ends.append((special[f"{name}_token"], int(meta[f"tokenizer.ggml.{name}_token_id"])))
    bos = f"{special['bos_token']}:0 " if add_bos else ""
    eos = f" {special['eos_token']}:0" if add_eos else ""
    template = processors.TemplateProcessing(single=f"{bos}$A:0{eos}", pair=f"{bos}$A:0{eos} {bos}$B:1{eos}",
                                             special_tokens=ends)
    if kind == "llama":
        return template
    byte_level = processors.ByteLevel(trim_offsets=False)
    return processors.Sequence([byte_level, template]) if ends else byte_level


def _byte_level(meta: dict[str, Any], tokens: list[str], special: dict[str, str], where: str) -> Any:
    """llama.cpp's "gpt2" model: the file's merges, the pre-tokenizer `tokenizer.ggml.pre` names."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if "tokenizer.ggml.merges" not in meta:
        raise ModelLoadError(f"{where}: a 'gpt2' tokenizer needs tokenizer.ggml.merges, which the file lacks")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    pre = meta.get("tokenizer.ggml.pre", "default")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token=special.get("unk_token"),
                     fuse_unk=False, byte_fallback=False, ignore_merges=pre in _LLAMA3_PRE)
    tk = Tokenizer(bpe)
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
    return tk


def _sentencepiece(meta: dict[str, Any], tokens: list[str], special: dict[str, str], where: str) -> Any:
    """llama.cpp's "llama" model (`llm_tokenizer_spm`) as a BPE with byte fallback (module docstring)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        have = "no scores" if scores is None else f"{len(scores)} scores"
        raise ModelLoadError(f"{where}: a 'llama' (SentencePiece) tokenizer needs tokenizer.ggml.scores, one per "
                             f"token; the file has {have} for {len(tokens)} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError(f"{where}: tokenizer.ggml.tokens holds a token twice")
    bpe = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores), unk_token=special.get("unk_token"),
                     fuse_unk=True, byte_fallback=True)
    tk = Tokenizer(bpe)
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # normalizers run on each piece of text between added tokens: llama.cpp's prefix after every special
    steps = [normalizers.Prepend(SPACE)] if space_prefix else []
    tk.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if space_prefix else []
    tk.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tk


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) with left + right a token and both halves tokens: llama.cpp's SentencePiece merge
    candidates, best first (the whole token's score, descending; ties by token id, then left token id)."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, t in enumerate(tokens):
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in ids and right in ids:
                ranked.append((-float(scores[i]), i, ids[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
