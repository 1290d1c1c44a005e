"""`python -m troupe.bench.ipc` on the null model: runs longer than the default KV pool's 512 tokens a
sequence finish (the bench sizes the pool), and a request the engine cuts short is reported, not counted."""

from __future__ import annotations

import re

import anyio
import pytest

from troupe import AsyncLLM
from troupe.bench import ipc
from troupe.bench.offline import stream_requests


def test_null_runs_past_the_default_pool(capsys: pytest.CaptureFixture[str]) -> None:
    assert ipc.main(["null", "--modes", "in-process", "--streams", "2", "--null-tokens", "600", "--repeats", "1",
                     "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rate = re.search(r"in-process +([\d.]+) output tok/s", out)
    assert rate is not None and float(rate.group(1)) > 0


def test_pool_sizing_holds_every_stream() -> None:
    blocks = ipc.null_pool_blocks(streams=3, tokens=600)
    assert (blocks - 1) * 16 >= 3 * (64 + 600)


def test_a_request_cut_short_is_an_error_not_a_rate() -> None:
    async def run() -> None:
        # 8 usable blocks: 128 tokens, so a 600-token request is capped at what the pool holds
        async with AsyncLLM(null_model=True, num_kv_blocks=9, num_threads=1) as llm:
            await stream_requests(llm, 1, 1, 600)

    with pytest.raises(RuntimeError, match="1 requests of 600 tokens produced 1[01][0-9] tokens"):
        anyio.run(run)
