"""The README's examples run as written, and the CLI: it streams an answer (and nothing else), samples
n answers, prints logprobs and follows a JSON schema."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
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


def test_ci_runs_the_readme_test_command_on_the_locked_toolchain() -> None:
    """`.ci/run` runs the README's test command, and the environment running this test holds every
    package of `constraints.txt` at its locked version (so a pass here is a pass on the lock)."""
    from importlib.metadata import PackageNotFoundError, version

    root = README.parent
    readme_cmds = re.findall(r"```bash\n(.*?)\n```", README.read_text(), flags=re.S)
    ci_cmd = (root / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_cmd in readme_cmds, ci_cmd
    assert "-c constraints.txt" in ci_cmd and "pytest" in ci_cmd
    locked = [
        line.split("==")
        for line in (root / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert len(locked) > 50
    off = {}
    for name, want in locked:
        try:
            have = version(name)
        except PackageNotFoundError:
            have = None
        if have != want:
            off[name] = (want, have)
    assert not off, off


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


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TROUPE_LOG_LEVEL"}
    return subprocess.run([sys.executable, "-m", "troupe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_prints_the_answer_only_unless_verbose(tiny_llama: Path) -> None:
    """generate prints the answer and no log lines (troupe logs at warning level, the engine process
    too); -v brings the info lines back on stderr."""
    base = ["generate", "hi", "--model", str(tiny_llama), "--dtype", "float32", "--max-tokens", "4",
            "--temperature", "0", "--ignore-eos"]
    quiet = _cli(*base)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert quiet.stdout.strip() and quiet.stderr.strip() == ""
    loud = _cli(*base, "-v")
    assert loud.returncode == 0 and "engine ready" in loud.stderr and "graph ready" in loud.stderr
    assert loud.stdout == quiet.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_generate_n(tiny_llama: Path) -> None:
    """--n 2 prints two different samples, each under its header."""
    proc = _cli("generate", "hi", "--model", str(tiny_llama), "--dtype", "float32", "--max-tokens", "5",
                "--temperature", "1", "--seed", "7", "--ignore-eos", "--n", "2", "--in-process")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line for line in lines if line.startswith("--- sample")] == ["--- sample 0 ---", "--- sample 1 ---"]
    first, second = lines[1:lines.index("--- sample 1 ---")], lines[lines.index("--- sample 1 ---") + 1:]
    assert first != second


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_generate_logprobs(tiny_llama: Path) -> None:
    """--logprobs 2 adds, after the answer, one line per generated token: its text, a logprob <= 0
    and its 2 alternatives."""
    proc = _cli("generate", "hi", "--model", str(tiny_llama), "--dtype", "float32", "--max-tokens", "5",
                "--temperature", "0", "--ignore-eos", "--logprobs", "2", "--in-process")
    assert proc.returncode == 0, proc.stderr[-3000:]
    token_lines = [line.split("\t") for line in proc.stdout.splitlines() if line.count("\t") == 2]
    assert len(token_lines) == 5
    assert all(float(logprob) <= 0 for _, logprob, _ in token_lines)
    assert all(1 <= len(alts.split("  ")) <= 2 for _, _, alts in token_lines)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_generate_json_schema(tmp_path: Path) -> None:
    """--json-schema FILE: the default model's answer is JSON that validates against the schema; a
    missing file is an error naming the flag (exit 2)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    proc = _cli("generate", "Describe the weather in Paris as JSON.", "--chat-template", "--json-schema", str(path),
                "--max-tokens", "60", "--temperature", "0", "--in-process")
    assert proc.returncode == 0, proc.stderr[-3000:]
    jsonschema.validate(json.loads(proc.stdout), schema)
    bad = _cli("generate", "hi", "--json-schema", str(tmp_path / "missing.json"))
    assert bad.returncode == 2 and "--json-schema" in bad.stderr and "Traceback" not in bad.stderr
