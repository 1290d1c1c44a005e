"""`python -m troupe.bench.offline` on a tiny random model on the CPU: warm-up rounds run both sides but are
left out of the medians and the per-round ratios; bad round counts are refused naming the option."""

from __future__ import annotations

import re

import pytest

from troupe.bench import offline

TINY = "hidden=64,layers=2,heads=4,kv_heads=2,intermediate=128"
SMALL = ["--random-model", TINY, "--device", "cpu", "--num-prompts", "4", "--min-len", "8", "--max-len", "24",
         "--max-tokens", "4", "--hf-batch-sizes", "2", "--threads", "1", "--in-process", "--skip-core"]


@pytest.mark.slow
def test_warmup_rounds_run_both_sides_and_are_not_counted(capsys: pytest.CaptureFixture[str]) -> None:
    assert offline.main([*SMALL, "--warmup-rounds", "1", "--repeats", "2"]) == 0
    out, err = capsys.readouterr()
    warmups = re.findall(r"warm-up round \(not counted\): troupe ([\d.]+) hf2 ([\d.]+) -> ([\d.]+)x", err)
    rounds = re.findall(r"round (\d): troupe ([\d.]+) hf2 ([\d.]+) -> ([\d.]+)x", err)
    assert len(warmups) == 1 and all(float(v) > 0 for v in warmups[0])
    assert [r[0] for r in rounds] == ["0", "1"]
    assert "medians of 2 alternating round(s) after 1 warm-up round(s)" in out
    # the medians and the per-round ratios are the two measured rounds' alone
    troupe = sorted(float(r[1]) for r in rounds)
    median = re.search(r"troupe LLM.generate \(actor graph\): +([\d.]+) output tok/s", out)
    assert median is not None and float(median.group(1)) == pytest.approx(sum(troupe) / 2, abs=0.11)
    per_round = re.search(r"per round: ([^)]*)\)", out)
    assert per_round is not None and per_round.group(1) == ", ".join(f"{float(r[3]):.2f}x" for r in rounds)


@pytest.mark.parametrize("bad", [["--repeats", "0"], ["--warmup-rounds", "-1"]])
def test_bad_round_counts_are_refused(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        offline.main([*SMALL, *bad])
    assert exc.value.code == 2
    assert "--repeats must be >= 1 and --warmup-rounds >= 0" in capsys.readouterr().err
