"""`StructuredOutputManager`: the engine's structured-output state, off the step path.

Contract (the engine core calls it; nothing here runs on the event loop):
- `submit(request_id, spec)` starts compiling the spec in one of the manager's `THREADS` worker threads
  (so one slow grammar delays no other), or reuses the
  compilation of an equal spec: compiled grammars are cached by `StructuredOutputsParams.key()`, the
  most recent `CACHE_SIZE` of them). Meanwhile the request waits in the scheduler's queue with the
  status `WAITING_FOR_FSM`, which admission skips.
- `poll()` returns the requests whose grammar is ready, each with its new `Matcher` (the engine keeps
  it on the request: `Request.matcher`), and those whose
  compilation failed, with the error text (only that request fails), a compilation still running
  `compile_timeout_s` after its request was submitted among them (the request fails; xgrammar cannot
  be interrupted, so the compilation runs on into the cache, holding its thread). The clock starts once
  the compiler exists (`_ready_at`): its one-time build is not a request's compile time. `wait(timeout)`
  blocks until one more is done or the timeout passes (the engine calls it only when it has nothing
  else to run).
- `forget(request_id)` drops a finished or aborted request's compilation (one no other request waits
  for is cancelled if it has not started, else left to finish into the cache).
- `close()` stops the worker threads (also done when the manager is garbage-collected).

The compiler (the model's tokenizer and xgrammar's view of its vocabulary) is built in the worker
thread on first use, so an engine that never sees a structured request never imports xgrammar.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from troupe.structured.backend import GrammarCompiler, Matcher
from troupe.structured.params import StructuredOutputsParams

CACHE_SIZE = 256
THREADS = 2


class StructuredOutputManager:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: list[int],
                 compile_timeout_s: float = 30.0) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self._submitted: dict[str, float] = {}
        self._compiler_lock = threading.Lock()
        self._stop_token_ids = list(stop_token_ids)
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: GrammarCompiler | None = None
        self._cache: OrderedDict[str, Future[Any]] = OrderedDict()
        self._pending: dict[str, Future[Any]] = {}
        self.num_compiled = 0  # compilations run (cache misses)
        self._ready_at: float | None = None  # when the compiler was built; no deadline runs before

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="troupe-grammar")
            weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        return self._pool

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        with self._compiler_lock:  # built once, by the first worker thread that needs it
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._load_tokenizer(), self.vocab_size, self._stop_token_ids)
                self._ready_at = time.monotonic()
            self.num_compiled += 1
        return self._compiler.compile(spec)  # xgrammar's compiler is thread-safe

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
        self._submitted[request_id] = time.monotonic()

    @property
    def num_waiting(self) -> int:
        return len(self._pending)

    def is_waiting(self, request_id: str) -> bool:
        return request_id in self._pending

    def poll(self) -> tuple[dict[str, Matcher], dict[str, str]]:
        """({ready request id: its matcher}, {failed request id: error}), in submission order."""
        ready: dict[str, Matcher] = {}
        failed: dict[str, str] = {}
        now = time.monotonic()
        for rid, future in list(self._pending.items()):
            if not future.done():
                if self._ready_at is not None and now - self._deadline_base(rid) > self.compile_timeout_s:
                    self.forget(rid)
                    failed[rid] = (f"grammar compilation took over {self.compile_timeout_s:g} s "
                                   "(grammar_compile_timeout_s)")
                continue
            del self._pending[rid]
            del self._submitted[rid]
            exc = future.exception()
            if exc is not None:
                failed[rid] = f"grammar compilation failed: {type(exc).__name__}: {exc}"
                continue
            try:
                ready[rid] = Matcher(future.result())
            except Exception as exc:  # this request's own failure
                failed[rid] = f"grammar matcher failed: {type(exc).__name__}: {exc}"
        return ready, failed

    def _deadline_base(self, request_id: str) -> float:
        """When `request_id`'s compile deadline started: its submission, or the compiler's build if later."""
        return max(self._submitted[request_id], self._ready_at or 0.0)

    def wait(self, timeout: float) -> None:
        if self._pending:
            due = timeout if self._ready_at is None else \
                min(map(self._deadline_base, self._pending)) + self.compile_timeout_s - time.monotonic()
            wait_futures(list(self._pending.values()), timeout=max(0.0, min(timeout, due)),
                         return_when=FIRST_COMPLETED)

    def forget(self, request_id: str) -> None:
        future = self._pending.pop(request_id, None)
        self._submitted.pop(request_id, None)
        if future is not None and not any(f is future for f in self._pending.values()) and future.cancel():
            for key, cached in list(self._cache.items()):  # never started: nobody else will get it
                if cached is future:
                    del self._cache[key]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
