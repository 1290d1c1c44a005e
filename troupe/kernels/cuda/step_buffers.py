"""`StepBuffers`: one step's inputs, built on the host in fixed (pinned) buffers and copied to fixed device
buffers without a host sync, in the layout the CUDA kernel set's ops and its CUDA graphs read.

Per step the host fills, from the scheduled sequences (`troupe.core.batch.ScheduledSeq`): token ids,
positions, slots (T,); seq_lens (S,); query_start_loc (S+1,); logits_indices (N,) (int64), and the block
tables (int32). Two copies go to the device, both `non_blocking` from pinned memory, and nothing waits
for them: the step's only sync is the sampled ids coming back.

Two layouts share the same device memory:

- eager steps pack the int64 arrays one after the other (`ids | positions | slots | seq_lens |
  query_start_loc | logits_indices`), and the tables as one contiguous (S, w) array, w = this step's
  widest table; only the used prefix of each buffer is copied;
- decode steps padded to a captured CUDA-graph size B (`fill(..., pad_to=B)`) use fixed offsets
  instead: region r starts at `r * (graph_rows + 1)` whatever B is, and the tables are rows of a (graph_rows, W)
  array, W = `max_blocks_per_seq`; so the views a graph captured stay the views every later step of that
  size writes. Rows past the real ones are padding: token 0 at position 0, slot -1 (no KV write),
  seq_len 0 (attention reads nothing, outputs zeros), table row 0.

A step that does not fit (more tokens, sequences or blocks than sized for) gets `None`: the caller falls
back to building it with `flatten_step`. The host side of each step comes from torch's caching pinned
allocator, which hands a block out again only once the copies that read it are done: no host wait,
not even for a step that samples nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from troupe.kernels.base import AttentionMetadata, ScheduledSeq, StepBatch

NUM_REGIONS = 6  # ids, positions, slots, seq_lens, query_start_loc, logits_indices


@dataclass(slots=True)
class CudaMetadata(AttentionMetadata):
    """`AttentionMetadata` plus what the runner needs to know of a padded step."""

    num_seqs: int = 0  # the real sequences (rows past them are padding)
    graph_size: int = 0  # the CUDA-graph batch this step is padded to (0: an eager step)


class StepBuffers:
    """Host staging and device buffers for steps of up to `max_tokens` tokens, `max_seqs` sequences and
    `max_blocks_per_seq` blocks each; graphs use up to `graph_rows` rows (see the module docstring)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, graph_rows: int,
                 device: torch.device) -> None:
        self.max_tokens = max(max_tokens, max_seqs)
        self.max_seqs = max_seqs
        self.max_blocks = max_blocks_per_seq
        self.graph_rows = graph_rows
        self.device = device
        self.pinned = device.type == "cuda"
        self.region = graph_rows + 1  # a graph step's region stride (query_start_loc holds rows + 1)
        small = max(3 * self.max_tokens + 3 * max_seqs + 1, NUM_REGIONS * self.region)
        tables = max(max_seqs, graph_rows) * max_blocks_per_seq
        self.dev = torch.zeros(small, dtype=torch.int64, device=device)
        self.dev_tables = torch.zeros(tables, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        """Device bytes held (the host holds as many again, pinned)."""
        return self.dev.numel() * 8 + self.dev_tables.numel() * 4

    def fits(self, seqs: Sequence[ScheduledSeq], block_size: int, pad_to: int = 0) -> bool:
        rows = max(pad_to, len(seqs))
        tokens = sum(len(s.token_ids) for s in seqs) + rows - len(seqs)
        widest = max((-(-(s.start_pos + len(s.token_ids)) // block_size) for s in seqs), default=1)
        limit = self.graph_rows if pad_to else self.max_seqs
        return 0 < rows <= limit and tokens <= self.max_tokens and widest <= self.max_blocks

    def fill(self, seqs: Sequence[ScheduledSeq], block_size: int, pad_to: int = 0,
             max_seq_len: int = 0) -> StepBatch | None:
        """The step as views of the device buffers, copies queued; None if it does not fit.

        `pad_to`: pad to this many one-token rows in the fixed graph layout (every seq must bring one
        token); `max_seq_len`: the host bound the attention launcher gets (0: this step's longest)."""
        if not self.fits(seqs, block_size, pad_to):
            return None
        n = len(seqs)
        S = max(pad_to, n)
        lens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)  # (n,)
        starts = np.fromiter((s.start_pos for s in seqs), np.int64, n)  # (n,)
        T_real = int(lens.sum())
        T = T_real + S - n  # a padding row is one token
        assert not pad_to or T == S, "a graph step brings one token per sequence"
        seq_lens = starts + lens  # (n,)
        width = int((-(-seq_lens // block_size)).max(initial=1))  # the widest table this step
        # int64 regions: fixed offsets for a graph step, packed for an eager one
        if pad_to:
            offsets = [r * self.region for r in range(NUM_REGIONS)]
        else:
            sizes = [T, T, T, S, S + 1]
            offsets = [0, *np.cumsum(sizes).tolist()]
        o_ids, o_pos, o_slot, o_len, o_qsl, o_out = offsets
        used = NUM_REGIONS * self.region if pad_to else offsets[-1] + n  # logits rows: at most n
        host = torch.empty(used, dtype=torch.int64, pin_memory=self.pinned)
        host_tables = torch.empty(S * width, dtype=torch.int32, pin_memory=self.pinned)
        h = host.numpy()
        if pad_to:
            h[:] = 0  # a graph step's whole layout is copied: nothing uninitialised between the regions
        qsl = h[o_qsl:o_qsl + S + 1]
        qsl[0] = 0
        np.cumsum(lens, out=qsl[1:n + 1])
        qsl[n + 1:] = T_real + np.arange(1, S - n + 1)
        seq_of_token = np.repeat(np.arange(n), lens)  # (T_real,)
        positions = np.arange(T_real) - qsl[seq_of_token] + starts[seq_of_token]  # (T_real,)
        h[o_ids:o_ids + T_real] = np.fromiter(chain.from_iterable(s.token_ids for s in seqs), np.int64, T_real)
        h[o_pos:o_pos + T_real] = positions
        h[o_len:o_len + n] = seq_lens
        h[o_ids + T_real:o_ids + T] = 0
        h[o_pos + T_real:o_pos + T] = 0
        h[o_len + n:o_len + S] = 0
        # block tables: (S, width) contiguous on the host
        tables = host_tables.numpy().reshape(S, width)
        tables[:] = 0
        rows = [s.block_ids[:width] for s in seqs]  # filled through one mask: a numpy row assignment per
        counts = np.fromiter(map(len, rows), np.int64, n)  # seq was most of this method's time
        tables[:n][np.arange(width) < counts[:, None]] = np.fromiter(chain.from_iterable(rows), np.int32,
                                                                      int(counts.sum()))
        blocks = tables[seq_of_token, positions // block_size].astype(np.int64)  # (T_real,)
        h[o_slot:o_slot + T_real] = blocks * block_size + positions % block_size
        h[o_slot + T_real:o_slot + T] = -1
        wanted = np.fromiter((s.needs_logits for s in seqs), bool, n)
        out_rows = qsl[1:n + 1][wanted] - 1  # (N,)
        N = len(out_rows)
        h[o_out:o_out + N] = out_rows
        # the copies: the int64 layout in use, then the tables
        self.dev[:used].copy_(host, non_blocking=True)
        staged = host_tables.view(S, width)
        if pad_to:
            dev_tables = self.dev_tables[:self.graph_rows * self.max_blocks].view(self.graph_rows, self.max_blocks)
            dev_tables[:S, :width].copy_(staged, non_blocking=True)
            dev_tables = dev_tables[:S]  # (S, W): stride W, the graph's fixed view
        else:
            dev_tables = self.dev_tables[:S * width].view(S, width)
            dev_tables.copy_(staged, non_blocking=True)
        d = self.dev
        meta = CudaMetadata(
            slot_mapping=d[o_slot:o_slot + T], query_start_loc=d[o_qsl:o_qsl + S + 1],
            seq_lens=d[o_len:o_len + S], block_tables=dev_tables,
            max_query_len=int(lens.max(initial=1)), max_seq_len=max_seq_len or int(seq_lens.max(initial=1)),
            num_seqs=n, graph_size=pad_to,
        )
        return StepBatch(input_ids=d[o_ids:o_ids + T], positions=d[o_pos:o_pos + T], meta=meta,
                         logits_indices=d[o_out:o_out + N])
