"""Ahead-of-time compile of every CUDA kernel for a GPU target, without a GPU: `python -m troupe.kernels.cuda.aot`.

Each variant below is one (kernel, argument types, constexprs, launch options) the launchers use, the
constexprs coming from the launchers' own `*_meta` functions: the default model's shapes (9 heads /
3 kv heads, head_dim 64, hidden 576) and Llama-8B-class ones (32 / 8, 128, 4096), bf16 / fp16 /
float32. `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` runs the whole NVIDIA
pipeline (TTIR, TTGIR, LLVM, PTX, then ptxas to a cubin) with the toolchain bundled in the triton
wheel. A kernel that does not compile, or needs more shared memory than the target has, fails.

Must run without `TRITON_INTERPRET` (the interpreter replaces `@triton.jit` functions by Python ones,
which cannot be compiled): CI runs this module in a subprocess with the variable removed.
Prints one JSON line per variant (`--json`) or a table, and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

# Hopper (sm_90): 227 KiB of shared memory per block with the opt-in limit
SHARED_LIMIT = {90: 232448, 80: 166912, 89: 101376}


@dataclass(frozen=True)
class Variant:
    name: str
    kernel: Any  # a triton JITFunction
    types: dict[str, str]  # non-constexpr argument -> triton type; unlisted ones are "i32"
    meta: dict[str, Any]  # constexprs plus num_warps / num_stages, as the launcher passes them
    ci: bool = True  # in the default set (CI); the rest only with --all


def variants() -> list[Variant]:
    """Every variant; the default set (`ci`) is bf16 at both shapes, float32 at the small one, a block size
    of 32, bf16 attention with a sliding window and soft-capping at the small one, and the fused MoE's two
    GEMMs in bf16 (gate/up with SiLU at prefill tiles, down with the routing weight at decode tiles); fp16
    compiles the bf16 code with another element type."""
    from troupe.kernels.cuda import (
        activation,
        attention,
        attention_decode,
        attention_prefill,
        cache_write,
        moe,
        norm,
        rotary,
    )

    out: list[Variant] = []
    ty = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
    shapes = [("small", 9, 3, 64, 576, 1536), ("8b", 32, 8, 128, 4096, 14336)]  # name, H, KVH, D, hidden, f
    for dt in ("bf16", "fp16", "fp32"):
        p = ty[dt]
        f32 = dt == "fp32"
        for shape, H, KVH, D, hidden, f in shapes:
            G = H // KVH
            tag = f"{dt}-{shape}"
            ci = dt == "bf16" or (dt == "fp32" and shape == "small")
            first = len(out)
            out.append(Variant(f"reshape_and_cache-{tag}", cache_write.reshape_and_cache_kernel,
                               dict(key=p, value=p, k_cache=p, v_cache=p, slot_mapping="*i64"),
                               cache_write.reshape_and_cache_meta(KVH, D, 16)))
            out.append(Variant(f"rotary_embedding-{tag}", rotary.rotary_embedding_kernel,
                               dict(positions="*i64", query=p, key=p, cos_sin_cache="*fp32"),
                               rotary.rotary_embedding_meta(H, KVH, D, is_neox=shape == "small")))
            for fused in (False, True):
                out.append(Variant(f"rms_norm{'-fused' if fused else ''}-{tag}", norm.rms_norm_kernel,
                                   dict(x=p, residual=p, weight=p, out=p, eps="fp32"),
                                   norm.rms_norm_meta(hidden, fused)))
            out.append(Variant(f"silu_and_mul-{tag}", activation.silu_and_mul_kernel, dict(x=p, out=p),
                               activation.silu_and_mul_meta(f)))
            attn = dict(q=p, k_cache=p, v_cache=p, out=p, query_start_loc="*i64", seq_lens="*i64",
                        block_tables="*i32", scale_log2="fp32", cap_log2="fp32")
            metas = [attention.prefill_meta(max_q, G, D, 16, f32) for max_q in (2048, 12, 2)]
            for meta in [m for i, m in enumerate(metas) if m not in metas[:i]]:  # long, medium, short chunks
                out.append(Variant(f"prefill_attention-{tag}-m{meta['BLOCK_M']}",
                                   attention_prefill.prefill_attention_kernel, attn, meta))
            for direct in (True, False):
                out.append(Variant(f"decode_attention-{tag}{'-direct' if direct else '-split'}",
                                   attention_decode.decode_attention_kernel,
                                   {**attn, "part_out": "*fp32", "part_lse": "*fp32"},
                                   attention.decode_meta(G, D, 16, f32, direct)))
            out.append(Variant(f"decode_reduce-{tag}", attention_decode.decode_reduce_kernel,
                               dict(out=p, part_out="*fp32", part_lse="*fp32"),
                               attention.reduce_meta(D, attention.MAX_SPLITS)))
            if not ci:
                out[first:] = [Variant(v.name, v.kernel, v.types, v.meta, ci=False) for v in out[first:]]
    meta32 = attention.prefill_meta(2048, 3, 64, 32, False)
    out.append(Variant("prefill_attention-bf16-small-bs32", attention_prefill.prefill_attention_kernel,
                       dict(q="*bf16", k_cache="*bf16", v_cache="*bf16", out="*bf16", query_start_loc="*i32",
                            seq_lens="*i32", block_tables="*i64", scale_log2="fp32", cap_log2="fp32"), meta32))
    attn16 = dict(q="*bf16", k_cache="*bf16", v_cache="*bf16", out="*bf16", query_start_loc="*i64", seq_lens="*i64",
                  block_tables="*i32", scale_log2="fp32", cap_log2="fp32")  # sliding window + soft-capping
    out.append(Variant("prefill_attention-bf16-small-window-softcap", attention_prefill.prefill_attention_kernel,
                       attn16, attention.prefill_meta(2048, 3, 64, 16, False, window=True, softcap=True)))
    out.append(Variant("decode_attention-bf16-small-window-softcap", attention_decode.decode_attention_kernel,
                       {**attn16, "part_out": "*fp32", "part_lse": "*fp32"},
                       attention.decode_meta(3, 64, 16, False, False, window=True, softcap=True)))
    moe_types = dict(a="*bf16", b="*bf16", c="*bf16", topk_weights="*fp32", sorted_token_ids="*i32",
                     expert_ids="*i32", num_padded="*i32")  # Mixtral-class: 8 experts, top-2, h 4096, f 14336
    out.append(Variant("fused_moe-gate_up-bf16-prefill", moe.fused_moe_kernel, moe_types,
                       moe.fused_moe_meta(2 * 1024, 8, 4096, False, top_k=2, gated=True, mul_weight=False)))
    out.append(Variant("fused_moe-down-bf16-decode", moe.fused_moe_kernel, {**moe_types, "c": "*fp32"},
                       moe.fused_moe_meta(2 * 8, 8, 14336, False, top_k=1, gated=False, mul_weight=True)))
    names = [v.name for v in out]
    assert len(set(names)) == len(names), "variant names must be unique"
    return out


def compile_variant(v: Variant, arch: int) -> dict[str, Any]:
    """Compile one variant for `cuda:<arch>`; returns sizes and resource use (raises on failure)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {k: v.meta[k] for k in ("num_warps", "num_stages") if k in v.meta}
    constexprs = {k: x for k, x in v.meta.items() if k not in options}
    names = v.kernel.arg_names
    unknown = set(constexprs) - set(names)
    assert not unknown, f"{v.name}: constexprs {unknown} are not arguments of {v.kernel.__name__}"
    if "constexprs" in inspect.signature(ASTSource.__init__).parameters:  # triton >= 3.2 or so
        signature = {n: "constexpr" if n in constexprs else v.types.get(n, "i32") for n in names}
        src = ASTSource(fn=v.kernel, signature=signature, constexprs=constexprs)
    else:  # older: index-keyed signature without the constexprs, which go to `constants`
        signature = {i: v.types.get(n, "i32") for i, n in enumerate(names) if n not in constexprs}
        src = ASTSource(fn=v.kernel, signature=signature, constants={names.index(k): x for k, x in constexprs.items()})
    start = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
    shared = int(getattr(compiled.metadata, "shared", 0))
    assert f".target sm_{arch}" in ptx, f"{v.name}: PTX has no .target sm_{arch}"
    assert cubin[:4] == b"\x7fELF", f"{v.name}: the cubin is not an ELF image"
    limit = SHARED_LIMIT.get(arch)
    assert limit is None or shared <= limit, f"{v.name}: needs {shared} B of shared memory, sm_{arch} has {limit}"
    return dict(name=v.name, ptx_bytes=len(ptx), cubin_bytes=len(cubin), shared_bytes=shared,
                num_warps=options.get("num_warps"), seconds=round(time.perf_counter() - start, 2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for Hopper")
    parser.add_argument("--only", default="", help="compile only variants whose name contains this")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--all", action="store_true", help="also fp16 and float32 at 8B shapes (slower)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: interpreted kernels cannot be compiled; unset it", file=sys.stderr)
        return 2
    failed = 0
    for v in variants():
        if args.only not in v.name or not (v.ci or args.all):
            continue
        try:
            row = compile_variant(v, args.arch)
        except Exception as e:  # report every failing variant, not only the first
            failed += 1
            row = dict(name=v.name, error=f"{type(e).__name__}: {e}"[:2000])
        if args.json:
            print(json.dumps(row), flush=True)
        elif "error" in row:
            print(f"{row['name']:<48} FAILED {row['error']}", flush=True)
        else:
            print(f"{row['name']:<48} ptx {row['ptx_bytes']:>7} B  cubin {row['cubin_bytes']:>7} B  "
                  f"shared {row['shared_bytes']:>6} B  {row['seconds']:>5.2f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
