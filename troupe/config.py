"""`EngineConfig`: the engine options shared by `LLM`, `AsyncLLM`, the CLI and the engine process.

A msgspec Struct, so it crosses a process boundary as it is. Validation names the option and the
allowed range.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import msgspec

from troupe.errors import InvalidInputError
from troupe.hooks import check_spec
from troupe.limits import InputLimits
from troupe.pooling import check_pooler_override

DEFAULT_MODEL = "smollm2-135m-instruct"
RAY_INSTALL_HINT = "pip install -e '.[ray]' in troupe's checkout (or pip install ray==2.60.0)"
KERNEL_SETS = ("auto", "eager", "cpu", "cuda")  # troupe.kernels.select: "auto" takes the best set for the device
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")  # docs/sampling.md
DEVICES = ("auto", "cpu", "cuda")  # troupe.kernels.select.resolve_device: "auto" is "cuda" when torch sees a GPU
QUANTIZATIONS = ("auto", "dequantize", "gguf", "gguf-q8", "gguf-bf16")  # troupe.models.loader.resolve_quantization
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's; on the CPU the only value accepted (troupe.core.model_runner)
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")  # the pool's dtype; "auto": the kernel set's choice


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str = DEFAULT_MODEL  # a folder, a .gguf file, a Hugging Face Hub id (troupe.models.hub) or the default
    revision: str | None = None  # a Hub id's branch, tag or commit (None: main)
    tokenizer: str | None = None  # vLLM's `tokenizer`: the tokenizer's folder, .gguf file or Hub id (None: the model's)
    dtype: str = "auto"  # "auto" (bfloat16 on CUDA; on CPU, bfloat16 only where it is native), "bfloat16",
    # "float16" (the eager and cuda kernel sets; "auto" kernels pick eager for it on the CPU), "float32"
    device: str = "auto"  # where the model runs: "auto" (CUDA when torch sees a GPU), "cpu", "cuda"
    max_model_len: int | None = None  # None: the model's context length; above it: an error at load
    # (troupe.models.loader.check_max_model_len; TROUPE_ALLOW_LONG_MAX_MODEL_LEN=1 allows it, as vLLM's env var)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_bytes
    decode_row_cache_bytes: int | None = None  # eager decode attention's contiguous K/V rows; None: 2x the pool; 0: off
    kernels: str = "auto"  # the kernel set (troupe.kernels): "auto", or a name from KERNEL_SETS
    # --- CUDA (docs/kernels.md, "Running on a GPU")
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION  # share of the GPU's memory the engine may use
    # (weights, activations, KV); an engine on the CPU refuses any other value (it sizes no GPU memory)
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly
    async_scheduling: bool = False  # launch step N+1 before step N's ids are read (troupe.core.overlap)
    # GGUF weights (docs/kernels.md): "auto" (a GGUF keeps its blocks, a folder its dtype), "dequantize"
    # (expand to float32 at load: the reference), "gguf" (blocks, float32 activations), "gguf-q8" (blocks,
    # 8-bit activations: needs kernels="cpu"), "gguf-bf16" (blocks; batches computed in bfloat16 with float32
    # sums: needs kernels="cpu" and a CPU with avx512_bf16)
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES; "auto": cpu set float16, eager set the model's dtype
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # "fcfs", or "priority" (lower `priority` value first, then arrival)
    seed: int = 0
    num_threads: int | None = None  # torch threads in the engine; None: all cores / engines
    output_chunk_size: int = 128
    null_model: bool = False  # a model that returns a fixed token with no compute (tests, benchmarks)
    # --- pooling (docs/pooling.md)
    runner: str = "generate"  # "generate", or "pooling": embeddings (encode / embed / score), no generation
    pooler_config: dict[str, Any] | None = None  # overrides the model's pooler: pooling_type, normalize
    # --- sampling (docs/sampling.md)
    max_logprobs: int = 20  # the most `logprobs` / `prompt_logprobs` a request may ask for; -1: the whole vocab
    logprobs_mode: str = "raw_logprobs"  # what logprobs report (vLLM's): raw_/processed_ + logprobs/logits
    # --- the engine process (docs/multiprocess.md)
    multiprocess: bool = True  # the EngineCore runs in its own spawned process; False: in this one (debugging)
    engine_address: str | None = None  # None: ipc:// in a private temp dir; or "tcp://HOST:PORT" (port "*": any)
    ipc_dir: str | None = None  # where that private dir is made (None: the system temp dir)
    engine_ready_timeout_s: float = 300.0  # start-up handshake deadline (first use may convert a model)
    engine_hang_timeout_s: float | None = 120.0  # no step for this long while requests wait: "hung"
    engine_shutdown_timeout_s: float = 5.0  # graceful stop before SIGTERM (then SIGKILL after 2 s more)
    # --- data parallel (docs/data_parallel.md)
    data_parallel_size: int = 1  # EngineCores serving this frontend, behind the DP balancer
    data_parallel_size_local: int | None = None  # of those, spawned here (ranks 0..local-1); None: all
    data_parallel_address: str | None = None  # "tcp://HOST:PORT": rank r of the others connects to PORT + r
    data_parallel_backend: str = "mp"  # "mp": processes spawned here (+ `troupe engine`s); "ray": every rank a Ray actor
    ray_address: str | None = None  # the Ray cluster; None: RAY_ADDRESS if set, else a local one started here
    ray_resources: dict[str, float] | list[dict[str, float]] | None = None  # extra resources of each rank's
    # placement group bundle (custom ones pick the nodes), the same for every rank or one dict per rank
    # --- logging (docs/debugging.md)
    log_stats_interval_s: float | None = 10.0  # the periodic stats line (silent while idle); None: off
    grammar_compile_timeout_s: float = 30.0  # a structured request whose grammar takes longer fails alone
    input_limits: InputLimits = msgspec.field(default_factory=InputLimits)  # per-request bounds (troupe.limits)
    hooks: str | None = None  # "module[:argument]": a plugin at the hook points (troupe.hooks; tests' faults)

    def __post_init__(self) -> None:
        check_spec(self.hooks)
        if self.dtype not in ("auto", "bfloat16", "float16", "float32", "bf16", "fp16", "half", "fp32"):
            raise InvalidInputError("dtype", f"must be 'auto', 'bfloat16', 'float16' or 'float32', got {self.dtype!r}")
        self.dtype = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}.get(self.dtype,
                                                                                                        self.dtype)
        for name, lo in (("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("block_size", 1),
                         ("output_chunk_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < lo:
                raise InvalidInputError(name, f"must be an integer >= {lo}, got {value!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise InvalidInputError("max_logprobs", f"must be an integer >= -1 (-1: the whole vocabulary), got "
                                    f"{self.max_logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidInputError("logprobs_mode", f"must be one of {list(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.kernels not in KERNEL_SETS:
            raise InvalidInputError("kernels", f"must be one of {list(KERNEL_SETS)}, got {self.kernels!r}")
        if self.device not in DEVICES:
            raise InvalidInputError("device", f"must be one of {list(DEVICES)}, got {self.device!r}")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1:
            raise InvalidInputError("gpu_memory_utilization", f"must be a fraction in (0, 1], got {util!r}")
        if not isinstance(self.enforce_eager, bool):
            raise InvalidInputError("enforce_eager", f"must be true or false, got {self.enforce_eager!r}")
        if not isinstance(self.async_scheduling, bool):
            raise InvalidInputError("async_scheduling", f"must be true or false, got {self.async_scheduling!r}")
        if self.async_scheduling and self.runner == "pooling":
            raise InvalidInputError("async_scheduling", "applies to generation; runner='pooling' samples nothing "
                                    "(leave async_scheduling off)")
        if self.quantization not in QUANTIZATIONS:
            raise InvalidInputError("quantization", f"must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidInputError("kv_cache_dtype", f"must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        # the eager set's pool is in the model's dtype (with dtype "auto" it checks once that is known)
        if self.kernels == "eager" and self.dtype != "auto" and self.kv_cache_dtype not in ("auto", self.dtype):
            raise InvalidInputError("kv_cache_dtype", f"the eager kernel set keeps the KV pool in the model's dtype: "
                                    f"must be 'auto' or dtype ({self.dtype!r}) with kernels='eager', "
                                    f"got {self.kv_cache_dtype!r}")
        if self.runner not in ("generate", "pooling"):
            raise InvalidInputError("runner", f"must be 'generate' or 'pooling', got {self.runner!r}")
        if self.pooler_config is not None and self.runner != "pooling":
            raise InvalidInputError("pooler_config", "is only used with runner='pooling'")
        check_pooler_override(self.pooler_config)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InvalidInputError("seed", f"must be an integer (the engine's random state is always seeded), got "
                                    f"{self.seed!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise InvalidInputError("scheduling_policy", f"must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidInputError("max_model_len", f"must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise InvalidInputError("kv_cache_memory_bytes", f"must be > 0, got {self.kv_cache_memory_bytes}")
        if self.decode_row_cache_bytes is not None and self.decode_row_cache_bytes < 0:
            raise InvalidInputError("decode_row_cache_bytes", f"must be >= 0, got {self.decode_row_cache_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidInputError("num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        if self.num_threads is not None and self.num_threads < 1:
            raise InvalidInputError("num_threads", f"must be >= 1, got {self.num_threads}")
        if not self.grammar_compile_timeout_s > 0:
            raise InvalidInputError("grammar_compile_timeout_s", f"must be > 0, got {self.grammar_compile_timeout_s}")
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise InvalidInputError("data_parallel_size", f"must be an integer >= 1, got {self.data_parallel_size!r}")
        local = self.data_parallel_size_local
        if local is not None and not 0 <= local <= self.data_parallel_size:
            raise InvalidInputError("data_parallel_size_local",
                                    f"must be in [0, {self.data_parallel_size}] (data_parallel_size), got {local!r}")
        self._check_backend()
        joining = self.num_remote_engines if self.data_parallel_backend == "mp" else 0
        if joining and not (self.data_parallel_address or "").startswith("tcp://"):
            raise InvalidInputError("data_parallel_address", "must be tcp://HOST:PORT when engines join from "
                                    f"elsewhere (data_parallel_size_local={local}), got {self.data_parallel_address!r}")
        for name in ("engine_ready_timeout_s", "engine_hang_timeout_s", "engine_shutdown_timeout_s",
                     "log_stats_interval_s"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int | float) or value <= 0):
                raise InvalidInputError(name, f"must be a number of seconds > 0, got {value!r}")
        if self.engine_address is not None and not self.engine_address.startswith(("ipc://", "tcp://")):
            raise InvalidInputError("engine_address", f"must start with ipc:// or tcp://, got {self.engine_address!r}")

    def _check_backend(self) -> None:
        if self.data_parallel_backend not in ("mp", "ray"):
            raise InvalidInputError("data_parallel_backend", f"must be 'mp' or 'ray', got {self.data_parallel_backend!r}")
        ray_set = [name for name in ("ray_address", "ray_resources") if getattr(self, name) is not None]
        if self.data_parallel_backend == "mp":
            if ray_set:
                raise InvalidInputError(ray_set[0], "is only used with data_parallel_backend='ray'")
            return
        if not _ray_installed():
            raise InvalidInputError("data_parallel_backend", f"'ray' needs Ray, which is not installed: {RAY_INSTALL_HINT}")
        if self.data_parallel_size_local is not None:
            raise InvalidInputError("data_parallel_size_local", "must be unset with data_parallel_backend='ray' "
                                    f"(Ray places every rank), got {self.data_parallel_size_local!r}")
        if self.data_parallel_address is not None and not self.data_parallel_address.startswith("tcp://"):
            raise InvalidInputError("data_parallel_address", f"must be tcp://HOST:PORT, got {self.data_parallel_address!r}")
        if (self.ray_address or "").startswith("ray://"):
            raise InvalidInputError("ray_address", "Ray Client (ray://) is not supported: run troupe on a node of the "
                                    f"cluster and give its GCS address (host:port, or 'auto'), got {self.ray_address!r}")
        resources = self.ray_resources
        if isinstance(resources, list) and len(resources) != self.data_parallel_size:
            raise InvalidInputError("ray_resources", f"a list needs one dict per rank ({self.data_parallel_size}), "
                                    f"got {len(resources)}")
        for bundle in resources if isinstance(resources, list) else [resources or {}]:
            for name, amount in bundle.items():
                if name in ("CPU", "GPU") or not isinstance(amount, int | float) or not amount > 0:
                    raise InvalidInputError("ray_resources", f"{name}={amount!r}: amounts must be numbers > 0 "
                                            "(CPU and GPU come from num_threads and the device)")

    @property
    def num_local_engines(self) -> int:
        """Engines this frontend starts itself (ranks 0 .. num_local_engines - 1); none with Ray."""
        if self.data_parallel_backend == "ray":
            return 0
        return self.data_parallel_size if self.data_parallel_size_local is None else self.data_parallel_size_local

    @property
    def num_remote_engines(self) -> int:
        """Engines started elsewhere (`troupe engine --connect`, or Ray actors) that join over TCP."""
        return self.data_parallel_size - self.num_local_engines


def _ray_installed() -> bool:
    """Whether `import ray` can work, without importing it (a second or more)."""
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):  # a blocked import (sys.modules["ray"] = None) raises ValueError
        return False
