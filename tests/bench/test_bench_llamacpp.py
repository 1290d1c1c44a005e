"""llama.cpp's own programs in `troupe bench`: the batched-bench parser on a recorded run, the binaries'
lookup, and the harness driving stand-ins of `llama-batched-bench` (offline part) and `llama-server -np`
(serve part), then the real binaries where this machine has them."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from troupe.bench import harness, llamacpp
from troupe.bench.engines import llamacpp_engines
from troupe.bench.report import Report

# What `llama-batched-bench -npp 32 -ntg 16 -npl 1,4` prints, in its source's printf formats (the file says
# why it is not a recorded run)
SAMPLE = (Path(__file__).parent / "data" / "llama_batched_bench.txt").read_text()

FAKE_SERVER = '''
import json, os, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
with open(os.environ["FAKE_PEER_LOG"], "a") as f:
    f.write(json.dumps({"call": "llama-server", "argv": argv}) + "\\n")

posts = 0
posts_lock = threading.Lock()  # handlers run in threads: each takes its own number

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        global posts
        with posts_lock:
            posts += 1
            number = posts
        if number > int(os.environ.get("FAKE_CRASH_AFTER", "1000000")):  # the process dies mid-load
            print("fake server: crashing", flush=True)
            os._exit(3)
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if number == int(os.environ.get("FAKE_DROP_POST", "0")):  # a keep-alive connection closed as it came
            self.close_connection = True
            return
        assert req["model"] == argv[argv.index("--alias") + 1] and req["ignore_eos"] is True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(req["max_tokens"]):
            self.wfile.write(b'data: {"choices": [{"text": "x"}]}\\n\\n')
        usage = {"choices": [], "usage": {"completion_tokens": req["max_tokens"]}}
        self.wfile.write(("data: " + json.dumps(usage) + "\\n\\ndata: [DONE]\\n\\n").encode())

ThreadingHTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Handler).serve_forever()
'''


def test_batched_bench_output_is_parsed() -> None:
    """Every result row of the table is read, the log around it skipped; the end-to-end output
    rate is B x TG over the whole time (prefill included), as the other engines' offline figure."""
    rows = llamacpp.parse_batched_bench(SAMPLE)
    assert [(r.pp, r.tg, r.batch) for r in rows] == [(32, 16, 1), (32, 16, 4)]
    for r in rows:
        assert r.n_kv == r.batch * (r.pp + r.tg)
        assert r.t == pytest.approx(r.t_pp + r.t_tg, abs=2e-3)
        assert r.s_tg == pytest.approx(r.batch * r.tg / r.t_tg, rel=1e-2)
        assert r.output_tok_s == r.batch * r.tg / r.t
    with pytest.raises(ValueError, match="no result row"):
        llamacpp.parse_batched_bench(SAMPLE.split("|    PP")[0])


