"""The device options through the real engine on a machine without a GPU: `device`, `kernels="cuda"`,
`gpu_memory_utilization` and `enforce_eager` (from `LLM` and from the CLI). What they do on a GPU is
covered by tests/kernels/test_cuda_engine_gpu.py (skipped here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from troupe import LLM, SamplingParams
from troupe.errors import EngineStartupError, InvalidInputError

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU"),
              pytest.mark.timeout(600)]  # the CLI in subprocesses

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("options,field", [({"device": "cuda"}, "device"), ({"kernels": "cuda"}, "kernels"),
                                           ({"kernels": "cuda", "device": "cuda"}, "device")],
                         ids=["device-cuda", "kernels-cuda", "both"])
@pytest.mark.parametrize("multiprocess", [True, False], ids=["engine-process", "in-process"])
def test_asking_for_cuda_without_a_gpu_fails_at_start_up(tiny_llama: Path, options: dict[str, str], field: str,
                                                         multiprocess: bool, ipc_root: str, check_leftovers: Any) -> None:
    """The engine refuses to start, with the InvalidInputError naming the field as the cause, and nothing
    is left running."""
    with pytest.raises(EngineStartupError) as err:
        LLM(model=str(tiny_llama), multiprocess=multiprocess, ipc_dir=ipc_root, **options)
    assert err.value.cause_type == "InvalidInputError"
    assert err.value.cause_message.startswith(f"{field}: ") and "cuda" in err.value.cause_message
    check_leftovers()


@pytest.mark.parametrize("options,field", [({"device": "tpu"}, "device"), ({"gpu_memory_utilization": 0.0},
                                           "gpu_memory_utilization"), ({"gpu_memory_utilization": 2},
                                           "gpu_memory_utilization"), ({"enforce_eager": "yes"}, "enforce_eager")])
def test_bad_device_options_are_refused_before_any_engine_starts(tiny_llama: Path, options: dict[str, object],
                                                                 field: str) -> None:
    """Out-of-range values are an InvalidInputError naming the field, from the constructor itself."""
    with pytest.raises(InvalidInputError) as err:
        LLM(model=str(tiny_llama), **options)
    assert err.value.field == field


def test_gpu_options_leave_the_cpu_engine_as_it_is(tiny_llama: Path) -> None:
    """On the CPU, device="cpu" with enforce_eager and the default gpu_memory_utilization (any other
    value is refused there: tests/facades/test_vllm_entry_points.py) runs the eager set and generates
    the same greedy tokens as the defaults ("auto" is the CPU here)."""
    prompts = ["hello there", "the sky is"]
    with LLM(model=str(tiny_llama), dtype="float32", multiprocess=False) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(model=str(tiny_llama), dtype="float32", device="cpu", enforce_eager=True, gpu_memory_utilization=0.9,
             multiprocess=False) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want and all(len(t) == 4 for t in got)


def test_cli_device_options(tiny_llama: Path) -> None:
    """`troupe generate --device cpu --enforce-eager --gpu-memory-utilization 0.9` streams an answer;
    `--device cuda` without a GPU is an error naming `device`, exit code 2, no traceback."""
    base = [sys.executable, "-m", "troupe.cli", "generate", "hi", "--model", str(tiny_llama), "--dtype", "float32",
            "--max-tokens", "4", "--temperature", "0", "--ignore-eos", "--in-process"]
    ok = subprocess.run(base + ["--device", "cpu", "--enforce-eager", "--gpu-memory-utilization", "0.9"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert ok.stdout.strip()
    bad = subprocess.run(base + ["--device", "cuda"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert "device: 'cuda' needs a CUDA GPU" in bad.stderr and "Traceback" not in bad.stderr.split("Engine traceback")[0]
