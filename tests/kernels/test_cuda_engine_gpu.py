"""The CUDA path on a real GPU (skipped without one; marked `gpu`): the model runner with decode CUDA
graphs against transformers on the same GPU, graphs against `enforce_eager`, steps without a host sync,
the KV pool sized from the GPU's memory, the device sampler's per-request fault isolation in a real
engine, and greedy equality with transformers on the default model in float32.

Run by scripts/gpu_check.sh on the GPU machine; they cannot run in CI (no GPU there)."""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs
from support.faults import fault_hooks

from troupe.config import EngineConfig
from troupe.core.batch import ScheduledSeq
from troupe.core.model_runner import ModelRunner
from troupe.errors import InvalidInputError
from troupe.kernels.cuda.graphs import capture_sizes, graph_size_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SEQS = [[5, 100, 2000, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
        [300, 301, 302, 303, 304, 305, 306, 307],
        [49000, 3, 3, 3, 3],
        [17, 4, 4, 4, 4, 4, 9, 99, 999, 9999, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]
PROMPT_LEN = [9, 4, 3, 12]
BS = 4


@pytest.fixture(autouse=True)
def fresh_gpu() -> Iterator[None]:
    """Every test starts and ends with the GPU's memory given back (runners size their pool from it)."""
    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def hf_logits(tiny_llama: Path) -> list[torch.Tensor]:
    """transformers' float32 logits on the GPU for every SEQS entry at every position."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, local_files_only=True, dtype=torch.float32).cuda()
    with torch.inference_mode():
        out = [hf(torch.tensor([s], device="cuda")).logits[0].float() for s in SEQS]
    del hf
    return out


def gpu_runner(folder: Path, **options: Any) -> ModelRunner:
    base: dict[str, Any] = dict(model=str(folder), device="cuda", block_size=BS, max_num_seqs=8,
                                max_model_len=512, gpu_memory_utilization=0.2)
    return ModelRunner(EngineConfig(**{**base, **options}))


def tables(num_blocks: int, seed: int) -> list[list[int]]:
    """Each sequence's blocks: distinct, shuffled, from the first 4096 of the pool (never block 0)."""
    free = list(range(1, min(num_blocks, 4096)))
    random.Random(seed).shuffle(free)
    return [[free.pop() for _ in range(-(-len(s) // BS))] for s in SEQS]


def run_schedule(runner: ModelRunner, seed: int) -> list[tuple[list[int], torch.Tensor]]:
    """Prefill chunks and whole prompts (eager), then decode-only steps of 2 to 4 sequences (graph-sized):
    per step, the positions sampled (`seq * 1000 + position`, one per logits row) and the logits."""
    blocks = tables(runner.num_blocks, seed)
    done = [0] * len(SEQS)
    steps = [[5, 2, 3, 8], [4, 2, 0, 4]] + [[1, 1, 1, 1], [1, 1, 0, 1]] * 3
    out = []
    for step in steps:
        batch, where = [], []
        for i, n in enumerate(step):
            n = min(n, len(SEQS[i]) - done[i])
            if n == 0:
                continue
            end = done[i] + n
            wants = end >= PROMPT_LEN[i]
            batch.append(ScheduledSeq(str(i), SEQS[i][done[i]:end], done[i], blocks[i], wants))
            if wants:
                where.append(i * 1000 + end - 1)
            done[i] = end
        out.append((where, runner.execute(batch)))
    return out


def test_runner_with_graphs_matches_transformers_on_the_gpu(tiny_llama: Path, hf_logits: list[torch.Tensor]) -> None:
    """float32 on the GPU: graphs for 1, 2, 4 and 8 rows are captured; prefill steps run eagerly, decode
    steps of 4 and 3 sequences replay the 4-row graph; every logits row is transformers' (same GPU), and
    the logits stay on the GPU."""
    runner = gpu_runner(tiny_llama, dtype="float32")
    assert runner.graphs is not None and runner.graphs.sizes == capture_sizes(8) == [1, 2, 4, 8]
    replays: list[int] = []
    real = runner.graphs.replay
    runner.graphs.replay = lambda batch: (replays.append(batch.meta.graph_size), real(batch))[1]
    steps = run_schedule(runner, seed=1)
    for where, logits in steps:
        assert logits.device.type == "cuda" and logits.dtype == torch.float32 and len(where) > 0
        want = torch.stack([hf_logits[w // 1000][w % 1000] for w in where])
        torch.testing.assert_close(logits, want, atol=2e-3, rtol=2e-3)
    decodes = [len(where) for where, _ in steps[2:]]  # every step after the second is decode-only
    assert replays == [graph_size_for(n, [1, 2, 4, 8]) for n in decodes] and set(replays) >= {4}


def test_graphs_and_enforce_eager_agree_in_bf16(tiny_llama: Path) -> None:
    """dtype="auto" is bfloat16 on CUDA; with and without graphs (enforce_eager) every step's logits agree
    within bf16 rounding (the graphs' attention splits differ from the eager steps')."""
    with_graphs = gpu_runner(tiny_llama)
    assert with_graphs.info.dtype == torch.bfloat16 and with_graphs.kv_caches[0][0].dtype == torch.bfloat16
    a = run_schedule(with_graphs, seed=2)
    del with_graphs
    gc.collect()
    eager = gpu_runner(tiny_llama, enforce_eager=True)
    assert eager.graphs is None and eager.kernels.graph_sizes == []  # type: ignore[attr-defined]
    b = run_schedule(eager, seed=2)
    for (wa, la), (wb, lb) in zip(a, b, strict=True):
        assert wa == wb
        torch.testing.assert_close(la, lb, atol=5e-2, rtol=5e-2)


def test_steps_do_not_sync_with_the_host(tiny_llama: Path) -> None:
    """A graph decode step and an eager mixed step (prepare, forward, LM head) run under CUDA's sync debug
    mode set to error: nothing waits for the GPU until the sampled ids are read."""
    runner = gpu_runner(tiny_llama)
    blocks = tables(runner.num_blocks, seed=3)
    runner.execute([ScheduledSeq(str(i), SEQS[i][:4], 0, blocks[i], True) for i in range(4)])
    decode = [ScheduledSeq(str(i), [SEQS[i][4]], 4, blocks[i], True) for i in range(3)]
    mixed = [ScheduledSeq("0", SEQS[0][5:9], 5, blocks[0], True), ScheduledSeq("1", [SEQS[1][5]], 5, blocks[1], True)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = runner.execute(decode)
        second = runner.execute(mixed)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert first.shape == (3, 49152) and second.shape == (2, 49152)
    assert torch.isfinite(first).all() and torch.isfinite(second).all()


def test_pool_is_sized_from_gpu_memory(tiny_llama: Path) -> None:
    """The pool takes what gpu_memory_utilization leaves: 0.3 more of the GPU gives 0.3 of its memory more
    pool (within 1%), the start-up line logs the figures, num_kv_blocks overrides, and a utilization
    too small for the weights and activations is an InvalidInputError naming it."""
    per_block = None
    counts = {}
    for util in (0.1, 0.4):
        with capture_logs() as logs:
            runner = gpu_runner(tiny_llama, gpu_memory_utilization=util, enforce_eager=True)
        line = next(e for e in logs if e["event"] == "kv cache sized")
        assert line["utilization"] == util and line["num_blocks"] == runner.num_blocks and line["model_gib"] > 0
        assert line["activations_gib"] > 0 and line["graphs_gib"] == 0 and not line["overridden"]
        per_block = runner.kv_bytes_per_token * BS
        counts[util] = runner.num_blocks
        total = torch.cuda.mem_get_info()[1]
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    assert per_block is not None
    grown = (counts[0.4] - counts[0.1]) * per_block
    assert abs(grown - 0.3 * total) < 0.01 * total, (counts, total)
    fixed = gpu_runner(tiny_llama, num_kv_blocks=100, enforce_eager=True)
    assert fixed.num_blocks == 100 and fixed.kv_caches[0][0].shape[0] == 100
    del fixed
    with pytest.raises(InvalidInputError) as err:
        gpu_runner(tiny_llama, gpu_memory_utilization=0.001)
    assert err.value.field == "gpu_memory_utilization"


def test_engine_on_gpu_isolates_a_failing_sample(tiny_llama: Path) -> None:
    """A real engine on the GPU samples with the device sampler; a request whose sampling fails
    (the fault plugin) finishes with an error while the others in its batch get all their tokens, and a
    seeded request gets the same tokens again afterwards."""
    import anyio

    from troupe import AsyncLLM, SamplingParams

    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=6, ignore_eos=True)

    async def main() -> dict[str, Any]:
        finals: dict[str, Any] = {}
        async with AsyncLLM(str(tiny_llama), device="cuda", num_kv_blocks=256, max_num_seqs=8,
                            hooks=fault_hooks("fail_sampling=bad")) as llm:

            async def one(rid: str) -> None:
                async for out in llm.generate("the same prompt", params, request_id=rid):
                    finals[rid] = out

            async with anyio.create_task_group() as tg:
                for rid in ("good-1", "bad-1", "good-2"):
                    tg.start_soon(one, rid)
            await one("good-3")
        return finals

    finals = anyio.run(main)
    reasons = {rid: out.outputs[0].finish_reason for rid, out in finals.items()}
    assert reasons == {"good-1": "length", "bad-1": "error", "good-2": "length", "good-3": "length"}
    tokens = {rid: out.outputs[0].token_ids for rid, out in finals.items()}
    assert len(tokens["good-1"]) == 6 and tokens["good-1"] == tokens["good-2"] == tokens["good-3"]


@pytest.mark.slow
def test_default_model_greedy_equals_transformers_in_float32() -> None:
    """The default model in float32 on the GPU, 8 prompts of 5..300 tokens together (chunked prefill, mixed
    steps, then graph decodes), 32 tokens each: at least 7 of 8 exactly transformers' greedy tokens on
    the same GPU, and at a divergence troupe's token is in transformers' top-5 (a near tie)."""
    from transformers import AutoModelForCausalLM

    from troupe.core.engine_core import EngineCore
    from troupe.messages import AddRequest
    from troupe.models.default_model import ensure_default_model
    from troupe.models.loader import load_tokenizer, resolve_model_path
    from troupe.sampling_params import SamplingParams

    tokenizer = load_tokenizer(resolve_model_path(None))

    text = ("In the quiet town by the river, the baker opened his shop before dawn. He kneaded dough, lit the "
            "ovens and watched the street wake up. ") * 30
    base = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = [base[i * 7:i * 7 + n] for i, n in enumerate([5, 20, 47, 80, 128, 175, 230, 300])]
    core = EngineCore(EngineConfig(device="cuda", dtype="float32", max_model_len=2048, max_num_batched_tokens=256,
                                   gpu_memory_utilization=0.3))
    assert core.runner.graphs is not None
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(AddRequest(f"r{i}", p, params, 32))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            got[o.request_id].extend(o.new_token_ids)
    del core
    gc.collect()
    torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(ensure_default_model(), local_files_only=True,
                                              dtype=torch.float32).cuda().eval()
    exact = 0
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            out = hf.generate(torch.tensor([p], device="cuda"), attention_mask=torch.ones(1, len(p), dtype=torch.long,
                              device="cuda"), do_sample=False, max_new_tokens=32, min_new_tokens=32,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            want, have = out.sequences[0, len(p):].tolist(), got[f"r{i}"]
            assert len(have) == 32
            if want == have:
                exact += 1
                continue
            k = next(j for j in range(32) if want[j] != have[j])
            assert have[k] in out.logits[k][0].topk(5).indices.tolist(), f"prompt {i} pos {k}: not a near tie"
    assert exact >= 7, f"only {exact}/8 exactly equal"
