"""`python -m troupe.bench.moe_llamacpp` end to end on a tiny MoE shape with llama.cpp absent: the GGUF
written once and reused, `troupe serve` on it under the single-stream and batched requests, the figures
read back into the table and the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from troupe.bench import moe_llamacpp

TINY = ["--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--experts", "8", "--expert-ff", "256",
        "--rounds", "1", "--prompt-len", "16", "--gen-tokens", "8", "--batch", "3", "--single-repeats", "1",
        "--threads", "1"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # a server in its own process
def test_moe_bench_on_a_tiny_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """troupe's three figures, its start-up and peak RSS come back positive; llama.cpp without its binary
    is skipped with a note; the file is written under a name of its shape and found again by a second
    writer (not rewritten)."""
    out = tmp_path / "moe.json"
    code = moe_llamacpp.main([*TINY, "--workdir", str(tmp_path), "--llama-bin", str(tmp_path / "no-llama"),
                              "--json", str(out)])
    assert code == 0, capsys.readouterr().err[-3000:]
    data = json.loads(out.read_text())
    med = data["medians"]
    assert set(med) == {"troupe"}
    assert set(med["troupe"]) == {"single_ttft_ms", "single_itl_ms", "batch_decode_tok_s", "serve_ready_s",
                                  "rss_serve_gib"}
    assert all(v > 0 for v in med["troupe"].values()), med
    assert any("llama.cpp: no llama-server" in n for n in data["notes"])
    assert data["shape"]["experts"] == 8 and data["shape"]["qtype"] == "Q4_K"
    printed = capsys.readouterr().out
    assert "batched decode: output tok/s" in printed and "single stream: ITL" in printed
    (gguf,) = tmp_path.glob("qwen3moe-L2-h256-*-E8-k2-f256-Q4_K-seed0.gguf")
    assert data["file_bytes"] == gguf.stat().st_size
    written = gguf.stat().st_mtime_ns
    args = moe_llamacpp.parser().parse_args([*TINY, "--workdir", str(tmp_path)])
    assert moe_llamacpp.model_file(moe_llamacpp.shape_of(args), 0, tmp_path) == gguf
    assert gguf.stat().st_mtime_ns == written


@pytest.mark.parametrize(("flags", "message"), [
    (["--gen-tokens", "1"], "--gen-tokens must be at least 2"),
    (["--top-k", "9", "--experts", "8"], "--top-k (9) must be at most --experts (8)"),
    (["--prompt-len", "200", "--gen-tokens", "100"], "--prompt-len + --gen-tokens must be at most 256"),
    (["--batch", "0"], "--batch must be at least 1"),
])
def test_bad_settings_are_refused(flags: list[str], message: str) -> None:
    """Settings the measurement cannot use are refused before anything is written, naming the flag."""
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        moe_llamacpp.shape_of(moe_llamacpp.parser().parse_args(flags))
