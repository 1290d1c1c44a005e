"""The README's examples run as written, and the CLI streams an answer."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)  # programs in subprocesses, the default model in two

README = Path(__file__).resolve().parents[2] / "README.md"


def examples() -> dict[str, str]:
    text = README.read_text()
    found = re.findall(r"<!-- example: (\w+) -->\s*```python\n(.*?)```", text, flags=re.S)
    return dict(found)


def test_readme_has_both_examples() -> None:
    """The README shows an AsyncLLM and an LLM example (the tests below run them)."""
    assert set(examples()) == {"async", "offline"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["async", "offline"])
def test_readme_example_runs(name: str, tmp_path: Path) -> None:
    """Each README example runs on the default model and prints generated text."""
    script = tmp_path / f"{name}.py"
    script.write_text(examples()[name])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(proc.stdout.strip()) > 10
    if name == "offline":
        assert "'Hello, my name is' ->" in proc.stdout and "'The sky is' ->" in proc.stdout


def test_cli_generate_streams_an_answer(tiny_llama: Path) -> None:
    """`troupe generate` prints the generated text and exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "troupe.cli", "generate", "hello there", "--model", str(tiny_llama),
         "--dtype", "float32", "--max-tokens", "8", "--temperature", "0", "--ignore-eos", "--in-process"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()


def test_cli_reports_bad_input_cleanly(tiny_llama: Path) -> None:
    """A bad sampling value is an error message naming the field, exit code 2, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "troupe.cli", "generate", "hi", "--model", str(tiny_llama), "--top-p", "0"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "top_p" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_chat_holds_a_conversation(tiny_llama: Path) -> None:
    """`troupe chat` answers each line through the chat template and ends on an empty line."""
    proc = subprocess.run(
        [sys.executable, "-m", "troupe.cli", "chat", "--model", str(tiny_llama), "--dtype", "float32",
         "--max-tokens", "4", "--temperature", "0", "--ignore-eos", "--in-process"],
        input="hi\nand again\n\n", capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len([line for line in proc.stdout.splitlines() if line.strip()]) >= 2
