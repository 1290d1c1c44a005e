"""Where troupe keeps what it builds once and reuses: converted models, tokenizer files, compiled
kernels. One root, `$TROUPE_CACHE_DIR` or `~/.cache/troupe`; nothing here imports the rest of troupe."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$TROUPE_CACHE_DIR`, else `~/.cache/troupe`."""
    return Path(os.environ.get("TROUPE_CACHE_DIR") or Path.home() / ".cache" / "troupe").expanduser()
