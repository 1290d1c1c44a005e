"""The model families troupe runs, each as the switches it sets on the shared Llama decoder.

`FAMILIES[architecture](cfg, base, where)` takes the HF config dict and the fields every family reads
the same way (`ModelArch.from_hf_config` fills `base`: sizes, eps, the rotary embedding, biases from
`attention_bias` / `mlp_bias`) and returns all of `ModelArch`'s fields for that family. Adding a family
that is the Llama decoder plus switches troupe already has is one function here and its line in
`FAMILIES` (docs/architecture.md, "Adding a model family"); a new switch goes into `ModelArch`, the
decoder layer (`troupe.models.llama`) and, for a new attention feature, every kernel set.

Sliding windows follow the config's `layer_types` where it has them (transformers 5 writes them for
every family with windows), else each family's own rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from troupe.errors import ModelLoadError
from troupe.models.rope_params import parse_rope, rope_params

Family = Callable[[dict[str, Any], dict[str, Any], str], dict[str, Any]]


def _windows(cfg: dict[str, Any], num_layers: int, default_sliding: Callable[[int], bool]) -> tuple[int | None, ...]:
    """Each layer's sliding window: `layer_types` if given, else `default_sliding(layer)`; () without one."""
    window = cfg.get("sliding_window")
    if window is None:
        return ()
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ModelLoadError(f"layer_types has {len(types)} entries for {num_layers} layers")
        sliding = [t == "sliding_attention" for t in types]
    else:
        sliding = [default_sliding(i) for i in range(num_layers)]
    out = tuple(int(window) if s else None for s in sliding)
    return out if any(w is not None for w in out) else ()


def _act(cfg: dict[str, Any], where: str) -> str:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    if act != "silu":
        raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported (silu, gelu_pytorch_tanh)")
    return "silu"


def llama(cfg: dict[str, Any], base: dict[str, Any], where: str) -> dict[str, Any]:
    return {**base, "hidden_act": _act(cfg, where)}


def mistral(cfg: dict[str, Any], base: dict[str, Any], where: str) -> dict[str, Any]:
    return {**base, "hidden_act": _act(cfg, where), "mlp_bias": False,
            "layer_windows": _windows(cfg, base["num_layers"], lambda i: True)}


def qwen2(cfg: dict[str, Any], base: dict[str, Any], where: str) -> dict[str, Any]:
    first = int(cfg.get("max_window_layers") or 0)
    windows = _windows(cfg, base["num_layers"], lambda i: i >= first) if cfg.get("use_sliding_window") else ()
    return {**base, "hidden_act": _act(cfg, where), "qkv_bias": True, "o_bias": False, "mlp_bias": False,
            "layer_windows": windows}


def qwen3(cfg: dict[str, Any], base: dict[str, Any], where: str) -> dict[str, Any]:
    first = int(cfg.get("max_window_layers") or 0)
    windows = _windows(cfg, base["num_layers"], lambda i: i >= first) if cfg.get("use_sliding_window") else ()
    return {**base, "hidden_act": _act(cfg, where), "qk_norm": "head", "mlp_bias": False, "layer_windows": windows}


def olmo2(cfg: dict[str, Any], base: dict[str, Any], where: str) -> dict[str, Any]:
    return {**base, "hidden_act": _act(cfg, where), "qk_norm": "full", "norm_layout": "post", "mlp_bias": False}


def granite(cfg: dict[str, Any], base: dict[str, Any], where: str) -> dict[str, Any]:
    return {**base, "hidden_act": _act(cfg, where),
            "embed_scale": float(cfg.get("embedding_multiplier", 1.0)),
            "residual_scale": float(cfg.get("residual_multiplier", 1.0)),
            "attn_scale": float(cfg.get("attention_multiplier", base["head_dim"] ** -0.5)),
            "logit_scale": 1.0 / float(cfg.get("logits_scaling", 1.0))}


