"""A random-weight mixture-of-experts GGUF, written as llama.cpp's converter writes a `qwen3moe` file:
`make_moe_gguf(path, MoeShape(...))`.

For the memory test (tests/models/test_gguf_memory.py) and the MoE benchmark (`troupe.bench.moe_llamacpp`):
every matrix is random valid blocks of `shape.qtype` (`troupe.kernels.quant.random_quantized`, so the
K-quants need no quantizer), the router, norms and q/k norms float32. Tensors are written one at a time
(`GGUFWriter.add_tensor_info` first, then each one's bytes drawn and written), so a file of a GB costs a
tensor's memory, not the file's. The values are scaled by 1/sqrt(fan-in) so activations stay of order 1
through the layers. `tokenizer=True` writes the default model's tokenizer metadata (vocabulary 49152, what
llama.cpp needs to load a file); without it the file has a bare vocabulary of `shape.vocab` (troupe loads
it, llama.cpp does not). Deterministic for a seed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from troupe.kernels.quant import QType


@dataclass(frozen=True, slots=True)
class MoeShape:
    """A Qwen3-MoE's proportions (every layer's MLP is its routed experts, top-k renormalized)."""

    layers: int = 12
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    experts: int = 16
    top_k: int = 2
    expert_ff: int = 2816  # moe_intermediate_size
    vocab: int = 49152
    context: int = 4096
    qtype: QType = QType.Q4_K  # every matrix but the router

    def expert_bytes(self) -> int:
        """Bytes of all the layers' `ffn_*_exps` tensors."""
        per_layer = 2 * self.expert_ff * self.qtype.row_bytes(self.hidden) + self.hidden * self.qtype.row_bytes(
            self.expert_ff)
        return self.layers * self.experts * per_layer


def make_moe_gguf(path: str | Path, shape: MoeShape, tokenizer: bool = True, seed: int = 0) -> Path:
    """Write the file (see the module docstring) at `path` and return it."""
    import gguf
    import numpy as np

    from troupe.models.default_model import find_default_gguf
    from troupe.models.gguf_file import GGUFFile

    s = shape
    out = Path(path)
    writer = gguf.GGUFWriter(out, "qwen3moe")
    writer.add_block_count(s.layers)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.expert_ff)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1000000.0)
    writer.add_expert_count(s.experts)
    writer.add_expert_used_count(s.top_k)
    writer.add_expert_feed_forward_length(s.expert_ff)
    writer.add_expert_weights_norm(True)
    vocab = s.vocab
    if tokenizer:
        with GGUFFile(find_default_gguf()) as src:
            meta = src.metadata
        vocab = len(meta["tokenizer.ggml.tokens"])
        writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
        writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
        writer.add_token_list(meta["tokenizer.ggml.tokens"])
        writer.add_token_merges(meta["tokenizer.ggml.merges"])
        writer.add_token_types(meta["tokenizer.ggml.token_type"])
        writer.add_bos_token_id(int(meta["tokenizer.ggml.bos_token_id"]))
        writer.add_eos_token_id(int(meta["tokenizer.ggml.eos_token_id"]))
        writer.add_chat_template(meta["tokenizer.chat_template"])
    else:
        writer.add_vocab_size(vocab)
    tensors = list(_tensors(s, vocab))
    for name, dims, qtype in tensors:  # the table first: each tensor's bytes are drawn as they are written
        rows = math.prod(dims[:-1])
        if qtype == QType.F32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), rows * dims[-1] * 4)
        else:
            byte_shape = (*dims[:-1], qtype.row_bytes(dims[-1]))
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), rows * byte_shape[-1],
                                   raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    import torch

    g = torch.Generator().manual_seed(seed)
    for name, dims, qtype in tensors:
        writer.write_tensor_data(_values(name, dims, qtype, g))
    writer.close()
    return out


def _tensors(s: MoeShape, vocab: int) -> Iterator[tuple[str, tuple[int, ...], QType]]:
    """(GGUF name, torch-order dims, format) of every tensor, in file order."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    yield "token_embd.weight", (vocab, s.hidden), s.qtype
    for i in range(s.layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (s.hidden,), QType.F32
        yield b + "attn_q.weight", (q, s.hidden), s.qtype
        yield b + "attn_k.weight", (kv, s.hidden), s.qtype
        yield b + "attn_v.weight", (kv, s.hidden), s.qtype
        yield b + "attn_output.weight", (s.hidden, q), s.qtype
        yield b + "attn_q_norm.weight", (s.head_dim,), QType.F32
        yield b + "attn_k_norm.weight", (s.head_dim,), QType.F32
        yield b + "ffn_norm.weight", (s.hidden,), QType.F32
        yield b + "ffn_gate_inp.weight", (s.experts, s.hidden), QType.F32
        yield b + "ffn_gate_exps.weight", (s.experts, s.expert_ff, s.hidden), s.qtype
        yield b + "ffn_up_exps.weight", (s.experts, s.expert_ff, s.hidden), s.qtype
        yield b + "ffn_down_exps.weight", (s.experts, s.hidden, s.expert_ff), s.qtype
    yield "output_norm.weight", (s.hidden,), QType.F32
    yield "output.weight", (vocab, s.hidden), s.qtype


def _values(name: str, dims: tuple[int, ...], qtype: QType, g: Any) -> Any:
    """The tensor's bytes (numpy): norms around 1, matrices of std ~ 1/sqrt(fan-in) (the router's larger,
    so that routing is not uniform)."""
    import torch

    from troupe.kernels.quant import QuantizedTensor, random_quantized

    cols = dims[-1]
    if len(dims) == 1:
        return (1.0 + 0.1 * torch.randn(dims, generator=g)).numpy()
    if qtype == QType.F32:
        return (torch.randn(dims, generator=g) * (4.0 if "gate_inp" in name else 1.0) / math.sqrt(cols)).numpy()
    w = random_quantized(qtype, math.prod(dims[:-1]), cols, g, scale=0.25 / math.sqrt(cols))
    assert isinstance(w, QuantizedTensor)
    return w.data.reshape(*dims[:-1], -1).numpy()
