"""`StructuredOutputManager`: the engine's structured-output state, off the step path.

Contract (the engine core calls it; nothing here runs on the event loop):
- `submit(request_id, spec)` starts compiling the spec in the manager's worker thread (or reuses the
  compilation of an equal spec: compiled grammars are cached by `StructuredOutputsParams.key()`, the
  most recent `CACHE_SIZE` of them). The request waits outside the scheduler until it is ready
  (vLLM's WAITING_FOR_FSM).
- `poll()` returns the requests whose grammar is ready (each now has a `Matcher`) and those whose
  compilation failed, with the error text (only that request fails); `wait(timeout)` blocks until one
  more is done or the timeout passes (the engine calls it only when it has nothing else to run).
- `matcher(request_id)` is the request's matcher once ready; `forget(request_id)` drops a finished or
  aborted request (a compilation in flight is left to finish into the cache).
- `close()` stops the worker thread (also done when the manager is garbage-collected).

The compiler (the model's tokenizer and xgrammar's view of its vocabulary) is built in the worker
thread on first use, so an engine that never sees a structured request never imports xgrammar.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from troupe.structured.backend import GrammarCompiler, Matcher
from troupe.structured.params import StructuredOutputsParams

CACHE_SIZE = 256


class StructuredOutputManager:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: list[int]) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: GrammarCompiler | None = None
        self._cache: OrderedDict[str, Future[Any]] = OrderedDict()
        self._pending: dict[str, Future[Any]] = {}
        self._matchers: dict[str, Matcher] = {}
        self.num_compiled = 0  # compilations run (cache misses)

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="troupe-grammar")
            weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        return self._pool

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        if self._compiler is None:  # only the worker thread touches it
            self._compiler = GrammarCompiler(self._load_tokenizer(), self.vocab_size, self._stop_token_ids)
        self.num_compiled += 1
        return self._compiler.compile(spec)

    def submit(self, request_id: str, spec: StructuredOutputsParams) -> None:
        key = spec.key()
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._worker().submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        self._pending[request_id] = future

    @property
    def num_waiting(self) -> int:
        return len(self._pending)

    def is_waiting(self, request_id: str) -> bool:
        return request_id in self._pending

    def poll(self) -> tuple[list[str], dict[str, str]]:
        """(ready request ids, {failed request id: error}), in submission order."""
        ready: list[str] = []
        failed: dict[str, str] = {}
        for rid, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[rid]
            exc = future.exception()
            if exc is not None:
                failed[rid] = f"grammar compilation failed: {type(exc).__name__}: {exc}"
                continue
            try:
                self._matchers[rid] = Matcher(future.result())
            except Exception as exc:  # this request's own failure
                failed[rid] = f"grammar matcher failed: {type(exc).__name__}: {exc}"
                continue
            ready.append(rid)
        return ready, failed

    def wait(self, timeout: float) -> None:
        if self._pending:
            wait_futures(list(self._pending.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def matcher(self, request_id: str) -> Matcher | None:
        return self._matchers.get(request_id)

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
