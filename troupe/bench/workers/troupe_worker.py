"""troupe's offline `LLM` as a `troupe bench` worker: `python -m troupe.bench.workers.troupe_worker SPEC
RESULT` (see `wire`). `spec["model"]` is what `LLM(model=...)` takes; `spec["options"]` are engine options
(EngineConfig fields: the harness gives dtype, num_threads, enable_prefix_caching=False and a troupe
configuration's own settings)."""

from __future__ import annotations

from typing import Any

from troupe.bench.workers import wire


class TroupeEngine:
    def __init__(self, spec: dict[str, Any]) -> None:
        from troupe import LLM

        self.llm = LLM(model=spec["model"], **spec["options"])

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        from troupe import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def info(self) -> dict[str, Any]:
        import msgspec
        import torch

        from troupe.kernels.cpu.build import isa

        return {"engine": "troupe", "config": msgspec.to_builtins(self.llm.config), "cpu_kernels_isa": isa(),
                "aten_cpu_capability": torch.backends.cpu.get_cpu_capability()}

    def close(self) -> None:
        self.llm.close()


if __name__ == "__main__":
    wire.run(TroupeEngine)
