"""The CUDA path's host-side logic on the CPU: device and kernel-set choice, the step buffers' two layouts
and padding, graph batch sizes, the pool-sizing arithmetic (made-up memory figures) and the sampler
choice. The real capture / replay and memory figures are covered by the GPU tests."""

from __future__ import annotations

import random

import pytest
import torch

from troupe.config import EngineConfig
from troupe.core import gpu_memory
from troupe.core.batch import ScheduledSeq
from troupe.core.sampler import Sampler, make_sampler
from troupe.errors import InvalidInputError
from troupe.kernels import select
from troupe.kernels.base import KVSpec, flatten_step
from troupe.kernels.cpu import available as cpu_available
from troupe.kernels.cuda.graphs import capture_order, capture_sizes, graph_size_for
from troupe.kernels.cuda.kernel_set import CudaKernels
from troupe.kernels.cuda.step_buffers import StepBuffers

BS = 4
MIXED = [ScheduledSeq("a", [5, 6, 7], 0, [9, 2], True), ScheduledSeq("b", [8], 6, [4, 1], True),
         ScheduledSeq("c", [1, 2, 3, 4, 5, 6], 2, [7, 3, 5, 8], False)]
DECODES = [ScheduledSeq("a", [11], 5, [9, 2], True), ScheduledSeq("b", [12], 0, [6], True),
           ScheduledSeq("c", [13], 12, [7, 3, 5, 8], True)]


def buffers(graph_rows: int = 8) -> StepBuffers:
    return StepBuffers(max_tokens=32, max_seqs=8, max_blocks_per_seq=6, graph_rows=graph_rows,
                       device=torch.device("cpu"))


def test_eager_layout_matches_flatten_step() -> None:
    """A mixed step (chunks after cached context, a decode, a row not sampled) packed by the step buffers
    holds exactly what `flatten_step` computes: ids, positions, slots, lengths, tables, logits rows."""
    batch = buffers().fill(MIXED, BS)
    ref = flatten_step(MIXED, BS)
    assert batch is not None
    m, r = batch.meta, ref.meta
    for got, want in ((batch.input_ids, ref.input_ids), (batch.positions, ref.positions),
                      (m.slot_mapping, r.slot_mapping), (m.query_start_loc, r.query_start_loc),
                      (m.seq_lens, r.seq_lens), (m.block_tables, r.block_tables),
                      (batch.logits_indices, ref.logits_indices)):
        assert torch.equal(got.long(), want), (got, want)
    assert (m.max_query_len, m.max_seq_len, m.num_seqs, m.graph_size) == (6, 8, 3, 0)
    assert m.block_tables.dtype == torch.int32 and m.block_tables.is_contiguous()


