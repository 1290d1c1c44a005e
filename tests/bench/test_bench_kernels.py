"""`python -m troupe.bench.kernels`: its arguments are checked at the edge (a wrong format or shape is named
with the choices, lower-case format names are taken), a one-shape run prints its table row, and
`--model-order --paths` times the named kernels on a real model's projections."""

from __future__ import annotations

import pytest

from troupe.bench import kernels


@pytest.mark.parametrize(("argv", "named", "choices"), [
    (["--formats", "q4_1,Q9_9"], "--formats: unknown Q9_9", "choose from F32, F16, Q4_0, Q4_1"),
    (["--shapes", "qkv,attn"], "--shapes: unknown attn", "choose from qkv"),
    (["--model-order", "--paths", "rows,fast"], "--paths: unknown fast", "choose from auto, rows"),
    (["--paths", "rows"], "--paths: only with --model-order", ""),
])
def test_unknown_format_or_shape_is_refused_naming_the_choices(argv: list[str], named: str, choices: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        kernels.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err and choices in err


def test_lower_case_format_runs_one_shape(capsys: pytest.CaptureFixture[str]) -> None:
    """`q4_1` is Q4_1; one shape at one M prints one row of the table against eager float32."""
    assert kernels.main(["--formats", "q4_1", "--shapes", "o", "--rows", "2", "--repeats", "1", "--threads",
                         "1"]) in (0, None)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| o |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1] == "576x576" and cells[2] == "2" and cells[3] == "Q4_1"
    assert float(cells[4]) > 0 and float(cells[7]) > 0  # our µs and eager's µs were measured


def test_model_order_paths_time_each_named_kernel(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--model-order --paths` on a small GGUF: one row per M, a time per named kernel and its ratio to
    the first."""
    from troupe.kernels.quant import QType
    from troupe.models.tiny import make_tiny_gguf

    gguf, _ = make_tiny_gguf(tmp_path / "m", default_qtype=QType.Q4_1, tie=False)
    assert kernels.main(["--model-order", "--model", str(gguf), "--paths", "rows,q8-rows,panel", "--rows", "1,5",
                         "--repeats", "1", "--threads", "1"]) in (0, None)
    out = capsys.readouterr().out.splitlines()
    assert "| M | rows ms | q8-rows ms | panel ms | q8-rows / rows | panel / rows |" in out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out if line.startswith(("| 1 |", "| 5 |"))]
    assert [r[0] for r in rows] == ["1", "5"]
    assert all(len(r) == 6 and all(float(c) > 0 for c in r[1:]) for r in rows)
