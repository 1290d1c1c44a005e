"""The blocking `LLM` facade: order, parity with AsyncLLM, threads, Ctrl-C; in both engine modes
(`engine_mode`), with one engine per mode for the module."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.faults import fault_hooks

from troupe import LLM, AsyncLLM, EngineDeadError, InvalidInputError, RequestOutputKind, SamplingParams

pytestmark = pytest.mark.slow  # engines in processes

ENGINE: dict[str, Any] = dict(dtype="float32", max_num_seqs=32, max_num_batched_tokens=256, num_kv_blocks=512)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path, engine_mode: dict[str, Any], check_leftovers: Any) -> Any:
    with LLM(str(tiny_llama), **ENGINE, **engine_mode) as llm:
        yield llm
    check_leftovers()


def test_outputs_come_back_in_input_order(llm: LLM) -> None:
    """64 prompts of mixed lengths and max_tokens: output i belongs to prompt i."""
    prompts = [f"prompt {i} " + "word " * (i * 3 % 50) for i in range(64)]
    sps = [SamplingParams(temperature=0.0, max_tokens=1 + i % 7, ignore_eos=True) for i in range(64)]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [1 + i % 7 for i in range(64)]
    assert all(o.finished for o in outs)


def test_greedy_results_equal_async_llm(llm: LLM, tiny_llama: Path, engine_mode: dict[str, Any]) -> None:
    """The same greedy requests give the same tokens through LLM and through AsyncLLM."""
    prompts = ["the cat sat on", "one two three", "a b c d e f g"]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    sync_ids = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    async def run() -> list[list[int]]:
        async with AsyncLLM(str(tiny_llama), **ENGINE, **engine_mode) as allm:
            res = []
            for p in prompts:
                final = [o async for o in allm.generate(p, SamplingParams(
                    temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY))][-1]
                res.append(list(final.outputs[0].token_ids))
            return res

    assert anyio.run(run) == [list(ids) for ids in sync_ids]


def test_param_list_length_mismatch_is_an_error(llm: LLM) -> None:
    """A per-prompt params list of the wrong length names the problem."""
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_chat_uses_the_chat_template(llm: LLM) -> None:
    """chat() renders the conversation with the template: the prompt text carries the roles."""
    out = llm.chat([{"role": "user", "content": "hi there"}], SamplingParams(max_tokens=2, temperature=0.0),
                   use_tqdm=False)[0]
    assert "hi there" in (out.prompt or "") and "user" in (out.prompt or "")


def test_safe_from_several_threads(llm: LLM) -> None:
    """Four threads calling generate at once each get their own, complete results."""
    results: dict[int, list[Any]] = {}

    def worker(t: int) -> None:
        results[t] = llm.generate([f"thread {t} item {i}" for i in range(8)],
                                  SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert sorted(results) == [0, 1, 2, 3]
    for t, outs in results.items():
        assert [o.prompt for o in outs] == [f"thread {t} item {i}" for i in range(8)]


@pytest.mark.parametrize("end", ["return", "raise"])
def test_an_in_process_llm_never_closed_lets_the_interpreter_exit(tiny_llama: Path, tmp_path: Path, end: str) -> None:
    """A script that leaves an in-process `LLM` open, ending normally or on an uncaught exception, exits
    at once with its own status: the `weakref.finalize` stops the engine at exit (its step thread once hung
    the exit: concurrent.futures joined it before the finalizer could run)."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        from troupe import LLM, SamplingParams
        llm = LLM({str(tiny_llama)!r}, dtype="float32", num_kv_blocks=64, multiprocess=False)
        out = llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        print(len(out[0].outputs[0].token_ids), flush=True)
        if {end == "raise"}:
            raise RuntimeError("the user's own error")
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.stdout.strip() == "3", proc.stderr[-2000:]
    if end == "raise":
        assert proc.returncode == 1 and proc.stderr.rstrip().endswith("RuntimeError: the user's own error")
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]


