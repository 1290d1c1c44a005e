"""llama-cpp-python as a `troupe bench` worker: `LLAMACPP_PY llamacpp_worker.py SPEC RESULT` (see `wire`).

Runs on the llama.cpp venv's python: imports llama_cpp, the standard library and its sibling `wire`,
never troupe. `spec["model"]` is a GGUF file; `spec["options"]` are `llama_cpp.Llama` keyword arguments
(the harness gives n_threads, n_threads_batch and n_ctx). llama.cpp has no batching in this API: a batch
of prompts runs one after the other. Each prompt starts from an empty context (`reset()`), so nothing of
an earlier prompt is reused (llama-cpp-python otherwise keeps the longest common prefix). Greedy:
`temp=0`; the generator never stops on EOS by itself, so exactly `max_tokens` tokens are taken.
"""

from __future__ import annotations

from typing import Any

import wire  # the sibling module: this file runs as a script


class LlamaCppEngine:
    def __init__(self, spec: dict[str, Any]) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=spec["model"], verbose=False, seed=0, **spec["options"])

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        produced = 0
        for prompt in prompts:
            self.llm.reset()
            count = 0
            for _ in self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                       reset=True):
                count += 1
                if count == max_tokens:
                    break
            produced += count
        return produced

    def info(self) -> dict[str, Any]:
        import llama_cpp

        return {"engine": "llama.cpp", "version": llama_cpp.__version__}

    def close(self) -> None:
        self.llm.close()


if __name__ == "__main__":
    wire.run(LlamaCppEngine)
