"""GGUF tokenizers rebuilt as llama.cpp tokenizes: tiny GGUF files (the `gguf` package's writer) with a
SentencePiece ("llama") vocabulary and a byte-level BPE ("gpt2") one, against a port of llama.cpp's
`llm_tokenizer_spm` and transformers' own GGUF tokenizer; BOS / EOS as `tokenizer.ggml.add_bos_token` /
`add_eos_token` (or llama.cpp's defaults) say, through `load_tokenizer` and through the engine's text
and chat prompt paths."""

from __future__ import annotations

import heapq
import random
from pathlib import Path
from typing import Any

import pytest

from troupe.errors import ModelLoadError
from troupe.models.gguf_tokenizer import SPACE, tokenizer_folder
from troupe.models.loader import load_tokenizer

# -- a tiny SentencePiece vocabulary: llama.cpp's token types, Llama 2's layout ---------------------------
UNK, BOS, EOS = 0, 1, 2
BYTES = [f"<0x{b:02X}>" for b in range(256)]
MERGED = ["▁t", "he", "ll", "▁h", "▁he", "llo", "▁hello", "or", "▁w", "▁wor", "ld", "▁world", "12", "▁1", "ab",
          "bc", "abc", "▁a", "▁ab", "▁▁", "▁▁▁", "lo", "el", "hel", "123", "▁x"]  # best score first
CHARS = ["▁", "e", "h", "l", "o", "w", "r", "d", "1", "2", "3", "a", "b", "c", "x", "\n"]
EXTRA = [("<|user|>", 4), ("<|end|>", 3), ("<unused0>", 5)]  # user-defined, control, unused
SPM_TOKENS = ["<unk>", "<s>", "</s>", *BYTES, *MERGED, *CHARS, *(t for t, _ in EXTRA)]
SPM_TYPES = [2, 3, 3] + [6] * 256 + [1] * (len(MERGED) + len(CHARS)) + [k for _, k in EXTRA]
SPM_SCORES = [0.0] * 259 + [-float(i) for i in range(len(MERGED) + len(CHARS))] + [0.0] * len(EXTRA)
TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"

# -- a tiny byte-level BPE vocabulary: the 256 byte characters, a few merges, Llama 3's special tokens -----
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
_OTHER = [b for b in range(256) if b not in _PRINTABLE]
BYTE_CHARS = {b: chr(b) if b in _PRINTABLE else chr(256 + _OTHER.index(b)) for b in range(256)}  # GPT-2's
BPE_MERGES = [("h", "e"), ("l", "l"), ("ll", "o"), ("he", "llo"), ("Ġ", "hello"), ("Ġ", "w"), ("o", "r"),
              ("Ġw", "or"), ("l", "d"), ("Ġwor", "ld"), ("1", "2")]
BPE_TOKENS = [*BYTE_CHARS.values(), *(a + b for a, b in BPE_MERGES), "Ġhi", "<|begin_of_text|>", "<|eot_id|>",
              "<tool>"]
BPE_TYPES = [1] * (len(BPE_TOKENS) - 3) + [3, 3, 4]
BPE_BOS, BPE_EOS = len(BPE_TOKENS) - 3, len(BPE_TOKENS) - 2


