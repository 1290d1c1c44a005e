"""The `cuda` kernel set end to end, on the CPU under the Triton interpreter (its test-only mode,
`kernels="cuda", device="cpu"`): a tiny random Llama's logits through the real `ModelRunner` match
transformers' and the eager set's over a mixed prefill / decode schedule, decode steps padded in the
CUDA-graph layout give the same logits and write nothing for their padding rows, and a real engine on
that set generates the eager engine's greedy tokens; a GGUF model on the set is expanded to the model's
dtype when it binds. Kept small: the interpreter runs each program in Python."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from troupe.config import EngineConfig
from troupe.core.batch import ScheduledSeq
from troupe.core.model_runner import ModelRunner
from troupe.errors import InvalidInputError
from troupe.kernels.cuda.kernel_set import CudaKernels
from troupe.kernels.quant import QType, QuantizedTensor
from troupe.models.tiny import make_tiny_gguf

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
    options = {"dtype": "float32", **options}
    return ModelRunner(EngineConfig(model=str(folder), block_size=BS, num_kv_blocks=48, max_model_len=256,
                                    kernels=kernels, device="cpu", **options))  # type: ignore[arg-type]


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
    generates the same greedy tokens as the eager set, with enforce_eager accepted (no effect on the CPU;
    a gpu_memory_utilization other than the default is refused there: tests/facades/test_vllm_entry_points.py),
    and so does the set with async scheduling on (the placeholders' ids written into the step's ids)."""
    from troupe import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": SEQS[0][:5]}, {"prompt_token_ids": SEQS[3][:7]}]
    options = dict(model=str(tiny_llama), dtype="float32", block_size=BS, num_kv_blocks=48, max_model_len=64,
                   device="cpu")
    with LLM(kernels="eager", multiprocess=False, **options) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(kernels="cuda", enforce_eager=True, **options) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want and all(len(t) == 3 for t in got)
    with LLM(kernels="cuda", async_scheduling=True, multiprocess=False, **options) as llm:
        assert llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids == want[0]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want


class FakeGraph:
    """Stands in for a CUDA graph on the CPU: replaying re-runs the captured function as it was bound at
    capture (the same tensors, the same Python values), which is what a graph replay does."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        fn()

    def replay(self) -> None:
        self.fn()


def test_graph_replay_reads_each_steps_inputs(tiny_llama: Path, hf_logits: list[torch.Tensor],
                                              device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's graph capture with the CUDA primitive faked (`FakeGraph`): graphs for 1, 2 and 4 rows,
    captured on padding batches; later decode steps of 3, 2 and 1 sequences replay them and get
    transformers' logits, so everything a graph reads is refilled in place by each step's `prepare`."""
    from troupe.kernels.cuda.graphs import DecodeGraphs

    monkeypatch.setattr(DecodeGraphs, "record", lambda self, fn: FakeGraph(fn))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *args: 0)
    cuda = runner(tiny_llama, "cuda", max_num_seqs=4)
    with capture_logs() as logs:
        cuda._capture_graphs()
    assert cuda.graphs.sizes == [1, 2, 4] and cuda.kernels.graph_sizes == [1, 2, 4]  # type: ignore[attr-defined]
    line = next(e for e in logs if e["event"] == "cuda graphs captured")
    assert line["sizes"] == [1, 2, 4] and line["skipped"] == [] and line["max_seq_len"] == 256
    replayed: list[int] = []
    real = cuda.graphs.replay
    cuda.graphs.replay = lambda batch: (replayed.append(batch.meta.graph_size), real(batch))[1]
    blocks = tables(seed=3)
    live = [0, 1, 3]
    cuda.execute([ScheduledSeq(str(i), SEQS[i][:PROMPT_LEN[i]], 0, blocks[i], False) for i in live])
    done = {i: PROMPT_LEN[i] for i in live}
    for decoding in (live, [0, 3], [1]):
        batch = [ScheduledSeq(str(i), [SEQS[i][done[i]]], done[i], blocks[i], True) for i in decoding]
        got = cuda.execute(batch)
        torch.testing.assert_close(got, torch.stack([hf_logits[i][done[i]] for i in decoding]), atol=1e-4, rtol=1e-4)
        for i in decoding:
            done[i] += 1
    assert replayed == [4, 2, 1]


def fake_gpu_memory(monkeypatch: pytest.MonkeyPatch, total: int, free: int, reserved: int, allocated: int,
                    peak: int) -> None:
    """torch.cuda's memory figures, made up: `allocated` bytes held throughout, `peak` during the profile."""
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *args: allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: peak)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *args: reserved)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (free, total))


