"""`ModelArch`: the shape of a supported decoder, read from an HF `config.json`.

Every family troupe runs is the Llama decoder with a few switches: where the norms sit, whether q and k
are normed, the activation, scalars on the embedding, the residual branches, the attention scores and the
logits, soft-capping, per-layer sliding windows, and the rotary embedding. `from_hf_config` reads the
switches common to all from the config, then the family's own parser (`troupe.models.families`) sets
the rest; the model (`troupe.models.llama`) reads only `ModelArch`. It reads the JSON as a dict, so
loading a model never imports transformers, and it accepts both spellings of the rotary settings:
`rope_theta` / `rope_scaling` (transformers 4) and `rope_parameters` (transformers 5). Anything it
cannot run faithfully is a `ModelLoadError` here, before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from troupe.errors import ModelLoadError
from troupe.models.rope_params import Rope, parse_rope, rope_params

__all__ = ["ModelArch", "Rope", "parse_rope", "rope_params"]

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
    rope_scaling: dict[str, Any] | None  # None, or {"rope_type": ..., ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # the family switches (defaults: Llama's)
    hidden_act: str = "silu"  # "silu" or "gelu_tanh", between gate and up
    qk_norm: str | None = None  # "head": RMSNorm of each head of q and k (Qwen3, Gemma 3); "full": of all (OLMo 2)
    norm_layout: str = "pre"  # "pre": norm before attention and MLP; "post": after each (OLMo 2); "sandwich": both (Gemma)
    norm_offset: float = 0.0  # Gemma's norms multiply by (offset + weight): folded into the weights at load
    embed_scale: float = 1.0  # the embedding is multiplied by this (Gemma: sqrt(hidden); Granite)
    residual_scale: float = 1.0  # each branch's output, before it is added to the residual (Granite)
    attn_scale: float | None = None  # attention score scale; None: head_dim ** -0.5
    logit_scale: float = 1.0  # the logits are multiplied by this (Granite: 1 / logits_scaling)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    layer_windows: tuple[int | None, ...] = ()  # sliding window of each layer (None: full); () for none at all
    local_rope: Rope | None = None  # the rotary embedding of the sliding layers, where it differs (Gemma 3)
    rotary_dim: int = 0  # dims of each head the rotary embedding turns; 0: all (head_dim)
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)
    # mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): the MLP of a sparse layer is `num_experts` experts of
    # `moe_intermediate_size`, `experts_per_token` of them per token (softmax top-k router, renormalized with
    # `norm_topk_prob`), plus on Qwen2-MoE a shared expert of `intermediate_size` behind a sigmoid gate
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert: bool = False
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is dense in a MoE model (Qwen's mlp_only_layers)
    expert_naming: str = "qwen"  # checkpoint names: "qwen" (mlp.experts.E.gate_proj) or "mixtral" (w1/w3/w2)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def is_plain(self) -> bool:
        """The Llama decoder itself (no family switch set): what a kernel set's one-call decoder stack runs."""
        return (self.hidden_act == "silu" and self.qk_norm is None and self.norm_layout == "pre"
                and self.embed_scale == 1.0 and self.residual_scale == 1.0 and self.attn_scale is None
                and self.logit_scale == 1.0 and self.attn_softcap is None and self.final_softcap is None
                and not any(self.layer_windows) and self.local_rope is None
                and self.rotary_dim in (0, self.head_dim) and not self.num_experts)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def rope(self) -> Rope:
        return Rope(self.rope_theta, self.rope_scaling, self.rotary_dim or self.head_dim)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], where: str = "config.json") -> ModelArch:
        """Parse and check an HF config dict; `where` names the file in error messages."""
        from troupe.models.families import FAMILIES

        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in FAMILIES), None)
        if arch is None:
            raise ModelLoadError(
                f"{where}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(FAMILIES)}"
            )

        def need(key: str) -> Any:
            if key not in cfg or cfg[key] is None:
                raise ModelLoadError(f"{where}: missing required key {key!r}")
            return cfg[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        num_layers = int(need("num_hidden_layers"))
        attention_bias = bool(cfg.get("attention_bias", False))
        base = dict(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )
        params = rope_params(cfg)
        rope = parse_rope(params, head_dim, where)
        base.update(rope_theta=rope.theta, rope_scaling=rope.scaling, rotary_dim=rope.rotary_dim)
        fields = FAMILIES[arch](cfg, base, where)
        act = fields.get("hidden_act", "silu")
        if act not in ("silu", "gelu_tanh"):
            raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported (silu, gelu_pytorch_tanh)")
        return cls(**fields)
