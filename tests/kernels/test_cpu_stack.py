"""The cpu set's decoder stack (`troupe.kernels.cpu.stack`, csrc/stack.cpp): every layer in one compiled call
gives the model's own per-layer loop's results bit for bit, on mixed prefill + decode steps, GQA and MHA,
biases, both activation modes; and it stays out of the way where it does not apply."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from troupe.core.batch import ScheduledSeq
from troupe.kernels import KVSpec
from troupe.kernels.cpu import CpuKernels, available
from troupe.kernels.quant import QType
from troupe.models.loader import load_model
from troupe.testing.models import make_tiny_gguf

pytestmark = pytest.mark.skipif(not available(), reason="the compiled CPU kernels do not build here")

BLOCK = 4


def _model(tmp_path: Path, quantize_activations: bool = False, **options):
    gguf, _ = make_tiny_gguf(tmp_path, **options)
    ops = CpuKernels(kv_cache_dtype="float32", quantize_activations=quantize_activations)
    return load_model(gguf, "float32", kernels=ops, quantization="gguf-q8" if quantize_activations else "gguf")


def _run_steps(model, info, steps: list[list[ScheduledSeq]], use_stack: bool) -> tuple[list[torch.Tensor], list]:
    """Run `steps` through the model on a fresh pool, with the stack or the per-layer loop; returns every
    step's hidden states and the pool afterwards."""
    ops = model.ops
    kv = ops.allocate_kv(KVSpec(num_layers=info.num_layers, num_blocks=64, block_size=BLOCK,
                                num_kv_heads=info.num_kv_heads, head_dim=info.head_dim, dtype=torch.float32,
                                max_model_len=info.max_model_len, max_num_seqs=8))
    outs = []
    with torch.inference_mode(), contextlib.nullcontext() if use_stack else model.per_layer_loop():
        for seqs in steps:
            batch = ops.prepare(seqs, BLOCK)
            outs.append(model(batch.input_ids, batch.positions, kv, batch.meta).clone())
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
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
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


def test_stack_stays_out_where_it_does_not_apply(tmp_path, monkeypatch):
    # q and k in Q4_0, v in Q8_0: the fused qkv projection is two runs of formats (not one QuantizedLinear)
    model, _ = _model(tmp_path / "mixed", qtypes={"attn_v": QType.Q8_0}, default_qtype=QType.Q4_0)
    assert model.stack is None
    monkeypatch.setenv("TROUPE_DECODER_STACK", "0")
    model, _ = _model(tmp_path / "off", default_qtype=QType.Q4_1)
    assert model.stack is None


def test_engine_generates_the_same_tokens_with_and_without_the_stack(tmp_path):
    """Through the real engine (scheduler, chunked prefill, sampler): greedy tokens and their logprobs are
    the same with the stack as with the per-layer loop (`TROUPE_DECODER_STACK=0` in a second process)."""
    gguf, _ = make_tiny_gguf(tmp_path, default_qtype=QType.Q4_1)
    script = (
        "import json, sys\n"
        "from troupe import LLM, SamplingParams\n"
        f"llm = LLM({str(gguf)!r}, kernels='cpu', multiprocess=False, max_num_batched_tokens=16,"
        " enable_prefix_caching=False)\n"
        "outs = llm.generate([{'prompt_token_ids': list(range(3, 3 + n))} for n in (1, 7, 30)],"
        " SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2), use_tqdm=False)\n"
        "print(json.dumps([[o.outputs[0].token_ids, [[[k, v.logprob] for k, v in sorted(lp.items())]"
        " for lp in o.outputs[0].logprobs]] for o in outs]))\n"
        "llm.close()\n")
    results = []
    for flag in ("1", "0"):
        env = {**os.environ, "TROUPE_DECODER_STACK": flag}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(done.stdout.strip().splitlines()[-1])
    assert results[0] == results[1]
