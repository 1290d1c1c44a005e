"""vLLM's offline `LLM` as a `troupe bench` worker: `VLLM_PY vllm_worker.py SPEC RESULT` (see `wire`).

Runs on the vllm venv's python: imports vllm, the standard library and its sibling `wire`, never troupe.
`spec["model"]` is a Hugging Face folder; `spec["options"]` are `vllm.LLM` keyword arguments (the harness
gives dtype and enable_prefix_caching=False); the CPU settings (`VLLM_CPU_OMP_THREADS_BIND`,
`VLLM_CPU_KVCACHE_SPACE`) come in the environment.
"""

from __future__ import annotations

from typing import Any

import wire  # the sibling module: this file runs as a script


class VllmEngine:
    def __init__(self, spec: dict[str, Any]) -> None:
        from vllm import LLM

        self.llm = LLM(model=spec["model"], seed=0, **spec["options"])

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def info(self) -> dict[str, Any]:
        import os

        import vllm

        config = getattr(getattr(self.llm, "llm_engine", None), "model_config", None)
        return {"engine": "vllm", "version": vllm.__version__,
                "dtype": str(getattr(config, "dtype", "unknown")),  # what `auto` resolved to
                "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")}}

    def close(self) -> None:
        client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if client is not None:  # the EngineCore process; else it goes with the interpreter
            client.shutdown()


if __name__ == "__main__":
    wire.run(VllmEngine)