def write_gguf(path: Path, model: str, add_bos: bool | None = None, add_eos: bool | None = None,
               pre: str | None = None, weights: bool = False, **extra: Any) -> Path:
    """A GGUF holding the tokenizer metadata of `model` ("llama": the SentencePiece vocabulary, "gpt2": the
    byte-level one); with `weights`, a tiny random Llama (hidden 64, 2 layers, float32) over it."""
    import gguf
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model(model)
    if model == "llama":
        w.add_token_list(SPM_TOKENS)
        w.add_token_scores(SPM_SCORES)
        w.add_token_types(SPM_TYPES)
        w.add_bos_token_id(BOS)
        w.add_eos_token_id(EOS)
        w.add_unk_token_id(UNK)
    else:
        w.add_tokenizer_pre(pre or "gpt2")
        w.add_token_list(BPE_TOKENS)
        w.add_token_types(BPE_TYPES)
        w.add_token_merges([f"{a} {b}" for a, b in BPE_MERGES])
        w.add_bos_token_id(BPE_BOS)
        w.add_eos_token_id(BPE_EOS)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    for key, value in extra.items():
        getattr(w, f"add_{key}")(value)
    w.add_chat_template(TEMPLATE)
    if weights:
        vocab, hidden, inter, heads, kv_heads, layers = len(SPM_TOKENS), 64, 128, 4, 2, 2
        w.add_block_count(layers)
        w.add_context_length(256)
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(inter)
        w.add_head_count(heads)
        w.add_head_count_kv(kv_heads)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_freq_base(10000.0)
        w.add_rope_dimension_count(hidden // heads)
        w.add_vocab_size(vocab)
        rng = np.random.default_rng(0)
        kv = hidden // heads * kv_heads
        shapes = {"token_embd": (vocab, hidden), "output_norm": (hidden,)}
        for i in range(layers):
            shapes |= {f"blk.{i}.attn_norm": (hidden,), f"blk.{i}.ffn_norm": (hidden,),
                       f"blk.{i}.attn_q": (hidden, hidden), f"blk.{i}.attn_k": (kv, hidden),
                       f"blk.{i}.attn_v": (kv, hidden), f"blk.{i}.attn_output": (hidden, hidden),
                       f"blk.{i}.ffn_gate": (inter, hidden), f"blk.{i}.ffn_up": (inter, hidden),
                       f"blk.{i}.ffn_down": (hidden, inter)}
        for name, shape in shapes.items():
            w.add_tensor(f"{name}.weight", (1.0 if len(shape) == 1 else 0.0) + 0.1 * rng.standard_normal(
                shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_spm(text: str, add_bos: bool = True, add_eos: bool = False, space_prefix: bool = True) -> list[int]:
    """llama.cpp's `llama_vocab::tokenize` on the SentencePiece vocabulary, special tokens parsed: a port of
    `tokenizer_st_partition` (control, unknown and user-defined tokens, longest first, cut out of the raw
    text) and of the SPM branch (a space prefix on the first piece and on every piece after a special token)."""
    specials = sorted((i for i, k in enumerate(SPM_TYPES) if k in (2, 3, 4)), key=lambda i: -len(SPM_TOKENS[i]))
    fragments: list[str | int] = [text] if text else []
    for sid in specials:
        parts: list[str | int] = []
        for f in fragments:
            if isinstance(f, int):
                parts.append(f)
                continue
            for k, piece in enumerate(f.split(SPM_TOKENS[sid])):
                parts += ([sid] if k else []) + ([piece] if piece else [])
        fragments = parts
    out = [BOS] if add_bos else []
    prev_special = True
    for f in fragments:
        if isinstance(f, int):
            out.append(f)
        else:
            out += spm_session(((" " if space_prefix and prev_special else "") + f).replace(" ", SPACE))
        prev_special = isinstance(f, int)
    return out + ([EOS] if add_eos else [])


def spm_session(s: str) -> list[int]:
    """A port of llama.cpp's `llm_tokenizer_spm_session::tokenize`: symbols (start, length, prev, next)
    over the characters, a priority queue of adjacent pairs whose concatenation is a token (highest score
    first, leftmost on ties), merged until none is left; then each symbol's token, or its parts through
    `rev_merge`, or byte tokens for what no token covers."""
    ids = {t: i for i, t in enumerate(SPM_TOKENS)}
    sym = [[i, 1, i - 1, i + 1 if i + 1 < len(s) else -1] for i in range(len(s))]
    queue: list[tuple[float, int, int, int]] = []
    rev_merge: dict[str, tuple[int, int]] = {}
    out: list[int] = []

    def bigram(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        t = s[sym[left][0]: sym[left][0] + sym[left][1] + sym[right][1]]
        if t in ids:
            heapq.heappush(queue, (-SPM_SCORES[ids[t]], left, right, len(t)))
            rev_merge[t] = (left, right)

    def resegment(i: int) -> None:
        t = s[sym[i][0]: sym[i][0] + sym[i][1]]
        if t in ids:
            out.append(ids[t])
        elif t in rev_merge:
            resegment(rev_merge[t][0])
            resegment(rev_merge[t][1])
        else:
            out.extend(ids[f"<0x{b:02X}>"] for b in t.encode())

    for i in range(1, len(s)):
        bigram(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if sym[left][1] == 0 or sym[right][1] == 0 or sym[left][1] + sym[right][1] != size:
            continue  # one of them merged since
        sym[left][1] += sym[right][1]
        sym[right][1] = 0
        sym[left][3] = sym[right][3]
        if sym[right][3] >= 0:
            sym[sym[right][3]][2] = left
        bigram(sym[left][2], left)
        bigram(left, sym[left][3])
    i = 0 if s else -1
    while i != -1:
        resegment(i)
        i = sym[i][3]
    return out


def pieces(*names: str) -> list[int]:
    return [SPM_TOKENS.index(n) for n in names]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokcache")


@pytest.fixture(autouse=True)
def _cache_dir(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TROUPE_CACHE_DIR", str(cache))


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Any:
    """The SentencePiece GGUF's rebuilt tokenizer (no add_bos_token key: llama.cpp's default adds BOS)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TROUPE_CACHE_DIR", str(cache))
        return load_tokenizer(write_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", "llama"))


@pytest.mark.parametrize(("text", "expected"), [
    ("hello world", ["<s>", "▁hello", "▁world"]),
    ("abc", ["<s>", "▁", "abc"]),  # ab (score -14) first, then abc (-16) beats ▁ab (-18)
    ("x123", ["<s>", "▁x", "123"]),  # 12 (-12), then 123 (-24), then ▁x (-25)
    (" hello", ["<s>", "▁", "▁hello"]),  # "▁▁hello": ▁▁ (-19) loses to he, ll, ▁he, llo, ▁hello (-1 .. -6)
    ("é\n", ["<s>", "▁", "<0xC3>", "<0xA9>", "\n"]),  # é is no token: its UTF-8 bytes
    ("<|user|>hi<|end|>", ["<s>", "<|user|>", "▁h", "<0x69>", "<|end|>"]),  # a space prefix after a special
])
def test_spm_oracle_is_llama_cpp(text: str, expected: list[str]) -> None:
    """The port of llama.cpp's SentencePiece tokenizer gives the tokens worked out by hand (merge order by
    score, byte fallback, the space prefix after special tokens): the oracle below is trustworthy."""
    assert llama_cpp_spm(text) == pieces(*expected)


def test_spm_tokenizes_as_llama_cpp(spm: Any) -> None:
    """The rebuilt SentencePiece tokenizer gives llama.cpp's ids on 300 strings of words, spaces (leading,
    repeated), digits, newlines, characters only bytes cover, and special / user-defined tokens in the
    text; with special tokens BOS comes first, without them none."""
    rng = random.Random(0)
    alphabet = ["hello", "world", "he", "l", "o", "w", "a", "b", "c", "x", "1", "2", "3", " ", " ", "  ", "\n",
                "é", "😀", "ab", "<|user|>", "<|end|>", "<s>", "<unused0>", "r"]
    texts = ["", " ", "hello", " hello", "  hello world  ", "hello\nworld", "12 123 1"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    for text in texts:
        assert spm(text)["input_ids"] == llama_cpp_spm(text), repr(text)
        assert spm(text, add_special_tokens=False)["input_ids"] == llama_cpp_spm(text, add_bos=False), repr(text)


def test_spm_matches_transformers_gguf_tokenizer(spm: Any, tmp_path: Path) -> None:
    """transformers' own GGUF tokenizer on the same file gives the same ids (BOS included) where the two
    agree by design: text that starts with no space and holds no special token (transformers' Metaspace
    adds no "▁" before a leading space, nor after a special token; llama.cpp does)."""
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "spm.gguf", "llama")
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name, local_files_only=True)
    for text in ["hello world", "hello  world\n12é😀", "abc abcabc", "x123 ▁ 1", "a\n\n b c"]:
        assert spm(text)["input_ids"] == theirs(text)["input_ids"], repr(text)


def test_spm_decodes_as_llama_cpp(spm: Any) -> None:
    """Decoding turns "▁" into spaces and byte tokens into their characters, drops the space prefix, keeps
    user-defined tokens and drops control ones with skip_special_tokens."""
    for text in ["hello world", "hello  world\n12é😀", "abc", "x y"]:
        assert spm.decode(llama_cpp_spm(text), skip_special_tokens=True) == text
    assert spm.decode(llama_cpp_spm("<|user|>hello<|end|>"), skip_special_tokens=True) == "<|user|> hello"


@pytest.mark.parametrize(("model", "pre", "add_bos", "add_eos", "bos", "eos"), [
    ("llama", None, None, None, True, False),  # llama.cpp's SentencePiece default: BOS
    ("llama", None, False, None, False, False),
    ("llama", None, True, True, True, True),
    ("gpt2", "gpt2", None, None, False, False),  # llama.cpp's byte-level default: none
    ("gpt2", "smollm", True, None, True, False),
    ("gpt2", "llama-bpe", None, None, True, False),  # the Llama 3 pre-tokenizer's default: BOS
    ("gpt2", "llama-bpe", False, True, False, True),
])
def test_bos_and_eos_follow_the_file(model: str, pre: str | None, add_bos: bool | None, add_eos: bool | None,
                                     bos: bool, eos: bool, tmp_path: Path) -> None:
    """`tokenizer.ggml.add_bos_token` / `add_eos_token`, or llama.cpp's default where absent, decide whether a
    text encoded with special tokens (a plain prompt) starts with BOS / ends with EOS; without special tokens
    (a rendered chat template) neither is added."""
    tok = load_tokenizer(write_gguf(tmp_path / "t.gguf", model, add_bos, add_eos, pre))
    bos_id, eos_id = (BOS, EOS) if model == "llama" else (BPE_BOS, BPE_EOS)
    for text in ["hello world", "12 hello"]:
        body = tok(text, add_special_tokens=False)["input_ids"]
        assert bos_id not in body and eos_id not in body
        assert tok(text)["input_ids"] == [bos_id] * bos + body + [eos_id] * eos


def test_byte_level_tokenizes_as_transformers_gguf_tokenizer(tmp_path: Path) -> None:
    """The byte-level BPE rebuild (no BOS by default) gives transformers' GGUF tokenizer's ids; control and
    user-defined tokens in the text stay whole."""
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "bpe.gguf", "gpt2")
    ours = load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name, local_files_only=True)
    for text in ["hello world", " hello  world\n12é😀", "<|eot_id|>hello<tool> world", "héllo wor"]:
        assert ours(text)["input_ids"] == theirs(text, add_special_tokens=False)["input_ids"], repr(text)
    assert ours("a<tool>b<|eot_id|>")["input_ids"] == [ord("a"), BPE_TOKENS.index("<tool>"), ord("b"), BPE_EOS]


def test_llama3_pre_tokenizer_takes_whole_vocabulary_words(tmp_path: Path) -> None:
    """With `llama-bpe` a pre-token that is itself a token is taken whole, merges or not (llama.cpp's
    `ignore_merges`, as Llama 3's tokenizer.json); the GPT-2 pre-tokenizer builds it from its merges."""
    hi = BPE_TOKENS.index("Ġhi")
    llama3 = load_tokenizer(write_gguf(tmp_path / "l3.gguf", "gpt2", add_bos=False, pre="llama-bpe"))
    gpt2 = load_tokenizer(write_gguf(tmp_path / "g2.gguf", "gpt2", pre="gpt2"))
    assert llama3(" hi")["input_ids"] == [hi]
    assert gpt2(" hi")["input_ids"] == [BPE_TOKENS.index(c) for c in "Ġhi"]


def test_bad_tokenizer_metadata_is_refused(tmp_path: Path) -> None:
    """An unknown tokenizer model, SentencePiece without scores and BOS asked for without a BOS id are
    `ModelLoadError`s naming the file and the field."""
    import gguf

    def bare(name: str, model: str, **keys: Any) -> Path:
        w = gguf.GGUFWriter(tmp_path / name, "llama")
        w.add_tokenizer_model(model)
        w.add_token_list(["<unk>", "a", "b"])
        for key, value in keys.items():
            getattr(w, f"add_{key}")(value)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return tmp_path / name

    with pytest.raises(ModelLoadError, match=r"t5.gguf: tokenizer.ggml.model 't5' is not supported"):
        tokenizer_folder(bare("t5.gguf", "t5"))
    with pytest.raises(ModelLoadError, match=r"noscores.gguf: a 'llama' .* needs tokenizer.ggml.scores"):
        tokenizer_folder(bare("noscores.gguf", "llama"))
    with pytest.raises(ModelLoadError, match=r"nobos.gguf: tokenizer.ggml.add_bos_token .* no tokenizer.ggml.bos"):
        tokenizer_folder(bare("nobos.gguf", "llama", token_scores=[0.0, -1.0, -2.0]))


@pytest.mark.timeout(300)
def test_engine_adds_bos_to_text_prompts_once(tmp_path: Path) -> None:
    """Through the engine (in-process `LLM` on a tiny SentencePiece GGUF model): a text prompt gets the
    file's BOS first; a chat whose template writes the BOS text gets exactly one BOS; token-id prompts are
    taken as given."""
    from troupe import LLM, SamplingParams

    path = write_gguf(tmp_path / "m.gguf", "llama", weights=True)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with LLM(str(path), multiprocess=False, kernels="eager", num_kv_blocks=32, max_model_len=128) as llm:
        text, ids = llm.generate(["hello world", {"prompt_token_ids": [5, 6]}], params, use_tqdm=False)
        chat = llm.chat([{"role": "user", "content": "hello"}], params, use_tqdm=False)[0]
    assert text.prompt_token_ids == llama_cpp_spm("hello world") and text.prompt_token_ids[0] == BOS
    assert ids.prompt_token_ids == [5, 6]
    assert chat.prompt_token_ids == llama_cpp_spm("<s>[hello]", add_bos=False)
    assert chat.prompt_token_ids.count(BOS) == 1 and chat.prompt_token_ids[0] == BOS
    assert all(len(o.outputs[0].token_ids) == 2 for o in (text, ids, chat))
