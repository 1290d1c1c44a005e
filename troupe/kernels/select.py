"""`select_kernels`: which kernel set runs a model, and on which device, decided once when it loads.

`EngineConfig.device` names the device: "auto" is "cuda" when torch sees a GPU, else "cpu"; "cuda" on a
machine without one is an `InvalidInputError` naming `device`. `EngineConfig.kernels` names the set:
"auto" takes the best one for the device, a name forces that one (an error if it cannot run there):

- "eager": plain torch on the CPU (always available);
- "cpu": compiled CPU kernels (troupe.kernels.cpu; needs a C++ compiler and AVX2/FMA/F16C);
- "cuda": Triton kernels on the GPU (troupe.kernels.cuda). TEST-ONLY: with `device="cpu"` and
  `TRITON_INTERPRET=1` set before the kernels were imported, the same set runs on CPU tensors under the
  Triton interpreter (how CI checks the CUDA path end to end without a GPU).

"auto" is "cuda" on CUDA; on the CPU it is "eager" for a float16 model (the compiled set's ops take float32
and bfloat16 activations only; kernels="cpu" with float16 is an error), else "cpu" where its extensions build and load here (compiled once
on first use, then cached), else "eager" after one warning naming the reason
(`troupe.kernels.cpu.build.load_ops`). Each new set adds its name to `troupe.config.KERNEL_SETS` and
itself to the "auto" order below once it is the better choice.
"""

from __future__ import annotations

import torch

from troupe.config import DEVICES, KERNEL_SETS, EngineConfig
from troupe.errors import InvalidInputError
from troupe.kernels.base import KernelSet

CPU_SETS = ("eager", "cpu")


def resolve_device(config: EngineConfig) -> torch.device:
    """The device `config.device` names here ("auto": CUDA when torch sees a GPU)."""
    name = config.device
    if name not in DEVICES:
        raise InvalidInputError("device", f"must be one of {list(DEVICES)}, got {name!r}")
    has_cuda = torch.cuda.is_available()
    if name == "cuda" and not has_cuda:
        raise InvalidInputError("device", "'cuda' needs a CUDA GPU that torch can use, and torch.cuda.is_available() "
                                f"is False here (torch {torch.__version__}); use device='cpu' or 'auto'")
    if name == "auto":
        name = "cuda" if has_cuda else "cpu"
    return torch.device(name)


def model_dtype(config: EngineConfig, device: torch.device) -> str | torch.dtype:
    """`config.dtype` for the model on `device`: "auto" is bfloat16 on CUDA (the loader decides on the CPU)."""
    return torch.bfloat16 if config.dtype == "auto" and device.type == "cuda" else config.dtype


def default_quantization(config: EngineConfig, gguf_file: bool, device: torch.device) -> str:
    """`config.quantization`, except "auto" for a GGUF file on a CPU kind where issue 41's rule, from measured
    quality, picked "gguf-bf16" (the float32 reference's perplexity, the fastest mode that keeps it;
    docs/benchmarks.md, "Quality"), where the compiled kernels run it: a CPU with AMX (`amx_bf16`), and an AMD
    CPU with `avx512_bf16` (Zen 4 and later, where `vdpbf16ps` runs at the FMA rate). Elsewhere "auto" stays
    (`gguf`: float32 on the blocks, output-exact), Intel cores with `avx512_bf16` but no AMX among them (the
    instruction runs at a quarter of the FMA rate there); a CPU kind gets another default once it is
    measured."""
    if (config.quantization != "auto" or not gguf_file or device.type != "cpu"
            or config.kernels not in ("auto", "cpu") or not _bf16_measured_best()):
        return config.quantization
    from troupe.kernels.cpu import bf16_runs

    return "gguf-bf16" if bf16_runs() else config.quantization


def _bf16_measured_best() -> bool:
    """Whether this CPU is of a kind where `gguf-bf16` was measured the best mode (docstring above)."""
    flags = _cpu_flags()
    return "amx_bf16" in flags or ("avx512_bf16" in flags and _cpu_vendor() == "AuthenticAMD")


