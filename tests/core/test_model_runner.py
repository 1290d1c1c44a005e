"""ModelRunner: flattened steps, chunked prefill, decode and shared prefix blocks match transformers."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from troupe.config import EngineConfig
from troupe.core.batch import ScheduledSeq
from troupe.core.model_runner import DEFAULT_KV_CAP_BYTES, NULL_TOKEN_ID, ModelRunner
from troupe.models.loader import resolve_model_path
from troupe.models.tiny import make_tiny_model

torch.set_num_threads(1)

SEQS = [
    [5, 100, 2000, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
    [300, 301, 302, 303, 304, 305],
    [49000, 3, 3],
    [17, 4, 4, 4, 4, 4, 9, 99, 999, 9999, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52],
]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, tuple[Path, list[torch.Tensor]]]:
    """One tiny folder per architecture, with transformers' logits for SEQS at every position."""
    from transformers import AutoModelForCausalLM

    out = {}
    for arch in ("llama", "qwen2", "mistral"):
        folder = make_tiny_model(tmp_path_factory.mktemp(arch), arch=arch)
        hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        with torch.inference_mode():
            out[arch] = (folder, [hf(torch.tensor([s])).logits[0] for s in SEQS])
    return out


class BlockTables:
    """Hands out free blocks in shuffled order, so sequences get non-contiguous blocks."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.block_size = block_size

    def grow(self, table: list[int], num_tokens: int) -> list[int]:
        while len(table) * self.block_size < num_tokens:
            table.append(self.free.pop())
        return table


# kernel sets the logit tests run with: (kernels, kv_cache_dtype, tolerance); a float16 pool rounds K/V
KERNELS = [("eager", "auto", 1e-4), ("cpu", "float32", 1e-4), ("cpu", "float16", 5e-3)]
KERNEL_IDS = ["eager", "cpu-f32", "cpu-f16"]


def runner_for(folder: Path, block_size: int, num_blocks: int = 200, kernels: str = "eager",
               kv_cache_dtype: str = "auto") -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(folder), dtype="float32", block_size=block_size,
                                    num_kv_blocks=num_blocks, kernels=kernels, kv_cache_dtype=kv_cache_dtype))


@pytest.mark.parametrize(("kernels", "kv_dtype", "tol"), KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_one_flattened_step_matches_transformers(tiny_models, arch, block_size, kernels, kv_dtype, tol):
    """Several whole prompts of different lengths in one step give transformers' last-token logits, with
    the eager set and with the compiled cpu set (float32 and float16 pools)."""
    folder, ref = tiny_models[arch]
    runner = runner_for(folder, block_size, kernels=kernels, kv_cache_dtype=kv_dtype)
    assert runner.kernels.name == kernels
    blocks = BlockTables(runner.num_blocks, block_size)
    seqs = [ScheduledSeq(str(i), s, 0, blocks.grow([], len(s)), True) for i, s in enumerate(SEQS)]
    logits = runner.execute(seqs)
    assert logits.dtype == torch.float32 and logits.shape == (len(SEQS), 49152)
    torch.testing.assert_close(logits, torch.stack([r[-1] for r in ref]), atol=tol, rtol=tol)


# per step, per sequence: how many of its tokens to compute (0: not scheduled). A sequence's chunk asks for
# logits only when it is a decode or ends its prompt (the first PROMPT_LEN tokens)
SCHEDULE = [[5, 2, 0, 8], [1, 2, 3, 1], [3, 1, 0, 3]]
PROMPT_LEN = [9, 4, 3, 12]


@pytest.mark.parametrize(("kernels", "kv_dtype", "tol"), KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_chunked_prefill_and_decode_match_transformers(tiny_models, arch, block_size, kernels, kv_dtype, tol):
    """Prompts fed in chunks mixed with decodes of other sequences, over several steps through the paged
    cache, give transformers' logits at every position where logits are asked for, in order, with each
    kernel set."""
    folder, ref = tiny_models[arch]
    runner = runner_for(folder, block_size, kernels=kernels, kv_cache_dtype=kv_dtype)
    blocks = BlockTables(runner.num_blocks, block_size, seed=block_size)
    done, tables = [0] * len(SEQS), [[] for _ in SEQS]
    steps = SCHEDULE + [[1] * len(SEQS)] * 12  # then plain decodes until every sequence is fed
    compared = 0
    for step in steps:
        batch, expected = [], []
        for i, n in enumerate(step):
            n = min(n, len(SEQS[i]) - done[i])
            if n == 0:
                continue
            end = done[i] + n
            wants = end >= PROMPT_LEN[i]
            batch.append(
                ScheduledSeq(str(i), SEQS[i][done[i] : end], done[i], blocks.grow(tables[i], end), wants)
            )
            if wants:
                expected.append(ref[i][end - 1])
            done[i] = end
        if not batch:
            break
        logits = runner.execute(batch)
        assert logits.shape == (len(expected), 49152)
        if expected:
            torch.testing.assert_close(logits, torch.stack(expected), atol=tol, rtol=tol)
        compared += len(expected)
    assert done == [len(s) for s in SEQS] and compared == 20


@pytest.mark.parametrize("row_cache_bytes", [None, 0])
def test_decode_row_cache_keeps_rows_only_across_consecutive_decodes(tiny_models, row_cache_bytes):
    """Decodes get rows in the row cache: a request keeps its row while it decodes step after step, loses
    it when a step skips it (its row goes to a newcomer, refilled from the pool), and logits stay
    transformers' throughout; with no budget for the cache (0 bytes) decodes gather from the pool instead,
    with the same logits."""
    folder, ref = tiny_models["llama"]
    runner = runner_for(folder, 4, kernels="eager")
    rows = runner.kernels.rows
    if row_cache_bytes is not None:
        rows.budget_bytes = row_cache_bytes
    blocks = BlockTables(runner.num_blocks, 4, seed=3)
    tables = [blocks.grow([], len(s)) for s in SEQS]
    runner.execute([ScheduledSeq(str(i), SEQS[i][:2], 0, tables[i], True) for i in range(4)])
    done = [2, 2, 2, 2]
    for decoding in ([0, 1, 3], [0, 1, 3], [0, 3], [2, 0, 1, 3], [0, 1, 3]):
        seqs = [ScheduledSeq(str(i), [SEQS[i][done[i]]], done[i], tables[i], True) for i in decoding]
        logits = runner.execute(seqs)
        torch.testing.assert_close(logits, torch.stack([ref[i][done[i]] for i in decoding]), atol=1e-4, rtol=1e-4)
        for i in decoding:
            done[i] += 1
        if row_cache_bytes == 0:
            assert rows.row_of == {} and rows.k == []
            continue
        assert sorted(rows.row_of) == sorted(str(i) for i in decoding)
        assert all(held == done[int(r)] for r, (_, held) in rows.row_of.items())
    if row_cache_bytes is None:
        held = {r: row for r, (row, _) in rows.row_of.items()}
        assert held == {"0": 0, "3": 2, "1": 3}  # 0 and 3 kept theirs since the first decode; 1 came back


def test_decodes_longer_than_a_row_gather_beside_row_decodes(tiny_models, monkeypatch):
    """Rows 4 positions long: decodes whose context fits use rows, longer ones gather from the pool in the
    same step, all with transformers' logits; rows are only cleaned up to the longest row decode, and a
    sequence that outgrows its row moves to the gather path."""
    import troupe.kernels.eager.rows as rows_mod

    monkeypatch.setattr(rows_mod, "ROW_LEN_STEP", 2)
    folder, ref = tiny_models["llama"]
    runner = runner_for(folder, 4, kernels="eager")
    rows = runner.kernels.rows
    rows.budget_bytes = runner.max_num_seqs * 4 * runner.kv_bytes_per_token
    blocks = BlockTables(runner.num_blocks, 4, seed=5)
    seqs = [0, 1, 3]
    tables = {i: blocks.grow([], len(SEQS[i])) for i in seqs}
    done = {0: 2, 1: 1, 3: 12}  # 1 fits for 3 steps, 0 for 1 step, 3 never
    runner.execute([ScheduledSeq(str(i), SEQS[i][: done[i]], 0, tables[i], False) for i in seqs])
    cleaned = []
    for _ in range(5):
        logits = runner.execute([ScheduledSeq(str(i), [SEQS[i][done[i]]], done[i], tables[i], True) for i in seqs])
        torch.testing.assert_close(logits, torch.stack([ref[i][done[i]] for i in seqs]), atol=1e-4, rtol=1e-4)
        done = {i: d + 1 for i, d in done.items()}
        assert set(rows.row_of) == {str(i) for i in seqs if done[i] <= 4}
        cleaned.append(rows.clean)
    assert rows.k[0].shape[2] == 4
    assert cleaned == [4, 4, 4, 4, 4] and rows.row_of == {}


def test_rows_are_sorted_by_length_when_that_reads_much_less(tiny_models, monkeypatch):
    """Decodes join one by one and take rows in arrival order (long, short, long, short); once sorting by
    context length reads much less (groups of 2 rows), kept rows are moved into length
    order, and the logits stay transformers' in that step and the next ones (read from the moved rows)."""
    import troupe.kernels.eager.rows as rows_mod

    monkeypatch.setattr(rows_mod, "ROW_GROUP", 2)
    folder, ref = tiny_models["llama"]
    runner = runner_for(folder, 4)
    blocks = BlockTables(runner.num_blocks, 4, seed=7)
    tables = [blocks.grow([], len(s)) for s in SEQS]
    done = {3: 12, 1: 2, 0: 9, 2: 2}
    runner.execute([ScheduledSeq(str(i), SEQS[i][:n], 0, tables[i], False) for i, n in done.items()])
    # step 4 reads 2*16 + 2*11 = 54 positions in arrival order, 2*5 + 2*16 = 42 sorted: 3 moves to row 3
    for decoding, rows in (([3], {3: 0}), ([3, 1], {3: 0, 1: 1}), ([3, 1, 0], {3: 0, 1: 1, 0: 2}),
                           ([3, 1, 0, 2], {2: 0, 1: 1, 0: 2, 3: 3}), ([3, 1, 0], {3: 3, 1: 1, 0: 2})):
        logits = runner.execute([ScheduledSeq(str(i), [SEQS[i][done[i]]], done[i], tables[i], True) for i in decoding])
        torch.testing.assert_close(logits, torch.stack([ref[i][done[i]] for i in decoding]), atol=1e-4, rtol=1e-4)
        for i in decoding:
            done[i] += 1
        assert {int(r): row for r, (row, _) in runner.kernels.rows.row_of.items()} == rows


