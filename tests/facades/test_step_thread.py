"""An engine's core is built on the thread that steps it, in its own process and in the frontend's: two
threads would keep two OpenMP teams, and libgomp then throttles both (a decode step of the default model
took 10 ms instead of 5 on 2 cores; troupe.engine.core_actor). The probe plugin (tests/support/
thread_probe.py) fails any step on another thread than the build's, which ends the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from factories import TINY_ENGINE as ENGINE

from troupe import AsyncLLM, SamplingParams

pytestmark = pytest.mark.slow  # engines in processes


@pytest.mark.parametrize("multiprocess", [True, False], ids=["engine-process", "in-process"])
async def test_the_core_is_built_on_the_thread_that_steps_it(tiny_llama: Path, multiprocess: bool,
                                                             ipc_root: str, check_leftovers: Any) -> None:
    async with AsyncLLM(str(tiny_llama), max_model_len=256, hooks="support.thread_probe:", **ENGINE,
                        multiprocess=multiprocess, ipc_dir=ipc_root) as llm:
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
        final = None
        async for out in llm.generate("the one thread", params, request_id="r"):
            final = out
        assert final is not None and final.finished
        assert final.outputs[0].finish_reason == "length" and len(final.outputs[0].token_ids) == 4
        await llm.check_health()
    check_leftovers()
