"""`gguf_config`: the HF `config.json` dict of a GGUF file's model, from llama.cpp's metadata keys.

llama.cpp's converter (`convert_hf_to_gguf.py`) writes the hyper-parameters under `{arch}.*`
(`qwen3.block_count`, `gemma2.attn_logit_softcapping`, `phi3.rope.scaling.original_context_length`, ...);
this module turns them back into the config transformers would read, so the family parsers
(`troupe.models.families`) check and run a GGUF exactly as the same model's folder. GGUF architectures:
`llama` (Llama, Mistral, Mixtral), `qwen2`, `qwen3`, `phi3`, `gemma2`, `gemma3` (the text model), `qwen2moe`,
`qwen3moe`, `olmo2` (OLMo 2; an Olmo 3 file, `olmo2` with a sliding window, is refused), `granite` (Granite 3:
its `embedding_scale`, `residual_scale`, `attention.scale` and `logit_scale` keys are the config's
`embedding_multiplier`, `residual_multiplier`, `attention_multiplier` and `logits_scaling`, each written by
the converter only where non-zero; a missing one is neutral, the attention scale then `head_dim ** -0.5`,
as llama.cpp runs it).

What llama.cpp does not store it fixes per architecture (`llama-model.cpp`), and so does troupe
(`_FAMILY_CONFIG`): Gemma's activation (GELU, tanh), its default soft-caps (Gemma 2: 50 and 30) and
sliding window (Gemma 2: 4096; Gemma 3: none without the key), which layers slide (Gemma 2 every even one,
Gemma 3 five of six, unless the file has `attention.sliding_window_pattern`: a period or a flag per layer),
Gemma 3's local rotary base (10000, or `rope.freq_base_swa`), the attention scale (`query_pre_attn_scalar`:
`hidden / heads` for the 27B models, known by their layer count, else `key_length`). Phi-3's window is
kept on every layer as transformers runs it (llama.cpp turns it off). A missing required key is a
`ModelLoadError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from troupe.errors import ModelLoadError

GGUF_ARCHITECTURES = {  # general.architecture -> (HF architecture, model_type)
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "olmo2": ("Olmo2ForCausalLM", "olmo2"),
    "granite": ("GraniteForCausalLM", "granite"),
}
PERMUTED_ARCHITECTURES = ("llama", "granite")  # llama.cpp's converter interleaves their q/k rows
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")  # norm weights stored as (1 + w)
POST_NORM_ARCHITECTURES = ("gemma2", "gemma3", "olmo2")  # post_attention_norm / post_ffw_norm after each branch

Meta = Callable[..., Any]  # get(key, default=None) / need(key): the value of `{arch}.{key}`


def gguf_config(meta: dict[str, Any], tensor_names: set[str], where: str = "GGUF") -> dict[str, Any]:
    """The HF config dict of a GGUF file's model (see the module docstring)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{where}: GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    architecture, model_type = GGUF_ARCHITECTURES[arch]
    p = f"{arch}."

    def need(key: str) -> Any:
        if meta.get(p + key) is None:
            raise ModelLoadError(f"{where}: metadata key {p + key!r} is missing")
        return meta[p + key]

    def get(key: str, default: Any = None) -> Any:  # (key under the architecture's prefix, default) -> value
        value = meta.get(p + key)
        return default if value is None else value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(get("attention.key_length") or hidden // heads)
    if int(get("attention.value_length") or head_dim) != head_dim:
        raise ModelLoadError(f"{where}: {p}attention.value_length {meta[p + 'attention.value_length']} differs "
                             f"from key_length {head_dim} (not supported)")
    rotary = int(get("rope.dimension_count") or head_dim)
    if rotary != head_dim and arch in PERMUTED_ARCHITECTURES:
        raise ModelLoadError(f"{where}: partial rotary ({rotary} of {head_dim} dims) is not supported for {arch!r}")
    rope_scaling, original = _rope_scaling(get, need, tensor_names, where)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length") or 2048),
        # GGUF stores eps as float32 (9.9999997e-06): give back the decimal it came from
        "rms_norm_eps": float(f"{need('attention.layer_norm_rms_epsilon'):.6g}"),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,  # longrope: None here, the factors are tensors (`gguf.gguf_arch`)
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "vocab_size": int(get("vocab_size") or len(tokens)),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if rotary != head_dim:
        cfg["partial_rotary_factor"] = rotary / head_dim
    if original is not None:
        cfg["original_max_position_embeddings"] = original
    extra = _FAMILY_CONFIG.get(arch)
    if extra is not None:
        cfg.update(extra(cfg, get, need, tensor_names, where))
    return cfg


def _rope_scaling(get: Meta, need: Meta, names: set[str], where: str) -> tuple[dict[str, Any] | None, int | None]:
    """(HF rope_scaling, original_max_position_embeddings) from `rope.scaling.*`: linear; yarn (its beta
    keys; llama.cpp's own extrapolation / attention factors and log multiplier are refused, HF's yarn has no
    place for them); longrope where the `rope_factors_long` / `rope_factors_short` tensors are (written
    with or without `rope.scaling.type = longrope`)."""
    scaling = get("rope.scaling.type", "none")
    factors = {"rope_factors_long.weight", "rope_factors_short.weight"} & names
    if len(factors) == 1:
        raise ModelLoadError(f"{where}: {factors.pop()!r} without its pair (longrope needs both)")
    if factors and scaling in ("none", "longrope"):
        return None, int(need("rope.scaling.original_context_length"))
    if scaling == "none":
        return None, None
    if scaling == "linear":
        return {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}, None
    if scaling == "yarn":
        for key, neutral in (("yarn_ext_factor", (1.0, -1.0)), ("yarn_attn_factor", (1.0,)),
                             ("yarn_log_multiplier", (0.0,))):
            if get(f"rope.scaling.{key}") not in (None, *neutral):
                raise ModelLoadError(f"{where}: rope.scaling.{key} = {get(f'rope.scaling.{key}')} is not supported "
                                     f"(only {neutral[0]})")
        original = int(need("rope.scaling.original_context_length"))
        sc = {"rope_type": "yarn", "factor": float(need("rope.scaling.factor")), "original_max_position_embeddings": original}
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if get(f"rope.scaling.{key}") is not None:
                sc[hf] = float(get(f"rope.scaling.{key}"))
        return sc, original
    if scaling == "longrope":
        raise ModelLoadError(f"{where}: rope scaling 'longrope' without the rope_factors_long / rope_factors_short tensors")
    raise ModelLoadError(f"{where}: rope scaling {scaling!r} is not supported (none, linear, yarn, longrope)")


def _qwen(cfg: dict[str, Any], get: Meta, need: Meta, names: set[str], where: str) -> dict[str, Any]:
    return {"use_sliding_window": False}


def _experts(need: Meta) -> dict[str, Any]:
    return {"num_experts": int(need("expert_count")), "num_local_experts": int(need("expert_count")),
            "num_experts_per_tok": int(need("expert_used_count"))}


def _llama(cfg: dict[str, Any], get: Meta, need: Meta, names: set[str], where: str) -> dict[str, Any]:
    """A `llama` file with experts (`expert_count`) is Mixtral: every layer's MLP is its experts."""
    if not get("expert_count"):
        return {}
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **_experts(need)}


