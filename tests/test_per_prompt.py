"""`troupe.inputs.per_prompt`: what `LLM.generate` and `LLM.encode` make of their parameters argument."""

from __future__ import annotations

import pytest

from troupe.errors import InvalidInputError
from troupe.inputs import per_prompt
from troupe.pooling import PoolingParams
from troupe.sampling_params import SamplingParams


@pytest.mark.parametrize(("kind", "field"), [(SamplingParams, "sampling_params"), (PoolingParams, "pooling_params")])
def test_none_one_or_one_per_prompt(kind: type, field: str) -> None:
    defaults = per_prompt(None, 3, kind, field, kind)
    assert len(defaults) == 3 and all(isinstance(p, kind) for p in defaults)
    assert len({id(p) for p in defaults}) == 3  # a fresh default each, none shared
    one = kind()
    assert per_prompt(one, 2, kind, field, kind) == [one, one]
    pair = [kind(), kind()]
    assert per_prompt(pair, 2, kind, field, kind) == pair
    with pytest.raises(InvalidInputError, match=f"{field}: got 1 for 2 prompts") as err:
        per_prompt([one], 2, kind, field, kind)
    assert err.value.field == field
