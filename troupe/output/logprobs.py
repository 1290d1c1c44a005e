"""The frontend's logprobs of one request: engine rows -> `Logprob` dicts, sliced per output kind.

`LogprobsState` (None for a request that asked for no logprobs) collects the rows of each
`EngineCoreOutput` (`update`) and puts them on the request's outputs (`attach`):

- `CompletionOutput.logprobs` is aligned with `token_ids`: all rows so far (CUMULATIVE, FINAL_ONLY) or
  the rows not sent yet (DELTA); `cumulative_logprob` is the running sum of the chosen tokens'
  logprobs;
- `RequestOutput.prompt_logprobs` (None first, then one dict per prompt token) goes on every output
  (CUMULATIVE, FINAL_ONLY) or only on the first one (DELTA, vLLM's rule).

Each dict holds the chosen token (its rank from the engine) and the top-k with ranks 1..k, in that
order, with `decoded_token` the token's own text (`tokenizer.decode([id])`, cached per tokenizer), or
None when the request does not detokenize.
"""

from __future__ import annotations

from typing import Any

from troupe.messages import EngineCoreOutput, LogprobsLists
from troupe.outputs import Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from troupe.sampling_params import RequestOutputKind, SamplingParams

_DECODED_CACHE_SIZE = 1 << 17


class TokenTexts:
    """`decode([id])` of a tokenizer, memoised (a whole-vocabulary `logprobs=-1` decodes every id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) or ""
            if len(self._cache) < _DECODED_CACHE_SIZE:
                self._cache[token_id] = text
        return text


def _dicts(rows: LogprobsLists, texts: TokenTexts | None) -> list[dict[int, Logprob]]:
    out = []
    for ids, values, rank in zip(rows.token_ids, rows.logprobs, rows.ranks, strict=True):
        d: dict[int, Logprob] = {}
        for j, (t, v) in enumerate(zip(ids, values, strict=True)):
            d[t] = Logprob(v, rank if j == 0 else j, texts(t) if texts is not None else None)
        if ids and d[ids[0]].rank != rank:  # the chosen token was also in the top-k: keep its own rank
            d[ids[0]] = Logprob(values[0], rank, d[ids[0]].decoded_token)
        out.append(d)
    return out


class LogprobsState:
    __slots__ = ("texts", "kind", "sample", "prompt", "cumulative", "sent", "prompt_sent")

    def __init__(self, texts: TokenTexts | None, params: SamplingParams) -> None:
        self.texts = texts
        self.kind = params.output_kind
        self.sample: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.prompt: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None
        self.cumulative = 0.0
        self.sent = 0  # DELTA: sample rows already sent
        self.prompt_sent = False

    def update(self, eco: EngineCoreOutput) -> None:
        if eco.new_logprobs is not None and self.sample is not None:
            rows = _dicts(eco.new_logprobs, self.texts)
            self.sample.extend(rows)
            self.cumulative += sum(values[0] for values in eco.new_logprobs.logprobs)
        if eco.prompt_logprobs is not None and self.prompt is not None:
            self.prompt.extend(_dicts(eco.prompt_logprobs, self.texts))

    def attach(self, out: RequestOutput) -> None:
        """Put this request's logprobs on `out` (one sample), sliced for its output kind."""
        completion = out.outputs[0]
        if self.sample is not None:
            if self.kind is RequestOutputKind.DELTA:
                completion.logprobs = self.sample[self.sent:]
                self.sent = len(self.sample)
            else:
                completion.logprobs = list(self.sample)
            completion.cumulative_logprob = self.cumulative
        if self.prompt is not None and not (self.kind is RequestOutputKind.DELTA and self.prompt_sent):
            out.prompt_logprobs = self.prompt
            self.prompt_sent = True


def make_logprobs_state(tokenizer: Any, params: SamplingParams, texts: dict[int, TokenTexts]) -> LogprobsState | None:
    """The request's state, or None when it asked for no logprobs. `texts` caches one `TokenTexts`
    per tokenizer (by id)."""
    if params.logprobs is None and params.prompt_logprobs is None:
        return None
    decoder = None
    if tokenizer is not None and params.detokenize:
        decoder = texts.setdefault(id(tokenizer), TokenTexts(tokenizer))
    return LogprobsState(decoder, params)
