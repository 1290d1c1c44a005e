"""The HTTP edge of `troupe serve` (troupe/server/edge.py and the launcher's flags), on a real server.

One server (a tiny random Llama) with short deadlines serves the module: `--header-timeout 1
--body-timeout 1 --limit-concurrency 8 --allowed-hosts 127.0.0.1 --api-key-file KEY`. Raw sockets
play the clients that misbehave; `/health` keeps answering beside them.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess

from troupe.server.launcher import api_key

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

KEY = "edge-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("edge")
    (folder / "key").write_text(KEY + "\n")
    args = [str(tiny_llama), "--dtype", "float32", "--max-model-len", "256", "--header-timeout", "1",
            "--body-timeout", "1", "--limit-concurrency", "8", "--allowed-hosts", "127.0.0.1",
            "--api-key-file", str(folder / "key")]
    with ServerProcess(args, folder) as srv:
        yield srv


def address(server: ServerProcess) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def read_response(sock: socket.socket, deadline: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection (b"" if it just closes it)."""
    sock.settimeout(deadline)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def json_body(raw: bytes) -> dict[str, object]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"application/json" in head.lower(), head
    parsed: dict[str, object] = json.loads(body)
    return parsed


def test_a_trickled_request_head_is_cut_off(server: ServerProcess) -> None:
    """Six connections trickling their request head one byte every 200 ms: each is closed by the
    server about --header-timeout (1 s) after it opened, with nothing sent back; /health answers meanwhile."""
    socks = [socket.create_connection(address(server)) for _ in range(6)]
    opened = time.monotonic()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100
    closed_at: dict[int, float] = {}
    for byte in head:
        for i, s in enumerate(socks):
            if i in closed_at:
                continue
            try:
                s.sendall(bytes([byte]))
            except OSError:
                closed_at[i] = time.monotonic() - opened
        if len(closed_at) == len(socks):
            break
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        time.sleep(0.2)
    for i, s in enumerate(socks):
        if i not in closed_at:
            assert read_response(s) == b""
            closed_at[i] = time.monotonic() - opened
        s.close()
    assert all(0.9 < t < 4.0 for t in closed_at.values()), closed_at


def test_a_trickled_body_gets_a_408(server: ServerProcess) -> None:
    """A whole head announcing 100 bytes of body, then 10 of them: a 408 with an OpenAI error body
    after --body-timeout (1 s)."""
    with socket.create_connection(address(server)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        started = time.monotonic()
        raw = read_response(s)
    assert raw.startswith(b"HTTP/1.1 408"), raw[:200]
    assert 0.9 < time.monotonic() - started < 4.0
    assert json_body(raw)["error"]["code"] == "request_timeout"  # type: ignore[index]


def test_a_nul_in_a_header_gets_an_openai_400(server: ServerProcess) -> None:
    """A NUL in X-Request-Id, refused by h11 before the app: a 400 with an OpenAI error body."""
    with socket.create_connection(address(server)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Request-Id: a\x00b\r\n\r\n")
        raw = read_response(s)
    assert raw.startswith(b"HTTP/1.1 400"), raw[:200]
    error = json_body(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and "malformed" in error["message"]  # type: ignore[operator]


def test_past_the_connection_limit_a_503(server: ServerProcess) -> None:
    """Eight idle connections (--limit-concurrency 8): the next request gets a 503 with an OpenAI error
    body; once they close, requests are served again."""
    idle = [socket.create_connection(address(server)) for _ in range(8)]
    try:
        deadline = time.monotonic() + 5
        while True:  # the server registers each connection when its event loop accepts it
            resp = httpx.get(f"{server.url}/health", timeout=5)
            if resp.status_code == 503 or time.monotonic() > deadline:
                break
        assert resp.status_code == 503
        error = resp.json()["error"]
        assert error["type"] == "service_unavailable" and "--limit-concurrency" in error["message"], error
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 5
    while httpx.get(f"{server.url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline


def test_the_key_file_and_the_host_allow_list(server: ServerProcess) -> None:
    """--api-key-file: /v1 needs its key, /health does not; --allowed-hosts 127.0.0.1: another Host
    header gets a 400 naming Host, with or without a port."""
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers=AUTH).status_code == 200
        assert http.get("/health").status_code == 200
        for host in ("evil.example", "evil.example:80", "localhost"):
            resp = http.get("/health", headers={"Host": host})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "Host", resp.text


def test_the_key_comes_from_the_flag_the_file_or_the_environment(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """--api-key, else --api-key-file's first line, else $TROUPE_API_KEY, else $VLLM_API_KEY; both
    flags at once, a missing or empty file: the server refuses to start."""
    def args(key: str | None = None, key_file: str | None = None) -> argparse.Namespace:
        return argparse.Namespace(api_key=key, api_key_file=key_file)

    monkeypatch.delenv("TROUPE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_key(args()) is None
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert api_key(args()) == "v"
    monkeypatch.setenv("TROUPE_API_KEY", "t")
    assert api_key(args()) == "t"
    (tmp_path / "k").write_text("from-file\nignored\n")
    assert api_key(args(key_file=str(tmp_path / "k"))) == "from-file"
    assert api_key(args(key="flag")) == "flag"
    (tmp_path / "empty").write_text("\n")
    for bad in (args("flag", str(tmp_path / "k")), args(key_file=str(tmp_path / "none")),
                args(key_file=str(tmp_path / "empty"))):
        with pytest.raises(SystemExit):
            api_key(bad)


def test_no_misbehaving_client_held_the_event_loop(server: ServerProcess) -> None:
    """Last in the module: after every client above (trickled heads and bodies, a NUL in a header, the
    connection limit, wrong keys and hosts), the event-loop watchdog's largest lag since the server started
    is under 250 ms."""
    import re

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    m = re.search(r"^troupe:event_loop_lag_max_seconds (\S+)$", text, re.M)
    assert m, "no watchdog gauge in /metrics"
    print(f"\nwatchdog max lag {float(m.group(1)) * 1000:.0f} ms")
    assert float(m.group(1)) < 0.25
