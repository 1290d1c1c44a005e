"""`ModelArch`: the shape of a supported decoder, read from an HF `config.json`.

One parser for the three architectures troupe runs (Llama, Mistral, Qwen2: the same decoder with
different defaults). It reads the JSON as a dict, so loading a model never imports transformers, and
it accepts both spellings of the rotary settings: `rope_theta` / `rope_scaling` (transformers 4) and
`rope_parameters` (transformers 5). Anything it cannot run faithfully is a `ModelLoadError` here,
before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from troupe.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True, slots=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None, or {"rope_type": "llama3" | "linear", ...}
    max_position_embeddings: int  # already capped by a sliding window (see `from_hf_config`)
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], where: str = "config.json") -> ModelArch:
        """Parse and check an HF config dict; `where` names the file in error messages."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{where}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def need(key: str) -> Any:
            if key not in cfg or cfg[key] is None:
                raise ModelLoadError(f"{where}: missing required key {key!r}")
            return cfg[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported (only 'silu')")
        theta, scaling = _rope_settings(cfg, where)
        max_pos = int(cfg.get("max_position_embeddings") or 2048)
        # A sliding window only changes attention for contexts longer than the window, so capping
        # the context at the window keeps the model exact without a sliding-window kernel.
        window = cfg.get("sliding_window")
        uses_window = window is not None and (arch != "Qwen2ForCausalLM" or cfg.get("use_sliding_window"))
        if uses_window:
            max_pos = min(max_pos, int(window))  # type: ignore[arg-type]  # not None here
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
        )


def _rope_settings(cfg: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling or None) from either config spelling; rejects unsupported rope types."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {}) or params
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ModelLoadError(f"{where}: rope type {rope_type!r} is not supported (supported: {_ROPE_TYPES})")
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    return theta, scaling
