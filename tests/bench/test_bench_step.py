"""`python -m troupe.bench.step`: the per-part table of a decode step (and of a prompt's step) on a tiny
GGUF, the engine left as it was (no request, no block, no wrapper) after each measurement, `--llm` taking turns through the engine process,
and bad arguments refused naming the option."""

from __future__ import annotations

from pathlib import Path

import pytest

from troupe.bench import step


def _table(out: str) -> dict[str, dict[str, float]]:
    """The printed table: batch -> part -> ms (the share in parentheses dropped)."""
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["B", *step.PARTS]
    rows = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = {name: float(cell.split()[0]) for name, cell in zip(header[1:], cells[1:], strict=True)}
    return rows


def test_each_batch_prints_every_part(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One row per batch size (and with --prefill one for the prompt's step first); the step and its timed
    parts are measured (> 0), and the parts of the step and of the forward run alone each add up to their
    whole."""
    assert step.main(["--model", str(tiny_gguf), "--batches", "1,3", "--context", "20", "--steps", "3",
                      "--repeats", "2", "--threads", "1", "--prefill"]) == 0
    rows = _table(capsys.readouterr().out)
    assert list(rows) == ["prefill 20", "1", "3"]
    for r in rows.values():
        assert [k for k in ("step", "prepare", "forward", "head", "sampler", "forward alone") if not r[k] > 0] == []
        rest = r["step"] - r["prepare"] - r["forward"] - r["head"] - r["sampler"]
        # each cell is rounded to 2 decimals (at most 0.005 off; the medians of 2 rounds are means, so the
        # parts add up exactly before rounding): six cells here, four below, and a float's last bit
        assert r["engine rest"] == pytest.approx(rest, abs=6 * 0.005 + 1e-9)
        parts = r["projections"] + r["attention"] + r["other ops"]
        assert r["forward alone"] == pytest.approx(parts, abs=4 * 0.005 + 1e-9)


def test_measure_leaves_the_engine_as_it_was(tiny_gguf: Path) -> None:
    """After a batch of decodes and after the prompts' steps: the requests are gone and their blocks free,
    and every timing wrapper and replaced projection is removed, so the next measurement (and the engine's
    own step) runs the real code."""
    from troupe.config import EngineConfig
    from troupe.core.engine_core import EngineCore

    core = EngineCore(EngineConfig(model=str(tiny_gguf), multiprocess=False, num_threads=1,
                                   enable_prefix_caching=False, max_num_seqs=4))
    try:
        layer = core.runner.model.layers[0]
        projections = [getattr(layer, name) for name in step.PROJECTIONS]
        free_blocks = core.kv.num_free_blocks
        result = step.measure(core, 2, 12, 2, 1)
        assert set(result) == set(step.PARTS)
        assert set(step.measure_prefill(core, 12, 2)) == set(step.PARTS)
        assert not core.has_unfinished_requests()
        assert core.kv.num_free_blocks == free_blocks
        assert [getattr(layer, name) for name in step.PROJECTIONS] == projections
        wrapped = ((core.runner, "execute"), (core.runner.kernels, "prepare"), (core.runner.kernels, "attention"),
                   (core.sampler, "sample"), (core.runner.model, "forward"), (core.runner.model, "compute_logits"))
        assert [attr for obj, attr in wrapped if attr in vars(obj)] == []
    finally:
        core.close()


@pytest.mark.slow
def test_llm_itl_takes_turns_with_the_bare_rounds(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--llm`: B = 1's ITL through LLM (an engine process), one sample per round, printed against the bare
    step."""
    assert step.main(["--model", str(tiny_gguf), "--batches", "1", "--context", "16", "--steps", "3",
                      "--repeats", "2", "--threads", "1", "--llm"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("B = 1 through LLM"))
    itl = float(line.split("ITL ")[1].split(" ms")[0])
    assert itl > 0 and "against the bare step" in line


@pytest.mark.parametrize(("argv", "named"), [
    (["--batches", "1,0"], "--batches: expected integers >= 1"),
    (["--batches", "one"], "--batches: expected comma-separated integers"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_bad_arguments_are_refused_naming_the_option(argv: list[str], named: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        step.main(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
