"""The repository's commit-msg hook (.githooks/commit-msg, installed with `git config core.hooksPath
.githooks`): a subject of at most 72 characters, then a blank line before any body. Run on sample
messages, not on the history, so that it holds in a shallow or fresh clone too."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parents[1] / ".githooks" / "commit-msg"


@pytest.mark.parametrize(("message", "accepted"), [
    ("scheduler: queue policy as classes\n", True),
    ("x" * 72 + "\n\nthe detail, as long as it needs to be: " + "y" * 200 + "\n", True),
    ("x" * 73 + "\n", False),
    ("# a comment line git strips, however long it is " + "z" * 80 + "\nshort subject\n", True),
    ("\n\nsubject after blank lines\n", True),
    ("subject\nthe body with no blank line before it\n", False),
])
def test_the_hook_accepts_short_subjects_and_refuses_long_ones(tmp_path: Path, message: str, accepted: bool) -> None:
    """Exit 0 for a subject of <= 72 characters (git's comment lines skipped), else 1 with the length
    on stderr; a body must follow a blank line."""
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    done = subprocess.run(["sh", str(HOOK), str(path)], capture_output=True, text=True, timeout=10, check=False)
    assert (done.returncode == 0) is accepted, done.stderr
    if not accepted:
        assert "commit-msg:" in done.stderr
