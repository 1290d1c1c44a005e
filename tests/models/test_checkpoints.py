"""Checkpoints honestly: quantized HF folders (vLLM's fp8, llm-compressor's fp8, GPTQ, AWQ) compute on the weights they mean, other
formats and unused tensors are refused by name, max_model_len above the model's is an error, float16 runs.

Each quantized folder is written here from one tiny random Llama (`make_tiny_model`), quantized with torch
and packed from the formats' specs (nothing downloaded); the oracle is the same model with the dequantized
weights saved as a plain float32 folder, which troupe loads on its plain path (checked against transformers
in test_models.py).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import CORES, add_request
from safetensors.torch import load_file, save_file
from structlog.testing import capture_logs

from troupe.config import EngineConfig
from troupe.core.batch import ScheduledSeq
from troupe.core.engine_core import EngineCore
from troupe.errors import EngineStartupError, InvalidInputError, ModelLoadError
from troupe.kernels import KVSpec
from troupe.kernels.quant import QType, QuantizedTensor
from troupe.models.checkpoint import CheckpointWeights
from troupe.models.checkpoint_quant import read_quant_scheme
from troupe.models.loader import load_model
from troupe.models.tiny import make_tiny_model

LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROMPTS = [[5, 100, 2000, 7, 8, 9, 10, 11, 12], [300, 301, 302], [49000], [17, 4, 4, 4, 4, 4]]
FP8_MAX = 448.0  # largest float8_e4m3fn


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama whose projections fit GPTQ's group of 128 (hidden 128, intermediate 256)."""
    return make_tiny_model(tmp_path_factory.mktemp("base"), hidden=128, intermediate=256, heads=4, kv_heads=2,
                           tie=False)


@pytest.fixture(scope="module")
def pairs(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], tuple[Path, Path]]:
    """`quantized_pair` of a (method, variant), written once per module."""
    cache: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(method: str, variant: str) -> tuple[Path, Path]:
        if (method, variant) not in cache:
            cache[method, variant] = quantized_pair(base, tmp_path_factory.mktemp(method), method, variant)
        return cache[method, variant]

    return get


def linear_names(folder: Path) -> list[str]:
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    return [f"model.layers.{i}.{m}" for i in range(layers) for m in LINEAR]


