"""vLLM's Python entry points on troupe's facades: `EngineArgs` with `from_engine_args` /
`from_vllm_config`, vLLM's keyword arguments (accepted where they ask for what troupe does, refused
naming the argument otherwise), `shutdown()`, and a scalar or per-prompt `priority`.

The option checks need no engine; the rest runs the tiny random-weight Llama in this process (one
engine for the generation tests), and in an engine process where `shutdown()` must stop one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from factories import TINY_ENGINE
from support.faults import fault_hooks

from troupe import LLM, AsyncEngineArgs, AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams
from troupe.config import EngineConfig
from troupe.engine_args import NEUTRAL, engine_config
from troupe.errors import EngineHungError, EngineStartupError, InvalidInputError

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ACCEPTED = [(name, value) for name, spec in NEUTRAL.items() for value in spec.allowed] + [("swap_space", 4.0)]
REFUSED = [("tensor_parallel_size", 2), ("tensor_parallel_size", True), ("pipeline_parallel_size", 4),
           ("trust_remote_code", "yes"), ("enable_chunked_prefill", False), ("swap_space", 16),
           ("cpu_offload_gb", 2), ("tokenizer_mode", "slow"), ("skip_tokenizer_init", True),
           ("distributed_executor_backend", "ray"), ("load_format", "dummy"), ("disable_custom_all_reduce", 0)]


@pytest.mark.parametrize("name,value", ACCEPTED, ids=[f"{n}={v}" for n, v in ACCEPTED])
def test_vllm_arguments_that_ask_for_what_troupe_does_are_accepted(name: str, value: Any) -> None:
    """Each accepted value of a vLLM-only argument gives the config troupe makes without it."""
    assert engine_config({"model": "m", name: value}) == EngineConfig(model="m")


@pytest.mark.parametrize("name,value", REFUSED, ids=[f"{n}={v}" for n, v in REFUSED])
def test_vllm_arguments_that_ask_for_more_are_refused_naming_them(name: str, value: Any) -> None:
    """A value troupe cannot honour is an InvalidInputError naming the argument, the values allowed
    and what troupe does instead; LLM(...) refuses it before starting anything."""
    with pytest.raises(InvalidInputError) as err:
        engine_config({name: value})
    assert err.value.field == name
    assert f"must be one of {list(NEUTRAL[name].allowed)}, got {value!r}: {NEUTRAL[name].why}" in str(err.value)
    with pytest.raises(InvalidInputError) as err:
        LLM(**{name: value})
    assert err.value.field == name


@pytest.mark.parametrize("options,want", [
    ({"disable_log_stats": True}, {"log_stats_interval_s": None}),
    ({"disable_log_stats": False}, {}),
    ({"disable_log_stats": True, "log_stats_interval_s": None}, {"log_stats_interval_s": None}),
    ({"disable_log_stats": False, "log_stats_interval_s": 3.0}, {"log_stats_interval_s": 3.0}),
    ({"num_gpu_blocks_override": 77}, {"num_kv_blocks": 77}),
    ({"max_num_seqs": None, "max_num_batched_tokens": None, "block_size": None, "enable_prefix_caching": None}, {}),
    ({"max_num_seqs": 5, "seed": 7, "enforce_eager": True}, {"max_num_seqs": 5, "seed": 7, "enforce_eager": True}),
], ids=["disable-stats", "keep-stats", "both-off", "both-on", "num-gpu-blocks", "none-is-default", "same-names"])
def test_vllm_names_map_to_troupes_fields(options: dict[str, Any], want: dict[str, Any]) -> None:
    """vLLM's names for troupe's options become those fields; None asks for troupe's default."""
    assert engine_config(options) == EngineConfig(**want)