@pytest.mark.parametrize(("kernels", "kv_dtype", "tol"), KERNELS, ids=KERNEL_IDS)
def test_shared_prefix_blocks_are_reused(tiny_models, kernels, kv_dtype, tol):
    """A sequence whose first blocks are another's cached blocks (prefix caching) computes only its
    remaining tokens and still gets transformers' logits; the owner's later decode is unaffected."""
    folder, _ = tiny_models["llama"]
    bs = 4
    prefix = SEQS[3][:8]  # two full blocks
    a, b = prefix + [1000, 1001, 1002], prefix + [2000, 2001]
    runner = runner_for(folder, bs, kernels=kernels, kv_cache_dtype=kv_dtype)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    with torch.inference_mode():
        ref_a, ref_b = hf(torch.tensor([a])).logits[0], hf(torch.tensor([b])).logits[0]
    table_a, table_b = [7, 3, 11], [7, 3, 5]
    out = runner.execute([ScheduledSeq("a", a[:-1], 0, table_a, True)])
    torch.testing.assert_close(out[0], ref_a[-2], atol=tol, rtol=tol)
    out = runner.execute(
        [ScheduledSeq("b", b[8:], 8, table_b, True), ScheduledSeq("a", a[-1:], 10, table_a, True)]
    )
    torch.testing.assert_close(out, torch.stack([ref_b[-1], ref_a[-1]]), atol=tol, rtol=tol)


