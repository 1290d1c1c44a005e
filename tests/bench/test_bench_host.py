"""`python -m troupe.bench.host`: the host-phase table of a decode step on a tiny GGUF and on the null model,
the engine left as it was (no request, no wrapper), and bad arguments refused naming the option."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

from troupe.bench import host


def _tables(out: str) -> list[dict[str, dict[str, float]]]:
    """Each markdown table of the output: {B: {column: value}}."""
    tables: list[list[str]] = []
    for line in out.splitlines():
        if line.startswith("| "):
            tables[-1].append(line) if tables and tables[-1] else tables.append([line])
        elif tables and tables[-1] and not line.startswith("|---"):
            tables.append([])
    parsed = []
    for lines in filter(None, tables):
        header = [c.strip() for c in lines[0].strip("|").split("|")]
        parsed.append({cells[0]: {name: float(cell.split()[0]) for name, cell in zip(header[1:], cells[1:], strict=True)}
                       for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])})
    return parsed


def _table(out: str) -> dict[str, dict[str, float]]:
    first = [line for line in out.splitlines() if line.startswith("| ")][0]
    assert [c.strip() for c in first.strip("|").split("|")] == ["B", *host.PHASES]
    return _tables(out)[0]


@pytest.mark.parametrize("null", [False, True], ids=["tiny-gguf", "null-model"])
def test_each_batch_prints_every_phase(tiny_gguf: Path, null: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """One row per batch size; every timed phase is measured (> 0) and together they stay within the step; on the
    null model, the host-cost table and (`--actor`) the engine loop's."""
    argv = ["--model", str(tiny_gguf), "--device", "cpu", "--batches", "1,6", "--context", "12", "--steps", "4",
            "--repeats", "2", "--threads", "1"]
    assert host.main(argv + (["--null-model", "--actor"] if null else [])) == 0
    assert gc.get_freeze_count() == 0  # the heap it froze while measuring is unfrozen
    out = capsys.readouterr().out
    assert ("null model on cpu" in out) is null
    rows = _table(out)
    assert list(rows) == ["1", "6"]
    for r in rows.values():
        assert [k for k in ("step", "schedule", "seqs", "execute", "sampler", "update") if not r[k] > 0] == []
        assert r["sampling rows"] >= 0 and r["rest"] > -0.01
        assert sum(r[k] for k in host.PHASES[1:]) == pytest.approx(r["step"], abs=0.01)
    if null:  # the host cost: the step less the argmax standing in for the device, per request; the actor's
        [_, costs, loop] = _tables(out)
        assert list(loop) == ["1", "6"]
        for r in loop.values():
            assert r["bare"] > 0 and r["actor"] > 0 and r["actor overhead"] == pytest.approx(r["actor"] - r["bare"],
                                                                                               abs=0.002)
        assert list(costs) == ["1", "6"]
        for b, c in costs.items():
            assert c["step"] == rows[b]["step"] and 0 < c["argmax"] < c["step"]
            assert c["host"] == pytest.approx(c["step"] - c["argmax"], abs=0.002)
            assert c["host/req"] == pytest.approx(c["host"] / int(b) * 1e3, rel=0.01, abs=0.02)
        assert "PASS" not in out and "FAIL" not in out  # the verdict needs B = 256
    else:
        assert len(_tables(out)) == 1


def test_measure_leaves_the_engine_as_it_was(tiny_gguf: Path) -> None:
    from troupe.config import EngineConfig
    from troupe.core.engine_core import EngineCore

    core = EngineCore(EngineConfig(model=str(tiny_gguf), multiprocess=False, num_threads=1,
                                   enable_prefix_caching=False, max_num_seqs=4))
    try:
        free = core.kv.num_free_blocks
        r = host.measure(core, 3, 10, 2, 1)
        assert r["step"] > 0
        assert not core.has_unfinished_requests() and core.kv.num_free_blocks == free
        for obj, attr in ((core.scheduler, "schedule"), (core.runner, "execute"), (core, "_sample"),
                          (core.sampler, "sample"), (core.scheduler, "update_from_output")):
            assert attr not in vars(obj), attr
    finally:
        core.close()


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--batches", "0,2"], ["--device", "tpu"]])
def test_bad_arguments_name_the_option(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        host.main(bad)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert bad[0] in err or "--batches" in err


def test_the_core_is_built_and_stepped_on_one_thread(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The bare loops and the actor step the core on the thread that built it, as the engine process does
    (a step on another thread would run a second OpenMP team: troupe.engine.core_actor)."""
    import threading

    from troupe.core import engine_core

    same_thread: list[bool] = []

    class Probe(engine_core.EngineCore):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            self.built_on = threading.get_ident()

        def step(self) -> Any:
            same_thread.append(threading.get_ident() == self.built_on)
            return super().step()

    monkeypatch.setattr(engine_core, "EngineCore", Probe)
    argv = ["--model", str(tiny_gguf), "--device", "cpu", "--batches", "2", "--context", "8", "--steps", "3",
            "--repeats", "1", "--threads", "1", "--actor"]
    assert host.main(argv) == 0
    assert len(same_thread) > 6 and all(same_thread)
