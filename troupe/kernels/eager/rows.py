"""`DecodeRowCache`: contiguous per-sequence K/V rows for the eager set's decode attention.

Besides the pool, each layer keeps a contiguous copy of every decoding sequence's context, one row per
sequence (`(rows, kv_heads, row_len, head_dim)`), so decode attention reads it in place instead of
gathering the blocks again in every layer of every step (`troupe.kernels.eager.attention`). A request
keeps its row only while it decodes in consecutive steps (its row then holds exactly `start_pos`
tokens); any other step drops it, and a new or returning decode gets a free row filled from the pool.

The cache is allocated once, on the first decode: `max_num_seqs` rows as long as the byte budget allows
(default: twice the pool's bytes, at least `ROW_CACHE_MIN_BYTES`; 0 turns the cache off), with
`torch.empty`, its pages zeroed only as decodes reach them, so memory grows with the longest decode seen;
a decode whose context is longer than a row gathers its blocks from the pool instead, in the same step.
Attention reads the rows in groups of `ROW_GROUP`, each up to its longest context, so rows are kept
sorted by context length: when the layout would read more than `ROW_SORT_SLACK` times the sorted one
(new decodes land in free rows anywhere), the kept rows are moved into length order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from troupe.kernels.base import KVSpec, ScheduledSeq
from troupe.kernels.eager.attention import ROW_GROUP, DecodeRows

ROW_LEN_STEP = 128  # row length is a multiple of this; rows are zeroed in steps of this many positions
ROW_CACHE_MIN_BYTES = 64 << 20  # the default budget: twice the pool's bytes, and at least this
ROW_SORT_SLACK = 1.25  # re-sort the rows by length when their layout reads this much more than sorted


def rows_read(rows: list[int], lens: list[int]) -> int:
    """Positions decode attention reads for this layout: each group of `ROW_GROUP` rows up to its longest
    context (`DecodeRows`), empty groups skipped."""
    group = ROW_GROUP
    longest: dict[int, int] = {}
    for r, n in zip(rows, lens, strict=True):
        longest[r // group] = max(longest.get(r // group, 0), n)
    return group * sum(longest.values())


class DecodeRowCache:
    """The row cache of one model (see the module docstring); `plan` is called once per step."""

    def __init__(self, spec: KVSpec, budget_bytes: int, kv_dtype: torch.dtype) -> None:
        self.spec = spec
        self.budget_bytes = budget_bytes
        self.dtype = kv_dtype
        self.k: list[torch.Tensor] = []  # per layer (RC, KVH, LC, D); empty: not allocated yet
        self.v: list[torch.Tensor] = []
        self.row_of: dict[str, tuple[int, int]] = {}  # request id -> (row, tokens it holds)
        self.clean = 0  # positions [0, this) of every row hold finite values

    @property
    def bytes_per_token(self) -> int:
        s = self.spec
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim * self.dtype.itemsize

    def plan(
        self, seqs: Sequence[ScheduledSeq], seq_lens: list[int], block_tables: torch.Tensor, starts: torch.Tensor
    ) -> DecodeRows | None:
        """Give each decode of this step a row (kept from the previous step when still valid); None when
        no decode fits a row (none this step, no budget, or longer than the rows). Decodes left without a
        row gather their context from the pool."""
        old, self.row_of = self.row_of, {}
        if not self._alloc():
            return None
        lc = self.k[0].shape[2]
        dec = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1 and seq_lens[i] <= lc]
        if not dec:
            return None
        kept = [old.get(seqs[i].request_id, (-1, -1)) for i in dec]
        rows = [row if held == seqs[i].start_pos else -1 for (row, held), i in zip(kept, dec, strict=True)]
        used = set(rows)
        free = (r for r in range(len(dec) + len(used)) if r not in used)
        refill = [j for j, row in enumerate(rows) if row < 0]
        for j in refill:
            rows[j] = next(free)
        lens = [seq_lens[i] for i in dec]
        self._clean(max(lens))
        if rows_read(rows, lens) > ROW_SORT_SLACK * rows_read(list(range(len(lens))), sorted(lens)):
            rows = self._sort(rows, lens, refill)
        for j, i in enumerate(dec):
            self.row_of[seqs[i].request_id] = (rows[j], lens[j])
        bs = self.spec.block_size
        refills = [(rows[j], block_tables[dec[j], : -(-lens[j] // bs)], lens[j]) for j in refill]
        return DecodeRows.build(self.k, self.v, starts[torch.tensor(dec)], rows, lens, refills, ROW_GROUP)

    def _sort(self, rows: list[int], lens: list[int], refill: list[int]) -> list[int]:
        """Give the decodes rows `0..B-1` in order of context length, moving the kept rows' contents
        (refilled ones are written from the pool later anyway); returns the new rows."""
        order = sorted(range(len(lens)), key=lens.__getitem__)
        new = [0] * len(rows)
        for r, j in enumerate(order):
            new[j] = r
        fresh = set(refill)
        moved = [j for j in range(len(rows)) if j not in fresh and rows[j] != new[j]]
        if moved:
            src, dst = torch.tensor([rows[j] for j in moved]), torch.tensor([new[j] for j in moved])
            held = max(lens[j] for j in moved) - 1  # what a kept row holds: all but this step's token
            for t in (*self.k, *self.v):
                t[dst, :, :held] = t[src, :, :held]  # the right side is a copy: cycles are safe
        return new

    def _alloc(self) -> bool:
        """Allocate the rows once: `max_num_seqs` rows (a decode step never has more), each as long as the
        budget allows (a multiple of `ROW_LEN_STEP`, at most the context length). False if not even
        `ROW_LEN_STEP` positions fit."""
        if self.k:
            return True
        s = self.spec
        rc = s.max_num_seqs
        lc = min(self.budget_bytes // (rc * self.bytes_per_token), -(-s.max_model_len // ROW_LEN_STEP) * ROW_LEN_STEP)
        lc -= lc % ROW_LEN_STEP
        if lc <= 0:
            return False
        shape = (rc, s.num_kv_heads, lc, s.head_dim)
        self.k = [torch.empty(shape, dtype=self.dtype) for _ in range(s.num_layers)]
        self.v = [torch.empty(shape, dtype=self.dtype) for _ in range(s.num_layers)]
        return True

    def _clean(self, length: int) -> None:
        """Make positions `[0, length)` of every row hold finite values: attention reads rows up to the
        longest decode and masks the rest, but a masked NaN would still poison the weighted sum. Zeroes
        new positions in steps of `ROW_LEN_STEP`; what a row held before stays (finite)."""
        if length <= self.clean:
            return
        end = min(-(-length // ROW_LEN_STEP) * ROW_LEN_STEP, self.k[0].shape[2])
        for t in (*self.k, *self.v):
            t[:, :, self.clean : end].zero_()
        self.clean = end
