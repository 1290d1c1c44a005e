"""The contract between the scheduler/engine and the model runner for one step.

The engine turns a scheduler decision into a list of `ScheduledSeq` (one per scheduled request, in
the order the scheduler chose) and calls `ModelRunner.execute(seqs)`, which returns float32 logits,
in the same order: one row per entry whose `needs_logits` is True, except that an entry with
`prompt_logits` gets one row per token of its chunk (row j: the logits after token j; the last row
is the one sampled from when it also `needs_logits`). The engine asks `prompt_logits` only for
requests that want prompt logprobs (`SamplingParams.prompt_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # tokens to compute this step: positions start_pos .. start_pos + len - 1
    start_pos: int  # tokens of this request already in the KV cache (num_computed_tokens)
    block_ids: list[int]  # the request's whole block table; covers start_pos + len(token_ids) tokens
    needs_logits: bool  # this chunk ends at the last known token: a new token is sampled after it
    prompt_logits: bool = False  # logits at every token of the chunk (prompt logprobs)
    placeholder: bool = False  # async scheduling: its last token is the previous step's sample, still on the
    # device (token_ids holds 0 there; the runner writes the sampled id in on the device: troupe.core.overlap)