def test_llama_bin_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag wins over $LLAMA_BIN; a folder without either binary is refused with how to get them."""
    (tmp_path / "bin").mkdir()
    server = tmp_path / "bin" / "llama-server"
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    monkeypatch.setenv("LLAMA_BIN", str(tmp_path / "bin"))
    assert llamacpp.find_llama_bin(None) == (tmp_path / "bin", "$LLAMA_BIN")
    folder, why = llamacpp.find_llama_bin(str(tmp_path))
    assert folder is None and why.startswith(f"no llama-server or llama-batched-bench in {tmp_path} (flag;")
    assert llamacpp.has(tmp_path / "bin", llamacpp.SERVER) and not llamacpp.has(tmp_path / "bin", llamacpp.BATCHED)


def _args(bin_dir: Path, *extra: str) -> Any:
    return harness.parser().parse_args(
        ["--peers", "llamacpp", "--llamacpp-python", str(bin_dir / "no-python"), "--llama-bin", str(bin_dir),
         "--num-prompts", "8", "--min-len", "5", "--max-len", "40", "--max-tokens", "16", "--serve-clients", "3",
         "--serve-requests", "5", "--serve-max-tokens", "6", "--serve-prompt-words", "10", "--threads", "2", *extra])


def _spec(args: Any) -> dict[str, Any]:
    from troupe.models.default_model import ensure_default_model
    from troupe.models.loader import load_tokenizer

    return harness.worker_spec(args, load_tokenizer(ensure_default_model()))


def _run(args: Any, gguf: str, workdir: Path) -> tuple[Report, dict[str, Any]]:
    report = Report(troupe=[], baselines=[])
    engines = llamacpp_engines(args, gguf, report)
    report.baselines = [e.label for e in engines]
    report.peer_of = {e.label: e.peer for e in engines}
    spec = _spec(args)
    for engine in engines:
        assert harness.run_round(engine, 0, args, spec, report, workdir) == 0, report.notes
    return report, spec


@pytest.mark.slow  # a server process
@pytest.mark.timeout(300)
def test_stand_in_binaries_are_driven_with_the_workload_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """batched-bench gets as many sequences as prompts, their mean length, the new tokens, a context that
    holds them all and the threads; its table's rate is the offline figure. The server gets -np CLIENTS,
    a context per slot and the served name, and the HTTP load's figures reach the report; llama.cpp's best
    is then batched-bench offline and the server for serving."""
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_PEER_LOG", str(log))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "server.py").write_text(textwrap.dedent(FAKE_SERVER))
    one_row = "\n".join(line for line in SAMPLE.splitlines() if not line.startswith("|    32 |     16 |    4 |"))
    (tmp_path / "sample.txt").write_text(one_row)
    for name, body in (("llama-server", f'exec "{sys.executable}" "{tmp_path / "server.py"}" "$@"'),
                       ("llama-batched-bench", f'echo "$@" > "{tmp_path / "batched.args"}"; '
                                               f'cat "{tmp_path / "sample.txt"}"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    args = _args(bin_dir, "--parts", "offline,serve")
    report, spec = _run(args, "/fake/model.gguf", tmp_path)
    assert report.baselines == ["llama.cpp server -np 3", "llama.cpp batched-bench"]
    assert report.notes == [f"llama.cpp python: skipped: no python at {bin_dir / 'no-python'} (flag; give "
                            "--llamacpp-python or $LLAMACPP_PY, or run shared/bench/setup_peers.sh llamacpp)"]
    argv = (tmp_path / "batched.args").read_text().split()
    mean = round(sum(map(len, spec["prompts"])) / 8)
    assert argv == ["-m", "/fake/model.gguf", "-t", "2", "-tb", "2", "-c", "2048", "-npp", str(mean),
                    "-ntg", "16", "-npl", "8"]
    (row,) = llamacpp.parse_batched_bench(one_row)
    assert report.median("llama.cpp batched-bench", "offline_tok_s") == row.output_tok_s == 16 / row.t
    assert report.info["llama.cpp batched-bench"]["decode_tok_s"] == row.s_tg
    # (no RSS figure is asserted here: the stand-in exits within milliseconds, before the sampler's first
    # look; the sampling of a live peer process tree is checked in test_bench_peers and test_bench_harness)
    assert report.best("llama.cpp", "offline_tok_s") == ("llama.cpp batched-bench", row.output_tok_s)
    (served,) = [json.loads(line) for line in log.read_text().splitlines()]
    sv = served["argv"]
    assert sv[sv.index("-np") + 1] == "3" and sv[sv.index("-c") + 1] == str(3 * 2048)
    assert sv[sv.index("--alias") + 1] == "bench-model" and sv[sv.index("-t") + 1] == "2"
    assert (report.median("llama.cpp server -np 3", "serve_tok_s") or 0) > 0
    assert report.best("llama.cpp", "serve_tok_s") == ("llama.cpp server -np 3",
                                                       report.median("llama.cpp server -np 3", "serve_tok_s"))


@pytest.mark.slow  # a server process
@pytest.mark.timeout(120)
def test_a_server_that_dies_mid_load_fails_its_round_not_the_run(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer server that goes away during the HTTP load (a crash: the connection closes without a
    response) is one failed round with a note naming the error and the server's last output; the harness
    goes on to the next engine instead of ending the whole benchmark."""
    monkeypatch.setenv("FAKE_PEER_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("FAKE_CRASH_AFTER", "2")  # the warm-up and one request, then the process exits
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "server.py").write_text(textwrap.dedent(FAKE_SERVER))
    server = bin_dir / "llama-server"
    server.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "server.py"}" "$@"\n')
    server.chmod(0o755)
    args = _args(bin_dir, "--parts", "serve")
    report = Report(troupe=[], baselines=[])
    (engine,) = [e for e in llamacpp_engines(args, "/fake/model.gguf", report) if e.serve is not None]
    assert harness.run_round(engine, 0, args, _spec(args), report, tmp_path) == 1
    (note,) = [n for n in report.notes if "server failed" in n]
    assert note.startswith(f"{engine.label}, round 0: the server failed: ") and "the load failed" in note
    assert "RemoteProtocolError" in note or "ReadError" in note or "ConnectError" in note, note
    assert report.median(engine.label, "serve_tok_s") is None


@pytest.mark.slow  # a server process
@pytest.mark.timeout(120)
def test_a_request_on_a_connection_the_server_closed_is_sent_again(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A request the server answers by closing the connection, with no response (llama-server closing a
    keep-alive connection as the request goes out), is sent again once on a fresh connection and counted;
    every request still gets all its tokens."""
    import argparse
    import subprocess

    import httpx

    from troupe.bench import server
    from troupe.bench.peers import stop_group
    from troupe.bench.serving import free_port

    monkeypatch.setenv("FAKE_PEER_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("FAKE_DROP_POST", "3")  # the warm-up, one request, then a dropped one
    (tmp_path / "server.py").write_text(textwrap.dedent(FAKE_SERVER))
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(tmp_path / "server.py"), "--port", str(port), "--alias", "m"],
                            start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)  # polling a starting process until it listens
        args = argparse.Namespace(clients=2, requests=5, max_tokens=4, prompt_words=3, api_key=None, served_model="m")
        figures = anyio.run(server.run, url, args)
    finally:
        stop_group(proc, grace=5.0)
    assert figures["requests"] == 5 and figures["output_tokens"] == 5 * 4
    assert figures["resent_requests"] == 1