def _cpu_flags() -> frozenset[str]:
    from troupe.kernels.cpu.build import cpu_flags

    return cpu_flags()


def _cpu_vendor() -> str:
    from troupe.kernels.cpu.build import cpu_vendor

    return cpu_vendor()


def select_kernels(config: EngineConfig, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> KernelSet:
    """The kernel set for `config`, on `device` (None: `resolve_device(config)`); `dtype` is the model's
    (what the set expands quantized weights to)."""
    name = config.kernels
    if name not in KERNEL_SETS:
        raise InvalidInputError("kernels", f"must be one of {list(KERNEL_SETS)}, got {name!r}")
    device = device if device is not None else resolve_device(config)
    q8 = config.quantization == "gguf-q8"
    bf16 = config.quantization == "gguf-bf16"
    if name == "auto":
        name = "cuda" if device.type == "cuda" else "auto"
    if name == "cuda":
        if q8 or bf16:
            raise InvalidInputError("quantization", f"{config.quantization!r} needs the compiled CPU kernels "
                                    "(kernels='cpu'); the cuda set expands GGUF blocks to the model's dtype")
        return _cuda_kernels(config, device, dtype)
    if device.type != "cpu":
        raise InvalidInputError("kernels", f"{name!r} runs on the CPU only, and device resolved to {device.type!r} "
                                "(device=" + repr(config.device) + "); use kernels='auto' or 'cuda', or device='cpu'")
    if dtype == torch.float16 and name in ("cpu", "auto"):  # the compiled set's ops take float32 / bfloat16
        if name == "cpu":
            raise InvalidInputError("kernels", "'cpu' computes float32 and bfloat16 activations, not float16; "
                                    "use dtype 'bfloat16' / 'float32', or kernels='eager' (or 'auto') for float16")
        name = "eager"
    if name in ("cpu", "auto"):
        from troupe.kernels.cpu import Bf16Unsupported, CpuKernels, available
        from troupe.kernels.cpu.build import BuildError

        if name == "cpu" or available():  # `available` logs the one warning when it is not
            try:
                return CpuKernels(kv_cache_dtype=config.kv_cache_dtype, quantize_activations=q8, bf16=bf16)
            except Bf16Unsupported as exc:
                raise InvalidInputError("quantization", f"'gguf-bf16' computes batches with avx512_bf16 "
                                        f"instructions, and {exc}; use 'gguf' (exact) or 'gguf-q8'") from exc
            except BuildError as exc:
                raise InvalidInputError("kernels", f"'cpu' cannot run here: {exc}") from exc
    if q8 or bf16:
        raise InvalidInputError("quantization", f"{config.quantization!r} needs the compiled CPU kernels "
                                "(kernels='cpu'); "
                                f"kernels={config.kernels!r} runs the eager set here, which expands the blocks "
                                "to float32")
    from troupe.kernels.eager import EagerKernels

    return EagerKernels(decode_row_cache_bytes=config.decode_row_cache_bytes, kv_cache_dtype=config.kv_cache_dtype)


def _cuda_kernels(config: EngineConfig, device: torch.device, dtype: torch.dtype | None) -> KernelSet:
    from troupe.kernels.cuda.kernel_set import CudaKernels, interpreter_active

    test_only = config.device == "cpu" and device.type == "cpu" and interpreter_active()
    if device.type != "cuda" and not test_only:
        raise InvalidInputError("kernels", f"'cuda' needs a CUDA GPU, and device resolved to {device.type!r} "
                                f"(device={config.device!r}, torch.cuda.is_available() is "
                                f"{torch.cuda.is_available()}); use kernels='auto' to run on the CPU")
    if config.kv_cache_dtype != "auto" and (dtype is None or config.kv_cache_dtype != str(dtype).removeprefix("torch.")):
        raise InvalidInputError("kv_cache_dtype", f"the cuda kernel set keeps the KV pool in the model's dtype "
                                f"({dtype}): must be 'auto' or that, got {config.kv_cache_dtype!r}")
    return CudaKernels(device, dtype=dtype, max_num_seqs=config.max_num_seqs,
                       max_num_batched_tokens=config.max_num_batched_tokens)
