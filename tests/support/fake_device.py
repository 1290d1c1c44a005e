"""A fake asynchronous device for async scheduling's tests (troupe.core.overlap.DeviceQueue): one worker
thread runs each launch in order, after a random delay drawn from a seeded generator, and the launch reads
its inputs (the step's sequences, the previous step's ids, the sampling rows) only when it runs. An engine
that changed an input after launching it, or read a result before it was ready, gives other tokens than
the synchronous engine; a correct one gives the same tokens whatever the delays."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class FakeAsyncDevice:
    def __init__(self, seed: int = 0, max_delay_s: float = 0.002) -> None:
        self._rng = random.Random(seed)
        self._max_delay_s = max_delay_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-device")
        self.launches = 0
        self.thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        delay = self._rng.uniform(0, self._max_delay_s)
        self.launches += 1

        def run() -> T:
            self.thread = threading.current_thread()
            time.sleep(delay)  # not a synchronisation: it only shuffles when the launch runs
            return fn()

        return self._pool.submit(run)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