def test_gpu_pool_sizing_runs_the_profile_and_logs(tiny_llama: Path, device: torch.device,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's GPU pool sizing with made-up memory figures: it profiles a real largest step (16
    tokens over 4 sequences, through the model and the device sampler), takes what the utilization
    leaves after the weights, the activations, the graphs' reserve and the memory outside torch, logs the
    figures, lets num_kv_blocks override it, and refuses a utilization that leaves less than a block."""
    from troupe.core import gpu_memory

    G = 1 << 30
    fake_gpu_memory(monkeypatch, total=80 * G, free=70 * G, reserved=9 * G, allocated=2 * G, peak=5 * G)
    cuda = runner(tiny_llama, "cuda", max_num_seqs=4, max_num_batched_tokens=16)
    spec = cuda.kv_spec
    config = EngineConfig(model=str(tiny_llama), gpu_memory_utilization=0.5, max_num_seqs=4,
                          max_num_batched_tokens=16)
    calls: list[int] = []
    real = cuda.execute
    monkeypatch.setattr(cuda, "execute", lambda seqs: (calls.append(sum(len(s.token_ids) for s in seqs)),
                                                       real(seqs))[1])
    with capture_logs() as logs:
        blocks = cuda._size_gpu_pool(config, spec)
    assert calls == [16]  # one profiling step of max_num_batched_tokens
    per_block = cuda.kv_bytes_per_token * BS
    scratch = 4 * 1 * per_block  # four sequences of 4 tokens: one block each
    graphs = gpu_memory.graph_reserve_bytes(3 * G, 16, 4)
    want = (40 * G - (2 * G - scratch) - 3 * G - graphs - 1 * G) // per_block
    assert blocks == want
    line = next(e for e in logs if e["event"] == "kv cache sized")
    assert line["num_blocks"] == want and line["activations_gib"] == 3.0 and line["other_gib"] == 1.0
    assert line["total_gib"] == 80.0 and line["utilization"] == 0.5 and not line["overridden"]
    assert cuda._size_gpu_pool(EngineConfig(model=str(tiny_llama), num_kv_blocks=7, max_num_seqs=4,
                                            max_num_batched_tokens=16), spec) == 7
    with pytest.raises(InvalidInputError) as err:
        cuda._size_gpu_pool(EngineConfig(model=str(tiny_llama), gpu_memory_utilization=0.05, max_num_seqs=4,
                                         max_num_batched_tokens=16), spec)
    assert err.value.field == "gpu_memory_utilization" and "16-token step" in str(err.value)


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_gguf_model_on_the_cuda_set_is_dequantized_to_its_dtype(tmp_path: Path, device: torch.device,
                                                                dtype: str) -> None:
    """A GGUF (Q4_1 projections, Q8_0 embedding and tied head, like the default model) on the cuda set: the
    blocks stay QuantizedTensors in the model, the set expands each to the model's dtype once at bind
    (float32 for "auto" on the CPU, bfloat16 when asked; a GGUF on the CPU sets must compute in float32),
    and the logits over a mixed step are transformers' on the same dequantized weights."""
    from transformers import AutoModelForCausalLM

    gguf_path, hf = make_tiny_gguf(tmp_path, default_qtype=QType.Q4_1, qtypes={"token_embd": QType.Q8_0})
    seqs = [s[:6] for s in SEQS]
    with torch.inference_mode():
        model = AutoModelForCausalLM.from_pretrained(hf, local_files_only=True, dtype=torch.float32)
        want = torch.stack([model(torch.tensor([s])).logits[0, -1] for s in seqs])
    cuda = runner(gguf_path, "cuda", dtype=dtype)
    expect = torch.float32 if dtype == "auto" else torch.bfloat16
    assert isinstance(cuda.kernels, CudaKernels) and cuda.info.dtype == expect
    assert cuda.model is not None and isinstance(cuda.model.embed, QuantizedTensor)
    assert isinstance(cuda.model.layers[0].qkv_w, QuantizedTensor)
    blocks = tables(seed=2)
    got = cuda.execute([ScheduledSeq(str(i), s, 0, blocks[i], True) for i, s in enumerate(seqs)])
    tol = 1e-4 if dtype == "auto" else 0.05 * float(want.abs().max())
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=1e-3 if dtype == "auto" else 0.05)
    if dtype == "bfloat16":
        with pytest.raises(InvalidInputError, match="float32"):  # the CPU sets keep blocks in float32 only
            ModelRunner(EngineConfig(model=str(gguf_path), dtype="bfloat16", kernels="eager", device="cpu",
                                     num_kv_blocks=8))
