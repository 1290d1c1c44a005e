"""transformers' pooled hidden states: the oracle of the pooling tests (importable from every test folder).

`AutoModel` in float32 on the same weights; `last_hidden_state` is taken after the model's final norm
(as sentence-transformers reads it) and pooled the way the engine's pooler says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def hf_model(path: str | Path) -> Any:
    """transformers' `AutoModel` (no LM head) of the folder, float32, eval mode."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def hf_pooled(model: Any, ids: list[int], pooling_type: str, normalize: bool, dimensions: int | None = None
              ) -> torch.Tensor:
    """(hidden,) or (dimensions,): `ids` through `model`, pooled (LAST / MEAN / CLS), cut, normalized."""
    with torch.inference_mode():
        hidden = model(torch.tensor([ids])).last_hidden_state[0].float()  # (T, hidden)
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling_type]
    if dimensions is not None:
        vector = vector[:dimensions]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def stored_hf_last_pooled(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """`hf_pooled(..., "LAST", True)` of each prompt on the default model's converted folder, computed once
    and kept in `<troupe cache>/test-oracles/` under a digest of everything it depends on (the prompts,
    the converted weights' record, size and mtime, the transformers and torch versions), as
    tests/models/test_hf_equality.py keeps its greedy runs: a later session skips loading transformers'
    model. The first process computes it under a file lock; the others wait and read it."""
    from support.oracles import stored

    def compute() -> list[torch.Tensor]:
        model = hf_model(model_dir)
        return [hf_pooled(model, p, "LAST", True) for p in prompts]

    return list(stored(model_dir, ["pool-last-normalized", prompts], compute))
