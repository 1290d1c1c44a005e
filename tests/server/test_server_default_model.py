"""`troupe serve` with no model argument: the real default model (SmolLM2-135M-Instruct) answers a
chat completion through the official openai client. Slow: the model loads (and converts from its
GGUF on first use)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from server_process import ServerProcess

pytestmark = pytest.mark.timeout(600)  # the default model loads (and converts on first use)


@pytest.mark.slow
def test_a_real_chat_completion(tmp_path: Path) -> None:
    """A greedy chat answer from the real model is on topic, and usage adds up."""
    with ServerProcess(["--max-model-len", "1024"], tmp_path) as srv:
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            model = client.models.list().data[0].id
            resp = client.chat.completions.create(
                model=model, temperature=0.0, max_tokens=40,
                messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    answer = resp.choices[0].message.content or ""
    assert "Paris" in answer, answer
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage is not None and resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
