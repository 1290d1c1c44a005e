"""`ModelRunner`: owns the model weights, its kernel set and the paged KV pool; runs one step on a list of
`ScheduledSeq`.

Contract of `execute(seqs)` (see `troupe.core.batch`): sequence i computes `seqs[i].token_ids` at
positions `start_pos ..`, its K/V going to the blocks `block_ids` (slot of position p:
`block_ids[p // block_size] * block_size + p % block_size`); it returns float32 logits
`(rows, vocab)`, one row per entry with `needs_logits` in order, taken at its last token, or one row
per token of the chunk for an entry with `prompt_logits` (prompt logprobs; `troupe.core.batch`).
`execute_hidden(seqs, rows)` (the pooling runner, `troupe.core.pooler`) runs the same step and returns
the final hidden states of the tokens `rows` instead of logits.
The KV pool is mutated in place; nothing else is. Not thread-safe: one step at a time.

The kernel set (`troupe.kernels`, chosen by `EngineConfig.kernels` and `device` when the runner is
built) flattens each step (`KernelSet.prepare`), allocates the pool in its own layout and runs the
model's heavy ops; the runner only sizes the pool and asks for logits where a token is sampled.

Devices (`EngineConfig.device`, `troupe.kernels.select.resolve_device`): on the CPU the logits come back
as CPU tensors. On CUDA the weights, the pool and the logits stay on the GPU (bf16 unless `dtype` says
otherwise): a step moves token ids, positions, slots and block tables to the device (pinned, no sync),
and `execute` returns the logits on the device for the device sampler (`troupe.core.sampler.make_sampler`),
so only the sampled ids come back. Decode steps replay CUDA graphs captured at start-up
(`troupe.kernels.cuda.graphs`; `enforce_eager` turns them off); other steps run eagerly.

KV pool sizing (`num_blocks`): `num_kv_blocks` if given, else `kv_cache_memory_bytes`; else, on CUDA,
what `gpu_memory_utilization` of the GPU leaves after the weights, a profiled largest step and the
graphs' reserve (`troupe.core.gpu_memory`); on the CPU a default of `max_num_seqs * 512` tokens capped
at `DEFAULT_KV_CAP_BYTES`: enough for a full batch of chat-sized requests without taking a large share
of the machine's memory.

`null_model=True` loads no weights and computes nothing: every row of logits picks one fixed text token
(`null_token_id`), with no pool but the `num_blocks` a real pool would have, so scheduling, detokenizing
and benchmarks of the engine around the model behave as with the real model. Its step still flattens the
batch with the kernel set's `prepare` (the host work a real step does before the model), and its logits
are rows of one read-only tensor built once (grown when a step needs more rows): a fresh (N, vocab) tensor
per step would cost more than the host work the null model is there to measure (`troupe.bench.host`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import structlog
import torch

from troupe.config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from troupe.core import gpu_memory
from troupe.core.batch import ScheduledSeq
from troupe.errors import InvalidInputError
from troupe.kernels import KVSpec, select_kernels
from troupe.kernels.select import default_quantization, model_dtype, resolve_device
from troupe.models import gguf
from troupe.models.loader import (
    ModelInfo,
    check_max_model_len,
    load_model,
    read_model_info,
    resolve_dtype,
    resolve_model_path,
)

log = structlog.get_logger("troupe.runner")

DEFAULT_KV_TOKENS_PER_SEQ = 512
DEFAULT_KV_CAP_BYTES = 1 << 30
Placeholders = tuple[list[int], list[int], torch.Tensor]  # (dst token indices, src rows, the previous step's ids)
NULL_TOKEN_ID = 260  # " the" in the SmolLM2 vocabulary: plain text, never EOS


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.model_path = resolve_model_path(config.model, config.revision)
        self.null_model = config.null_model
        self.device = resolve_device(config)
        if self.device.type != "cuda" and config.gpu_memory_utilization != DEFAULT_GPU_MEMORY_UTILIZATION:
            raise InvalidInputError("gpu_memory_utilization", f"sizes the KV cache from a GPU's memory, and this "
                                    f"engine runs on the CPU: leave it at {DEFAULT_GPU_MEMORY_UTILIZATION} and size "
                                    f"the pool with kv_cache_memory_bytes or num_kv_blocks, got "
                                    f"{config.gpu_memory_utilization!r}")
        dtype = resolve_dtype(model_dtype(config, self.device), self.model_path)
        if dtype == torch.float32:  # "auto" on a GGUF: this CPU kind's measured default mode
            config = msgspec.structs.replace(config, quantization=default_quantization(
                config, gguf.is_gguf(self.model_path), self.device))
        self.quantization = config.quantization
        self.kernels = select_kernels(config, self.device, dtype)
        self.graphs: Any = None  # troupe.kernels.cuda.graphs.DecodeGraphs once captured
        self.graph_reserve_bytes = 0  # what the pool sizing left the graphs (`gpu_memory`)
        if self.null_model:
            self.model = None
            self.info: ModelInfo = read_model_info(self.model_path, dtype)
        else:
            self.model, self.info = load_model(self.model_path, dtype, max_len=config.max_model_len,
                                               kernels=self.kernels, quantization=config.quantization)
        self.max_model_len = check_max_model_len(config.max_model_len, self.info)  # above the model's: an error
        self.vocab_size = self.info.vocab_size
        self.max_num_seqs = config.max_num_seqs
        self.block_size = config.block_size
        self.null_token_id = NULL_TOKEN_ID if NULL_TOKEN_ID < self.vocab_size else 0
        self._null_logits = torch.empty(0, self.vocab_size)  # (rows, vocab): the null model's, grown on demand
        i = self.info
        spec = KVSpec(num_layers=i.num_layers, num_blocks=0, block_size=self.block_size, num_kv_heads=i.num_kv_heads,
                      head_dim=i.head_dim, dtype=i.dtype, max_model_len=self.max_model_len,
                      max_num_seqs=self.max_num_seqs)
        self.kv_bytes_per_token = self.kernels.kv_bytes_per_token(spec)  # K and V of all layers, one token
        self.kv_caches: list[Any] = []  # per layer (K, V)
        on_gpu = self.device.type == "cuda" and not self.null_model
        self.num_blocks = self._size_gpu_pool(config, spec) if on_gpu else self._count_blocks(config)
        self.kv_spec = dataclasses.replace(spec, num_blocks=self.num_blocks)
        self.kv_caches = [] if self.null_model else self.kernels.allocate_kv(self.kv_spec)
        if on_gpu and not config.enforce_eager:
            self._capture_graphs()
        log.info("model loaded", model=str(self.model_path), kernels=self.kernels.name, quantization=self.quantization,
                 device=str(self.device),
                 dtype=str(self.info.dtype).removeprefix("torch."), num_kv_blocks=self.num_blocks,
                 kv_cache_dtype=str(self.kernels.kv_cache_dtype(self.info.dtype)).removeprefix("torch."))

    def _count_blocks(self, config: EngineConfig, gpu_budget: int | None = None) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = self.kv_bytes_per_token * self.block_size
        budget = config.kv_cache_memory_bytes or gpu_budget
        if budget is None:
            budget = min(
                config.max_num_seqs * DEFAULT_KV_TOKENS_PER_SEQ * self.kv_bytes_per_token,
                DEFAULT_KV_CAP_BYTES,
            )
        return max(1, budget // per_block)

    def _size_gpu_pool(self, config: EngineConfig, spec: KVSpec) -> int:
        """Blocks for the pool on the GPU: profile the largest step on a throw-away pool, then what
        `gpu_memory_utilization` leaves (unless `num_kv_blocks` / `kv_cache_memory_bytes` say)."""
        from troupe.core.sampler import Sampler
        from troupe.core.sampling_metadata import SamplingRow
        from troupe.sampling_params import SamplingParams

        seqs = gpu_memory.profile_seqs(config.max_num_batched_tokens, self.max_num_seqs, self.max_model_len,
                                       self.block_size)
        scratch = dataclasses.replace(spec, num_blocks=sum(len(s.block_ids) for s in seqs))
        self.kv_caches = self.kernels.allocate_kv(scratch)
        scratch_bytes = scratch.num_blocks * self.block_size * self.kv_bytes_per_token
        model_bytes = torch.cuda.memory_allocated() - scratch_bytes  # weights, rope table, step buffers
        rows = [SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), None) for _ in seqs]
        activations = gpu_memory.profile_peak(lambda: self.execute(seqs),
                                              lambda logits: Sampler().sample(logits, rows))
        self.kv_caches = []
        total, other = gpu_memory.device_usage()
        tokens = sum(len(s.token_ids) for s in seqs)
        self.graph_reserve_bytes = gpu_memory.graph_reserve_bytes(activations, tokens, self.max_num_seqs)
        graphs = 0 if config.enforce_eager else self.graph_reserve_bytes
        mem = gpu_memory.GpuMemory(total=total, model=model_bytes, activations=activations, graphs=graphs, other=other)
        budget = gpu_memory.kv_pool_bytes(mem, config.gpu_memory_utilization)
        per_block = self.kv_bytes_per_token * self.block_size
        overridden = config.num_kv_blocks is not None or config.kv_cache_memory_bytes is not None
        if not overridden and budget < per_block:
            raise InvalidInputError("gpu_memory_utilization", f"{config.gpu_memory_utilization} of the GPU's "
                                    f"{total / gpu_memory.GiB:.2f} GiB leaves {budget / gpu_memory.GiB:.3f} GiB for "
                                    "the KV cache after the weights, the activations of a "
                                    f"{tokens}-token step and the CUDA graphs' reserve, less than one block: "
                                    "raise it (at most 1), or lower max_num_batched_tokens")
        blocks = self._count_blocks(config, gpu_budget=max(budget, per_block))
        log.info("kv cache sized", device=str(self.device), utilization=config.gpu_memory_utilization,
                 profile_tokens=tokens, **mem.fields(), kv_cache_gib=round(blocks * per_block / gpu_memory.GiB, 3),
                 num_blocks=blocks, kv_tokens=blocks * self.block_size, overridden=overridden)
        return blocks

    def _capture_graphs(self) -> None:
        """Decode CUDA graphs for batch sizes up to `max_num_seqs` (troupe.kernels.cuda.graphs)."""
        from troupe.kernels.cuda.graphs import DecodeGraphs, capture_sizes

        assert self.model is not None
        kernels: Any = self.kernels
        kernels.graph_max_seq_len = self.max_model_len
        sizes = capture_sizes(self.max_num_seqs)
        graphs = DecodeGraphs(self.info.arch.hidden_size, self.info.dtype, self.device, max(sizes))
        model = self.model
        with torch.inference_mode():
            report = graphs.capture(sizes, lambda size: kernels.padding_batch(size, self.block_size),
                                    lambda b: model(b.input_ids, b.positions, self.kv_caches, b.meta),
                                    budget_bytes=2 * self.graph_reserve_bytes)
        kernels.graph_sizes = report.captured
        self.graphs = graphs
        log.info("cuda graphs captured", sizes=report.captured, skipped=report.skipped, stopped_by=report.stopped_by,
                 seconds=round(report.seconds, 2), pool_gib=round(report.pool_bytes / gpu_memory.GiB, 3),
                 max_seq_len=self.max_model_len)

    @torch.inference_mode()
    def execute(self, seqs: list[ScheduledSeq], placeholders: Placeholders | None = None) -> torch.Tensor:
        """Run one step; returns (num seqs with needs_logits, vocab) float32 logits, in order.

        1. The kernel set flattens the step (token ids, positions, attention metadata) on its device.
        2. The model runs over every new token, writing K/V into the pool, and returns the final hidden
           states of the tokens that need logits (its last layer's MLP runs on those alone); a decode step
           padded to a captured size replays its CUDA graph instead.
        3. The LM head runs on those rows (the last token of each seq that needs logits, or a whole chunk
           for prompt logprobs); logits come back on the CPU, or stay on the GPU for the device sampler.

        `placeholders` (async scheduling, troupe.core.overlap): `(dst, src, ids)`, the step's token indices
        whose id is the previous step's sample `ids[src]`, still on the device; written into the flattened
        ids there, after `prepare`, without a host read.
        """
        n_out = sum(len(s.token_ids) if s.prompt_logits else s.needs_logits for s in seqs)
        if not seqs:
            return torch.empty(0, self.vocab_size)
        if self.model is None:
            self.kernels.prepare(seqs, self.block_size)
            return self._null_rows(n_out)
        assert max(s.start_pos + len(s.token_ids) for s in seqs) <= self.max_model_len, "a seq runs past max_model_len"
        batch = self.kernels.prepare(seqs, self.block_size)
        if placeholders is not None:
            dst, src, ids = placeholders
            device = batch.input_ids.device
            batch.input_ids[_indices(dst, device)] = ids[_indices(src, ids.device)].to(device=device,
                                                                                      dtype=batch.input_ids.dtype)
        size = getattr(batch.meta, "graph_size", 0)
        if self.graphs is not None and size in self.graphs.graphs:
            hidden = self.graphs.replay(batch)  # (N, hidden): every row of a graph step is sampled
        else:
            rows = batch.logits_indices if n_out == len(batch.logits_indices) else _logits_rows(seqs)
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, rows)  # (N, hidden)
        logits = self.model.compute_logits(hidden)  # (N, vocab)
        return logits if self.device.type == "cuda" else logits.cpu()

    def _null_rows(self, n: int) -> torch.Tensor:
        """(n, vocab) logits picking `null_token_id`: rows of one tensor nobody writes (the sampler copies)."""
        if self._null_logits.shape[0] < n:
            logits = torch.zeros(max(n, 2 * self._null_logits.shape[0]), self.vocab_size)
            logits[:, self.null_token_id] = 1.0
            self._null_logits = logits
        return self._null_logits[:n]

    @torch.inference_mode()
    def execute_hidden(self, seqs: list[ScheduledSeq], rows: list[int]) -> torch.Tensor:
        """The pooling runner's step: the model over every new token (K/V written as in `execute`) and
        the final hidden states, after the final norm, of the step's tokens `rows` (increasing
        indices): (len(rows), hidden) in the model's dtype, on the model's device. No LM head, no
        CUDA graph. The null model returns zeros."""
        if self.model is None:
            return torch.zeros(len(rows), self.info.arch.hidden_size)  # (R, hidden)
        if not seqs:
            return torch.empty(0, self.info.arch.hidden_size)
        assert max(s.start_pos + len(s.token_ids) for s in seqs) <= self.max_model_len, "a seq runs past max_model_len"
        batch = self.kernels.prepare(seqs, self.block_size)
        n_tokens = sum(len(s.token_ids) for s in seqs)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta,
                          None if len(rows) == n_tokens else rows)  # (R, hidden)


def _indices(values: list[int], device: torch.device) -> torch.Tensor:
    """(len,) int64 on `device`. To a GPU through pinned memory, `non_blocking`: a copy from pageable memory
    would wait for the stream's earlier work, the very wait async scheduling removes."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _logits_rows(seqs: list[ScheduledSeq]) -> list[int]:
    """Token indices of the step whose logits are returned when some seq wants all of its chunk's."""
    rows: list[int] = []
    start = 0
    for s in seqs:
        n = len(s.token_ids)
        if s.prompt_logits:
            rows.extend(range(start, start + n))
        elif s.needs_logits:
            rows.append(start + n - 1)
        start += n
    return rows
