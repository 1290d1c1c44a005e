"""The rotary settings of an HF config: `rope_params` reads them from either spelling, `parse_rope` checks
them into a `Rope` (shared by `troupe.models.arch` and the family parsers; the tables are `troupe.models.rope`'s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from troupe.errors import ModelLoadError

ROPE_TYPES = ("default", "llama3", "linear", "yarn", "dynamic", "longrope")


@dataclass(frozen=True, slots=True)
class Rope:
    """One rotary embedding: base, scaling (None, or the config's dict with `rope_type` set), and the
    number of leading dims of each head it rotates (the rest pass through; `partial_rotary_factor`)."""

    theta: float
    scaling: dict[str, Any] | None
    rotary_dim: int


def rope_params(cfg: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The rotary settings of the config in transformers 5's shape (`rope_theta`, `rope_type`, scaling keys,
    `partial_rotary_factor`), from either spelling; `layer_type` picks Gemma 3's per-layer-type entry."""
    given = cfg.get("rope_parameters")
    if isinstance(given, dict) and layer_type is not None and isinstance(given.get(layer_type), dict):
        given = given[layer_type]
    params = dict(given or {})
    if layer_type is None and params and all(isinstance(v, dict) for v in params.values()):
        params = dict(params.get("full_attention") or {})  # a per-layer-type dict: the global layers'
    params.update({k: v for k, v in (cfg.get("rope_scaling") or {}).items() if k not in params})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in cfg:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if "original_max_position_embeddings" in cfg:
        params.setdefault("original_max_position_embeddings", cfg["original_max_position_embeddings"])
    params.setdefault("max_position_embeddings", cfg.get("max_position_embeddings") or 2048)
    return params


def parse_rope(params: dict[str, Any], head_dim: int, where: str) -> Rope:
    """A `Rope` from `rope_params`' dict; an unsupported type is a ModelLoadError naming it."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"{where}: rope type {rope_type!r} is not supported (supported: {ROPE_TYPES})")
    rotary = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise ModelLoadError(f"{where}: partial_rotary_factor gives {rotary} rotary dims of {head_dim}")
    theta = float(params["rope_theta"])
    if rope_type == "default":
        return Rope(theta, None, rotary)
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    scaling["rope_type"] = rope_type
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(scaling.get(key) or []) != rotary // 2:
                raise ModelLoadError(f"{where}: rope {key} must have {rotary // 2} values")
    return Rope(theta, scaling, rotary)
