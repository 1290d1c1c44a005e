"""GGUF files of Qwen3, Gemma 2, Gemma 3, Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMo 2 and Granite, written as
llama.cpp's converter writes them, against transformers on the same weights.

Each model is a tiny random-weight transformers model (as tests/models/test_families.py builds them),
written here as a GGUF the way `convert_hf_to_gguf.py` does: tensor names from the gguf package's own map
(`gguf.get_tensor_name_map`), metadata through `GGUFWriter`'s key writers, Gemma's norm weights stored as
`1 + w`, Phi-3's fused `attn_qkv` / `ffn_up` and its longrope factors as `rope_factors_long/short`
tensors, yarn as `rope.scaling.*` keys, Granite's multipliers as its `*_scale` keys, and q/k permuted only
where the converter's class is LlamaModel's (Mixtral, Granite; OLMo 2's Olmo2Model is not). The quantized variants hold every matrix in Q8_0
(`gguf.quants.quantize`); transformers then runs on the gguf package's dequantization of those blocks
(`gguf.quants.dequantize`), so both sides compute with the same values. troupe loads the file (blocks kept)
through `EngineCore` on the eager and the cpu kernel sets and must give transformers' greedy tokens.

What llama.cpp does not store, the models here are built to agree with: `query_pre_attn_scalar` equal to
`head_dim` (llama.cpp's rule below 27B), Gemma 3's sliding pattern of 6 (six layers: one global).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from factories import engine_greedy, transformers_greedy

from troupe.config import EngineConfig
from troupe.errors import ModelLoadError
from troupe.kernels.cpu import build
from troupe.models.gguf_config import gguf_config
from troupe.models.gguf_file import GGUFFile
from troupe.models.tiny import add_default_tokenizer

NEW_TOKENS = 6
SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, tie_word_embeddings=False, rms_norm_eps=1e-6)
WINDOWED = [[(7 * i + 3 * n) % 4000 + 10 for i in range(n)] for n in (5, 17, 30)]  # windows of 16
SHORT = [[(5 * i + 2 * n) % 4000 + 10 for i in range(n)] for n in (5, 12, 20)]  # within longrope's 32
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 32, "short_factor": [1.0, 1.1, 1.3, 1.6],
            "long_factor": [1.0, 2.0, 4.0, 8.0]}

# name: (GGUF architecture, transformers config class, its arguments over SMALL, weight format, prompts)
CASES: dict[str, tuple[str, str, dict[str, Any], str, list[list[int]]]] = {
    "qwen3-F32": ("qwen3", "Qwen3Config", dict(head_dim=32), "F32", WINDOWED),  # q is 128 wide, hidden 64
    "qwen3-Q8_0": ("qwen3", "Qwen3Config", {}, "Q8_0", WINDOWED),
    "qwen3-yarn-F32": ("qwen3", "Qwen3Config", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 4.0}), "F32", WINDOWED),
    "gemma2-F32": ("gemma2", "Gemma2Config", dict(sliding_window=16, query_pre_attn_scalar=16,
                                                  attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                                                  tie_word_embeddings=True), "F32", WINDOWED),
    "gemma3-Q8_0": ("gemma3", "Gemma3TextConfig", dict(
        num_hidden_layers=6, sliding_window=16, query_pre_attn_scalar=16, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}),
        "Q8_0", WINDOWED),
    "phi3-Q8_0": ("phi3", "Phi3Config", dict(sliding_window=16), "Q8_0", WINDOWED),
    # mixtures of experts (8 experts, top-2): the ffn_*_exps tensors hold every expert, blocks kept per expert
    "mixtral-Q8_0": ("llama", "MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2), "Q8_0", WINDOWED),
    "qwen2moe-F32": ("qwen2moe", "Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                                        shared_expert_intermediate_size=96), "F32", WINDOWED),
    "qwen3moe-Q8_0": ("qwen3moe", "Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                                         norm_topk_prob=True), "Q8_0", WINDOWED),
    "phi3-partial-longrope-F32": ("phi3", "Phi3Config", dict(
        partial_rotary_factor=0.5, max_position_embeddings=256, original_max_position_embeddings=32,
        rope_parameters=LONGROPE), "F32", SHORT),
    # OLMo 2: norms after each branch, q/k norms over all heads; Granite: Llama's layout (q/k permuted) plus
    # four multipliers (residual 0.22 is not a float32: the key gives it back as the decimal it came from)
    "olmo2-F32": ("olmo2", "Olmo2Config", {}, "F32", WINDOWED),
    "granite-Q8_0": ("granite", "GraniteConfig", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                                      attention_multiplier=0.1, logits_scaling=8.0), "Q8_0", WINDOWED),
}


def hf_model(name: str) -> Any:
    """The tiny transformers model of case `name`, weights drawn with a fixed seed (norms around their
    neutral value: 1, or Gemma's 0 of `1 + w`)."""
    import transformers

    _, cls, extra, _, _ = CASES[name]
    config = getattr(transformers, cls)(**{**SMALL, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1 and "norm" in pname:
                p.copy_((0.0 if "gemma" in cls.lower() else 1.0) + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def write_gguf(model: Any, arch: str, fmt: str, path: Path) -> Path:
    """`model` as llama.cpp's converter writes it (see the module docstring); in Q8_0, the model's matrices
    are replaced by the dequantized blocks the file holds."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(path, arch)
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    writer.add_block_count(layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    if arch in ("qwen3", "gemma2", "gemma3", "qwen3moe"):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:  # convert_hf_to_gguf's MixtralModel / Qwen2MoeModel / Qwen3MoeModel keys
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "granite":  # convert_hf_to_gguf's GraniteModel: each multiplier where non-zero
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    if arch in ("qwen3", "qwen2moe", "qwen3moe", "llama", "olmo2", "granite"):
        writer.add_rope_freq_base(rope["rope_theta"])
        if rope.get("rope_type") == "yarn":  # convert_hf_to_gguf's TextModel.set_gguf_parameters
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        full = rope["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    if arch == "phi3":
        partial = float(rope.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(partial * cfg.hidden_size) // heads)
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings or cfg.max_position_embeddings)
        writer.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(
                cfg.original_max_position_embeddings))))
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    add_default_tokenizer(writer)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    with torch.no_grad():
        for pname, p in model.named_parameters():  # a tied head is the embedding's one parameter
            if pname.endswith("mlp.experts.gate_up_proj"):  # (E, 2f, h): gate rows, then up rows
                layer = pname.split(".")[2]
                gate, up = p.chunk(2, dim=1)
                for part, w3 in (("gate", gate), ("up", up)):
                    _add(writer, f"blk.{layer}.ffn_{part}_exps.weight", w3, fmt)
                continue
            if pname.endswith("mlp.experts.down_proj"):  # (E, h, f)
                _add(writer, f"blk.{pname.split('.')[2]}.ffn_down_exps.weight", p, fmt)
                continue
            gname = names.get_name(pname, try_suffixes=(".weight", ".bias"))
            assert gname is not None, pname
            w = p.detach().float().numpy()
            if arch in ("llama", "granite") and pname.endswith(("q_proj.weight", "k_proj.weight")):  # LlamaModel's permute
                n = heads if "q_proj" in pname else cfg.num_key_value_heads
                w = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
                if fmt != "F32":  # the dequantized values go back in the HF layout below
                    qtype = gguf.GGMLQuantizationType[fmt]
                    raw = gguf.quants.quantize(w, qtype)
                    writer.add_tensor(gname, raw, raw_dtype=qtype)
                    back = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
                    back = back.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
                    p.copy_(torch.from_numpy(np.ascontiguousarray(back)))
                    continue
            if arch.startswith("gemma") and pname.endswith("norm.weight"):  # convert_hf_to_gguf: 1 + w
                w = w + 1
            if p.ndim == 1 or fmt == "F32":
                writer.add_tensor(gname, np.ascontiguousarray(w, dtype=np.float32))
                continue
            qtype = gguf.GGMLQuantizationType[fmt]
            raw = gguf.quants.quantize(w, qtype)
            writer.add_tensor(gname, raw, raw_dtype=qtype)
            p.copy_(torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(p.shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: Any, gname: str, p: torch.Tensor, fmt: str) -> None:
    """A (E, rows, cols) expert tensor in `fmt`; in a block format `p` takes the blocks' values."""
    import gguf

    w = p.detach().float().numpy()
    if fmt == "F32":
        writer.add_tensor(gname, np.ascontiguousarray(w, dtype=np.float32))
        return
    qtype = gguf.GGMLQuantizationType[fmt]
    raw = gguf.quants.quantize(w, qtype)
    writer.add_tensor(gname, raw, raw_dtype=qtype)
    p.copy_(torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(p.shape)))


def hf_greedy(model: Any, batch: list[list[int]]) -> list[list[int]]:
    return transformers_greedy(model, batch, NEW_TOKENS)


def troupe_greedy(path: Path, kernels: str, batch: list[list[int]]) -> list[list[int]]:
    """All prompts in one engine (the file's blocks kept), chunked prefill mixing prefills with decodes."""
    kv = "float32" if kernels == "cpu" else "auto"
    return engine_greedy(EngineConfig(model=str(path), dtype="float32", kernels=kernels, kv_cache_dtype=kv, quantization="gguf",
                                      num_kv_blocks=64, block_size=4, max_num_batched_tokens=32, num_threads=1),
                         batch, NEW_TOKENS)


_BUILT: dict[str, tuple[Path, list[list[int]], dict[str, Any]]] = {}
_WEIGHTS: dict[str, dict[str, torch.Tensor]] = {}  # case -> the HF model's parameters (the file's values)


def built(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], dict[str, Any]]:
    """(GGUF file, transformers' greedy tokens on the file's values, the HF config dict) of case `name`,
    built once a session."""
    if name not in _BUILT:
        arch, _, _, fmt, prompts = CASES[name]
        model = hf_model(name)
        path = write_gguf(model, arch, fmt, tmp_path_factory.mktemp(name) / "model.gguf")
        _BUILT[name] = path, hf_greedy(model, prompts), {**model.config.to_dict(), "architectures": [type(model).__name__]}
        _WEIGHTS[name] = {k: v.detach().clone() for k, v in model.named_parameters()}
    return _BUILT[name]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, list[list[int]]]:
    path, want, _ = built(request.param, tmp_path_factory)
    return request.param, path, want


def test_gguf_arch_is_the_hf_configs(case: tuple[str, Path, list[list[int]]]) -> None:
    """The ModelArch read from the GGUF's metadata is the one read from the same model's HF config, but for
    what llama.cpp's layout changes (Gemma's norms stored as 1 + w: norm_offset 0; Phi-3's fused projections
    served split: fused_checkpoint off); the rotary tables agree over the whole context (longrope's factors
    and attention factor come from float32 tensors and keys)."""
    import dataclasses

    from troupe.models.arch import ModelArch
    from troupe.models.gguf import gguf_arch
    from troupe.models.rope import rope_table

    name, path, _ = case
    want = ModelArch.from_hf_config(_BUILT[name][2])
    with GGUFFile(path) as f:
        _, got = gguf_arch(f)
    n = want.max_position_embeddings
    torch.testing.assert_close(rope_table(got.rope, got.head_dim, n, n), rope_table(want.rope, want.head_dim, n, n))
    want = dataclasses.replace(want, norm_offset=0.0, fused_checkpoint=False, rope_scaling=None)
    assert dataclasses.replace(got, rope_scaling=None) == want


@pytest.mark.parametrize("kernels", ["eager", "cpu"])
def test_gguf_family_greedy_equals_transformers(case: tuple[str, Path, list[list[int]]], kernels: str) -> None:
    """troupe on the GGUF gives transformers' greedy tokens on the same weights, on both kernel sets."""
    if kernels == "cpu" and not (build.REQUIRED_CPU_FLAGS <= build.cpu_flags() and build.shutil.which("c++")):
        pytest.skip("no AVX2/FMA/F16C CPU or no C++ compiler here")
    name, path, want = case
    assert troupe_greedy(path, kernels, CASES[name][4]) == want


@pytest.mark.parametrize("name", ["granite-Q8_0", "olmo2-F32", "qwen3-F32"])
def test_gguf_weights_are_the_hf_parameters(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every parameter of the HF model is served under its name with its values: q/k rows back in the HF
    layout where the converter permuted them (Granite), as stored where it did not (OLMo 2, Qwen3), the post
    norms under OLMo 2's names. (Greedy tokens of a tiny random model barely depend on which rows rotate
    together; this checks the layout itself.)"""
    from troupe.kernels.quant import QuantizedTensor
    from troupe.models.gguf import GGUFWeights, gguf_arch

    path = built(name, tmp_path_factory)[0]
    with GGUFFile(path) as f:
        _, arch = gguf_arch(f)
        weights = GGUFWeights(f, arch)
        want = _WEIGHTS[name]
        for pname, p in want.items():
            got = weights.get(pname, tuple(p.shape))
            if isinstance(got, QuantizedTensor):
                got = got.dequantize()
            torch.testing.assert_close(got, p, rtol=0, atol=1e-6, msg=pname)
        assert weights.unused(set(want)) == []


def test_quantized_fused_projections_stay_in_blocks(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Phi-3's fused attn_qkv / ffn_up in Q8_0 are served split as Q8_0 row slices (nothing expanded), each
    equal to its rows of the gguf package's dequantization of the fused tensor."""
    import gguf

    from troupe.kernels.quant import QuantizedTensor
    from troupe.models.gguf import GGUFWeights, gguf_arch

    path = built("phi3-Q8_0", tmp_path_factory)[0]
    with GGUFFile(path) as f:
        _, arch = gguf_arch(f)
        assert not arch.fused_checkpoint
        weights = GGUFWeights(f, arch)
        h, q, kv, ff = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
        for fused, parts in (("attn_qkv", [("self_attn.q_proj", q), ("self_attn.k_proj", kv),
                                           ("self_attn.v_proj", kv)]),
                             ("ffn_up", [("mlp.gate_proj", ff), ("mlp.up_proj", ff)])):
            info = f.tensors[f"blk.1.{fused}.weight"]
            want = torch.from_numpy(gguf.quants.dequantize(f.raw(info.name), gguf.GGMLQuantizationType.Q8_0)
                                    .reshape(info.shape))
            start = 0
            for part, rows in parts:
                got = weights.get(f"model.layers.1.{part}.weight", (rows, h))
                assert isinstance(got, QuantizedTensor)
                torch.testing.assert_close(got.dequantize(), want[start:start + rows], rtol=0, atol=0)
                start += rows
            assert start == info.shape[0]


@pytest.mark.parametrize("name", ["qwen3-F32", "gemma2-F32", "gemma3-Q8_0", "phi3-Q8_0"])
@pytest.mark.parametrize("missing", ["block_count", "embedding_length", "feed_forward_length",
                                     "attention.head_count", "attention.layer_norm_rms_epsilon"])
def test_missing_metadata_key_is_refused(name: str, missing: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A file without one of the keys the architecture needs is a ModelLoadError naming the key."""
    with GGUFFile(built(name, tmp_path_factory)[0]) as f:
        meta, names = dict(f.metadata), set(f.tensors)
    key = f"{meta['general.architecture']}.{missing}"
    with pytest.raises(ModelLoadError, match=rf"metadata key '{key}' is missing"):
        gguf_config({k: v for k, v in meta.items() if k != key}, names, "m.gguf")


def test_longrope_needs_its_original_context_and_both_factors() -> None:
    """Phi-3 longrope: the factor tensors without `rope.scaling.original_context_length`, or one factor
    tensor alone, are ModelLoadErrors naming what is missing."""
    meta = {"general.architecture": "phi3", "phi3.embedding_length": 64, "phi3.attention.head_count": 4,
            "phi3.feed_forward_length": 128, "phi3.block_count": 2, "phi3.attention.layer_norm_rms_epsilon": 1e-6,
            "phi3.rope.scaling.original_context_length": 32}
    both = {"rope_factors_long.weight", "rope_factors_short.weight", "token_embd.weight"}
    assert gguf_config(meta, both)["original_max_position_embeddings"] == 32
    no_ctx = {k: v for k, v in meta.items() if k != "phi3.rope.scaling.original_context_length"}
    with pytest.raises(ModelLoadError, match="phi3.rope.scaling.original_context_length"):
        gguf_config(no_ctx, both)
    with pytest.raises(ModelLoadError, match="rope_factors_long.weight' without its pair"):
        gguf_config(meta, both - {"rope_factors_short.weight"})
    with pytest.raises(ModelLoadError, match="'longrope' without the rope_factors_long / rope_factors_short"):
        gguf_config({**meta, "phi3.rope.scaling.type": "longrope"}, {"token_embd.weight"})


@pytest.mark.parametrize(("key", "value"), [("yarn_log_multiplier", 0.1), ("yarn_attn_factor", 1.2),
                                            ("yarn_ext_factor", 0.5)])
def test_yarn_beyond_transformers_is_refused(key: str, value: float) -> None:
    """llama.cpp's YaRN knobs that transformers' yarn has no place for are ModelLoadErrors naming the key."""
    meta = {"general.architecture": "qwen3", "qwen3.embedding_length": 64, "qwen3.attention.head_count": 4,
            "qwen3.feed_forward_length": 128, "qwen3.block_count": 2, "qwen3.attention.layer_norm_rms_epsilon": 1e-6,
            "qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0,
            "qwen3.rope.scaling.original_context_length": 128}
    assert gguf_config(meta, set())["rope_scaling"]["rope_type"] == "yarn"
    with pytest.raises(ModelLoadError, match=f"rope.scaling.{key}"):
        gguf_config({**meta, f"qwen3.rope.scaling.{key}": value}, set())


def test_unsupported_layouts_are_refused() -> None:
    """A value length other than the key length, and partial rotary on a Llama (permuted) file, are
    ModelLoadErrors naming the key or the architecture."""
    base = {"embedding_length": 64, "attention.head_count": 4, "feed_forward_length": 128, "block_count": 2,
            "attention.layer_norm_rms_epsilon": 1e-6}
    gemma = {"general.architecture": "gemma2", **{f"gemma2.{k}": v for k, v in base.items()},
             "gemma2.attention.key_length": 16, "gemma2.attention.value_length": 32}
    with pytest.raises(ModelLoadError, match="value_length"):
        gguf_config(gemma, set())
    llama = {"general.architecture": "llama", **{f"llama.{k}": v for k, v in base.items()},
             "llama.rope.dimension_count": 8}
    with pytest.raises(ModelLoadError, match="partial rotary"):
        gguf_config(llama, set())


def test_gemma3_context_is_not_stretched_by_its_rope_scaling(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Gemma 3's context_length already is the scaled length (vLLM does not multiply it by the linear factor):
    the model's max_model_len is the file's context_length, not 4 times it."""
    from troupe.models.loader import read_model_info

    path = built("gemma3-Q8_0", tmp_path_factory)[0]
    with GGUFFile(path) as f:
        assert f.metadata["gemma3.rope.scaling.factor"] == 4.0
        stated = f.metadata["gemma3.context_length"]
    assert read_model_info(path).max_model_len == stated


def test_olmo3_window_is_refused_and_granite_scales_default() -> None:
    """An `olmo2` file with a sliding window (Olmo 3) is a ModelLoadError naming the key; a `granite` file
    without its scale keys (the converter skips zeros) runs neutral: no embedding / residual / logit scale,
    attention scaled by head_dim ** -0.5 as llama.cpp does."""
    from troupe.models.arch import ModelArch

    base = {"embedding_length": 64, "attention.head_count": 4, "feed_forward_length": 128, "block_count": 2,
            "attention.layer_norm_rms_epsilon": 1e-6}
    olmo = {"general.architecture": "olmo2", **{f"olmo2.{k}": v for k, v in base.items()}}
    assert gguf_config(olmo, set())["architectures"] == ["Olmo2ForCausalLM"]
    with pytest.raises(ModelLoadError, match="olmo2.attention.sliding_window"):
        gguf_config({**olmo, "olmo2.attention.sliding_window": 4096}, set())
    granite = {"general.architecture": "granite", **{f"granite.{k}": v for k, v in base.items()}}
    arch = ModelArch.from_hf_config({**gguf_config(granite, set()), "vocab_size": 256})
    assert (arch.embed_scale, arch.residual_scale, arch.logit_scale, arch.attn_scale) == (1.0, 1.0, 1.0, 16 ** -0.5)