@pytest.mark.parametrize("kernels", ["eager", "cpu"])
def test_empty_step_and_no_logits(tiny_models, kernels):
    """An empty step returns (0, vocab); a step where nobody needs logits returns (0, vocab) too."""
    folder, _ = tiny_models["llama"]
    runner = runner_for(folder, 16, kernels=kernels)
    assert runner.execute([]).shape == (0, 49152)
    assert runner.execute([ScheduledSeq("a", [1, 2, 3], 0, [0], False)]).shape == (0, 49152)


def test_kv_pool_sizing(tiny_models):
    """num_kv_blocks wins, then kv_cache_memory_bytes; the default is max_num_seqs x 512 tokens capped at
    1 GiB; max_model_len is the smaller of the option and the model's."""
    folder, _ = tiny_models["llama"]
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head_dim 16, float32
    eager = dict(model=str(folder), dtype="float32", kernels="eager")
    r = ModelRunner(EngineConfig(**eager, num_kv_blocks=7, max_model_len=100))
    assert (r.num_blocks, r.block_size, r.max_model_len, r.vocab_size) == (7, 16, 100, 49152)
    assert r.kv_caches[0][0].shape == (7, 16, 2, 16) and len(r.kv_caches) == 2
    r = ModelRunner(EngineConfig(**eager, kv_cache_memory_bytes=per_token * 16 * 10))
    assert r.num_blocks == 10 and r.max_model_len == 2048
    r = ModelRunner(EngineConfig(**eager, max_num_seqs=3, block_size=8))
    assert r.num_blocks == 3 * 512 // 8
    assert r.kv_bytes_per_token == per_token and DEFAULT_KV_CAP_BYTES == 1 << 30


