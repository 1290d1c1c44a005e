"""Async scheduling (troupe.core.overlap) against the synchronous engine, on the tiny random Llama: the same
requests give the same tokens, logprobs, finish reasons and errors in both modes, with the async engine's
launches run by a fake asynchronous device (tests/support/fake_device.py: a worker thread, random delays,
inputs read late). Covered: greedy, seeded sampling, penalties, logit bias, allowed ids, min_tokens, stop ids,
EOS, max_tokens of 1 to 3 (the length look-ahead), logprobs and prompt logprobs, a structured output, chunked
prefill, preemption, aborts, a request whose sampling fails alone (the batched sampling's fallback, and the
next forward's placeholders then taken from the host), and no host read of the device inside the launch
phase."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from support.fake_device import FakeAsyncDevice

from troupe.config import EngineConfig
from troupe.core.engine_core import EngineCore
from troupe.core.overlap import AsyncStepper
from troupe.errors import InvalidInputError
from troupe.messages import AddRequest, FinishReason
from troupe.sampling_params import SamplingParams
from troupe.structured import StructuredOutputsParams

ENGINE: dict[str, Any] = dict(dtype="float32", max_model_len=160, num_threads=1, max_num_batched_tokens=48,
                              num_kv_blocks=96, enable_prefix_caching=True)
Result = dict[str, Any]


def make_core(model: Path, mode: str, seed: int = 0, **options: Any) -> EngineCore:
    config = EngineConfig(model=str(model), async_scheduling=mode == "async", **{**ENGINE, **options})
    return EngineCore(config, device_queue=FakeAsyncDevice(seed) if mode == "async" else None)


def add(rid: str, prompt: list[int], max_tokens: int = 16, eos: list[int] | None = None, **params: Any) -> AddRequest:
    return AddRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), max_tokens,
                      eos_token_ids=eos or [], external_id=rid)


def run(core: EngineCore, requests: list[AddRequest],
        between_steps: Callable[[int, EngineCore], None] | None = None) -> dict[str, Result]:
    """Every request's tokens, logprobs, prompt logprobs, finish reason and error; `between_steps(k, core)`
    runs before step k (from 1)."""
    got: dict[str, Result] = {r.request_id: {"tokens": [], "logprobs": [], "prompt": None, "finish": None,
                                             "error": None} for r in requests}
    for r in requests:
        core.add_request(r)
    k = 0
    try:
        while core.has_unfinished_requests():
            k += 1
            if between_steps is not None:
                between_steps(k, core)
            for o in core.step().outputs:
                g = got[o.request_id]
                g["tokens"] += o.new_token_ids
                if o.new_logprobs is not None:
                    g["logprobs"].append(o.new_logprobs)
                if o.prompt_logprobs is not None:
                    g["prompt"] = o.prompt_logprobs
                if o.finish_reason is not None:
                    g["finish"], g["error"] = o.finish_reason, o.error
            assert k < 2000, "the engine does not finish"
    finally:
        core.close()
    return got


@pytest.fixture(scope="module")
def greedy_tokens(tiny_llama: Path) -> list[int]:
    """What the model generates greedily after [11, 12, 13] (picks stop and EOS tokens that do occur)."""
    out = run(make_core(tiny_llama, "sync"), [add("g", [11, 12, 13], max_tokens=12, temperature=0.0)])
    return out["g"]["tokens"]


def mixed_requests(tokens: list[int]) -> list[AddRequest]:
    stop, eos = tokens[5], tokens[3]
    prompt = [11, 12, 13]
    long = list(range(100, 170))  # 70 tokens: two prefill chunks of 48
    return [
        add("greedy", long, 20, temperature=0.0),
        add("seeded", [7, 8, 9, 10], 20, temperature=1.0, top_p=0.9, top_k=50, seed=7),
        add("penalties", [7, 8, 9], 20, temperature=0.8, seed=3, repetition_penalty=1.3, frequency_penalty=0.5,
            presence_penalty=0.3),
        add("logprobs", list(range(40, 75)), 10, temperature=0.0, logprobs=3, prompt_logprobs=2),
        add("stop-id", prompt, 20, temperature=0.0, stop_token_ids=[stop]),
        add("eos", prompt, 20, eos=[eos], temperature=0.0),
        add("min-tokens", prompt, 20, eos=[eos], temperature=0.0, min_tokens=8),
        add("bias", [21, 22], 12, temperature=0.0, logit_bias={500: 4.0, 501: 3.5}),
        add("allowed", [23, 24], 12, temperature=1.0, seed=5, allowed_token_ids=[500, 600, 700, 800]),
        add("one", [31, 32], 1, temperature=0.0),
        add("two", [33], 2, temperature=1.0, seed=11),
        add("three", list(range(200, 260)), 3, temperature=0.0),
        add("regex", [41, 42, 43], 12, temperature=0.0,
            structured_outputs=StructuredOutputsParams(regex="(yes|no|maybe)[0-9]{2,4}")),
    ]


@pytest.mark.parametrize("seed", [0, 1])
def test_async_gives_the_sync_engines_outputs(tiny_llama: Path, greedy_tokens: list[int], seed: int) -> None:
    """Every request of a mixed batch outputs the same in both modes, under two delay schedules."""
    sync = run(make_core(tiny_llama, "sync"), mixed_requests(greedy_tokens))
    core = make_core(tiny_llama, "async", seed)
    assert core.stepper is not None and isinstance(core.stepper.queue, FakeAsyncDevice)
    device = core.stepper.queue
    asynchronous = run(core, mixed_requests(greedy_tokens))
    assert asynchronous == sync
    stop, eos = greedy_tokens[5], greedy_tokens[3]
    assert sync["stop-id"]["finish"] == FinishReason.STOP and sync["stop-id"]["tokens"][-1] == stop
    assert sync["eos"]["finish"] == FinishReason.STOP and len(sync["eos"]["tokens"]) == greedy_tokens.index(eos) + 1
    assert len(sync["min-tokens"]["tokens"]) > 8 or sync["min-tokens"]["finish"] == FinishReason.LENGTH
    assert [len(sync[r]["tokens"]) for r in ("one", "two", "three")] == [1, 2, 3]
    assert sync["regex"]["finish"] == FinishReason.STOP and sync["logprobs"]["prompt"] is not None
    assert device.launches > 20 and device.thread is not None and device.thread is not threading.current_thread()


def test_preemption_gives_the_same_tokens(tiny_llama: Path) -> None:
    """A pool too small for the batch preempts (and recomputes) requests in both modes; greedy and seeded
    tokens are the same, and the async engine preempted too."""
    requests = lambda: [add(f"r{i}", list(range(50 + 7 * i, 80 + 7 * i)), 40,  # noqa: E731
                            temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(6)]
    options = dict(num_kv_blocks=14, enable_prefix_caching=False)
    sync_core = make_core(tiny_llama, "sync", **options)
    sync = run(sync_core, requests())
    async_core = make_core(tiny_llama, "async", 3, **options)
    preemptions: list[int] = []
    asynchronous = run(async_core, requests(), lambda k, core: preemptions.append(core.scheduler.num_preemptions))
    assert asynchronous == sync
    assert sync_core.scheduler.num_preemptions > 0 and max(preemptions) > 0
    assert all(len(r["tokens"]) == 40 for r in sync.values())


def test_aborts_leave_the_other_requests_as_they_were(tiny_llama: Path) -> None:
    """Two requests aborted mid-decode stop (what they output is a prefix of their full run) and free
    their blocks; the others' tokens are those of the run without aborts."""
    requests = lambda: [add(f"r{i}", [60 + i, 61, 62], 24, temperature=0.7, seed=20 + i)  # noqa: E731
                        for i in range(5)]
    full = run(make_core(tiny_llama, "sync"), requests())

    def abort(k: int, core: EngineCore) -> None:
        if k == 6:
            assert core.abort_requests(["r1", "r3"]) == ["r1", "r3"]

    for mode in ("sync", "async"):
        core = make_core(tiny_llama, mode, 5)
        got = run(core, requests(), abort)
        assert core.kv.num_free_blocks == core.kv.num_usable_blocks
        for rid, result in got.items():
            if rid in ("r1", "r3"):
                assert 0 < len(result["tokens"]) < 24 and full[rid]["tokens"][:len(result["tokens"])] == result["tokens"]
            else:
                assert result == full[rid], (mode, rid)


