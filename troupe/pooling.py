"""Pooling (embedding) requests: `PoolingParams`, the model's resolved pooler (`PoolerConfig`) and
the vLLM-shaped outputs (`PoolingRequestOutput`, `EmbeddingRequestOutput`, `ScoringRequestOutput`).

An engine started with `runner="pooling"` (vLLM's `--runner pooling`) answers pooling requests
only: each request runs its prompt's prefill (chunked like any prefill) and finishes, its KV blocks
freed; the final hidden states (after the model's final norm, as HF `AutoModel`'s
`last_hidden_state`) are pooled into one vector per prompt (`troupe.core.pooler`).

Which pooler, in order (later wins):
1. vLLM's default for a decoder LM used as an embedder: last token, normalized (L2);
2. a sentence-transformers folder: `modules.json` names the `Pooling` module, whose `config.json`
   says the mode (`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`, `pooling_mode_cls_token`),
   and a `Normalize` module turns normalization on (else off); a mode or module troupe cannot
   apply (max, weighted mean, a `Dense` layer, `include_prompt: false`) is an error at load, never ignored;
3. `EngineConfig.pooler_config` (`--pooler-config` / vLLM's `--override-pooler-config`):
   `{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool}`.

Matryoshka: a model whose `config.json` has `matryoshka_dimensions` (a list) or `is_matryoshka: true`
accepts `PoolingParams.dimensions` (the first `dimensions` values, then normalized); any other model
refuses it, as vLLM does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from troupe.errors import InvalidInputError

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("generate", "pooling")
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request pooling settings (vLLM's `PoolingParams`).

    `dimensions`: keep the first k values (Matryoshka models only; 1 <= k <= hidden size).
    `normalize`: None follows the model's pooler; True / False override it for this request.
    `truncate_prompt_tokens`: keep the prompt's last k tokens (-1: max_model_len), as `SamplingParams`."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Check every field (again at submission: the struct is mutable)."""
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidInputError("dimensions", f"must be an integer >= 1, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidInputError("normalize", f"must be true, false or null, got {self.normalize!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1)):
            raise InvalidInputError("truncate_prompt_tokens", f"must be an integer >= 1, or -1 (max_model_len), got {k!r}")


class PoolerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The pooler an engine applies (resolved at load, see the module docstring); reported to the
    frontend in `ModelLimits.pooler`."""

    pooling_type: str = "LAST"  # one of POOLING_TYPES
    normalize: bool = True
    hidden_size: int = 0
    matryoshka: bool = False  # the model accepts `dimensions`
    matryoshka_dimensions: list[int] | None = None  # the sizes it was trained for, when it says

    def check(self, params: PoolingParams) -> None:
        """Raise `InvalidInputError` if this pooler cannot honour `params` (naming the field)."""
        dims = params.dimensions
        if dims is None:
            return
        if not self.matryoshka:
            raise InvalidInputError("dimensions", "this model does not support Matryoshka representation (its "
                                    "config.json has no matryoshka_dimensions / is_matryoshka): changing the "
                                    "output dimensions is refused")
        if not 1 <= dims <= self.hidden_size:
            raise InvalidInputError("dimensions", f"must be in [1, {self.hidden_size}] (the hidden size), got {dims}")
        if self.matryoshka_dimensions and dims not in self.matryoshka_dimensions:
            raise InvalidInputError("dimensions", f"must be one of the model's matryoshka_dimensions "
                                    f"{self.matryoshka_dimensions}, got {dims}")


def check_pooler_override(override: dict[str, Any] | None) -> None:
    """Validate `EngineConfig.pooler_config` (each key named on error)."""
    if override is None:
        return
    if not isinstance(override, dict):
        raise InvalidInputError("pooler_config", f"must be an object with pooling_type and/or normalize, got {override!r}")
    for key, value in override.items():
        if key == "pooling_type":
            if not isinstance(value, str) or value.upper() not in POOLING_TYPES:
                raise InvalidInputError("pooler_config.pooling_type", f"must be one of {list(POOLING_TYPES)}, got {value!r}")
        elif key == "normalize":
            if not isinstance(value, bool):
                raise InvalidInputError("pooler_config.normalize", f"must be true or false, got {value!r}")
        else:
            raise InvalidInputError(f"pooler_config.{key}", "is not a pooler option (pooling_type, normalize)")


def resolve_pooler(path: Path, hf_config: dict[str, Any], hidden_size: int,
                   override: dict[str, Any] | None = None) -> PoolerConfig:
    """The pooler for the model at `path` (a folder or a GGUF file), per the module docstring."""
    check_pooler_override(override)
    pooling_type, normalize = "LAST", True
    modules_file = path / "modules.json" if path.is_dir() else None
    if modules_file is not None and modules_file.is_file():
        pooling_type, normalize = _sentence_transformers(path, json.loads(modules_file.read_text()))
    if override:
        pooling_type = str(override.get("pooling_type", pooling_type)).upper()
        normalize = bool(override.get("normalize", normalize))
    dims = hf_config.get("matryoshka_dimensions")
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize, hidden_size=hidden_size,
                        matryoshka=bool(dims) or bool(hf_config.get("is_matryoshka")),
                        matryoshka_dimensions=[int(d) for d in dims] if isinstance(dims, list) else None)


def _sentence_transformers(path: Path, modules: list[dict[str, Any]]) -> tuple[str, bool]:
    """(pooling_type, normalize) from a sentence-transformers folder; anything it cannot apply raises."""
    where = path / "modules.json"
    pooling_type, normalize = "LAST", False
    for module in modules:
        kind = module.get("type", "")
        if kind == _ST_POOLING:
            cfg = json.loads((path / module.get("path", "") / "config.json").read_text())
            modes = [mode for mode, on in cfg.items() if mode.startswith("pooling_mode") and on]
            if len(modes) != 1 or modes[0] not in _ST_MODES:
                raise ValueError(f"{where}: pooling modes {modes} are not supported (one of {list(_ST_MODES)}); "
                                 "set pooler_config / --pooler-config to choose one")
            if cfg.get("include_prompt", True) is not True:
                raise ValueError(f"{where}: include_prompt=false is not supported")
            pooling_type = _ST_MODES[modes[0]]
        elif kind == _ST_NORMALIZE:
            normalize = True
        elif kind != _ST_TRANSFORMER:
            raise ValueError(f"{where}: module {kind!r} is not supported (troupe applies Transformer, Pooling, "
                             "Normalize)")
    return pooling_type, normalize


# ---------------------------------------------------------------------- outputs (vLLM's shapes)


@dataclass(slots=True)
class PoolingOutput:
    data: Any  # torch.Tensor (hidden,) float32: the pooled vector

    def __repr__(self) -> str:
        return f"PoolingOutput(data={self.data!r})"


@dataclass(slots=True)
class PoolingRequestOutput:
    """What `AsyncLLM.encode` / `LLM.encode` give for one prompt."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` gives for one prompt (`outputs.embedding`: a list of floats)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, EmbeddingOutput(out.outputs.data.tolist()), out.prompt_token_ids, out.finished)


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """What `LLM.score` gives for one pair: the cosine similarity of the two embeddings."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the two prompts' tokens, concatenated
    finished: bool = True


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors (0.0 when either is all zeros)."""
    if len(a) != len(b):
        raise ValueError(f"vectors of different sizes: {len(a)} and {len(b)}")
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    na, nb = math.sqrt(math.fsum(x * x for x in a)), math.sqrt(math.fsum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


def score_pairs(n_1: int, n_2: int) -> list[tuple[int, int]]:
    """vLLM's pairing of `text_1` / `text_2`: one with many pairs it with each; two lists of the same
    length pair up index by index; anything else is an `InvalidInputError`."""
    if n_1 < 1 or n_2 < 1:
        raise InvalidInputError("text_1" if n_1 < 1 else "text_2", "must not be empty")
    if n_1 == 1:
        return [(0, j) for j in range(n_2)]
    if n_1 != n_2:
        raise InvalidInputError("text_2", f"must have one item or as many as text_1 ({n_1}), got {n_2}")
    return [(i, i) for i in range(n_1)]