def phi3(cfg: dict[str, Any], base: dict[str, Any], where: str) -> dict[str, Any]:
    return {**base, "hidden_act": _act(cfg, where), "fused_checkpoint": True, "qkv_bias": False, "o_bias": False,
            "mlp_bias": False, "layer_windows": _windows(cfg, base["num_layers"], lambda i: True)}


def _gemma(cfg: dict[str, Any], base: dict[str, Any], where: str) -> dict[str, Any]:
    hidden = base["hidden_size"]
    scalar = cfg.get("query_pre_attn_scalar") or base["head_dim"]
    return {**base, "hidden_act": _act(cfg, where), "norm_layout": "sandwich", "norm_offset": 1.0,
            "embed_scale": float(hidden) ** 0.5, "attn_scale": float(scalar) ** -0.5, "mlp_bias": False,
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
            "attn_softcap": cfg.get("attn_logit_softcapping"), "final_softcap": cfg.get("final_logit_softcapping")}


def gemma2(cfg: dict[str, Any], base: dict[str, Any], where: str) -> dict[str, Any]:
    return {**_gemma(cfg, base, where), "layer_windows": _windows(cfg, base["num_layers"], lambda i: i % 2 == 0)}


def gemma3(cfg: dict[str, Any], base: dict[str, Any], where: str) -> dict[str, Any]:
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    fields = {**_gemma(cfg, base, where), "qk_norm": "head",
              "layer_windows": _windows(cfg, base["num_layers"], lambda i: (i + 1) % pattern != 0)}
    local = rope_params(cfg, "sliding_attention")
    given = cfg.get("rope_parameters") or {}
    if not isinstance(given.get("sliding_attention"), dict):  # transformers 4: a local base, no scaling
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0), "rope_type": "default"}
    fields["local_rope"] = parse_rope(local, base["head_dim"], where)
    return fields


def _experts(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    n = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    k = int(cfg.get("num_experts_per_tok") or 0)
    if n < 1 or not 0 < k <= n:
        raise ModelLoadError(f"{where}: a mixture of experts needs num_experts >= 1 and 1 <= num_experts_per_tok <= "
                             f"num_experts, got {n} and {k}")
    return {"num_experts": n, "experts_per_token": k}


def mixtral(cfg: dict[str, Any], base: dict[str, Any], where: str) -> dict[str, Any]:
    return {**mistral(cfg, base, where), **_experts(cfg, where), "moe_intermediate_size": base["intermediate_size"],
            "norm_topk_prob": True, "expert_naming": "mixtral"}


def _qwen_moe(cfg: dict[str, Any], base: dict[str, Any], where: str) -> dict[str, Any]:
    n = base["num_layers"]
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(n) if i in only or (i + 1) % step != 0)
    return {**_experts(cfg, where), "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or 0),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)), "dense_layers": dense}


def qwen2_moe(cfg: dict[str, Any], base: dict[str, Any], where: str) -> dict[str, Any]:
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    fields = {**qwen2(cfg, base, where), **_qwen_moe(cfg, base, where)}
    if shared:  # the shared expert is the layer's dense MLP (of its own size) behind a gate
        if fields["dense_layers"] and shared != base["intermediate_size"]:
            raise ModelLoadError(f"{where}: dense layers and a shared expert of another size are not supported")
        fields.update(shared_expert=True, intermediate_size=shared)
    return fields


def qwen3_moe(cfg: dict[str, Any], base: dict[str, Any], where: str) -> dict[str, Any]:
    return {**qwen3(cfg, base, where), **_qwen_moe(cfg, base, where)}


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": llama,
    "MistralForCausalLM": mistral,
    "Qwen2ForCausalLM": qwen2,
    "Qwen3ForCausalLM": qwen3,
    "Olmo2ForCausalLM": olmo2,
    "GraniteForCausalLM": granite,
    "Phi3ForCausalLM": phi3,
    "Gemma2ForCausalLM": gemma2,
    "Gemma3ForCausalLM": gemma3,
    "MixtralForCausalLM": mixtral,
    "Qwen2MoeForCausalLM": qwen2_moe,
    "Qwen3MoeForCausalLM": qwen3_moe,
}