def write_folder(base: Path, dst: Path, tensors: dict[str, torch.Tensor], quant: dict[str, Any] | None,
                 quant_file: str = "config.json") -> Path:
    """`base`'s config and tokenizer with `tensors` as its weights and `quant` as its quantization_config
    (or, with quant_file "quantize_config.json", in AutoGPTQ's own file)."""
    shutil.copytree(base, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if quant is not None:
        if quant_file == "config.json":
            cfg = json.loads((dst / "config.json").read_text())
            (dst / "config.json").write_text(json.dumps(cfg | {"quantization_config": quant}))
        else:
            (dst / quant_file).write_text(json.dumps(quant))
    return dst


# ------------------------------------------------------------------------------------ writing the formats


def fp8_quantize(w: torch.Tensor, kind: str, block_key: str = "weight_scale_inv") -> tuple[dict[str, torch.Tensor],
                                                                                           torch.Tensor]:
    """(stored tensors under weight / weight_scale (a block scale: `block_key`), the dequantized float32
    weight) of one (out, in) weight: one scale, one per output row, or one per 64 x 64 block."""
    out, inp = w.shape
    if kind == "per-tensor":
        scale = w.abs().max() / FP8_MAX  # ()
        full = scale
    elif kind == "per-channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX  # (out, 1)
        full = scale
    else:
        grid = w.reshape(out // 64, 64, inp // 64, 64)
        scale = grid.abs().amax(dim=(1, 3)) / FP8_MAX  # (out / 64, in / 64)
        full = scale.repeat_interleave(64, 0).repeat_interleave(64, 1)  # (out, in)
    q = (w / full).to(torch.float8_e4m3fn)
    key = block_key if kind == "block" else "weight_scale"
    return {"weight": q, key: scale.float().contiguous()}, q.float() * full


def gptq_quantize(w: torch.Tensor, bits: int, group: int, act_order: bool, gen: torch.Generator,
                  v2: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(qweight, qzeros, scales, g_idx, the dequantized weight) of one (out, in) weight, symmetric GPTQ written
    from the format (AutoGPTQ's "gptq" checkpoint_format): q in [0, 2**bits), zero 2**(bits-1) stored minus
    one (`v2`, GPTQModel's "gptq_v2": as it is), words of 32 / bits values, lowest bits first; qweight packed
    along the input dim, qzeros along the output dim. `act_order`: groups assigned through a random order of
    the input rows (desc_act)."""
    out, inp = w.shape
    mid, top, per_word = 1 << (bits - 1), (1 << bits) - 1, 32 // bits
    order = torch.randperm(inp, generator=gen) if act_order else torch.arange(inp)
    g_idx = torch.empty(inp, dtype=torch.int64)
    g_idx[order] = torch.arange(inp) // group  # (in,)
    wt = w.t()  # (in, out)
    groups = inp // group
    amax = torch.stack([wt[g_idx == g].abs().amax(dim=0) for g in range(groups)])  # (groups, out)
    scales = (amax / (mid - 1)).half()  # (groups, out)
    s = scales.float()[g_idx]  # (in, out)
    q = (torch.round(wt / s) + mid).clamp(0, top).long()  # (in, out)
    dequant = ((q - mid).float() * s).t().contiguous()  # (out, in)
    shifts = torch.arange(per_word) * bits

    def to_int32(words: torch.Tensor) -> torch.Tensor:
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()

    qweight = to_int32((q.reshape(inp // per_word, per_word, out) << shifts.view(1, -1, 1)).sum(1))
    zeros = torch.full((groups, out), mid if v2 else mid - 1, dtype=torch.int64)
    qzeros = to_int32((zeros.reshape(groups, out // per_word, per_word) << shifts).sum(2))
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx.int()}, dequant


def awq_quantize(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(qweight, qzeros, scales, the dequantized weight) of one (out, in) weight in AutoAWQ's GEMM layout,
    written from the format: asymmetric 4-bit per group of input rows, q = round(w / s) + z; words of 8
    output columns, column 8j + ORDER[i] in nibble i; qweight (in, out / 8), qzeros (groups, out / 8)."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    out, inp = w.shape
    wt = w.t().reshape(inp // group, group, out)  # (groups, group, out)
    lo, hi = wt.amin(dim=1), wt.amax(dim=1)  # (groups, out)
    scales = ((hi - lo) / 15).half()  # (groups, out)
    s = scales.float()
    zeros = torch.round(-lo / s).clamp(0, 15).long()  # (groups, out)
    q = (torch.round(wt / s.unsqueeze(1)) + zeros.unsqueeze(1)).clamp(0, 15).long().reshape(inp, out)
    g = torch.arange(inp) // group
    dequant = ((q - zeros[g]).float() * s[g]).t().contiguous()  # (out, in)

    def pack(v: torch.Tensor) -> torch.Tensor:  # (R, out) -> (R, out / 8) int32
        cols = v.reshape(v.shape[0], -1, 8)
        words = sum(cols[:, :, order[i]] << (4 * i) for i in range(8))
        assert isinstance(words, torch.Tensor)
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()

    return {"qweight": pack(q), "qzeros": pack(zeros), "scales": scales}, dequant


def quantized_pair(base: Path, tmp: Path, method: str, variant: str) -> tuple[Path, Path]:
    """(the quantized folder, the plain folder of its dequantized weights) for one variant."""
    weights = load_file(base / "model.safetensors")
    stored, exact = dict(weights), dict(weights)
    gen = torch.Generator().manual_seed(7)
    quant: dict[str, Any]
    for name in linear_names(base):
        w = weights.pop(name + ".weight")
        del stored[name + ".weight"]
        if method == "fp8":  # "static": per-tensor weights, plus the static activation scale vLLM would use
            parts, exact[name + ".weight"] = fp8_quantize(w, "per-tensor" if variant == "static" else variant)
            if variant == "static":
                parts["input_scale"] = torch.tensor(0.02)
        elif method == "compressed-tensors":
            parts, exact[name + ".weight"] = fp8_quantize(w, variant, block_key="weight_scale")
        elif method == "awq":
            parts, exact[name + ".weight"] = awq_quantize(w, 64)
        else:
            bits = 8 if variant == "8bit" else 4
            parts, exact[name + ".weight"] = gptq_quantize(w, bits, 128, variant == "act-order", gen, variant == "v2")
        stored |= {f"{name}.{k}": v for k, v in parts.items()}
    if method == "fp8":
        quant = {"quant_method": "fp8", "activation_scheme": "static" if variant == "static" else "dynamic"}
        if variant == "block":
            quant["weight_block_size"] = [64, 64]
    elif method == "compressed-tensors":  # llm-compressor's FP8 (dynamic per-token activations)
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": "block" if variant == "block" else "channel",
                   "block_structure": [64, 64] if variant == "block" else None}
        activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
        quant = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                 "quantization_status": "compressed", "config_groups": {
                     "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}}}
    elif method == "awq":
        quant = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
    else:
        quant = {"quant_method": "gptq", "bits": 8 if variant == "8bit" else 4, "group_size": 128,
                 "desc_act": variant == "act-order", "sym": True,
                 "checkpoint_format": "gptq_v2" if variant == "v2" else "gptq"}
    tag = f"{method}-{variant}"
    quant_file = "quantize_config.json" if variant == "quantize_config" else "config.json"
    if quant_file != "config.json":
        del quant["quant_method"]
    return (write_folder(base, tmp / tag, stored, quant, quant_file),
            write_folder(base, tmp / f"{tag}-dequantized", exact, None))


def all_logits(folder: Path, dtype: str = "float32", model_out: list[Any] | None = None, **load: Any) -> torch.Tensor:
    """Logits at every position of PROMPTS in one flattened step through the loaded model (appended to
    `model_out` if given): (T, vocab)."""
    model, info = load_model(folder, dtype, **load)
    if model_out is not None:
        model_out.append(model)
    bs = 4
    need = [-(-len(p) // bs) for p in PROMPTS]
    tables = [list(range(sum(need[:i]), sum(need[: i + 1]))) for i in range(len(PROMPTS))]
    ops = model.ops
    kv = ops.allocate_kv(KVSpec(num_layers=info.num_layers, num_blocks=sum(need), block_size=bs,
                                num_kv_heads=info.num_kv_heads, head_dim=info.head_dim, dtype=info.dtype,
                                max_model_len=info.max_model_len, max_num_seqs=len(PROMPTS)))
    seqs = [ScheduledSeq(str(i), p, 0, t, True) for i, (p, t) in enumerate(zip(PROMPTS, tables, strict=True))]
    batch = ops.prepare(seqs, bs)
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, kv, batch.meta))


def greedy(folder: Path, **options: Any) -> dict[str, list[int]]:
    """Greedy tokens of PROMPTS, all in one engine batch."""
    core = EngineCore(EngineConfig(model=str(folder), max_model_len=128, num_kv_blocks=64, num_threads=CORES,
                                   **options))
    for i, p in enumerate(PROMPTS):
        core.add_request(add_request(str(i), p, max_tokens=8, ignore_eos=True, temperature=0.0))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            got[o.request_id] += o.new_token_ids
    return got


# ------------------------------------------------------------------------------------ quantized folders

VARIANTS = [("fp8", "per-tensor"), ("fp8", "per-channel"), ("fp8", "block"), ("fp8", "static"),
            ("gptq", "4bit"), ("gptq", "8bit"), ("gptq", "act-order"), ("gptq", "quantize_config"), ("gptq", "v2"),
            ("awq", "gemm"), ("compressed-tensors", "per-channel"), ("compressed-tensors", "block")]


@pytest.mark.parametrize(("method", "variant"), VARIANTS, ids=[f"{m}-{v}" for m, v in VARIANTS])
def test_quantized_weights_are_their_dequantized_values(pairs: Any, base: Path, method: str, variant: str):
    """Each weight of an fp8 / GPTQ / AWQ folder is its stored values times its scales (GPTQ, AWQ: minus its
    zero point), exactly, whatever form it loads in (GPTQ groups of consecutive rows as Q4_0 / Q8_0 blocks);
    fp8 is not the bare upcast (the scales matter)."""
    quantized, plain = pairs(method, variant)
    expected = load_file(plain / "model.safetensors")
    scheme = read_quant_scheme(quantized, json.loads((quantized / "config.json").read_text()))
    with CheckpointWeights(quantized, scheme, keep_blocks=True) as weights:
        for name in linear_names(base):
            w = weights.get(name + ".weight", tuple(expected[name + ".weight"].shape))
            # act-order groups (down_proj's 2 here; the others have one group) are expanded, not kept
            blocks = method == "gptq" and (variant != "act-order" or "down_proj" not in name)
            assert isinstance(w, QuantizedTensor) == blocks
            if isinstance(w, QuantizedTensor):
                assert w.qtype == (QType.Q8_0 if variant == "8bit" else QType.Q4_0)
                w = w.dequantize()
            torch.testing.assert_close(w, expected[name + ".weight"], atol=0, rtol=0)
            if method in ("fp8", "compressed-tensors"):
                assert not torch.equal(weights.read(name + ".weight").float(), w)


@pytest.mark.parametrize(("method", "variant", "quantization"), [
    ("fp8", "block", "auto"), ("gptq", "act-order", "auto"), ("gptq", "4bit", "dequantize"), ("awq", "gemm", "auto")])
def test_quantized_folder_logits_are_the_dequantized_folders(pairs: Any, method: str, variant: str,
                                                             quantization: str):
    """Through load_model, the logits at every position are those of the plain folder of the dequantized
    weights; quantization="dequantize" expands a GPTQ folder to float32 instead of keeping its blocks."""
    quantized, plain = pairs(method, variant)
    models: list[Any] = []
    torch.testing.assert_close(all_logits(quantized, model_out=models, quantization=quantization), all_logits(plain),
                               atol=1e-5, rtol=1e-5)
    kept = isinstance(models[0].layers[0].qkv_w, QuantizedTensor)
    assert kept == (method == "gptq" and quantization == "auto")  # act-order: q/k/v have one group each; AWQ never


def test_fp8_folder_generates_like_its_dequantized_weights(pairs: Any):
    """Through the engine on the compiled cpu set, in one batch, greedy tokens of an fp8 folder are those of
    the dequantized plain folder (its weights are dense after load: the same floats, so the same tokens
    whatever the margins)."""
    quantized, plain = pairs("fp8", "per-channel")
    assert greedy(quantized, dtype="float32", kernels="cpu") == greedy(plain, dtype="float32", kernels="cpu")


def test_gptq_blocks_compute_on_the_cpu_set(pairs: Any):
    """The compiled cpu set computes a GPTQ folder on its Q4_0 blocks, and its logits at every position are
    the dequantized folder's (float32 math on the same values, a float32 KV pool; only the summation order
    differs)."""
    from troupe.kernels.cpu import CpuKernels

    quantized, plain = pairs("gptq", "4bit")
    models: list[Any] = []
    logits = all_logits(quantized, model_out=models, kernels=CpuKernels(kv_cache_dtype="float32"))
    assert isinstance(models[0].layers[0].gate_up_w, QuantizedTensor) and models[0].ops.name == "cpu"
    torch.testing.assert_close(logits, all_logits(plain), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------ refusals


def _config_with(folder: Path, dst: Path, quant: dict[str, Any]) -> Path:
    return write_folder(folder, dst, load_file(folder / "model.safetensors"), quant)


@pytest.mark.parametrize(("quant", "match"), [
    ({"quant_method": "aqlm"}, r"quant_method 'aqlm' is not supported; supported: fp8 .*gptq .*awq"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"'awq' with version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, r"'awq' with zero_point false"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"},
     r"'compressed-tensors' with format 'pack-quantized' is not supported; supported: compressed-tensors \(format "
     r"float-quantized"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}}}}, r"weight strategy 'group'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"'gptq' with bits 3 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False}, r"'gptq' with sym false"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     r"checkpoint_format 'marlin'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "activation_scheme": "weird"}, r"activation_scheme 'weird'"),
])
def test_unsupported_quantization_is_refused_by_name(base: Path, tmp_path: Path, quant: dict[str, Any], match: str):
    """Any other quant_method, or a variant troupe does not compute, is a ModelLoadError naming it (and what is
    supported) before any weight is read."""
    folder = _config_with(base, tmp_path / "m", quant)
    with pytest.raises(ModelLoadError, match=match):
        load_model(folder, "float32")


def test_fp8_weights_without_their_scale_are_refused(pairs: Any, base: Path, tmp_path: Path):
    """A float8 weight is never upcast alone: without quantization_config, or without its weight_scale, or with
    a block scale of the wrong grid, loading fails naming the tensor."""
    quantized, _ = pairs("fp8", "per-tensor")
    tensors = load_file(quantized / "model.safetensors")
    no_config = write_folder(base, tmp_path / "no-config", tensors, None)
    with pytest.raises(ModelLoadError, match=r"q_proj.weight' is stored in torch.float8_e4m3fn, but config.json has "
                                             r"no quantization_config"):
        load_model(no_config, "float32")
    del tensors["model.layers.0.self_attn.q_proj.weight_scale"]
    no_scale = write_folder(base, tmp_path / "no-scale", tensors, {"quant_method": "fp8"})
    with pytest.raises(ModelLoadError, match=r"has no scale 'model.layers.0.self_attn.q_proj.weight_scale'"):
        load_model(no_scale, "float32")
    block, _ = pairs("fp8", "block")
    wrong_grid = _config_with(block, tmp_path / "grid", {"quant_method": "fp8", "weight_block_size": [32, 32]})
    with pytest.raises(ModelLoadError, match=r"weight_block_size \[32, 32\] .* needs \[4, 4\]"):
        load_model(wrong_grid, "float32")


# ------------------------------------------------------------------------------------ unused tensors


def test_a_tensor_the_model_does_not_use_is_an_error(base: Path, tmp_path: Path):
    """An extra weight (here a bias Llama without mlp_bias has no use for) is a ModelLoadError naming it."""
    tensors = load_file(base / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.bias"] = torch.full((128,), 0.5)
    tensors["model.layers.0.self_attn.extra.weight"] = torch.ones(4, 4)
    folder = write_folder(base, tmp_path / "extra", tensors, None)
    with pytest.raises(ModelLoadError, match=r"2 tensor\(s\) in the checkpoint that the model does not use: "
                                             r"'model.layers.0.self_attn.extra.weight', "
                                             r"'model.layers.1.mlp.down_proj.bias'"):
        load_model(folder, "float32")


def test_harmless_unused_tensors_get_one_log_line(pairs: Any, tmp_path: Path):
    """Rotary inverse frequencies, a tied model's lm_head.weight, all-zero biases and (fp8) static activation
    scales load, with one log line naming what was skipped and why."""
    quantized, _ = pairs("fp8", "static")
    tensors = load_file(quantized / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(128)
    folder = write_folder(quantized, tmp_path / "harmless", tensors, None)
    with capture_logs() as logs:
        load_model(folder, "float32")
    lines = [e for e in logs if e["event"] == "checkpoint tensors not used"]
    assert len(lines) == 1
    assert set(lines[0]["skipped"]) == {"rotary inverse frequencies (troupe computes its own)",
                                        "all-zero biases of layers without one",
                                        "static fp8 activation scales (troupe does not quantize activations)"}
    tied = make_tiny_model(tmp_path / "tied", tie=True)
    tensors = load_file(tied / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, tied / "model.safetensors")
    with capture_logs() as logs:
        load_model(tied, "float32")
    assert [e["skipped"] for e in logs if e["event"] == "checkpoint tensors not used"] == [
        {"an LM head tied to the embedding (tie_word_embeddings)": "1, e.g. lm_head.weight"}]


def test_an_unused_gguf_tensor_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A GGUF file with a tensor the model does not read fails naming it (the GGUF name)."""
    import troupe.models.tiny as models

    make = models.make_tiny_model

    def with_extra(path: Path, **kw: Any) -> Path:
        folder = make(path, **kw)
        tensors = load_file(folder / "model.safetensors")
        save_file(tensors | {"model.layers.1.mlp.extra.weight": torch.ones(8, 32)}, folder / "model.safetensors")
        return folder

    monkeypatch.setattr(models, "make_tiny_model", with_extra)
    monkeypatch.setitem(models._PARTS, "mlp.extra", "ffn_extra")
    path, _ = models.make_tiny_gguf(tmp_path, hidden=64)
    with pytest.raises(ModelLoadError, match=r"model.gguf: 1 tensor\(s\) .* does not use: 'blk.1.ffn_extra.weight'"):
        load_model(path)


# ------------------------------------------------------------------------------------ max_model_len, dtype


def test_max_model_len_above_the_model_is_an_error(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch):
    """max_model_len above max_position_embeddings (2048) fails naming both numbers, in an EngineCore and
    through LLM; TROUPE_ALLOW_LONG_MAX_MODEL_LEN=1 allows it (vLLM's override); equal or below is served."""
    from troupe import LLM

    options = dict(model=str(tiny_llama), dtype="float32", num_kv_blocks=16, num_threads=1)
    with pytest.raises(InvalidInputError, match=r"max_model_len: 4096 is greater than the model's limit of 2048 "
                                                r"\(max_position_embeddings=2048"):
        EngineCore(EngineConfig(**options, max_model_len=4096))
    with pytest.raises(EngineStartupError, match=r"4096 is greater than the model's limit of 2048"):
        LLM(**options, max_model_len=4096, multiprocess=False)
    assert EngineCore(EngineConfig(**options, max_model_len=2048)).max_model_len == 2048
    monkeypatch.setenv("TROUPE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert EngineCore(EngineConfig(**options, max_model_len=4096)).max_model_len == 4096


def test_float16_runs_on_the_eager_set(tiny_llama: Path):
    """dtype="float16" computes in float16 on the CPU with the eager set ("auto" picks it there); its logits
    follow float32's loosely; the compiled cpu set, which has no float16 ops, refuses it by name."""
    core = EngineCore(EngineConfig(model=str(tiny_llama), dtype="float16", num_kv_blocks=16, num_threads=1))
    assert (core.runner.kernels.name, core.runner.info.dtype) == ("eager", torch.float16)
    assert core.runner.kv_caches[0][0].dtype == torch.float16
    half, full = all_logits(tiny_llama, "float16"), all_logits(tiny_llama, "float32")
    assert full.abs().max() > 1.0
    torch.testing.assert_close(half, full, atol=2e-2, rtol=2e-2)
    with pytest.raises(InvalidInputError, match=r"kernels: 'cpu' computes float32 and bfloat16 activations, not "
                                                r"float16"):
        EngineCore(EngineConfig(model=str(tiny_llama), dtype="float16", kernels="cpu", num_kv_blocks=16))


@pytest.mark.parametrize(("scaling", "window", "limit", "why"), [
    (None, None, 2048, r"max_position_embeddings=2048 in"),
    ({"rope_type": "linear", "factor": 4.0}, None, 8192, r"max_position_embeddings=2048 times the rope scaling "
                                                          r"factor 4.0"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 256}, None, 2048, r"max_position_embeddings=2048 in"),
    (None, 512, 2048, r"max_position_embeddings=2048 in"),  # a sliding window is attention's, not the context's
])
def test_the_model_limit_is_derived_as_vllm_does(tmp_path: Path, scaling: dict[str, Any] | None, window: int | None,
                                                 limit: int, why: str):
    """The limit is max_position_embeddings, times the factor of a rope scaling that stretches it (linear; not
    llama3, whose max_position_embeddings is already the long one; a sliding window does not bound it); the
    error one above it names what it came from."""
    from troupe.models.loader import check_max_model_len, read_model_info

    cfg = {"architectures": ["MistralForCausalLM" if window else "LlamaForCausalLM"], "vocab_size": 100,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
           "max_position_embeddings": 2048, "rope_scaling": scaling, "sliding_window": window}
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # the limit needs no weights
    info = read_model_info(tmp_path, "float32")
    assert info.max_model_len == limit and check_max_model_len(None, info) == limit
    assert check_max_model_len(limit, info) == limit
    with pytest.raises(InvalidInputError, match=rf"max_model_len: {limit + 1} is greater than the model's limit of "
                                                rf"{limit} \({why}"):
        check_max_model_len(limit + 1, info)
