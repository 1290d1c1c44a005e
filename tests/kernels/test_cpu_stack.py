"""The cpu set's decoder stack (`troupe.kernels.cpu.stack`, csrc/stack.cpp): every layer in one compiled call
gives the model's own per-layer loop's results bit for bit, on mixed prefill + decode steps, GQA and MHA,
biases, both activation modes; and it stays out of the way where it does not apply."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from troupe.core.batch import ScheduledSeq
from troupe.kernels import KVSpec
from troupe.kernels.cpu import CpuKernels, available
from troupe.kernels.cpu.linear import bf16_unsupported
from troupe.kernels.quant import QType
from troupe.models.loader import load_model
from troupe.models.tiny import make_tiny_gguf

pytestmark = pytest.mark.skipif(not available(), reason="the compiled CPU kernels do not build here")

BLOCK = 4


def _model(tmp_path: Path, quantize_activations: bool = False, bf16: bool = False, **options):
    gguf, _ = make_tiny_gguf(tmp_path, **options)
    ops = CpuKernels(kv_cache_dtype="float32", quantize_activations=quantize_activations, bf16=bf16)
    mode = "gguf-q8" if quantize_activations else "gguf-bf16" if bf16 else "gguf"
    return load_model(gguf, "float32", kernels=ops, quantization=mode)


def _run_steps(model, info, steps: list[list[ScheduledSeq]], use_stack: bool,
               trim: bool = False) -> tuple[list[torch.Tensor], list]:
    """Run `steps` through the model on a fresh pool, with the stack or the per-layer loop; returns every
    step's hidden states (with `trim`, of the tokens that need logits alone, as the runner asks) and the
    pool afterwards."""
    ops = model.ops
    kv = ops.allocate_kv(KVSpec(num_layers=info.num_layers, num_blocks=64, block_size=BLOCK,
                                num_kv_heads=info.num_kv_heads, head_dim=info.head_dim, dtype=torch.float32,
                                max_model_len=info.max_model_len, max_num_seqs=8))
    outs = []
    with torch.inference_mode(), contextlib.nullcontext() if use_stack else model.per_layer_loop():
        for seqs in steps:
            batch = ops.prepare(seqs, BLOCK)
            rows = batch.logits_indices if trim else None
            outs.append(model(batch.input_ids, batch.positions, kv, batch.meta, rows).clone())
    return outs, kv


def _mixed_steps(vocab: int) -> list[list[ScheduledSeq]]:
    """A prefill of three prompts (1, 6 and 13 tokens: within a block, across blocks), then a step with two
    of them decoding and a fourth prompt's first chunk, then a decode of all."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 6, 13, 9)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    grown = [p + [7, 8] for p in prompts]
    return [
        [ScheduledSeq(str(i), prompts[i], 0, tables[i], True) for i in range(3)],
        [ScheduledSeq("0", grown[0][:2], 1, tables[0], True), ScheduledSeq("2", grown[2][:14], 13, tables[2], True),
         ScheduledSeq("3", prompts[3][:5], 0, tables[3], False)],
        [ScheduledSeq("0", grown[0][:3], 2, tables[0], True), ScheduledSeq("1", grown[1][:7], 6, tables[1], True),
         ScheduledSeq("2", grown[2][:15], 14, tables[2], True), ScheduledSeq("3", prompts[3], 5, tables[3], True)],
    ]


VARIANTS = {
    "llama-gqa-q4_1": dict(default_qtype=QType.Q4_1),
    "llama-mha-untied-q8_0": dict(tie=False, kv_heads=4),
    "qwen2-bias": dict(arch="qwen2", kv_heads=1, default_qtype=QType.Q4_0),
    "llama-q8-activations": dict(default_qtype=QType.Q4_1, quantize_activations=True),
    "llama-bf16": dict(default_qtype=QType.Q4_K, hidden=256, intermediate=512, heads=4, kv_heads=2, bf16=True),
}
NO_BF16 = pytest.mark.skipif(bf16_unsupported() is not None, reason=f"gguf-bf16: {bf16_unsupported()}")


def _variants(*names: str) -> list:
    return [pytest.param(n, marks=NO_BF16) if VARIANTS[n].get("bf16") else n for n in names]


