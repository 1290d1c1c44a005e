"""GGUF models: the file reader, tiny GGUFs of two architectures in every kept format against transformers on
the same (dequantized) weights, the `quantization` option through the engine and the CLI, the cached
tokenizer, and the errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from troupe.config import EngineConfig
from troupe.core.batch import ScheduledSeq
from troupe.errors import InvalidInputError, ModelLoadError
from troupe.kernels import KVSpec
from troupe.kernels.cpu import build
from troupe.kernels.quant import QType, QuantizedTensor
from troupe.models.default_model import find_default_gguf
from troupe.models.loader import load_model, load_tokenizer, read_model_info
from troupe.models.tiny import make_tiny_gguf

torch.set_num_threads(1)

PROMPTS = [[5, 100, 2000, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [300, 301, 302], [49000], [17, 4, 4, 4, 4, 4]]
needs_build = pytest.mark.skipif(not build.REQUIRED_CPU_FLAGS <= build.cpu_flags() or not build.shutil.which("c++"),
                                 reason="no AVX2/FMA/F16C CPU or no C++ compiler here")
KQUANTS = dict(hidden=256, intermediate=512, heads=4, kv_heads=2)  # widths that are whole 256-value blocks

VARIANTS: dict[str, dict[str, Any]] = {
    "llama-Q8_0": dict(arch="llama", default_qtype=QType.Q8_0),
    "llama-Q4_0": dict(arch="llama", default_qtype=QType.Q4_0),
    "llama-Q4_1-untied-F32-head": dict(arch="llama", default_qtype=QType.Q4_1, tie=False,
                                       qtypes={"output": QType.F32}),
    "llama-F16-rope-llama3": dict(arch="llama", default_qtype=QType.F16, rope_theta=500000.0,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
    "llama-kquants-mixed": dict(arch="llama", default_qtype=QType.Q4_K, **KQUANTS,
                                qtypes={"attn_v": QType.Q6_K, "ffn_down": QType.Q5_K, "token_embd": QType.Q6_K}),
    "qwen2-Q4_1-bias": dict(arch="qwen2", default_qtype=QType.Q4_1, kv_heads=1),
    "qwen2-kquants-BF16-embed": dict(arch="qwen2", default_qtype=QType.Q5_K, **KQUANTS,
                                     qtypes={"attn_q": QType.Q4_K, "token_embd": QType.BF16}),
}


def hf_logits(folder: Path, prompts: list[list[int]]) -> torch.Tensor:
    """transformers' forward on the HF folder, every position of every prompt: (sum of lengths, vocab)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    with torch.inference_mode():
        return torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])


def troupe_logits(path: Path, kernels: str, quantization: str, block_size: int = 4,
                  prompts: list[list[int]] = PROMPTS) -> torch.Tensor:
    """All prompts in one flattened step through the model bound to the named kernel set: every position."""
    from troupe.kernels import select_kernels

    # a float32 pool, so that the projections' exactness is what the tolerance checks
    ops = select_kernels(EngineConfig(kernels=kernels, quantization=quantization, decode_row_cache_bytes=0,
                                      kv_cache_dtype="float32"))
    model, info = load_model(path, "auto", kernels=ops, quantization=quantization)
    need = [-(-len(p) // block_size) for p in prompts]
    tables = [list(range(sum(need[:i]), sum(need[: i + 1]))) for i in range(len(prompts))]
    kv = ops.allocate_kv(KVSpec(info.num_layers, sum(need), block_size, info.num_kv_heads, info.head_dim,
                                torch.float32, info.max_model_len, len(prompts)))
    batch = ops.prepare([ScheduledSeq(str(i), p, 0, t, True) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))],
                        block_size)
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, kv, batch.meta))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Every variant's (GGUF file, HF folder with its exact weights), made once."""
    root = tmp_path_factory.mktemp("gguf")
    return {name: make_tiny_gguf(root / name, seed=i, **opts) for i, (name, opts) in enumerate(VARIANTS.items())}


@needs_build
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_gguf_matches_transformers(variant: str, tiny: dict[str, tuple[Path, Path]]) -> None:
    """A GGUF (Llama with llama.cpp's q/k row interleaving, or Qwen2 with biases; formats F16, BF16, Q8_0,
    Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, mixed within one fused projection; tied or untied head; Llama 3 rope as
    rope_freqs) gives transformers' logits on the same weights at every position: on its blocks with the
    compiled kernels, expanded at bind by the eager set, and expanded at load ("dequantize")."""
    gguf_path, hf = tiny[variant]
    ref = hf_logits(hf, PROMPTS)
    assert ref.abs().max() > 1.0
    for kernels, quantization in (("cpu", "gguf"), ("eager", "auto"), ("eager", "dequantize")):
        ours = troupe_logits(gguf_path, kernels, quantization)
        torch.testing.assert_close(ours, ref, atol=2e-4 * float(ref.abs().max()), rtol=1e-4,
                                   msg=lambda m, k=kernels, q=quantization: f"{k}/{q}: {m}")  # noqa: B023


