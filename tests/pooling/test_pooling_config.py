"""The pooler's resolution and the pure pieces of pooling: sentence-transformers folders, the
override, Matryoshka checks, `PoolingParams` validation, the `Pooler`'s chunk folding, vLLM's pairing
for scores."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import make_request

from troupe.config import EngineConfig
from troupe.core.batch import ScheduledSeq
from troupe.core.pooler import Pooler
from troupe.errors import InvalidInputError
from troupe.pooling import PoolerConfig, PoolingParams, cosine, resolve_pooler, score_pairs

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def st_folder(path: Path, modes: dict[str, Any], normalize: bool, extra: list[dict[str, Any]] | None = None) -> Path:
    """A sentence-transformers folder: modules.json and 1_Pooling/config.json."""
    pooling = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    modules = [TRANSFORMER, pooling] + ([NORMALIZE] if normalize else []) + (extra or [])
    (path / "1_Pooling").mkdir(parents=True)
    (path / "modules.json").write_text(json.dumps(modules))
    cfg = {"word_embedding_dimension": 8, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
           "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False, **modes}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(("modes", "normalize", "expected"), [
    ({"pooling_mode_mean_tokens": True}, True, ("MEAN", True)),
    ({"pooling_mode_lasttoken": True}, False, ("LAST", False)),
    ({"pooling_mode_cls_token": True}, True, ("CLS", True)),
])
def test_sentence_transformers_folder_decides(tmp_path: Path, modes: dict[str, Any], normalize: bool,
                                              expected: tuple[str, bool]) -> None:
    """modules.json's Pooling module gives the mode, a Normalize module turns normalization on."""
    got = resolve_pooler(st_folder(tmp_path, modes, normalize), {}, 8)
    assert (got.pooling_type, got.normalize) == expected


def test_default_is_vllms_last_token_normalized(tmp_path: Path) -> None:
    """Without modules.json a decoder LM embeds as vLLM's default: last token, L2-normalized."""
    got = resolve_pooler(tmp_path, {"hidden_size": 8}, 8)
    assert (got.pooling_type, got.normalize, got.matryoshka) == ("LAST", True, False)


def test_override_wins_over_the_folder(tmp_path: Path) -> None:
    """pooler_config overrides the folder's choice, key by key (case-insensitive type)."""
    folder = st_folder(tmp_path, {"pooling_mode_mean_tokens": True}, True)
    assert resolve_pooler(folder, {}, 8, {"pooling_type": "cls"}).pooling_type == "CLS"
    got = resolve_pooler(folder, {}, 8, {"normalize": False})
    assert (got.pooling_type, got.normalize) == ("MEAN", False)


@pytest.mark.parametrize(("modes", "extra", "match"), [
    ({"pooling_mode_max_tokens": True}, None, "pooling_mode_max_tokens"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, None, "pooling modes"),
    ({"pooling_mode_mean_tokens": True, "include_prompt": False}, None, "include_prompt"),
    ({"pooling_mode_mean_tokens": True}, [{"path": "2_Dense", "type": "sentence_transformers.models.Dense"}], "Dense"),
])
def test_what_cannot_be_applied_is_an_error(tmp_path: Path, modes: dict[str, Any],
                                            extra: list[dict[str, Any]] | None, match: str) -> None:
    """A pooling mode or module troupe does not apply fails at load, never silently ignored."""
    with pytest.raises(ValueError, match=match):
        resolve_pooler(st_folder(tmp_path, modes, False, extra), {}, 8)


@pytest.mark.parametrize(("override", "field"), [
    ({"pooling_type": "MAX"}, "pooler_config.pooling_type"),
    ({"normalize": "yes"}, "pooler_config.normalize"),
    ({"softmax": True}, "pooler_config.softmax"),
])
def test_bad_override_names_the_key(override: dict[str, Any], field: str) -> None:
    """A bad pooler_config key or value is an InvalidInputError naming it; only with runner='pooling'."""
    with pytest.raises(InvalidInputError) as err:
        EngineConfig(runner="pooling", pooler_config=override)
    assert err.value.field == field
    with pytest.raises(InvalidInputError, match="runner='pooling'"):
        EngineConfig(pooler_config={"normalize": False})
    with pytest.raises(InvalidInputError) as bad_runner:
        EngineConfig(runner="embed")
    assert bad_runner.value.field == "runner"


