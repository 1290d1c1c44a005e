"""vLLM's perplexity and greedy tokens for `troupe.bench.quality`: `VLLM_PY vllm_quality.py SPEC RESULT`.

Runs on the vllm venv's python (standard library and vllm only). SPEC: `model` (a Hugging Face folder),
`dtype`, `windows` (token-id lists: each scored through `prompt_logprobs=0`, the logprob of every token
but the first), `prompts` and `max_tokens` (greedy, ignore_eos, one generate call, timed). RESULT:
`logprobs` (every scored token's, in order), `tokens` (each prompt's greedy tokens), `seconds`, `version`,
`dtype` (what vLLM resolved); or `error` (the traceback; exit status 1).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, enable_prefix_caching=False)
    windows, prompts, n = spec["windows"], spec["prompts"], spec["max_tokens"]
    scored = llm.generate([{"prompt_token_ids": w} for w in windows],
                          SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    logprobs = [o.prompt_logprobs[i][w[i]].logprob for o, w in zip(scored, windows, strict=True)
                for i in range(1, len(w))]
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    return {"logprobs": logprobs, "tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds,
            "version": vllm.__version__, "dtype": str(llm.llm_engine.model_config.dtype)}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    try:
        result, code = measure(spec), 0
    except BaseException:
        result, code = {"error": traceback.format_exc()}, 1
    with open(sys.argv[2] + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    sys.exit(code)