@pytest.mark.parametrize("variant", _variants(*sorted(VARIANTS)))
def test_stack_equals_the_layer_loop_bit_for_bit(variant, tmp_path):
    options = dict(VARIANTS[variant])
    model, info = _model(tmp_path, **options)
    assert model.stack is not None, "every projection computes on blocks: the stack applies"
    steps = _mixed_steps(info.vocab_size)
    looped, kv_loop = _run_steps(model, info, steps, use_stack=False)
    stacked, kv_stack = _run_steps(model, info, steps, use_stack=True)
    for a, b in zip(looped, stacked, strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(kv_loop, kv_stack, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("variant", _variants("llama-gqa-q4_1", "llama-q8-activations", "llama-bf16"))
def test_last_layer_trimmed_to_the_logits_rows(variant, tmp_path):
    """With the rows that need logits, the stack runs all but the last layer and the last layer's output
    projection and MLP take those rows alone: the same as the per-layer loop's trimmed step bit for bit,
    the untrimmed step's rows up to float rounding (fewer rows may take another kernel), and the pool the
    same bit for bit. The steps include one where a prompt's chunk needs no logits, and one where none does."""
    model, info = _model(tmp_path, **VARIANTS[variant])
    steps = _mixed_steps(info.vocab_size)
    steps.insert(1, [ScheduledSeq("4", list(range(3, 10)), 0, list(range(40, 48)), False)])  # no logits at all
    full, kv_full = _run_steps(model, info, steps, use_stack=True)
    looped, kv_loop = _run_steps(model, info, steps, use_stack=False, trim=True)
    stacked, kv_stack = _run_steps(model, info, steps, use_stack=True, trim=True)
    for seqs, a, b, c in zip(steps, full, looped, stacked, strict=True):
        ends = torch.tensor([len(s.token_ids) for s in seqs]).cumsum(0) - 1
        rows = ends[torch.tensor([s.needs_logits for s in seqs])]
        assert b.shape == (len(rows), a.shape[1])
        assert torch.equal(b, c)
        # 8-bit activations: a call of few rows may compute in float32 where many rows quantize x
        # (troupe_qmm.q8_path), so the trimmed rows differ from the full step's by x's 8-bit rounding
        # (likewise bf16: few rows take the exact float path)
        tol = 0.05 if VARIANTS[variant].get("quantize_activations") or VARIANTS[variant].get("bf16") else 1e-4
        torch.testing.assert_close(c, a[rows], atol=tol, rtol=tol)
    for (k1, v1), (k2, v2), (k3, v3) in zip(kv_full, kv_loop, kv_stack, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2) and torch.equal(k1, k3) and torch.equal(v1, v3)


def test_stack_stays_out_where_it_does_not_apply(tmp_path, monkeypatch):
    # q and k in Q4_0, v in Q8_0: the fused qkv projection is two runs of formats (not one QuantizedLinear)
    model, _ = _model(tmp_path / "mixed", qtypes={"attn_v": QType.Q8_0}, default_qtype=QType.Q4_0)
    assert model.stack is None
    monkeypatch.setenv("TROUPE_DECODER_STACK", "0")
    model, _ = _model(tmp_path / "off", default_qtype=QType.Q4_1)
    assert model.stack is None


def test_engine_generates_the_same_tokens_with_and_without_the_stack(tmp_path):
    """Through the real engine core (scheduler, chunked prefill, batched decode, sampler): greedy tokens and
    their logprobs are the same with the stack as with the per-layer loop (`TROUPE_DECODER_STACK=0` in a
    second process). The requests are all added before the first step, so both runs batch them alike
    (through `LLM.generate` which prompts share a step depends on when each add reaches the engine, and the
    kernels round a row as its batch's size decides)."""
    gguf, _ = make_tiny_gguf(tmp_path, default_qtype=QType.Q4_1)
    script = (
        "import json\nimport msgspec\n"
        "from troupe.config import EngineConfig\n"
        "from troupe.core.engine_core import EngineCore\n"
        "from troupe.messages import AddRequest\n"
        "from troupe.sampling_params import SamplingParams\n"
        f"core = EngineCore(EngineConfig(model={str(gguf)!r}, kernels='cpu', max_num_batched_tokens=16,"
        " enable_prefix_caching=False))\n"
        "params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)\n"
        "for n in (1, 7, 30):\n"
        "    core.add_request(AddRequest(f'r{n}', list(range(3, 3 + n)), params, 12))\n"
        "got = {}\n"
        "while core.has_unfinished_requests():\n"
        "    for o in core.step().outputs:\n"
        "        tokens, logprobs = got.setdefault(o.request_id, ([], []))\n"
        "        tokens += o.new_token_ids\n"
        "        logprobs.append(msgspec.to_builtins(o.new_logprobs))\n"
        "core.close()\n"
        "print(json.dumps(got, sort_keys=True))\n")
    results = []
    for flag in ("1", "0"):
        env = {**os.environ, "TROUPE_DECODER_STACK": flag}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert results[0] == results[1]
    assert sorted(len(tokens) for tokens, _ in results[0].values()) == [12, 12, 12]