def test_matryoshka_dimensions_checked() -> None:
    """dimensions: refused without Matryoshka support; within [1, hidden] and the declared sizes with it."""
    plain = PoolerConfig(hidden_size=64)
    with pytest.raises(InvalidInputError, match="Matryoshka"):
        plain.check(PoolingParams(dimensions=8))
    plain.check(PoolingParams())
    declared = resolve_pooler(Path("/nonexistent"), {"matryoshka_dimensions": [16, 32, 64]}, 64)
    declared.check(PoolingParams(dimensions=32))
    with pytest.raises(InvalidInputError, match=r"\[16, 32, 64\]"):
        declared.check(PoolingParams(dimensions=8))
    free = resolve_pooler(Path("/nonexistent"), {"is_matryoshka": True}, 64)
    free.check(PoolingParams(dimensions=5))
    with pytest.raises(InvalidInputError, match=r"\[1, 64\]"):
        free.check(PoolingParams(dimensions=65))


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"dimensions": 0}, "dimensions"), ({"dimensions": True}, "dimensions"), ({"normalize": 1}, "normalize"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
])
def test_pooling_params_validated(kwargs: dict[str, Any], field: str) -> None:
    """Each PoolingParams field's type and range, named on error."""
    with pytest.raises(InvalidInputError) as err:
        PoolingParams(**kwargs)
    assert err.value.field == field


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_pooler_folds_chunks_like_one_pass(kind: str) -> None:
    """Chunks of a prompt (with another request's chunk between, and a restart at position 0 after a
    preemption) pool to what the whole prompt pools to in one pass."""
    g = torch.Generator().manual_seed(0)
    full = torch.randn(10, 4, generator=g)  # (T, hidden): request "a"'s final hidden states
    other = torch.randn(3, 4, generator=g)
    pooler = Pooler(PoolerConfig(pooling_type=kind, normalize=False, hidden_size=4))
    requests = {"a": make_request(10, rid="a"), "b": make_request(3, rid="b")}

    def step(seqs: list[ScheduledSeq], rows_of: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        step_hidden = torch.cat(rows_of)  # (T_step, hidden)
        return pooler.update(seqs, step_hidden[pooler.rows(seqs)], requests)

    seq = lambda rid, start, n, total: ScheduledSeq(rid, [0] * n, start, [], start + n == total)  # noqa: E731
    assert step([seq("a", 0, 4, 10), seq("b", 0, 3, 3)], [full[:4], other]).keys() == {"b"}
    step([seq("a", 0, 3, 10)], [full[:3]])  # preempted and recomputed from 0
    assert step([seq("a", 3, 4, 10)], [full[3:7]]) == {}
    done = step([seq("a", 7, 3, 10)], [full[7:]])
    expected = {"LAST": full[-1], "MEAN": full.mean(dim=0), "CLS": full[0]}[kind]
    torch.testing.assert_close(done["a"], expected)
    assert requests["a"].pooling_state is None and requests["b"].pooling_state is None  # nothing kept
    assert pooler.finish(done["a"], PoolingParams(normalize=True)) == pytest.approx(
        torch.nn.functional.normalize(expected, dim=0).tolist(), abs=1e-6)


def test_score_pairing_and_cosine() -> None:
    """vLLM's pairing: one with many, or index by index; other shapes name the field."""
    assert score_pairs(1, 3) == [(0, 0), (0, 1), (0, 2)]
    assert score_pairs(2, 2) == [(0, 0), (1, 1)]
    with pytest.raises(InvalidInputError) as err:
        score_pairs(2, 3)
    assert err.value.field == "text_2"
    assert cosine([1.0, 0.0], [2.0, 0.0]) == pytest.approx(1.0)
    assert cosine([1.0, 0.0], [0.0, 3.0]) == pytest.approx(0.0)
    assert cosine([1.0, 1.0], [-1.0, -1.0]) == pytest.approx(-1.0)


def test_vllm_engine_arguments_for_pooling() -> None:
    """vLLM's `runner` and `override_pooler_config` (its older name for pooler_config) configure the
    engine as troupe's fields; passing both names is refused naming vLLM's."""
    from troupe.engine_args import EngineArgs, engine_config

    want = EngineConfig(model="m", runner="pooling", pooler_config={"normalize": False})
    assert engine_config({"model": "m", "runner": "pooling", "override_pooler_config": {"normalize": False}}) == want
    assert EngineArgs("m", runner="pooling", pooler_config={"normalize": False}).create_engine_config() == want
    with pytest.raises(InvalidInputError) as err:
        engine_config({"runner": "pooling", "override_pooler_config": {}, "pooler_config": {}})
    assert err.value.field == "override_pooler_config"
