"""transformers oracles kept on disk between test runs: `stored(model_dir, key, compute)`."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from troupe.paths import cache_dir


def stored(model_dir: Path, key: list[Any], compute: Callable[[], Any]) -> Any:
    """`compute()`'s result (anything `torch.save` keeps with `weights_only` loading) from
    `<troupe cache>/test-oracles/<digest>.pt`, the digest covering `key` and everything an oracle on the
    converted folder `model_dir` depends on: its conversion record, the weights' size and mtime, and the
    transformers and torch versions. The first process to need it computes it under a file lock; the
    others wait and read it."""
    import transformers

    stat = (model_dir / "model.safetensors").stat()
    h = hashlib.sha256(json.dumps([*key, transformers.__version__, torch.__version__,
                                   (model_dir / "troupe_conversion.json").read_text(), stat.st_size,
                                   stat.st_mtime_ns]).encode())
    folder = cache_dir() / "test-oracles"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{h.hexdigest()[:24]}.pt"
    with open(folder / f"{path.stem}.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if path.exists():
            return torch.load(path, weights_only=True)
        value = compute()
        partial = path.with_suffix(".partial")
        torch.save(value, partial)
        os.replace(partial, path)
        return value
