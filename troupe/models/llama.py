"""`LlamaModel`: the Llama / Mistral / Qwen2 decoder over a flattened batch and a paged KV cache.

Contract of `forward(input_ids, positions, kv_caches, meta)`:
- `input_ids`, `positions`: (T,) the new tokens of every scheduled sequence, concatenated, no padding;
- `kv_caches[layer]` = (k_pool, v_pool), each `(num_blocks, block_size, num_kv_heads, head_dim)`, written
  in place at `meta.slot_mapping` (see `troupe.kernels.attention`);
- returns the final hidden states (T, hidden); `compute_logits` turns the rows that need a token into
  (N, vocab) logits, so the 49k-wide head only runs where a token is sampled.

CPU speed: q/k/v and gate/up are fused into one matmul each at load time (`load_weights`), rotary
cos/sin come from a table built once, and everything runs under `torch.inference_mode()` (the caller's).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from troupe.kernels.attention import AttentionMetadata, paged_attention
from troupe.kernels.linear import Linear, packing_supported
from troupe.models.arch import ModelArch

WeightGetter = Callable[[str, tuple[int, ...]], torch.Tensor]  # (HF name, expected shape) -> tensor


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _bias(enabled: bool, n: int, dtype: torch.dtype) -> nn.Parameter | None:
    return _param(n, dtype=dtype) if enabled else None


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """(D/2,) float64 inverse frequencies, with "linear" or "llama3" scaling applied."""
    D = arch.head_dim
    inv = 1.0 / arch.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    sc = arch.rope_scaling
    if sc is None:
        return inv
    if sc["rope_type"] == "linear":
        return inv / float(sc["factor"])
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between
    factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_len = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary (HF layout): x (T, n, D), cos/sin (T, 1, D/2)."""
    x1, x2 = x.chunk(2, dim=-1)  # (T, n, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (T, n, D)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, index: int = 0) -> None:
        super().__init__()
        h, f, qkv = arch.hidden_size, arch.intermediate_size, arch.q_size + 2 * arch.kv_size
        self.arch = arch
        self.index = index  # which layer: picks its tensors in a decode row cache
        self.scale = arch.head_dim**-0.5
        self.input_norm = _param(h, dtype=dtype)
        self.post_norm = _param(h, dtype=dtype)
        self.qkv_w = _param(qkv, h, dtype=dtype)
        self.qkv_b = _bias(arch.qkv_bias, qkv, dtype)
        self.o_w = _param(h, arch.q_size, dtype=dtype)
        self.o_b = _bias(arch.o_bias, h, dtype)
        self.gate_up_w = _param(2 * f, h, dtype=dtype)
        self.gate_up_b = _bias(arch.mlp_bias, 2 * f, dtype)
        self.down_w = _param(h, f, dtype=dtype)
        self.down_b = _bias(arch.mlp_bias, h, dtype)
        self.qkv = Linear(self.qkv_w, self.qkv_b)
        self.o_proj = Linear(self.o_w, self.o_b)
        self.gate_up = Linear(self.gate_up_w, self.gate_up_b)
        self.down = Linear(self.down_w, self.down_b)

    def linears(self) -> tuple[Linear, ...]:
        return self.qkv, self.o_proj, self.gate_up, self.down

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden) residual stream
        cos: torch.Tensor,  # (T, 1, D/2)
        sin: torch.Tensor,  # (T, 1, D/2)
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        a, eps = self.arch, self.arch.rms_norm_eps
        T = x.shape[0]
        h = F.rms_norm(x, (a.hidden_size,), self.input_norm, eps)  # (T, hidden)
        qkv = self.qkv(h)  # (T, q_size + 2 * kv_size)
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = apply_rope(q.view(T, a.num_heads, a.head_dim), cos, sin)  # (T, H, D)
        k = apply_rope(k.view(T, a.num_kv_heads, a.head_dim), cos, sin)  # (T, KVH, D)
        v = v.reshape(T, a.num_kv_heads, a.head_dim)  # (T, KVH, D)
        o = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.index)  # (T, H, D)
        x = x + self.o_proj(o.view(T, a.q_size))  # (T, hidden)
        h = F.rms_norm(x, (a.hidden_size,), self.post_norm, eps)  # (T, hidden)
        gate, up = self.gate_up(h).chunk(2, dim=-1)  # (T, f) each
        return x + self.down(F.silu(gate) * up)  # (T, hidden)


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, max_len: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.embed = _param(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(arch, dtype, i) for i in range(arch.num_layers))
        self.norm = _param(arch.hidden_size, dtype=dtype)
        self.lm_head = (
            self.embed if arch.tie_word_embeddings else _param(arch.vocab_size, arch.hidden_size, dtype=dtype)
        )
        self.head = Linear(self.lm_head)
        n = max_len or arch.max_position_embeddings
        angles = torch.outer(torch.arange(n, dtype=torch.float64), rope_inv_freq(arch))  # (n, D/2)
        self.register_buffer("cos_table", angles.cos().to(dtype), persistent=False)  # (n, D/2)
        self.register_buffer("sin_table", angles.sin().to(dtype), persistent=False)  # (n, D/2)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed)  # (T, hidden)
        cos_table: torch.Tensor = self.cos_table  # type: ignore[assignment]  # a registered buffer
        sin_table: torch.Tensor = self.sin_table  # type: ignore[assignment]
        cos = cos_table[positions].unsqueeze(1)  # (T, 1, D/2)
        sin = sin_table[positions].unsqueeze(1)  # (T, 1, D/2)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv, meta)
        return F.rms_norm(x, (self.arch.hidden_size,), self.norm, self.arch.rms_norm_eps)  # (T, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32."""
        return self.head(hidden).float()

    def pack_weights(self) -> bool:
        """Once the weights are loaded: hand every projection and the LM head to oneDNN in its packed
        layout where that is supported (`troupe.kernels.linear`); returns whether it did. The dense
        copies are released, so `load_weights` cannot run again afterwards. A tied LM head gets its own
        packed copy (the embedding lookup still needs the dense table)."""
        if not packing_supported(self.dtype):
            return False
        if self.arch.tie_word_embeddings:
            self.head = Linear(self.embed.detach().clone())
        for layer in self.layers:
            for lin in layer.linears():  # type: ignore[operator]
                lin.pack()
        return self.head.pack()

    def load_weights(self, get: WeightGetter) -> None:
        """Fill every parameter from HF-named tensors; `get(name, shape)` returns one checked tensor."""
        a, p = self.arch, "model."
        with torch.no_grad():
            self.embed.copy_(get(p + "embed_tokens.weight", (a.vocab_size, a.hidden_size)))
            self.norm.copy_(get(p + "norm.weight", (a.hidden_size,)))
            if not a.tie_word_embeddings:
                self.lm_head.copy_(get("lm_head.weight", (a.vocab_size, a.hidden_size)))
            for i, layer in enumerate(self.layers):
                _load_layer(layer, f"{p}layers.{i}.", a, get)  # type: ignore[arg-type]