def test_ctrl_c_returns_control_quickly(tiny_llama: Path, tmp_path: Path, engine_mode: dict[str, Any]) -> None:
    """SIGINT during a long generate: KeyboardInterrupt within 2 s, then a clean exit."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import signal, sys, threading, time
        # a runner that starts the suite in the background of a non-interactive shell passes SIGINT on
        # as ignored, and Python then keeps it ignored: give this program the usual Ctrl-C handler
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from troupe import LLM, SamplingParams
        llm = LLM({str(tiny_llama)!r}, dtype="float32", num_kv_blocks=512, multiprocess={engine_mode["multiprocess"]})

        def announce():  # tell the parent once requests are in the engine
            while llm._engine.num_unfinished_requests == 0:
                time.sleep(0.01)
            print("generating", flush=True)

        threading.Thread(target=announce, daemon=True).start()
        try:
            llm.generate(["go " * 50] * 64, SamplingParams(max_tokens=100000, ignore_eos=True), use_tqdm=False)
        except KeyboardInterrupt:
            print("interrupted", time.monotonic(), flush=True)
        llm.close()
        print("closed", flush=True)
    """))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            first = proc.stdout.readline().strip()
            assert first == "generating", proc.stderr.read()
            sent = time.monotonic()
            proc.send_signal(signal.SIGINT)
            line = proc.stdout.readline().split()
            assert line and line[0] == "interrupted", proc.stderr.read()
            assert float(line[1]) - sent < 2.0
            assert proc.wait(timeout=30) == 0
            assert proc.stdout.read().strip() == "closed"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_bad_prompt_in_a_batch_raises_its_own_error(llm: LLM) -> None:
    """One invalid prompt among good ones: the batch raises InvalidInputError naming the field (never
    an ExceptionGroup), the prompts already submitted are aborted, and the next batch runs."""
    good = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with pytest.raises(InvalidInputError) as info:
        llm.generate(["fine", "also fine", {"prompt_token_ids": [10**7]}], good, use_tqdm=False)
    assert info.value.field == "prompt_token_ids"
    assert llm._engine.num_unfinished_requests == 0
    assert [len(o.outputs[0].token_ids) for o in llm.generate(["again", "x"], good, use_tqdm=False)] == [3, 3]


def test_after_a_death_every_call_raises_engine_dead(tiny_llama: Path, engine_mode: dict[str, Any],
                                                     check_leftovers: Any) -> None:
    """The model fails during a batch: generate raises EngineDeadError with the cause (not an
    ExceptionGroup); so do every later generate, chat and utility call; close() is clean."""
    with LLM(str(tiny_llama), hooks=fault_hooks("raise_after_steps=2"), **ENGINE, **engine_mode) as dying:
        pids = dying._engine.engine_pids
        sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        with pytest.raises(EngineDeadError, match="injected model failure"):
            dying.generate([f"doomed {i}" for i in range(4)], sp, use_tqdm=False)
        calls: list[Any] = [lambda: dying.generate("after", sp, use_tqdm=False),
                            lambda: dying.chat([{"role": "user", "content": "hi"}], sp, use_tqdm=False),
                            dying.get_stats, dying.reset_prefix_cache, dying.get_tokenizer]
        for call in calls:
            with pytest.raises(EngineDeadError, match="injected model failure"):
                call()
    check_leftovers(pids)


def test_a_failed_start_leaves_no_thread_importing_behind(tiny_llama: Path) -> None:
    """In a fresh interpreter, an in-process LLM whose start fails (max_model_len above the model's) raises
    only once its tokenizer thread is done: the caller's own transformers import right after works (an
    abandoned thread still importing transformers made it fail with "cannot import name")."""
    script = textwrap.dedent(f"""
        from troupe import LLM
        from troupe.errors import EngineStartupError
        try:
            LLM(model={str(tiny_llama)!r}, dtype="float32", num_kv_blocks=16, num_threads=1, max_model_len=4096,
                multiprocess=False)
        except EngineStartupError:
            pass
        else:
            raise SystemExit("the start did not fail")
        from transformers import AutoModelForCausalLM
        print("imported", AutoModelForCausalLM.__name__)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "imported AutoModelForCausalLM" in proc.stdout, proc.stderr[-2000:]
