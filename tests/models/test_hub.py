"""Hugging Face Hub ids: `org/name` (and `revision=`) resolve through a local Hugging Face cache, built here
in the cache's own layout (refs/<revision> naming a snapshot folder): never the network."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from troupe.config import EngineConfig
from troupe.core.engine_core import EngineCore
from troupe.errors import ModelLoadError
from troupe.messages import AddRequest
from troupe.models.loader import resolve_model_path
from troupe.models.tiny import make_tiny_model
from troupe.sampling_params import SamplingParams

COMMITS = {"main": "a" * 40, "v2": "b" * 40}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding `troupe-test/tiny` at `main` (seed 0) and at tag `v2` (seed 1)."""
    root = tmp_path_factory.mktemp("hf-cache")
    repo = root / "models--troupe-test--tiny"
    for (ref, commit), seed in zip(COMMITS.items(), (0, 1), strict=True):
        make_tiny_model(repo / "snapshots" / commit, seed=seed)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return root


@pytest.fixture
def offline(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def greedy(model: str, revision: str | None = None) -> list[int]:
    core = EngineCore(EngineConfig(model=model, revision=revision, dtype="float32", num_kv_blocks=16, num_threads=1))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    core.add_request(AddRequest("r", [5, 100, 2000, 7], params, 6))
    out: list[int] = []
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            out.extend(o.new_token_ids)
    return out


def test_a_hub_id_resolves_from_the_cache_at_its_revision(offline: Path) -> None:
    """main and the tag v2 are their snapshot folders; the engine loads each by its id and runs the same as
    from the folder; the two revisions are different weights."""
    repo = offline / "models--troupe-test--tiny" / "snapshots"
    assert resolve_model_path("troupe-test/tiny") == repo / COMMITS["main"]
    assert resolve_model_path("troupe-test/tiny", "v2") == repo / COMMITS["v2"]
    assert resolve_model_path("troupe-test/tiny", COMMITS["v2"]) == repo / COMMITS["v2"]
    main, v2 = greedy("troupe-test/tiny"), greedy("troupe-test/tiny", "v2")
    assert main == greedy(str(repo / COMMITS["main"])) and v2 == greedy(str(repo / COMMITS["v2"])) and main != v2


def test_offline_and_not_cached_says_so(offline: Path) -> None:
    for name, revision, message in (("troupe-test/absent", None, "not in the local Hugging Face cache, and "
                                     "HF_HUB_OFFLINE is set"),
                                    ("troupe-test/tiny", "v3", "troupe-test/tiny at revision 'v3': not in the local")):
        with pytest.raises(ModelLoadError, match=message):
            resolve_model_path(name, revision)
    with pytest.raises(ModelLoadError, match="does not exist .*Hub id"):
        resolve_model_path("./no/such/folder")


def test_the_cli_takes_a_hub_id_and_a_revision(hub_cache: Path) -> None:
    """`troupe generate --model org/name --revision v2` in a fresh process with HF_HUB_CACHE and
    HF_HUB_OFFLINE=1: the v2 weights' greedy tokens."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, "-m", "troupe.cli", "generate", "hello world", "--max-tokens", "4", "--temperature", "0",
            "--ignore-eos", "--in-process", "--dtype", "float32"]
    by_id = subprocess.run([*args, "--model", "troupe-test/tiny", "--revision", "v2"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert by_id.returncode == 0, by_id.stderr[-2000:]
    folder = hub_cache / "models--troupe-test--tiny" / "snapshots" / COMMITS["v2"]
    local = subprocess.run([*args, "--model", str(folder)], env=env, capture_output=True, text=True, timeout=300)
    assert by_id.stdout == local.stdout and by_id.stdout.strip()
