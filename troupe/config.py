"""`EngineConfig`: the engine options shared by `LLM`, `AsyncLLM`, the CLI and the engine process.

A msgspec Struct, so it crosses a process boundary as it is. Validation names the option and the
allowed range.
"""

from __future__ import annotations

import msgspec

from troupe.errors import InvalidInputError

DEFAULT_MODEL = "smollm2-135m-instruct"


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # "auto", "bfloat16", "float32"
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_bytes
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None  # torch threads in the engine; None: all cores / engines
    output_chunk_size: int = 128
    null_model: bool = False  # a model that returns a fixed token with no compute (tests, benchmarks)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float32", "bf16", "fp32"):
            raise InvalidInputError("dtype", f"must be 'auto', 'bfloat16' or 'float32', got {self.dtype!r}")
        self.dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(self.dtype, self.dtype)
        for name, lo in (("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("block_size", 1),
                         ("output_chunk_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < lo:
                raise InvalidInputError(name, f"must be an integer >= {lo}, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidInputError("max_model_len", f"must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise InvalidInputError("kv_cache_memory_bytes", f"must be > 0, got {self.kv_cache_memory_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidInputError("num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        if self.num_threads is not None and self.num_threads < 1:
            raise InvalidInputError("num_threads", f"must be >= 1, got {self.num_threads}")
