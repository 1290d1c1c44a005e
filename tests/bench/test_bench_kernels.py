"""`python -m troupe.bench.kernels`: its arguments are checked at the edge (a wrong format or shape is named
with the choices, lower-case format names are taken), and a one-shape run prints its table row."""

from __future__ import annotations

import pytest

from troupe.bench import kernels


@pytest.mark.parametrize(("argv", "named", "choices"), [
    (["--formats", "q4_1,Q9_9"], "--formats: unknown Q9_9", "Q4_1"),
    (["--shapes", "qkv,attn"], "--shapes: unknown attn", "gate_up"),
])
def test_unknown_format_or_shape_is_refused_naming_the_choices(argv: list[str], named: str, choices: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        kernels.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "choose from" in err and choices in err


def test_lower_case_format_runs_one_shape(capsys: pytest.CaptureFixture[str]) -> None:
    """`q4_1` is Q4_1; one shape at one M prints one row of the table against eager float32."""
    assert kernels.main(["--formats", "q4_1", "--shapes", "o", "--rows", "2", "--repeats", "1", "--threads",
                         "1"]) in (0, None)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| o |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1] == "576x576" and cells[2] == "2" and cells[3] == "Q4_1"
    assert float(cells[4]) > 0 and float(cells[7]) > 0  # our µs and eager's µs were measured
