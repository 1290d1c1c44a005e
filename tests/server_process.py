"""`ServerProcess`: a real `troupe serve` subprocess for tests, on a free loopback port.

The server binds port 0 and prints `troupe serve: http://HOST:PORT` first thing; the helper reads
that line, then polls `/health` until 200 (start-up polling with a deadline, not a sleep), and
on the way out (`with`, even when the test failed) terminates it, then kills it if it lingers:
no orphan processes. stdout/stderr go to files under the test's tmp dir, shown on failure.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

_URL = re.compile(r"troupe serve: (http://\S+)")
STARTUP_TIMEOUT_S = 180.0


class ServerProcess:
    def __init__(self, args: list[str], log_dir: Path, *, api_key: str | None = None,
                 module: list[str] | None = None, wait_healthy: bool = True,
                 env: dict[str, str] | None = None) -> None:
        self.args = args
        self.api_key = api_key
        self.log_dir = log_dir
        self.module = module or ["-m", "troupe.cli", "serve"]
        self.wait_healthy = wait_healthy
        self.env = {"TROUPE_LOG_FORMAT": "json", **(env or {})}  # JSON lines unless the test says otherwise
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> ServerProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._out = open(self.log_dir / "stdout.txt", "wb")
        self._err = open(self.log_dir / "stderr.txt", "wb")
        cmd = [sys.executable, *self.module, *self.args, "--host", "127.0.0.1", "--port", "0"]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        env = {**os.environ, **self.env}
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=self._err, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._out.close()
        self._err.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.url:
            self._check_alive("before printing its address")
            m = _URL.search((self.log_dir / "stdout.txt").read_text())
            if m:
                self.url = m.group(1)
            elif time.monotonic() > deadline:
                raise TimeoutError(f"no address printed in {STARTUP_TIMEOUT_S} s\n{self.stderr_tail()}")
            else:
                time.sleep(0.05)
        if not self.wait_healthy:
            return
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while True:
                self._check_alive("during start-up")
                try:
                    if client.get("/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"/health not 200 within {STARTUP_TIMEOUT_S} s\n{self.stderr_tail()}")
                time.sleep(0.1)

    def _check_alive(self, when: str) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode} {when}\n{self.stderr_tail()}")

    # ------------------------------------------------------------------ helpers

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stderr_tail(self, lines: int = 60) -> str:
        text = (self.log_dir / "stderr.txt").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> int:
        """The exit code, waiting at most `timeout` seconds (TimeoutExpired otherwise)."""
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)


class HealthProber:
    """While in its `with` block, a thread asks `url`/health every `every` seconds; `slowest` is the longest
    answer (seconds) and every answer must be 200 (checked when the block ends)."""

    def __init__(self, url: str, every: float = 0.05) -> None:
        import threading

        self.url, self.every = url, every
        self.slowest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe, name="health-prober", daemon=True)
        self._error: BaseException | None = None

    def _probe(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=10) as http:
                while not self._stop.is_set():
                    started = time.monotonic()
                    status = http.get("/health").status_code
                    assert status == 200, status
                    self.slowest = max(self.slowest, time.monotonic() - started)
                    self._stop.wait(self.every)
        except BaseException as exc:  # reported by __exit__, in the test's thread
            self._error = exc

    def __enter__(self) -> HealthProber:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        if self._error is not None:
            raise self._error
