"""The `cuda` kernel set end to end, on the CPU under the Triton interpreter (its test-only mode,
`kernels="cuda", device="cpu"`): a tiny random Llama's logits through the real `ModelRunner` match
transformers' and the eager set's over a mixed prefill / decode schedule, decode steps padded in the
CUDA-graph layout give the same logits and write nothing for their padding rows, and a real engine on
that set generates the eager engine's greedy tokens. Kept small: the interpreter runs each program in
Python."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from troupe.config import EngineConfig
from troupe.core.batch import ScheduledSeq
from troupe.core.model_runner import ModelRunner
from troupe.kernels.cuda.kernel_set import CudaKernels

SEQS = [
    [5, 100, 2000, 7, 8, 9, 10, 11, 12, 13, 14],
    [300, 301, 302, 303, 304, 305],
    [49000, 3, 3],
    [17, 4, 4, 4, 4, 4, 9, 99, 999, 9999, 42, 43],
]
PROMPT_LEN = [6, 4, 3, 9]
SCHEDULE = [[5, 2, 0, 8], [1, 2, 3, 1], [1, 1, 0, 1], [1, 1, 0, 1]]  # tokens per sequence and step
BS = 4


@pytest.fixture(scope="module")
def hf_logits(tiny_llama: Path) -> list[torch.Tensor]:
    """transformers' float32 logits of every SEQS entry at every position."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, local_files_only=True, dtype=torch.float32)
    with torch.inference_mode():
        return [hf(torch.tensor([s])).logits[0] for s in SEQS]


def runner(folder: Path, kernels: str, **options: object) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(folder), dtype="float32", block_size=BS, num_kv_blocks=48,
                                    max_model_len=256, kernels=kernels, device="cpu", **options))


def tables(seed: int) -> list[list[int]]:
    """Each sequence's blocks: distinct, shuffled, never block 0 (so a write there would show)."""
    free = list(range(1, 48))
    random.Random(seed).shuffle(free)
    return [[free.pop() for _ in range(-(-len(s) // BS))] for s in SEQS]


def test_mixed_schedule_matches_transformers_and_eager(tiny_llama: Path, hf_logits: list[torch.Tensor],
                                                       device: torch.device) -> None:
    """Chunks after cached context, a whole prompt, decodes and unsampled chunks in the same steps: the
    cuda set's logits are transformers' (and the eager set's) at every sampled position, in order."""
    cuda, eager = runner(tiny_llama, "cuda"), runner(tiny_llama, "eager")
    assert isinstance(cuda.kernels, CudaKernels) and cuda.kv_caches[0][0].shape == (48, 2, BS, 16)
    blocks = tables(seed=1)
    done, compared = [0] * len(SEQS), 0
    for step in SCHEDULE:
        batch, expected = [], []
        for i, n in enumerate(step):
            n = min(n, len(SEQS[i]) - done[i])
            if n == 0:
                continue
            end = done[i] + n
            wants = end >= PROMPT_LEN[i]
            batch.append(ScheduledSeq(str(i), SEQS[i][done[i]:end], done[i], blocks[i], wants))
            if wants:
                expected.append(hf_logits[i][end - 1])
            done[i] = end
        got, ref = cuda.execute(batch), eager.execute(batch)
        assert got.shape == (len(expected), 49152) and got.device.type == "cpu"
        if expected:
            torch.testing.assert_close(got, torch.stack(expected), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        compared += len(expected)
    assert compared == 10


def test_padded_decode_steps_match_and_write_nothing_for_padding(tiny_llama: Path, hf_logits: list[torch.Tensor],
                                                                 device: torch.device) -> None:
    """With graph sizes 1, 2, 4 declared (as after a capture), decode steps of 3 and 1 sequences are padded
    to 4 and 1 rows in the graphs' fixed layout, with the graphs' max_seq_len (two decode splits here);
    no graph exists on the CPU, so the padded batch runs eagerly: same logits as transformers and the
    eager set, and the padding rows write no K/V (block 0, used by no sequence, stays zero)."""
    cuda, eager = runner(tiny_llama, "cuda"), runner(tiny_llama, "eager")
    kernels = cuda.kernels
    assert isinstance(kernels, CudaKernels)
    kernels.graph_sizes, kernels.graph_max_seq_len = [1, 2, 4], cuda.max_model_len
    blocks = tables(seed=2)
    live = [0, 1, 3]
    prefill = [ScheduledSeq(str(i), SEQS[i][:PROMPT_LEN[i]], 0, blocks[i], True) for i in live]
    torch.testing.assert_close(cuda.execute(prefill), eager.execute(prefill), atol=1e-4, rtol=1e-4)
    done = {i: PROMPT_LEN[i] for i in live}
    for decoding in (live, live, [3]):
        batch = [ScheduledSeq(str(i), [SEQS[i][done[i]]], done[i], blocks[i], True) for i in decoding]
        prepared = kernels.prepare(batch, BS)
        assert prepared.meta.graph_size == {3: 4, 1: 1}[len(decoding)]
        assert prepared.meta.max_seq_len == 256 and prepared.meta.block_tables.stride(0) == 256 // BS
        got = cuda.execute(batch)
        torch.testing.assert_close(got, torch.stack([hf_logits[i][done[i]] for i in decoding]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got, eager.execute(batch), atol=1e-4, rtol=1e-4)
        for i in decoding:
            done[i] += 1
    for k_pool, v_pool in cuda.kv_caches:
        assert not k_pool[0].any() and not v_pool[0].any()
        assert k_pool[blocks[3][0]].any()  # real rows did write


def test_engine_on_the_cuda_set_generates_the_eager_tokens(tiny_llama: Path, device: torch.device) -> None:
    """`LLM(kernels="cuda", device="cpu")` (the engine in its own process, inheriting the interpreter)
    generates the same greedy tokens as the eager set, with enforce_eager and gpu_memory_utilization
    accepted (no effect on the CPU)."""
    from troupe import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": SEQS[0][:5]}, {"prompt_token_ids": SEQS[3][:7]}]
    options = dict(model=str(tiny_llama), dtype="float32", block_size=BS, num_kv_blocks=48, max_model_len=64,
                   device="cpu")
    with LLM(kernels="eager", multiprocess=False, **options) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(kernels="cuda", enforce_eager=True, gpu_memory_utilization=0.5, **options) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want and all(len(t) == 3 for t in got)
