"""Model names as users type them: a Hugging Face Hub id (`org/name`) resolved to a local folder.

`hub_folder(repo_id, revision)` returns the snapshot folder of the repository at `revision` (a branch,
tag or commit; None: `main`), through `huggingface_hub`:

1. the local cache first (`HF_HUB_CACHE` / `HF_HOME`, as every Hugging Face tool shares it), without any
   network access;
2. else, unless `HF_HUB_OFFLINE` is set, a download of the files troupe reads (config, safetensors,
   tokenizer and generation files, chat templates) with huggingface_hub's progress bars, into that cache.

A name that is neither in the cache nor downloadable is a `ModelLoadError` saying which and why (offline,
no such repository or revision, no network). Tests build a cache folder locally and set `HF_HUB_CACHE`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from troupe.errors import ModelLoadError

# what troupe loads from an HF folder (weights as safetensors only: no pickled .bin is ever read)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(name: str) -> bool:
    """`org/name` with the Hub's characters (a local path that exists is never one: the caller checks)."""
    return bool(_HUB_ID.match(name)) and ".." not in name


def hub_folder(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot folder of `repo_id` at `revision` (see the module docstring)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}" + (f" at revision {revision!r}" if revision else "")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                      local_files_only=True))
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
            raise ModelLoadError(f"{where}: not in the local Hugging Face cache, and HF_HUB_OFFLINE is set "
                                 "(download it once online, or give a local folder)") from None
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except RevisionNotFoundError:
        raise ModelLoadError(f"{where}: the Hub has no such revision") from None
    except GatedRepoError:
        raise ModelLoadError(f"{where}: the repository is gated; log in (`hf auth login` or HF_TOKEN) with "
                             "access to it") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"{where}: no such model on the Hugging Face Hub (or it is private)") from None
    except LocalEntryNotFoundError as exc:  # the download itself failed: no network
        raise ModelLoadError(f"{where}: not in the local cache and the Hub could not be reached: {exc}") from None