@needs_build
def test_gguf_weights_stay_in_blocks(tiny: dict[str, tuple[Path, Path]]) -> None:
    """With quantization "gguf" the projections, embedding and head are the file's blocks (no float copy);
    mixed formats in one fused projection stay separate groups; "dequantize" gives plain float tensors."""
    from troupe.kernels.cpu import CpuKernels

    gguf_path, _ = tiny["llama-kquants-mixed"]
    model, _ = load_model(gguf_path, kernels=CpuKernels(), quantization="gguf")
    layer = model.layers[0]
    assert isinstance(model.embed, QuantizedTensor) and model.embed.qtype == QType.Q6_K
    assert [w.qtype for w in layer.qkv_w] == [QType.Q4_K, QType.Q6_K]  # q+k stacked, v apart
    assert isinstance(layer.down_w, QuantizedTensor) and layer.down_w.qtype == QType.Q5_K
    expanded, _ = load_model(gguf_path, "float32", quantization="dequantize")
    assert not any(isinstance(v, QuantizedTensor) for v in vars(expanded.layers[0]).values())


@needs_build
@pytest.mark.parametrize("variant", ["llama-Q4_1-untied-F32-head", "llama-Q8_0", "llama-kquants-mixed"])
def test_q8_activations_stay_close(variant: str, tiny: dict[str, tuple[Path, Path]]) -> None:
    """quantization="gguf-q8" quantizes the activations (the tiled integer GEMM for batches; Q6_K batches,
    and Q8_0 batches without VNNI, stay on the float path): the whole prefill batch (23 tokens) stays
    within a few percent of transformers' logits, with the same top token wherever transformers' leads its
    runner-up by more than twice the largest logit error (the tiny random models have near ties
    elsewhere), and is not the exact result where it is quantized. A two-token step: on AVX-512 builds the float rows path (faster there than the integer
    kernels), equal to the output-exact mode bit for bit; on AVX2 builds the integer rows kernel, close."""
    gguf_path, hf = tiny[variant]
    two = [PROMPTS[0][:2]]
    q8_two = troupe_logits(gguf_path, "cpu", "gguf-q8", prompts=two)
    exact_two = troupe_logits(gguf_path, "cpu", "gguf", prompts=two)
    if torch.ops.troupe_qmm.q8_path(int(QType.Q4_1), 2) < 0:
        assert torch.equal(q8_two, exact_two)
    else:
        err = float((q8_two - exact_two).abs().max() / exact_two.abs().max())
        assert 1e-7 < err < 0.05, f"two tokens: relative error {err:.1e} against the exact mode"
    ref = hf_logits(hf, PROMPTS)
    ours = troupe_logits(gguf_path, "cpu", "gguf-q8", prompts=PROMPTS)
    err = float((ours - ref).abs().max() / ref.abs().max())
    # Q8_0 batches have the GEMM only with VNNI: without it (AVX2 builds) they take the exact float path
    qtype = VARIANTS[variant]["default_qtype"]
    quantized = torch.ops.troupe_qmm.q8_path(int(qtype), len(ours)) >= 0
    assert (1e-6 if quantized else 0) <= err < (0.05 if quantized else 1e-5), f"{len(ours)} tokens: error {err:.1e}"
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * float((ours - ref).abs().max())
    assert bool((ours.argmax(-1) == ref.argmax(-1))[clear].all()), f"{len(ours)} tokens: a clear top token changed"


@needs_build
@pytest.mark.slow
@pytest.mark.timeout(600)  # the engine in its own process
@pytest.mark.parametrize("quantization", ["auto", "gguf", "gguf-q8", "dequantize"])
def test_llm_serves_a_gguf(quantization: str, tiny: dict[str, tuple[Path, Path]]) -> None:
    """`LLM(model="x.gguf", quantization=...)` generates through the whole engine (its own process): the
    exact modes give transformers' greedy tokens; q8 gives tokens of the model's vocabulary."""
    from transformers import AutoModelForCausalLM

    from troupe import LLM, SamplingParams

    gguf_path, hf = tiny["qwen2-Q4_1-bias"]
    prompt = [5, 100, 2000, 7, 8]
    model = AutoModelForCausalLM.from_pretrained(hf, local_files_only=True, dtype=torch.float32)
    want = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 5:].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model=str(gguf_path), kernels="cpu", quantization=quantization, num_kv_blocks=64) as llm:
        got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(got) == 8 and all(0 <= t < 49152 for t in got)
    if quantization != "gguf-q8":
        assert list(got) == want


