"""llama.cpp's own programs as `troupe bench` peers: `llama-server` and `llama-batched-bench`.

llama-cpp-python (`workers/llamacpp_worker.py`) decodes one sequence at a time, which is not how llama.cpp's
users serve: they run `llama-server -np N` (N parallel slots, continuous batching) and measure batched
decoding with `llama-batched-bench`. Both are binaries in one folder (`$LLAMA_BIN`, `--llama-bin`, or the
build `shared/bench/setup_peers.sh llamaserver` makes under ~/.cache/troupe-peers/llama.cpp/build/bin):

- `server_cmd`: `llama-server -m GGUF -t T -np SLOTS -c SLOTS*CTX`, served under the harness's model name,
  loaded by the same HTTP client as troupe's and vLLM's servers (`troupe.bench.serving.serve_once`);
- `batched_bench_cmd` / `run_batched_bench`: `llama-batched-bench -npp P -ntg G -npl B` with the offline
  workload's shape (B = the number of prompts, P = their mean length, G = the new tokens of each), run in
  a session of its own with its process tree sampled; `parse_batched_bench` reads its result table. Its
  prompts are random tokens of one length (the offline workload's lengths vary): it times llama.cpp's
  batched prefill and decode, not a scheduler. Its end-to-end output rate, B*G / (prefill + decode time),
  is the figure beside the others' offline output tok/s; decode alone (S_TG) goes to the info.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from troupe.bench.peers import PEERS_HOME, WorkerError, log_tail, stop_group
from troupe.bench.rss import TreePeak, TreeSampler

SERVER, BATCHED = "llama-server", "llama-batched-bench"
DEFAULT_BIN = PEERS_HOME / "llama.cpp" / "build" / "bin"


def find_llama_bin(flag: str | None) -> tuple[Path | None, str]:
    """(the folder with llama.cpp's binaries, where it came from) or (None, why llama.cpp's own programs
    are skipped). The folder must hold at least one of llama-server and llama-batched-bench."""
    if flag:
        folder, source = Path(flag), "flag"
    elif os.environ.get("LLAMA_BIN"):
        folder, source = Path(os.environ["LLAMA_BIN"]), "$LLAMA_BIN"
    else:
        folder, source = DEFAULT_BIN, "default path"
    if not any(os.access(folder / name, os.X_OK) for name in (SERVER, BATCHED)):
        return None, (f"no {SERVER} or {BATCHED} in {folder} ({source}; give --llama-bin or $LLAMA_BIN, or run "
                      "shared/bench/setup_peers.sh llamaserver)")
    return folder, source


def has(folder: Path, name: str) -> bool:
    return os.access(folder / name, os.X_OK)


def server_cmd(folder: Path, gguf: str, port: int, *, threads: int, slots: int, ctx_per_slot: int,
               served_name: str) -> list[str]:
    return [str(folder / SERVER), "-m", gguf, "-t", str(threads), "-tb", str(threads), "-np", str(slots),
            "-c", str(slots * ctx_per_slot), "--host", "127.0.0.1", "--port", str(port), "--alias", served_name]


def batched_bench_cmd(folder: Path, gguf: str, *, threads: int, prompt_len: int, new_tokens: int,
                      batch: int) -> list[str]:
    ctx = max(2048, batch * (prompt_len + new_tokens))  # every sequence's prompt and tokens in the KV cache
    return [str(folder / BATCHED), "-m", gguf, "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
            "-npp", str(prompt_len), "-ntg", str(new_tokens), "-npl", str(batch)]


@dataclass(frozen=True)
class BatchedRow:
    """One line of llama-batched-bench's table: B sequences of PP prompt tokens, then TG tokens each."""
    pp: int
    tg: int
    batch: int
    n_kv: int
    t_pp: float  # s, prefill of every prompt
    s_pp: float  # prompt tok/s
    t_tg: float  # s, the TG decode steps
    s_tg: float  # decode tok/s (B * TG / T_TG)
    t: float  # s, both
    s: float  # (B * PP + B * TG) / T

    @property
    def output_tok_s(self) -> float:
        """New tokens over the whole time, prefill included: what the other engines' offline figure is."""
        return self.batch * self.tg / self.t


def parse_batched_bench(text: str) -> list[BatchedRow]:
    """The result rows of llama-batched-bench's output (its `|    PP |     TG |    B | ...` table); raises
    `ValueError` when the output holds none (a failed run)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 10 or not cells[0].isdigit():
            continue  # the header, the rule, the log
        pp, tg, batch, n_kv = (int(c) for c in cells[:4])
        t_pp, s_pp, t_tg, s_tg, t, s = (float(c) for c in cells[4:])
        rows.append(BatchedRow(pp, tg, batch, n_kv, t_pp, s_pp, t_tg, s_tg, t, s))
    if not rows:
        raise ValueError("llama-batched-bench printed no result row")
    return rows


@dataclass
class BatchedRun:
    row: BatchedRow
    seconds: float  # the whole process, load and warm-up included
    peak: TreePeak
    log: Path


def run_batched_bench(cmd: list[str], *, env: dict[str, str], workdir: Path, tag: str,
                      timeout: float) -> BatchedRun:
    """Run `cmd` (one -npp/-ntg/-npl each) in a new session, its tree sampled; its one result row. Raises
    `WorkerError` when it fails, prints no row, or outlives `timeout` s (its group is killed)."""
    log = workdir / f"{tag}.log"
    with open(log, "wb") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    timed_out = False
    try:
        with TreeSampler(proc.pid, group=proc.pid) as sampler:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        stop_group(proc)
    seconds = time.perf_counter() - start
    if timed_out or proc.returncode != 0:
        why = f"ran past {timeout:.0f} s" if timed_out else f"exit status {proc.returncode}"
        raise WorkerError(f"{tag}: {why}; its output ends:\n{log_tail(log)}")
    try:
        rows = parse_batched_bench(log.read_text(errors="replace"))
    except ValueError as e:
        raise WorkerError(f"{tag}: {e}; its output ends:\n{log_tail(log)}") from None
    if len(rows) != 1:
        raise WorkerError(f"{tag}: {len(rows)} result rows, one expected (one -npp, -ntg and -npl)")
    return BatchedRun(row=rows[0], seconds=seconds, peak=sampler.peak, log=log)


def batched_info(run: BatchedRun, cmd: list[str]) -> dict[str, Any]:
    r = run.row
    return {"engine": "llama-batched-bench", "argv": cmd[1:], "prompt_tokens_each": r.pp, "new_tokens_each": r.tg,
            "sequences": r.batch, "prefill_s": r.t_pp, "prefill_tok_s": r.s_pp, "decode_s": r.t_tg,
            "decode_tok_s": r.s_tg, "total_s": r.t, "output_tok_s": r.output_tok_s}