@pytest.mark.parametrize(("kv_dtype", "dtype", "itemsize"),
                         [("auto", torch.float16, 2), ("float16", torch.float16, 2), ("float32", torch.float32, 4),
                          ("bfloat16", torch.bfloat16, 2)])
def test_cpu_kernels_own_their_pool(tiny_models, kv_dtype, dtype, itemsize):
    """The cpu set's pool: K (blocks, kv heads, head dim, block) and V (blocks, kv heads, block, head dim) in
    kv_cache_dtype ("auto": float16), sized by its bytes per token (a float16 pool holds as many tokens
    in half the bytes); no decode row cache."""
    folder, _ = tiny_models["llama"]
    r = ModelRunner(EngineConfig(model=str(folder), dtype="float32", kernels="cpu", kv_cache_dtype=kv_dtype,
                                 block_size=8, kv_cache_memory_bytes=2 * 2 * 2 * 16 * 2 * 8 * 10))
    assert r.kernels.name == "cpu" and r.kernels.rows is None
    k_pool, v_pool = r.kv_caches[0]
    assert r.kv_bytes_per_token == 2 * 2 * 2 * 16 * itemsize and r.num_blocks == 10 * 2 // itemsize
    assert k_pool.shape == (r.num_blocks, 2, 16, 8) and v_pool.shape == (r.num_blocks, 2, 8, 16)
    assert k_pool.dtype == v_pool.dtype == dtype
    r.execute([ScheduledSeq("a", SEQS[0][:5], 0, [3], True)])  # block 3, positions 0..4 of K/V written
    assert k_pool[3, :, :, :5].abs().sum() > 0 and k_pool[3, :, :, 5:].abs().sum() == 0


def test_null_model_picks_a_fixed_text_token():
    """null_model loads no weights and allocates no real pool, but reports the default model's info and
    a plausible pool size; its logits always pick one non-EOS text token."""
    r = ModelRunner(EngineConfig(null_model=True, dtype="float32"))
    assert r.model is None and r.kv_caches == []
    assert r.model_path == resolve_model_path(None) and r.vocab_size == 49152
    itemsize = r.kernels.kv_cache_dtype(torch.float32).itemsize  # the selected set's pool dtype
    assert r.kv_bytes_per_token == 2 * 30 * 3 * 64 * itemsize
    assert r.num_blocks == min(64 * 512, (1 << 30) // r.kv_bytes_per_token) // 16
    logits = r.execute(
        [
            ScheduledSeq("a", [1, 2, 3], 0, [0], True),
            ScheduledSeq("b", [4], 3, [0], False),
            ScheduledSeq("c", [5], 9, [1], True),
        ]
    )
    assert logits.shape == (2, 49152) and logits.dtype == torch.float32
    assert logits.argmax(-1).tolist() == [NULL_TOKEN_ID, NULL_TOKEN_ID]
    assert NULL_TOKEN_ID not in r.info.eos_token_ids
