"""The sampling defaults a model folder's `generation_config.json` recommends (vLLM's
`--generation-config auto`, `ModelConfig.get_diff_sampling_param`).

Only these keys are read, with the `SamplingParams` field each one sets: `temperature`, `top_p`,
`top_k`, `min_p`, `repetition_penalty`, `max_new_tokens` -> `max_tokens`. A request (or
`LLM.generate` without `SamplingParams`) uses them for the fields it leaves unset. The default model's
GGUF carries no sampling metadata, so its converted folder recommends nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from troupe.errors import ModelLoadError

_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_INTS = ("top_k", "max_tokens")


def read_generation_defaults(folder: str | Path) -> dict[str, Any]:
    """`{SamplingParams field: value}` from `folder/generation_config.json` ({} without the file);
    a value of the wrong type is a `ModelLoadError` naming the key."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    out: dict[str, Any] = {}
    for key, field in _KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        ok = isinstance(value, int) if field in _INTS else isinstance(value, int | float)
        if isinstance(value, bool) or not ok:
            raise ModelLoadError(f"{path}: {key} must be a {'integer' if field in _INTS else 'number'}, got {value!r}")
        out[field] = float(value) if field not in _INTS else value
    return out