def _load_layer(layer: DecoderLayer, p: str, a: ModelArch, get: WeightGetter) -> None:
    h, f = a.hidden_size, a.intermediate_size
    layer.input_norm.copy_(get(p + "input_layernorm.weight", (h,)))
    layer.post_norm.copy_(get(p + "post_attention_layernorm.weight", (h,)))
    att, mlp = p + "self_attn.", p + "mlp."
    sizes = {"q_proj": a.q_size, "k_proj": a.kv_size, "v_proj": a.kv_size}
    layer.qkv_w.copy_(torch.cat([get(f"{att}{n}.weight", (s, h)) for n, s in sizes.items()]))
    if layer.qkv_b is not None:
        layer.qkv_b.copy_(torch.cat([get(f"{att}{n}.bias", (s,)) for n, s in sizes.items()]))
    layer.o_w.copy_(get(att + "o_proj.weight", (h, a.q_size)))
    if layer.o_b is not None:
        layer.o_b.copy_(get(att + "o_proj.bias", (h,)))
    layer.gate_up_w.copy_(
        torch.cat([get(mlp + "gate_proj.weight", (f, h)), get(mlp + "up_proj.weight", (f, h))])
    )
    layer.down_w.copy_(get(mlp + "down_proj.weight", (h, f)))
    if layer.gate_up_b is not None and layer.down_b is not None:
        layer.gate_up_b.copy_(torch.cat([get(mlp + "gate_proj.bias", (f,)), get(mlp + "up_proj.bias", (f,))]))
        layer.down_b.copy_(get(mlp + "down_proj.bias", (h,)))
