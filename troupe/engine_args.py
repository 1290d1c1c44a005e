"""vLLM's way of configuring an engine: `EngineArgs`, and vLLM's keyword arguments that troupe has no field for.

`engine_config(options)` turns the keyword options of `LLM(...)` / `AsyncLLM(...)` / `EngineArgs(...)` into an
`EngineConfig`:

1. troupe's own fields (`EngineConfig`) pass as they are; vLLM's arguments of the same name and meaning
   (`max_num_seqs`, `gpu_memory_utilization`, `enforce_eager`, `seed`, ...) are those fields.
2. vLLM's arguments that troupe names otherwise are mapped (`RENAMED`): `disable_log_stats=True` is
   `log_stats_interval_s=None`, `num_gpu_blocks_override` is `num_kv_blocks`. Passing both names is refused.
3. For `max_num_seqs`, `max_num_batched_tokens`, `block_size` and `enable_prefix_caching`, None (vLLM's "the
   engine's default") is troupe's default.
4. vLLM's arguments that troupe has no option for (`NEUTRAL`) are accepted when the value asks for what
   troupe does anyway, and refused otherwise with an `InvalidInputError` naming the argument, the values
   allowed and what troupe does instead. Nothing accepted is ignored: an accepted value is one troupe's
   behaviour already is (docs/vllm_compat.md has the table).
5. Anything else is a `TypeError` naming the keyword, as for any Python call.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from troupe.config import EngineConfig
from troupe.errors import InvalidInputError


class Neutral(NamedTuple):
    """A vLLM argument with no troupe option: the values that ask for what troupe does, and why."""

    allowed: tuple[Any, ...]
    why: str


_ONE_DEVICE = ("each engine runs its model whole on one device; for more throughput run several engines "
               "(data_parallel_size)")
NEUTRAL: dict[str, Neutral] = {
    "tensor_parallel_size": Neutral((1,), _ONE_DEVICE),
    "pipeline_parallel_size": Neutral((1,), _ONE_DEVICE),
    "trust_remote_code": Neutral((False, True), "troupe runs no code from a model's folder: its architectures are "
                                 "its own and a model that needs its own code is refused at load"),
    "enable_chunked_prefill": Neutral((True, None), "troupe's scheduler always splits a prompt longer than "
                                      "max_num_batched_tokens into chunks"),
    "swap_space": Neutral((0, 4), "troupe preempts by recomputation (as vLLM v1) and keeps no CPU swap space: "
                          "0 or vLLM's default 4"),
    "cpu_offload_gb": Neutral((0,), "troupe keeps every weight on the engine's device"),
    "tokenizer_mode": Neutral(("auto",), "troupe loads the model's own tokenizer (the fast one where there is one)"),
    "skip_tokenizer_init": Neutral((False,), "troupe's frontend tokenizes prompts and detokenizes outputs"),
    "distributed_executor_backend": Neutral((None, "mp", "uni"), "each engine runs its model in one process; "
                                            "data_parallel_backend chooses how the engines start ('mp' or 'ray')"),
    "disable_custom_all_reduce": Neutral((False, True), "with one device per engine there is no all-reduce"),
    "load_format": Neutral(("auto",), "troupe reads safetensors folders and GGUF files by what it finds"),
}
RENAMED = {"num_gpu_blocks_override": "num_kv_blocks"}  # vLLM's name -> EngineConfig's (same meaning)
NONE_IS_DEFAULT = ("max_num_seqs", "max_num_batched_tokens", "block_size", "enable_prefix_caching")
_FIELDS = frozenset(EngineConfig.__struct_fields__)


def _same(value: Any, allowed: Any) -> bool:
    """`value == allowed` without True passing for 1 or 1 for True."""
    if isinstance(value, bool) or isinstance(allowed, bool) or value is None or allowed is None:
        return value is allowed
    return type(value) in (int, float) and type(allowed) in (int, float) and value == allowed or (
        isinstance(value, str) and value == allowed)


def engine_config(options: dict[str, Any]) -> EngineConfig:
    """The `EngineConfig` of these keyword options (troupe's fields and vLLM's arguments, see the module)."""
    options = dict(options)
    for name, spec in NEUTRAL.items():
        if name in options:
            value = options.pop(name)
            if not any(_same(value, ok) for ok in spec.allowed):
                raise InvalidInputError(name, f"must be one of {list(spec.allowed)}, got {value!r}: {spec.why}")
    for vllm_name, field in RENAMED.items():
        if vllm_name in options:
            if field in options:
                raise InvalidInputError(vllm_name, f"is vLLM's name for {field}: pass one of the two")
            options[field] = options.pop(vllm_name)
    if "disable_log_stats" in options:
        disable = options.pop("disable_log_stats")
        if not isinstance(disable, bool):
            raise InvalidInputError("disable_log_stats", f"must be true or false, got {disable!r}")
        if "log_stats_interval_s" in options and (options["log_stats_interval_s"] is None) != disable:
            raise InvalidInputError("disable_log_stats", f"contradicts log_stats_interval_s="
                                    f"{options['log_stats_interval_s']!r} "
                                    "(None turns the stats line off): pass one of the two")
        if disable:
            options["log_stats_interval_s"] = None
    for name in NONE_IS_DEFAULT:
        if name in options and options[name] is None:
            del options[name]
    unknown = sorted(set(options) - _FIELDS)
    if unknown:
        raise TypeError(f"unexpected engine option {unknown[0]!r}: see troupe.config.EngineConfig for troupe's "
                        "options and docs/vllm_compat.md for vLLM's")
    return EngineConfig(**options)


class EngineArgs:
    """vLLM's `EngineArgs`: the engine's options by keyword (troupe's `EngineConfig` fields and vLLM's
    arguments, see `engine_config`), checked when made. `LLM.from_engine_args(args)` and
    `AsyncLLM.from_engine_args(args)` build an engine from them; `create_engine_config()` is the
    `EngineConfig` that `AsyncLLM.from_vllm_config` takes. Reading an option (`args.max_num_seqs`) gives
    its value as given, else the config's."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        if model is not None:
            options["model"] = model
        self._options = options
        self._config = engine_config(options)

    def create_engine_config(self) -> EngineConfig:
        return engine_config(self._options)

    def options(self) -> dict[str, Any]:
        """The keyword options as given (what `LLM(**args.options())` takes)."""
        return dict(self._options)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._options:
            return self._options[name]
        if name in _FIELDS:
            return getattr(self._config, name)
        raise AttributeError(f"EngineArgs has no option {name!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._options.items())})"


class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the `EngineArgs` of `AsyncLLM`: the same options."""