def test_a_request_whose_sampling_fails_fails_alone(tiny_llama: Path) -> None:
    """A request left with no token (its only allowed id is EOS, which min_tokens suppresses) fails the
    batched sampling; its rows are sampled one by one, it alone ends with the error, and in the async engine
    the next forward, launched before, gets its placeholders' ids from the host's sampling."""
    def requests() -> list[AddRequest]:
        return [add("ok-a", [5, 6, 7], 8, temperature=0.0), add("ok-b", [8, 9], 8, temperature=0.9, seed=4),
                add("bad", [1, 2], 8, eos=[2], temperature=0.0, min_tokens=3, allowed_token_ids=[2])]
    sync = run(make_core(tiny_llama, "sync"), requests())
    asynchronous = run(make_core(tiny_llama, "async", 2), requests())
    assert asynchronous == sync
    assert sync["bad"]["finish"] == FinishReason.ERROR and "every token is masked" in sync["bad"]["error"]
    assert len(sync["ok-a"]["tokens"]) == 8 and len(sync["ok-b"]["tokens"]) == 8


SYNCING = ("tolist", "item", "cpu", "numpy")


class HostReads:
    """Records every `Tensor.tolist/item/cpu/numpy` the host thread calls inside `AsyncStepper.step`, except
    in `_finish` (reading step N's ids back is its one wait) and in a forward the host reruns itself."""

    def __init__(self, host: threading.Thread) -> None:
        self.host = host
        self.seen: list[str] = []
        self._state = threading.local()

    def during_launch(self, fn: Callable[..., Any], launching: bool = True) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            before = getattr(self._state, "launching", False)
            self._state.launching = launching
            try:
                return fn(*args, **kwargs)
            finally:
                self._state.launching = before
        return wrapped

    def _guarded(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is self.host and getattr(self._state, "launching", False):
                self.seen.append(name)
            return real(tensor, *args, **kwargs)
        return call

    @contextmanager
    def installed(self) -> Iterator[HostReads]:
        originals = {name: getattr(torch.Tensor, name) for name in SYNCING}
        methods = {name: getattr(AsyncStepper, name) for name in ("step", "_finish", "_forward_result")}
        try:
            for name, real in originals.items():
                setattr(torch.Tensor, name, self._guarded(name, real))
            AsyncStepper.step = self.during_launch(methods["step"])  # type: ignore[method-assign]
            AsyncStepper._finish = self.during_launch(methods["_finish"], False)  # type: ignore[method-assign]
            AsyncStepper._forward_result = self.during_launch(methods["_forward_result"], False)  # type: ignore[method-assign]
            yield self
        finally:
            for name, real in originals.items():
                setattr(torch.Tensor, name, real)
            for name, method in methods.items():
                setattr(AsyncStepper, name, method)


def test_the_launch_phase_never_reads_the_device(tiny_llama: Path, greedy_tokens: list[int]) -> None:
    """Scheduling, placeholders, sampling rows and both launches run on the host without one read of a
    device result (prompt logprobs, which read the logits on purpose, left out); the guard itself catches
    a read made inside the launch phase, so it can fail."""
    requests = [r for r in mixed_requests(greedy_tokens) if r.params.prompt_logprobs is None]
    with HostReads(threading.current_thread()).installed() as guard:
        asynchronous = run(make_core(tiny_llama, "async", 1), requests)
        assert guard.seen == []
        guard.during_launch(lambda: torch.zeros(2).tolist())()
        assert guard.seen == ["tolist"]
    assert all(r["finish"] is not None for r in asynchronous.values())


def test_async_scheduling_is_refused_for_pooling(tiny_llama: Path) -> None:
    with pytest.raises(InvalidInputError, match="async_scheduling: applies to generation"):
        EngineConfig(model=str(tiny_llama), runner="pooling", async_scheduling=True)
    with pytest.raises(InvalidInputError, match="async_scheduling: must be true or false"):
        EngineConfig(model=str(tiny_llama), async_scheduling=1)  # type: ignore[arg-type]
