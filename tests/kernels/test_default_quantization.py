"""`quantization="auto"` takes the mode measured best on the CPU kind (issue 41's rule): `gguf-bf16` for a
GGUF file on a CPU with AMX, or an AMD CPU with avx512_bf16, where the compiled kernels run it; the
output-exact `gguf` everywhere else; an explicit mode is never changed. The CPU's vendor, its flags and the
kernels' abilities are set per case here, so every branch runs on every machine; the engine case checks
what an engine on this machine reports."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from troupe.config import EngineConfig
from troupe.kernels import select

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
AMX = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
AVX512_BF16 = frozenset({"avx512f", "avx512_bf16"})


INTEL, AMD = "GenuineIntel", "AuthenticAMD"
Machine = Callable[[str, frozenset[str], bool], None]


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Machine:
    """Set the CPU's vendor, its flags and whether the compiled bf16 kernels run:
    `machine(vendor, flags, runs)`."""
    def set_machine(vendor: str, flags: frozenset[str], runs: bool) -> None:
        monkeypatch.setattr(select, "_cpu_vendor", lambda: vendor)
        monkeypatch.setattr(select, "_cpu_flags", lambda: flags)
        monkeypatch.setattr("troupe.kernels.cpu.bf16_runs", lambda: runs)
    return set_machine


@pytest.mark.parametrize(("vendor", "flags", "runs", "config", "gguf", "device", "want"), [
    (INTEL, AMX, True, {}, True, CPU, "gguf-bf16"),
    (INTEL, AMX, True, {"kernels": "cpu"}, True, CPU, "gguf-bf16"),
    (INTEL, AMX, False, {}, True, CPU, "auto"),  # TROUPE_CPU_ISA=avx2: the kernels have no bf16 path
    (AMD, AVX512_BF16, True, {}, True, CPU, "gguf-bf16"),  # Zen 4 and later
    (AMD, AVX512_BF16, False, {}, True, CPU, "auto"),
    (INTEL, AVX512_BF16, True, {}, True, CPU, "auto"),  # vdpbf16ps at a quarter of the FMA rate: exact
    (AMD, frozenset({"avx2", "fma"}), True, {}, True, CPU, "auto"),  # Zen 3
    (INTEL, AMX, True, {}, False, CPU, "auto"),  # a Hugging Face folder
    (AMD, AVX512_BF16, True, {}, False, CPU, "auto"),
    (INTEL, AMX, True, {}, True, CUDA, "auto"),
    (AMD, AVX512_BF16, True, {"kernels": "eager"}, True, CPU, "auto"),
    (AMD, AVX512_BF16, True, {"quantization": "gguf"}, True, CPU, "gguf"),
    (INTEL, AMX, True, {"quantization": "gguf-q8"}, True, CPU, "gguf-q8"),
    (INTEL, AVX512_BF16, True, {"quantization": "gguf-bf16"}, True, CPU, "gguf-bf16"),
], ids=["amx", "amx-cpu-set", "amx-avx2-build", "amd-avx512-bf16", "amd-avx2-build", "intel-avx512-bf16",
        "avx2", "hf-folder", "amd-hf-folder", "cuda", "eager", "explicit-gguf", "explicit-q8", "explicit-bf16"])
def test_auto_takes_the_measured_mode_of_the_cpu_kind(machine: Machine, vendor: str, flags: frozenset[str],
                                                      runs: bool, config: dict[str, str], gguf: bool,
                                                      device: torch.device, want: str) -> None:
    machine(vendor, flags, runs)
    assert select.default_quantization(EngineConfig(**config), gguf, device) == want


@pytest.fixture(scope="module")
def tiny_gguf_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from troupe.kernels.quant import QType
    from troupe.models.tiny import make_tiny_gguf

    path, _ = make_tiny_gguf(tmp_path_factory.mktemp("auto-mode") / "m", default_qtype=QType.Q4_1)
    return path


@pytest.mark.slow
def test_an_engine_reports_the_mode_it_runs(tiny_gguf_llama: Path) -> None:
    """The runner resolves `auto` once and builds its kernels and weights in that mode: `gguf-bf16`
    (a bf16 kernel set) on this machine if it is of a kind measured for it (AMX, or AMD with avx512_bf16)
    and has the bf16 kernels, else `gguf`."""
    from troupe.core.model_runner import ModelRunner
    from troupe.kernels.cpu import bf16_runs
    from troupe.kernels.cpu.build import cpu_flags, cpu_vendor

    runner = ModelRunner(EngineConfig(model=str(tiny_gguf_llama), num_kv_blocks=16, kernels="cpu"))
    flags = cpu_flags()
    measured = "amx_bf16" in flags or ("avx512_bf16" in flags and cpu_vendor() == "AuthenticAMD")
    bf16 = measured and bf16_runs()
    assert runner.quantization == ("gguf-bf16" if bf16 else "auto")
    assert getattr(runner.kernels, "bf16", False) is bf16
    exact = ModelRunner(EngineConfig(model=str(tiny_gguf_llama), num_kv_blocks=16, kernels="cpu", quantization="gguf"))
    assert exact.quantization == "gguf" and getattr(exact.kernels, "bf16", True) is False
