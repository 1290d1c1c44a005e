"""`python -m troupe.bench.accuracy`: greedy tokens of each kernel set against transformers.

`--num-prompts` prompts of 5..300 tokens (natural text, `troupe.bench.offline.make_prompts`), `--max-tokens`
greedy tokens each, transformers float32 on the same weights as the oracle (for the default model, its GGUF
expanded to a float32 folder; else `--hf-model`). For each set of `--sets`
(`name[:kv_cache_dtype][/quantization]`, `troupe.bench.kernel_sets.set_options`) all prompts run together
in one `EngineCore` (chunked prefill, mixed steps), and the line says how many sequences equal
transformers' exactly, how many diverge at a near-tie (at the first differing position transformers' logit
for its own token exceeds its logit for troupe's by less than 0.1, the rule of tests/models/test_gguf_equality.py;
and, looser, troupe's token in transformers' top-5), the first-divergence positions, and the largest and
mean absolute difference of the logits at each prompt's last position (one prefill per prompt) from
transformers'. The figures in docs/kernels.md that decide `kv_cache_dtype="auto"` come from this command.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from typing import Any

import torch

NEAR_TIE = 0.1  # logits: the near-tie bound of tests/models/test_gguf_equality.py


def hf_greedy(model_dir: Any, prompts: list[list[int]], n: int
              ) -> tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """transformers' greedy continuation of each prompt, its logits at each generated position (n, vocab),
    and its logits at the prompt's last position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    tokens, steps, first = [], [], []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=n, min_new_tokens=n, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            tokens.append(out.sequences[0, len(p):].tolist())
            steps.append(torch.cat(out.logits).float())
            first.append(out.logits[0][0].float())
    return tokens, steps, first


def troupe_greedy(spec: str, model: str, prompts: list[list[int]], n: int, threads: int | None
                  ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The greedy tokens of every prompt (all in one engine), then each prompt's last-position logits."""
    from troupe.bench.kernel_sets import set_options
    from troupe.config import EngineConfig
    from troupe.core.batch import ScheduledSeq
    from troupe.core.engine_core import EngineCore
    from troupe.messages import AddRequest
    from troupe.sampling_params import SamplingParams

    core = EngineCore(EngineConfig(model=model, **set_options(spec), max_num_batched_tokens=512,
                                   enable_prefix_caching=False, num_threads=threads))
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(AddRequest(f"r{i}", p, params, n))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            got[o.request_id].extend(o.new_token_ids)
    bs = core.runner.block_size
    logits = [core.runner.execute([ScheduledSeq("probe", p, 0, list(range(1, 1 + -(-len(p) // bs))), True)])[0]
              for p in prompts]
    return [got[f"r{i}"] for i in range(len(prompts))], logits


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m troupe.bench.accuracy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default="eager,cpu:float32,cpu:float16,cpu:bfloat16,cpu/gguf-q8")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--hf-model", default=None, help="transformers' folder with the same weights (default: the "
                                                    "model's, or the default GGUF's float32 expansion)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    from troupe.bench.offline import make_prompts
    from troupe.models.default_model import ensure_default_model, find_default_gguf
    from troupe.models.gguf import is_gguf
    from troupe.models.loader import load_tokenizer, resolve_model_path

    model_dir = resolve_model_path(args.model)
    if args.hf_model:
        model_dir = resolve_model_path(args.hf_model)
    elif model_dir == find_default_gguf():
        model_dir = ensure_default_model()
    elif is_gguf(model_dir):
        p.error("--hf-model: transformers needs a folder with the GGUF's weights")
    tok = load_tokenizer(model_dir)
    prompts = [make_prompts(tok, 1, n, n, seed=i)[0]
               for i, n in enumerate(random.Random(0).randint(5, 300) for _ in range(args.num_prompts))]
    want, steps, hf_logits = hf_greedy(model_dir, prompts, args.max_tokens)
    print(f"{args.num_prompts} prompts of 5..300 tokens, {args.max_tokens} greedy tokens, against transformers float32")
    for spec in args.sets.split(","):
        got, logits = troupe_greedy(spec, args.model, prompts, args.max_tokens, args.threads)
        diff = torch.stack([(a - b).abs().max() for a, b in zip(logits, hf_logits, strict=True)])
        mean = torch.stack([(a - b).abs().mean() for a, b in zip(logits, hf_logits, strict=True)]).mean()
        exact, tie, top5, far, where = 0, 0, 0, 0, []
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            if w == g:
                exact += 1
                continue
            k = next(j for j in range(args.max_tokens) if w[j] != g[j])
            gap = float(steps[i][k, w[k]] - steps[i][k, g[k]])
            where.append((k, round(gap, 3)))
            in_top5 = g[k] in set(steps[i][k].topk(5).indices.tolist())
            tie += gap < NEAR_TIE
            top5 += in_top5 and gap >= NEAR_TIE
            far += not in_top5
        print(f"{spec:<20} exact {exact}/{len(prompts)} ({exact / len(prompts):.0%}); diverging at a near-tie "
              f"(gap < {NEAR_TIE}) {tie}, in the top-5 only {top5}, elsewhere {far}; first divergences (position, "
              f"gap) {sorted(where)}; last-prompt-position logits vs transformers: max |diff| {diff.max():.2e}, "
              f"mean {mean:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