def test_eager_layout_matches_flatten_step_on_random_steps() -> None:
    """Random mixed steps (1-8 sequences, chunks and decodes, tables with blocks past the step's need)
    pack exactly what `flatten_step` computes, tables included."""
    rng = random.Random(7)
    buf = StepBuffers(max_tokens=256, max_seqs=8, max_blocks_per_seq=40, graph_rows=8, device=torch.device("cpu"))
    for _ in range(200):
        seqs = []
        for i in range(rng.randint(1, 8)):
            n, start = rng.choice([1, rng.randint(1, 30)]), rng.randint(0, 90)
            blocks = -(-(start + n) // BS) + rng.randint(0, 2)
            seqs.append(ScheduledSeq(f"s{i}", [rng.randrange(1000) for _ in range(n)], start,
                                     rng.sample(range(1, 500), blocks), rng.random() < 0.8))
        batch, ref = buf.fill(seqs, BS), flatten_step(seqs, BS)
        assert batch is not None
        assert torch.equal(batch.meta.block_tables.long(), ref.meta.block_tables)
        assert torch.equal(batch.meta.slot_mapping, ref.meta.slot_mapping)
        assert torch.equal(batch.positions, ref.positions) and torch.equal(batch.input_ids, ref.input_ids)
        assert torch.equal(batch.logits_indices, ref.logits_indices)


def test_graph_layout_pads_rows_at_fixed_offsets() -> None:
    """Three decodes padded to 4 rows: the real rows as `flatten_step` has them, the padding row token 0
    at position 0, slot -1, seq_len 0, one query token; the views are the same memory for every step of
    that size (what a captured graph reads), and the tables keep their full width as stride."""
    buf = buffers()
    first = buf.fill(DECODES, BS, pad_to=4, max_seq_len=24)
    ref = flatten_step(DECODES, BS)
    assert first is not None
    m = first.meta
    assert first.input_ids.tolist() == [11, 12, 13, 0]
    assert first.positions.tolist() == ref.positions.tolist() + [0]
    assert m.slot_mapping.tolist() == ref.meta.slot_mapping.tolist() + [-1]
    assert m.seq_lens.tolist() == [6, 1, 13, 0] and m.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert m.block_tables.shape == (4, 6) and m.block_tables.stride() == (6, 1)
    assert m.block_tables[:3, :4].tolist() == [[9, 2, 0, 0], [6, 0, 0, 0], [7, 3, 5, 8]]
    assert m.block_tables[3].tolist() == [0] * 6
    assert first.logits_indices.tolist() == [0, 1, 2]
    assert (m.max_query_len, m.max_seq_len, m.num_seqs, m.graph_size) == (1, 24, 3, 4)
    buf.fill(MIXED, BS)  # an eager step in between reuses the same memory
    second = buf.fill(DECODES[:2], BS, pad_to=4, max_seq_len=24)
    assert second is not None
    for a, b in ((first.input_ids, second.input_ids), (first.meta.slot_mapping, second.meta.slot_mapping),
                 (first.meta.seq_lens, second.meta.seq_lens), (first.meta.block_tables, second.meta.block_tables),
                 (first.meta.query_start_loc, second.meta.query_start_loc)):
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape
    assert second.meta.seq_lens.tolist() == [6, 1, 0, 0] and second.meta.slot_mapping.tolist()[2:] == [-1, -1]
    assert second.meta.num_seqs == 2 and second.logits_indices.tolist() == [0, 1]


def test_all_padding_batch_for_capture() -> None:
    """A capture batch is padding rows only: no slot is written, every context is empty."""
    batch = buffers().fill([], BS, pad_to=8, max_seq_len=24)
    assert batch is not None
    assert batch.meta.slot_mapping.tolist() == [-1] * 8 and batch.meta.seq_lens.tolist() == [0] * 8
    assert batch.logits_indices.numel() == 0 and batch.meta.max_query_len == 1


@pytest.mark.parametrize("seqs,pad_to", [
    ([ScheduledSeq("long", list(range(40)), 0, list(range(10)), True)], 0),  # more tokens than sized for
    ([ScheduledSeq("deep", [1], 30, list(range(8)), True)], 0),  # a table wider than max_blocks_per_seq
    ([ScheduledSeq(str(i), [1], 0, [i], True) for i in range(9)], 0),  # more sequences than max_seqs
    (DECODES, 16),  # a graph size past graph_rows
])
def test_steps_that_do_not_fit_are_refused(seqs: list[ScheduledSeq], pad_to: int) -> None:
    """A step past the buffers' sizes gets None (the kernel set then builds it without the buffers)."""
    assert buffers().fill(seqs, BS, pad_to=pad_to) is None


def test_kernel_set_falls_back_without_buffers() -> None:
    """A step too large for the step buffers still runs: the kernel set flattens it as `flatten_step` does."""
    kernels = CudaKernels("cpu", max_num_seqs=2, max_num_batched_tokens=4)
    spec = KVSpec(num_layers=1, num_blocks=16, block_size=BS, num_kv_heads=1, head_dim=16,
                         dtype=torch.float32, max_model_len=32, max_num_seqs=2)
    kernels.allocate_kv(spec)
    batch = kernels.prepare(MIXED, BS)
    assert torch.equal(batch.meta.slot_mapping, flatten_step(MIXED, BS).meta.slot_mapping)
    assert batch.meta.num_seqs == 3 and batch.meta.graph_size == 0


def test_capture_sizes_and_padding_choice() -> None:
    """Graph sizes: 1, 2, 4, 8, then every 16 up to max_num_seqs (included), capped at 512; a batch
    pads to the smallest captured size that holds it, or runs eagerly past the largest."""
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(70) == [1, 2, 4, 8, 16, 32, 48, 64, 70]
    assert capture_sizes(10_000)[-1] == 512 and len(capture_sizes(10_000)) == 4 + 32
    sizes = [1, 2, 4, 8, 16, 32]
    assert [graph_size_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 32, 33)] == [1, 2, 4, 8, 8, 16, 32, 32, 0]
    assert graph_size_for(3, []) == 0
    assert capture_order([1, 2, 4, 8, 16, 32, 48]) == [1, 2, 4, 8, 48, 32, 16]  # small first, then large down


def test_decode_graph_size_needs_one_sampled_token_per_seq() -> None:
    """Only steps of one sampled token per sequence are padded for a graph; anything else is eager."""
    kernels = CudaKernels("cpu")
    assert kernels.decode_graph_size(DECODES) == 0  # no graphs captured
    kernels.graph_sizes = [1, 2, 4]
    assert kernels.decode_graph_size(DECODES) == 4
    assert kernels.decode_graph_size(DECODES[:1]) == 1
    assert kernels.decode_graph_size(MIXED) == 0
    unsampled = [ScheduledSeq("x", [3], 4, [1, 2], False)]
    assert kernels.decode_graph_size(unsampled) == 0
    assert kernels.decode_graph_size(DECODES + DECODES) == 0  # 6 rows, no graph that large


