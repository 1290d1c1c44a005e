"""Hugging Face transformers' `generate` as a `troupe bench` worker: `python -m
troupe.bench.workers.hf_worker SPEC RESULT` (see `wire`).

`spec["model"]` is a Hugging Face folder (`spec["options"]["gguf_file"]`: a GGUF inside it, read by
transformers' own GGUF loader); `options`: `dtype` and `batch_size`. A batch of prompts runs in
left-padded chunks of `batch_size` (greedy, `min_new_tokens` = `max_new_tokens`, so EOS never ends a
row early); `threads` sets torch's thread count.
"""

from __future__ import annotations

from typing import Any

from troupe.bench.workers import wire


class HFEngine:
    def __init__(self, spec: dict[str, Any]) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        options = dict(spec["options"])
        self.batch_size = int(options.pop("batch_size"))
        self.dtype = options.pop("dtype")
        extra = {"gguf_file": options.pop("gguf_file")} if options.get("gguf_file") else {}
        tok = AutoTokenizer.from_pretrained(spec["model"], local_files_only=True, **extra)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        model: Any = AutoModelForCausalLM.from_pretrained(spec["model"], local_files_only=True,
                                                          dtype=getattr(torch, self.dtype), **extra, **options)
        self.model = model.eval()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        import torch

        produced = 0
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start:start + self.batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in chunk])  # (B, width) left-padded
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                          max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                          pad_token_id=self.pad)
            produced += (out.shape[1] - width) * len(chunk)
        return produced

    def info(self) -> dict[str, Any]:
        import torch
        import transformers

        return {"engine": "transformers", "version": transformers.__version__, "dtype": self.dtype,
                "batch_size": self.batch_size, "torch_threads": torch.get_num_threads(),
                "aten_cpu_capability": torch.backends.cpu.get_cpu_capability()}

    def close(self) -> None:
        pass


if __name__ == "__main__":
    wire.run(HFEngine)