@pytest.mark.parametrize("options,field", [
    ({"disable_log_stats": True, "log_stats_interval_s": 5.0}, "disable_log_stats"),
    ({"disable_log_stats": False, "log_stats_interval_s": None}, "disable_log_stats"),
    ({"disable_log_stats": "no"}, "disable_log_stats"),
    ({"num_gpu_blocks_override": 8, "num_kv_blocks": 8}, "num_gpu_blocks_override"),
    ({"seed": None}, "seed"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
], ids=["stats-on-and-off", "stats-off-and-on", "stats-not-bool", "both-block-names", "seed-none", "bad-field"])
def test_contradictions_and_bad_values_are_refused(options: dict[str, Any], field: str) -> None:
    """Two names for one option that disagree, or a bad value, are refused naming the argument."""
    with pytest.raises(InvalidInputError) as err:
        engine_config(options)
    assert err.value.field == field


def test_an_unknown_option_is_a_type_error_naming_it() -> None:
    """A keyword neither troupe nor this table knows is a TypeError naming it, as for any call."""
    with pytest.raises(TypeError, match="'lora_modules'"):
        engine_config({"lora_modules": []})
    with pytest.raises(TypeError, match="'lora_modules'"):
        EngineArgs(model="m", lora_modules=[])


def test_engine_args_check_and_read_their_options() -> None:
    """EngineArgs are checked when made; an option reads as given, else as the config's value; the
    config they create is the one the same keywords give."""
    with pytest.raises(InvalidInputError, match="tensor_parallel_size"):
        EngineArgs(model="m", tensor_parallel_size=8)
    args = AsyncEngineArgs(model="m", tensor_parallel_size=1, max_num_seqs=3)
    assert (args.model, args.tensor_parallel_size, args.max_num_seqs, args.block_size) == ("m", 1, 3, 16)
    assert args.create_engine_config() == EngineConfig(model="m", max_num_seqs=3)
    assert args.options() == {"model": "m", "tensor_parallel_size": 1, "max_num_seqs": 3}
    with pytest.raises(AttributeError, match="no option 'nope'"):
        _ = args.nope
    with pytest.raises(TypeError, match="EngineConfig"):
        AsyncLLM.from_vllm_config(args)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> Iterator[LLM]:
    """One in-process engine made as a vLLM script makes it, with priority scheduling."""
    args = EngineArgs(model=str(tiny_llama), tensor_parallel_size=1, pipeline_parallel_size=1, trust_remote_code=True,
                      enable_chunked_prefill=True, disable_log_stats=True, enforce_eager=True, seed=3, swap_space=4,
                      scheduling_policy="priority", multiprocess=False, num_gpu_blocks_override=96,
                      **{k: v for k, v in TINY_ENGINE.items() if k != "num_kv_blocks"})
    with LLM.from_engine_args(args) as llm:
        yield llm


@pytest.mark.slow
def test_from_engine_args_makes_the_engine_they_describe(llm: LLM) -> None:
    """The engine runs with the mapped options (num_gpu_blocks_override's pool, no stats line, the seed)."""
    assert llm.config.num_kv_blocks == 96 and llm.config.log_stats_interval_s is None and llm.config.seed == 3
    assert llm.get_stats()["num_kv_blocks"] == 96 - 1  # block 0 is the null block


@pytest.mark.slow
@pytest.mark.parametrize("priority", [0, -4, [1, -2, 0]], ids=["scalar-0", "scalar", "per-prompt"])
def test_priority_as_one_value_or_one_per_prompt(llm: LLM, priority: Any) -> None:
    """A scalar priority applies to every prompt, a list one per prompt; greedy tokens do not depend on it."""
    prompts = ["the cat", "one two", "a b c"]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, priority=priority)]
    assert got == want and all(len(t) == 4 for t in got)


@pytest.mark.slow
@pytest.mark.parametrize("priority,match", [(2**63, "signed 64-bit"), ([0, True], "signed 64-bit"),
                                            ("1", "signed 64-bit"), ([0], "1 values for 2 prompts")])
def test_bad_priorities_are_refused_naming_priority(llm: LLM, priority: Any, match: str) -> None:
    """Out of range, a bool, a string, or a list of the wrong length: an InvalidInputError on priority."""
    with pytest.raises(InvalidInputError, match=match) as err:
        llm.generate(["x", "y"], GREEDY, use_tqdm=False, priority=priority)
    assert err.value.field == "priority"


@pytest.mark.slow
def test_priority_under_fcfs_is_refused_as_vllm_does(tiny_llama: Path) -> None:
    """Under first-come-first-served, priority 0 (scalar or list) runs and any other value is refused
    (vLLM: "Priority scheduling is not enabled"); AsyncLLM's in the shutdown test below."""
    with LLM(str(tiny_llama), multiprocess=False, **TINY_ENGINE) as llm:
        assert len(llm.generate(["x", "y"], GREEDY, use_tqdm=False, priority=0)) == 2
        assert len(llm.generate(["x", "y"], GREEDY, use_tqdm=False, priority=[0, 0])) == 2
        for priority in (1, [0, -1]):
            with pytest.raises(InvalidInputError, match="first-come-first-served") as err:
                llm.generate(["x", "y"], GREEDY, use_tqdm=False, priority=priority)
            assert err.value.field == "priority"


