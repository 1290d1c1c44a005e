"""A GGUF's experts are not copied: the model bound to the cpu set computes on the file's own pages, mapped
read-only, so loading a MoE GGUF costs next to nothing beyond its dense layers (docs/models.md, "Memory").

The file is a random `qwen3moe` GGUF (`troupe.testing.moe_gguf`) with ~68 MiB of Q4_K experts, written by
the test; the checks are on where the expert tensors the fused MoE op holds live (inside a read-only
mapping of that file in /proc/self/maps) and on how much the process's resident memory grows during the
load, after a first load of a one-layer file has paid what a process pays once (libraries, thread pools).
A copy of the experts would add their size (the arena's or any heap copy is fresh memory, written):
measured so, the former copying loader grew by 73 MiB here, this one by 7 MiB."""

from __future__ import annotations

import dataclasses
import gc
import os
from pathlib import Path

import pytest

from troupe.kernels.cpu import build
from troupe.models.moe_gguf import MoeShape, make_moe_gguf

pytestmark = [
    pytest.mark.skipif(not build.REQUIRED_CPU_FLAGS <= build.cpu_flags() or not build.shutil.which("c++"),
                       reason="no AVX2/FMA/F16C CPU or no C++ compiler here"),
    pytest.mark.timeout(600),  # the first test of a process may build the C++ extensions
]

# 10 layers x 16 experts x (gate, up, down) of 512 x 512 in Q4_K: 67.5 MiB of experts, ~1 MiB else
SHAPE = MoeShape(layers=10, hidden=512, heads=4, kv_heads=2, head_dim=64, experts=16, top_k=2, expert_ff=512,
                 vocab=256)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def file_mappings(path: Path) -> list[tuple[int, int, str, int]]:
    """(start, end, permissions, file offset) of this process's mappings of `path`."""
    target = os.path.realpath(path)
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == target:
                start, end = (int(a, 16) for a in fields[0].split("-"))
                spans.append((start, end, fields[1], int(fields[2], 16)))
    return spans


def test_experts_stay_mapped_from_the_file(tmp_path: Path) -> None:
    """Every expert's gate, up and down blocks that the bound fused op computes on lie inside a read-only
    mapping of the GGUF file; what stays mapped is only the experts and the embedding table (the dense
    projections were copied into the arena and their mappings released, up to the pages at each end);
    the load grows resident memory by less than a quarter of the experts' bytes (it grew by more than
    their size when they were copied out of the file)."""
    from troupe.kernels.cpu import CpuKernels
    from troupe.kernels.cpu.arena import _malloc_trim
    from troupe.kernels.cpu.moe import FusedMoe
    from troupe.kernels.quant import QuantizedTensor
    from troupe.models.gguf_file import GGUFFile
    from troupe.models.loader import load_model

    path = make_moe_gguf(tmp_path / "moe.gguf", SHAPE, tokenizer=False, seed=3)
    experts = SHAPE.expert_bytes()
    assert experts > 64 << 20
    kernels = CpuKernels()
    warm = make_moe_gguf(tmp_path / "warm.gguf", dataclasses.replace(SHAPE, layers=1), tokenizer=False)
    load_model(warm, kernels=kernels)  # what a first load costs once (libraries, thread pools), not measured
    gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)  # the file writer's freed buffers go back: a copy cannot hide in resident free heap
    before = resident_bytes()
    model, _ = load_model(path, kernels=kernels)
    gc.collect()
    grown = resident_bytes() - before

    spans = file_mappings(path)
    assert spans and all("w" not in perms for _, _, perms, _ in spans), spans
    with GGUFFile(path) as f:
        tensors = list(f.tensors.values())
    kept = [(t.offset, t.offset + t.nbytes) for t in tensors if t.name.endswith("_exps.weight")
            or t.name == "token_embd.weight"]
    for start, end, _, offset in spans:  # what stays mapped: the experts and the (untied) embedding table only
        covered = sum(max(0, min(b, offset + end - start) - max(a, offset)) for a, b in kept)
        assert end - start - covered < 2 * os.sysconf("SC_PAGE_SIZE"), f"file bytes {offset}.. mapped for another tensor"
    seen = 0
    for layer in model.layers:
        op = layer.experts
        assert isinstance(op, FusedMoe)
        for e, (gate, up, down) in enumerate(zip(op.gate, op.up, op.down, strict=True)):
            parts = layer.experts_gate_up[e]
            assert isinstance(parts, list) and all(isinstance(w, QuantizedTensor) for w in parts)
            assert [gate.data_ptr(), up.data_ptr()] == [w.data.data_ptr() for w in parts]  # the model's own
            for t in (gate, up, down):
                start, end = t.data_ptr(), t.data_ptr() + t.numel()
                assert any(a <= start and end <= b for a, b, _, _ in spans), f"expert {e} is not in the file"
                seen += t.numel()
    assert seen == experts
    assert grown < experts // 4, f"resident memory grew by {grown / 2**20:.1f} MiB on {experts / 2**20:.1f} MiB of experts"