@pytest.mark.slow
@pytest.mark.timeout(600)  # the CLI in a subprocess
def test_cli_generates_from_a_gguf(tiny: dict[str, tuple[Path, Path]]) -> None:
    """`troupe generate --model x.gguf --quantization dequantize` answers from the file (tokenizer from it)."""
    gguf_path, _ = tiny["llama-Q8_0"]
    cmd = [sys.executable, "-m", "troupe.cli", "generate", "Hello", "--model", str(gguf_path), "--quantization",
           "dequantize", "--max-tokens", "4", "--temperature", "0", "--in-process"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip()


def test_quantization_option_is_checked(tiny: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """A bad value, block modes on a Hugging Face folder, 8-bit activations on the eager set and a bfloat16
    dtype on kept blocks are errors naming the field and what is allowed."""
    from troupe.core.model_runner import ModelRunner

    gguf_path, hf = tiny["llama-Q8_0"]
    with pytest.raises(InvalidInputError, match=r"quantization: must be one of \['auto', 'dequantize', 'gguf'"):
        EngineConfig(quantization="int4")
    with pytest.raises(InvalidInputError, match="quantization: 'gguf' keeps a GGUF file's blocks"):
        ModelRunner(EngineConfig(model=str(hf), quantization="gguf", num_kv_blocks=8))
    with pytest.raises(InvalidInputError, match="quantization: 'gguf-q8' needs the compiled CPU kernels"):
        ModelRunner(EngineConfig(model=str(gguf_path), kernels="eager", quantization="gguf-q8", num_kv_blocks=8))
    with pytest.raises(InvalidInputError, match="dtype: a GGUF model's kept blocks take float32"):
        ModelRunner(EngineConfig(model=str(gguf_path), dtype="bfloat16", num_kv_blocks=8))
    runner = ModelRunner(EngineConfig(model=str(gguf_path), dtype="bfloat16", quantization="dequantize",
                                      num_kv_blocks=8))
    assert runner.info.dtype == torch.bfloat16 and runner.model is not None


def test_bad_gguf_files_are_refused(tmp_path: Path) -> None:
    """A file that is not GGUF, a truncated one, and an architecture troupe does not run: `ModelLoadError`s
    naming the file and the problem."""
    import gguf

    not_gguf = tmp_path / "a.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        read_model_info(not_gguf)
    src = find_default_gguf().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src[: len(src) // 2])
    with pytest.raises(ModelLoadError, match="runs past the end of the file"):
        read_model_info(cut)
    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"gpt2.gguf: GGUF architecture 'gpt2' is not supported"):
        read_model_info(tmp_path / "gpt2.gguf")


def test_tokenizer_comes_from_the_file_and_is_cached(tiny: dict[str, tuple[Path, Path]], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF's tokenizer is rebuilt into cached tokenizer files once (tokenizer files only, no weights);
    it tokenizes as the HF folder's; a modified file gets a new cache entry."""
    from troupe.models.gguf_tokenizer import tokenizer_folder

    monkeypatch.setenv("TROUPE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path, hf = tiny["llama-Q8_0"]
    folder = tokenizer_folder(gguf_path)
    assert tokenizer_folder(gguf_path) == folder
    assert sorted(p.name for p in folder.iterdir()) == ["chat_template.jinja", "special_tokens_map.json",
                                                         "tokenizer.json", "tokenizer_config.json",
                                                         "troupe_tokenizer.json"]
    text = "In 2024, the baker's 12 loaves <|im_end|> cost £3."
    assert load_tokenizer(gguf_path).encode(text) == load_tokenizer(hf).encode(text)
    copy = tmp_path / "copy.gguf"
    shutil.copy(gguf_path, copy)
    copied = tokenizer_folder(copy)
    os.utime(copy, ns=(1, 1))
    assert tokenizer_folder(copy) != copied and not copied.exists()  # the changed file's old folder: removed
    assert folder.is_dir()


def test_tokenizer_folders_no_file_maps_to_are_removed_at_the_next_rebuild(tiny: dict[str, tuple[Path, Path]],
                                                                          tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebuild removes the folders of deleted GGUF files; a folder of another rebuild version whose file
    is unchanged (another install's), one being written (dot name) and one without a marker stay."""
    from troupe.models import gguf_tokenizer
    from troupe.models.gguf_tokenizer import MARKER, tokenizer_folder

    monkeypatch.setenv("TROUPE_CACHE_DIR", str(tmp_path / "cache"))
    src, _ = tiny["llama-Q8_0"]
    files = [tmp_path / f"{name}.gguf" for name in ("gone", "kept", "other", "next")]
    for f in files:
        shutil.copy(src, f)
    gone, kept, other = (tokenizer_folder(f) for f in files[:3])
    with monkeypatch.context() as m:
        m.setattr(gguf_tokenizer, "TOKENIZER_VERSION", gguf_tokenizer.TOKENIZER_VERSION + 1)
        newer = tokenizer_folder(files[2])
    root = gone.parent
    (root / ".half-written").mkdir()
    (root / "no-marker").mkdir()
    files[0].unlink()
    assert {p.name for p in root.iterdir()} >= {gone.name, kept.name, other.name, newer.name}
    latest = tokenizer_folder(files[3])
    assert {p.name for p in root.iterdir()} == {kept.name, other.name, newer.name, latest.name, ".half-written",
                                                "no-marker"}
    assert all((root / p / MARKER).is_file() for p in (kept, other, newer, latest))


@pytest.mark.slow
def test_gguf_reader_matches_gguf_package() -> None:
    """troupe's GGUF reader gives the gguf package's metadata, tensor table and tensor bytes on the
    default model's file."""
    import gguf
    import numpy as np

    from troupe.models.gguf_file import GGUFFile

    path = find_default_gguf()
    theirs = gguf.GGUFReader(path)
    with GGUFFile(path) as ours:
        for key, field in theirs.fields.items():
            if not key.startswith("GGUF."):
                assert ours.metadata[key] == pytest.approx(field.contents()), key
        assert len(ours.metadata) == len(theirs.fields) - 3  # GGUF.version / tensor_count / kv_count
        assert len(ours.tensors) == len(theirs.tensors) == 272
        for t in theirs.tensors:
            mine = ours.tensors[t.name]
            assert (mine.ggml_type, mine.shape) == (int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)))
            assert np.array_equal(ours.raw(t.name), np.asarray(t.data).view(np.uint8).reshape(-1)), t.name


@pytest.mark.slow
@needs_build
@pytest.mark.slow
@pytest.mark.timeout(600)  # the default model
def test_default_model_is_the_gguf_in_its_blocks() -> None:
    """The default model resolves to the package's GGUF and loads with its Q4_1 projections and Q8_0 tied
    embedding / head kept as blocks (~96 MB of weights instead of 538 MB of float32)."""
    from troupe.core.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(kernels="cpu", num_kv_blocks=8))
    model = runner.model
    assert model is not None and runner.model_path == find_default_gguf()
    assert isinstance(model.embed, QuantizedTensor) and model.embed.qtype == QType.Q8_0
    layer = model.layers[0]
    assert isinstance(layer.qkv_w, QuantizedTensor) and layer.qkv_w.qtype == QType.Q4_1
    weights = sum(w.nbytes for lay in model.layers for w in (lay.qkv_w, lay.o_w, lay.gate_up_w, lay.down_w))
    assert 60e6 < weights + model.embed.nbytes < 100e6


@needs_build
@pytest.mark.parametrize("variant", ["llama-kquants-mixed", "qwen2-kquants-BF16-embed"])
def test_kquants_in_bf16_mode_at_decode_sizes(variant: str, tiny: dict[str, tuple[Path, Path]]) -> None:
    """`gguf-bf16` on steps of at most 8 rows, where its K-quant projections take the 16-bit rows path
    (x in int16 per 32 values, the blocks' integers exact: csrc/rows_i16.h): transformers' logits within
    2e-3 of the largest (measured: up to 7e-4; the mode's bf16 GEMM on all four prompts in one 23-row step
    is off by 1.5e-2 and 7e-2, the output-exact mode by 1e-5), and not the output-exact mode's bit for bit
    (so the path ran)."""
    from troupe.kernels.cpu.linear import bf16_unsupported

    if (reason := bf16_unsupported()) is not None:
        pytest.skip(f"gguf-bf16: {reason}")
    gguf_path, hf = tiny[variant]
    for prompt in ([300, 301, 302], [49000], [17, 4, 4, 4, 4, 4]):  # one step each: 3, 1 and 6 rows
        ref = hf_logits(hf, [prompt])
        ours = troupe_logits(gguf_path, "cpu", "gguf-bf16", prompts=[prompt])
        torch.testing.assert_close(ours, ref, atol=2e-3 * float(ref.abs().max()), rtol=0)
        assert not torch.equal(ours, troupe_logits(gguf_path, "cpu", "gguf", prompts=[prompt]))