@pytest.mark.slow
async def test_async_llm_shutdown_stops_the_engine_at_once(tiny_llama: Path, ipc_root: str,
                                                          check_leftovers: Any) -> None:
    """`await llm.shutdown()` inside the block ends a running stream with finish_reason "abort", stops
    the engine process, makes later calls raise, and is idempotent, after the block too. (And a
    priority under FCFS is refused, as vLLM does.)"""
    args = AsyncEngineArgs(model=str(tiny_llama), ipc_dir=ipc_root, **TINY_ENGINE)
    llm = AsyncLLM.from_engine_args(args)
    finals: list[Any] = []
    async with llm:
        pids = llm.engine_pids
        assert len(pids) == 1
        with pytest.raises(InvalidInputError, match="first-come-first-served"):
            async for _ in llm.generate("x", GREEDY, priority=5):
                pass

        streaming = anyio.Event()

        async def consume() -> None:
            long = SamplingParams(max_tokens=10_000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            async for out in llm.generate("go on", long):
                streaming.set()
                finals[:] = [out]

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await streaming.wait()
                await llm.shutdown()
            check_leftovers(pids)  # gone before the block ends
        assert finals[0].finished and finals[0].outputs[0].finish_reason == "abort"
        assert not llm.is_running
        with pytest.raises(RuntimeError, match="shut down"):
            async for _ in llm.generate("after", GREEDY):
                pass
        await llm.shutdown()
    await llm.shutdown()
    check_leftovers(pids)


@pytest.mark.slow
def test_llm_shutdown_is_close(tiny_llama: Path) -> None:
    """LLM.shutdown() stops the engine as close() does; later calls raise; a second shutdown is a no-op."""
    llm = LLM(str(tiny_llama), multiprocess=False, **TINY_ENGINE)
    assert len(llm.generate("hi", GREEDY, use_tqdm=False)) == 1
    llm.shutdown()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("hi", GREEDY, use_tqdm=False)
    llm.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU engine's refusal")
def test_gpu_memory_utilization_other_than_the_default_is_refused_on_the_cpu(tiny_llama: Path) -> None:
    """On the CPU gpu_memory_utilization sizes nothing: a value other than the default fails the start
    naming it and the options that size the pool there (the default passes: tests/e2e/test_device.py)."""
    with pytest.raises(EngineStartupError) as err:
        LLM(str(tiny_llama), gpu_memory_utilization=0.5, multiprocess=False)
    assert err.value.cause_type == "InvalidInputError"
    assert err.value.cause_message.startswith("gpu_memory_utilization: ")
    assert "kv_cache_memory_bytes" in err.value.cause_message


@pytest.mark.slow
async def test_shutdown_answers_the_calls_still_waiting(tiny_llama: Path, tmp_path: Path, ipc_root: str,
                                                       check_leftovers: Any) -> None:
    """With the engine's step blocked, a utility call waits for an answer that cannot come; shutdown()
    fails it with a RuntimeError instead of leaving it waiting, and the request in the step ends with
    finish_reason "abort"."""
    release = tmp_path / "release"  # never made: the first model call stays blocked
    async with AsyncLLM(str(tiny_llama), hooks=fault_hooks(f"block_after_steps=0,release={release}"),
                        engine_hang_timeout_s=0.2, engine_shutdown_timeout_s=0.5, ipc_dir=ipc_root,
                        **TINY_ENGINE) as llm:
        pids = llm.engine_pids
        finals: list[Any] = []
        errors: list[RuntimeError] = []

        async def generate() -> None:
            finals.extend([out async for out in llm.generate("stuck", GREEDY)][-1:])

        async def utility_call() -> None:
            try:
                await llm.get_stats()
            except RuntimeError as exc:
                errors.append(exc)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(generate)
                stuck = False
                while not stuck:  # the condition, polled under the deadline: the step is blocked
                    try:
                        await llm.check_health()
                    except EngineHungError:
                        stuck = True
                    await anyio.sleep(0.05)
                tg.start_soon(utility_call)
                while True:  # the condition, polled under the deadline: the call waits for its answer
                    if llm._port is not None and llm._port.num_unanswered > 0:
                        break
                    await anyio.sleep(0.01)
                assert errors == []
                await llm.shutdown()
        assert [str(e) for e in errors] == ["the engine was shut down before it answered"]
        assert finals[0].outputs[0].finish_reason == "abort"
    check_leftovers(pids)