def _qwen_moe(cfg: dict[str, Any], get: Meta, need: Meta, names: set[str], where: str) -> dict[str, Any]:
    """Qwen2-MoE / Qwen3-MoE: experts of `expert_feed_forward_length`, top-k renormalized as the file says
    (`expert_weights_norm`; llama.cpp's default: Qwen3-MoE yes, Qwen2-MoE no); Qwen2-MoE's shared expert of
    `expert_shared_feed_forward_length`."""
    qwen3 = cfg["model_type"] == "qwen3_moe"
    out = {"use_sliding_window": False, **_experts(need),
           "moe_intermediate_size": int(need("expert_feed_forward_length")),
           "norm_topk_prob": bool(get("expert_weights_norm", qwen3))}
    if not qwen3:
        out["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length", 0))
    return out


def _phi3(cfg: dict[str, Any], get: Meta, need: Meta, names: set[str], where: str) -> dict[str, Any]:
    """Phi-3: a sliding window on every layer where the file has one (0: none, Phi-4)."""
    return {"sliding_window": int(get("attention.sliding_window", 0)) or None}


_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's rule for query_pre_attn_scalar


def _gemma(cfg: dict[str, Any], get: Meta, need: Meta, names: set[str], where: str) -> dict[str, Any]:
    """Gemma 2 / 3 (see the module docstring for what llama.cpp fixes rather than stores)."""
    arch = "gemma2" if cfg["model_type"] == "gemma2" else "gemma3"
    layers, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    big = layers == _GEMMA_27B_LAYERS[arch]
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if big else head_dim,
        "final_logit_softcapping": get("final_logit_softcapping", 30.0 if arch == "gemma2" else None),
        "attn_logit_softcapping": get("attn_logit_softcapping", 50.0) if arch == "gemma2" else None,
    }
    window = int(get("attention.sliding_window", 4096 if arch == "gemma2" else 0))
    out["sliding_window"] = window or None
    if window:
        pattern = get("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
        if isinstance(pattern, list):  # one flag a layer: true = sliding
            if len(pattern) != layers:
                raise ModelLoadError(f"{where}: {arch}.attention.sliding_window_pattern has {len(pattern)} "
                                     f"entries for {layers} layers")
            sliding = [bool(s) for s in pattern]
        else:  # llama.cpp's set_swa_pattern(n): every n-th layer is global, the others slide
            n = int(pattern)
            sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
        out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    if arch == "gemma3":
        out["rope_local_base_freq"] = float(get("rope.freq_base_swa", 10000.0))
    return out


def _olmo2(cfg: dict[str, Any], get: Meta, need: Meta, names: set[str], where: str) -> dict[str, Any]:
    """OLMo 2: nothing beyond the common keys; Olmo 3 (the same GGUF architecture with a sliding window)
    is refused."""
    if get("attention.sliding_window"):
        raise ModelLoadError(f"{where}: olmo2.attention.sliding_window is set (an Olmo 3 file): sliding windows "
                             f"are not supported for 'olmo2'")
    return {}


_GRANITE_SCALES = (("embedding_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier"),
                   ("attention.scale", "attention_multiplier"), ("logit_scale", "logits_scaling"))


def _granite(cfg: dict[str, Any], get: Meta, need: Meta, names: set[str], where: str) -> dict[str, Any]:
    """Granite: the four scales the converter writes (where non-zero), as the decimals the float32 keys
    came from; an absent one stays out of the config (the family's neutral default)."""
    return {hf: _f32_decimal(get(key)) for key, hf in _GRANITE_SCALES if get(key)}


def _f32_decimal(value: float) -> float:
    """The shortest decimal that a float32 key holds (0.22, not 0.2199999988079071)."""
    return float(str(np.float32(value)))


_FAMILY_CONFIG = {"llama": _llama, "qwen2": _qwen, "qwen3": _qwen, "phi3": _phi3, "gemma2": _gemma, "gemma3": _gemma,
                  "qwen2moe": _qwen_moe, "qwen3moe": _qwen_moe, "olmo2": _olmo2, "granite": _granite}
