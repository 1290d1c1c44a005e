"""`troupe.kernels.base.flatten_step` against a reference built with torch ops over the same seqs (the
former implementation: a position range per seq, each token's seq by `repeat_interleave`, the slots
gathered from the padded block tables), on random mixed steps: prefill chunks starting mid-block, decodes,
contexts past several blocks, seqs with and without logits, block tables longer than the step needs."""

from __future__ import annotations

import random

import pytest
import torch

from troupe.core.batch import ScheduledSeq
from troupe.kernels.base import AttentionMetadata, StepBatch, flatten_step


def reference(seqs: list[ScheduledSeq], bs: int) -> StepBatch:
    lens = [len(s.token_ids) for s in seqs]
    seq_lens = [s.start_pos + n for s, n in zip(seqs, lens, strict=True)]
    width = max(-(-n // bs) for n in seq_lens)
    tables = torch.tensor([s.block_ids[:width] + [0] * (width - len(s.block_ids[:width])) for s in seqs])
    positions = torch.cat([torch.arange(s.start_pos, n) for s, n in zip(seqs, seq_lens, strict=True)])
    seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lens))
    query_start_loc = torch.tensor([0, *lens]).cumsum(0)
    wanted = torch.tensor([s.needs_logits for s in seqs], dtype=torch.bool)
    meta = AttentionMetadata(slot_mapping=tables[seq_of_token, positions // bs] * bs + positions % bs,
                             query_start_loc=query_start_loc, seq_lens=torch.tensor(seq_lens), block_tables=tables,
                             max_query_len=max(lens), max_seq_len=max(seq_lens))
    return StepBatch(torch.tensor([t for s in seqs for t in s.token_ids]), positions, meta,
                     query_start_loc[1:][wanted] - 1)


def random_step(rnd: random.Random, bs: int) -> list[ScheduledSeq]:
    seqs = []
    free = list(range(1, 4000))
    rnd.shuffle(free)
    for i in range(rnd.randint(1, 40)):
        start = rnd.choice([0, rnd.randint(0, 3 * bs), rnd.randint(0, 40 * bs)])
        n = 1 if rnd.random() < 0.6 else rnd.randint(1, 5 * bs)
        blocks = -(-(start + n) // bs) + rnd.randint(0, 2)  # the table may run past what the step needs
        seqs.append(ScheduledSeq(f"r{i}", [rnd.randrange(50000) for _ in range(n)], start,
                                 [free.pop() for _ in range(blocks)], needs_logits=rnd.random() < 0.7))
    return seqs


@pytest.mark.parametrize("bs", [1, 5, 16])
def test_flatten_step_matches_the_torch_reference(bs: int) -> None:
    rnd = random.Random(bs)
    for _ in range(60):
        seqs = random_step(rnd, bs)
        got, want = flatten_step(seqs, bs), reference(seqs, bs)
        for name in ("input_ids", "positions", "logits_indices"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b), name
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            a, b = getattr(got.meta, name), getattr(want.meta, name)
            assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b), name
        assert (got.meta.max_query_len, got.meta.max_seq_len) == (want.meta.max_query_len, want.meta.max_seq_len)


def test_no_seq_needs_logits_gives_an_empty_int64_index() -> None:
    seqs = [ScheduledSeq("a", [1, 2, 3], 0, [7], needs_logits=False)]
    batch = flatten_step(seqs, 16)
    assert batch.logits_indices.dtype == torch.int64 and batch.logits_indices.numel() == 0
    assert batch.meta.slot_mapping.tolist() == [112, 113, 114]