def test_pool_sizing_arithmetic() -> None:
    """pool = utilization * total - (model + activations + graphs + other); the reserve for graphs
    scales the profiled activations per token to the largest graph's rows."""
    G = 1 << 30
    mem = gpu_memory.GpuMemory(total=100 * G, model=2 * G, activations=3 * G, graphs=1 * G, other=G // 2)
    assert gpu_memory.kv_pool_bytes(mem, 0.9) == int(0.9 * 100 * G) - int(6.5 * G)
    assert gpu_memory.kv_pool_bytes(mem, 0.05) < 0
    assert mem.fields() == {"total_gib": 100.0, "model_gib": 2.0, "activations_gib": 3.0, "graphs_gib": 1.0,
                            "other_gib": 0.5}
    base = gpu_memory.GRAPH_RESERVE_BASE
    assert gpu_memory.graph_reserve_bytes(8192 * 1000, 8192, 256) == base + 256 * 1000
    assert gpu_memory.graph_reserve_bytes(64 * 1000, 64, 256) == base + 64 * 1000  # no more than profiled


def test_profile_step_is_the_largest_the_scheduler_makes() -> None:
    """The profiling step has max_num_batched_tokens tokens over max_num_seqs sequences (none longer than
    max_model_len), all sampled, on distinct blocks."""
    seqs = gpu_memory.profile_seqs(1000, 64, 2048, 16)
    assert len(seqs) == 64 and sum(len(s.token_ids) for s in seqs) == 1000 and all(s.needs_logits for s in seqs)
    blocks = [b for s in seqs for b in s.block_ids]
    assert len(blocks) == len(set(blocks)) and all(len(s.block_ids) * 16 >= len(s.token_ids) for s in seqs)
    short = gpu_memory.profile_seqs(8192, 4, 100, 16)  # capped by max_num_seqs * max_model_len
    assert [len(s.token_ids) for s in short] == [100] * 4
    few = gpu_memory.profile_seqs(3, 64, 100, 16)
    assert [len(s.token_ids) for s in few] == [1, 1, 1]


def test_device_and_kernel_choice_without_a_gpu() -> None:
    """Without CUDA: "auto" is the CPU and its best set (the compiled cpu set where it builds); device="cuda" and kernels="cuda" (on a device that
    is not CUDA) are InvalidInputErrors naming the field; kernels="cuda" with device="cpu" is the
    interpreter's test-only mode."""
    assert not torch.cuda.is_available()
    assert select.resolve_device(EngineConfig()) == torch.device("cpu")
    assert select.select_kernels(EngineConfig()).name == ("cpu" if cpu_available() else "eager")
    with pytest.raises(InvalidInputError, match="device") as err:
        select.resolve_device(EngineConfig(device="cuda"))
    assert err.value.field == "device" and "torch.cuda.is_available" in str(err.value)
    with pytest.raises(InvalidInputError) as err:
        select.select_kernels(EngineConfig(kernels="cuda"))
    assert err.value.field == "kernels" and "device" in str(err.value)
    kernels = select.select_kernels(EngineConfig(kernels="cuda", device="cpu"), dtype=torch.float32)
    assert isinstance(kernels, CudaKernels) and kernels.device.type == "cpu" and kernels.dtype == torch.float32
    assert select.model_dtype(EngineConfig(), torch.device("cpu")) == "auto"


def test_device_and_kernel_choice_with_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch sees a GPU: "auto" is CUDA, the cuda set and bfloat16; the CPU sets are refused on
    CUDA, naming kernels and the device; device="cpu" still picks a CPU set. (No GPU is touched:
    the kernel set allocates nothing until the pool.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select.resolve_device(EngineConfig()) == torch.device("cuda")
    kernels = select.select_kernels(EngineConfig(max_num_seqs=7, max_num_batched_tokens=99))
    assert isinstance(kernels, CudaKernels) and kernels.device.type == "cuda"
    assert (kernels.max_num_seqs, kernels.max_num_batched_tokens) == (7, 99)
    assert select.model_dtype(EngineConfig(), torch.device("cuda")) == torch.bfloat16
    assert select.model_dtype(EngineConfig(dtype="float32"), torch.device("cuda")) == "float32"
    for name in ("eager", "cpu"):
        with pytest.raises(InvalidInputError) as err:
            select.select_kernels(EngineConfig(kernels=name))
        assert err.value.field == "kernels" and "'cuda'" in str(err.value)
    assert select.select_kernels(EngineConfig(device="cpu")).name == ("cpu" if cpu_available() else "eager")


def test_one_sampler_for_every_device() -> None:
    """One sampler implementation serves CPU and CUDA logits (no feature exists on one device only)."""
    assert type(make_sampler(torch.device("cpu"), 3)) is Sampler
    assert type(make_sampler(torch.device("cuda"), 3)) is Sampler


@pytest.mark.parametrize("field,value", [("device", "gpu"), ("device", "cuda:0"), ("gpu_memory_utilization", 0),
                                         ("gpu_memory_utilization", 1.01), ("gpu_memory_utilization", float("nan")),
                                         ("gpu_memory_utilization", True), ("gpu_memory_utilization", "0.5"),
                                         ("enforce_eager", 1), ("kernels", "triton")])
def test_bad_options_name_their_field(field: str, value: object) -> None:
    """Bad device / gpu_memory_utilization / enforce_eager / kernels values are refused naming the field."""
    with pytest.raises(InvalidInputError) as err:
        EngineConfig(**{field: value})
    assert err.value.field == field
