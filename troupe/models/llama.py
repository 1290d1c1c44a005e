"""`LlamaModel`: the Llama / Mistral / Qwen2 decoder over a flattened batch and a paged KV cache.

The model is a plain description of the architecture; its heavy ops (projections, norms, rotary + KV
write, attention, SiLU x up) come from the `KernelSet` it is bound to (`bind`), chosen per device when
the model loads (`troupe.kernels.select_kernels`).

Contract of `forward(input_ids, positions, kv_caches, meta)`:
- `input_ids`, `positions`: (T,) the new tokens of every scheduled sequence, concatenated, no padding;
- `kv_caches[layer]` = (k_pool, v_pool) from `KernelSet.allocate_kv`, written in place at
  `meta.slot_mapping`;
- returns the final hidden states (T, hidden); `compute_logits` turns the rows that need a token into
  (N, vocab) float32 logits, so the vocabulary-wide head only runs where a token is sampled.

The residual stream follows vLLM's layout: each layer takes (hidden, residual) and starts with a fused
residual add + RMSNorm, so a kernel set can do the add and the norm in one pass. q/k/v and gate/up are
fused into one projection each at load time (`load_weights`); the rotary table is built once.

Weights may come quantized (`troupe.kernels.quant.QuantizedTensor`, from a GGUF file): a quantized
projection, embedding or LM head replaces its float parameter and goes to the kernel set as it is. Parts
of one fused projection in different formats (a GGUF may hold q and k in Q4_K and v in Q6_K) are kept as
consecutive groups of one format each, one projection per group, their outputs concatenated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from troupe.kernels.base import AttentionMetadata, DecoderStack, KernelSet, LayerKV, LayerWeights, LinearOp
from troupe.kernels.moe import MoeOp, route
from troupe.kernels.quant import QuantizedTensor, Weight
from troupe.models.arch import ModelArch
from troupe.models.layer_loading import WeightGetter, load_layer, load_norm, set_weight
from troupe.models.rope import rope_table


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _bias(enabled: bool, n: int, dtype: torch.dtype) -> nn.Parameter | None:
    return _param(n, dtype=dtype) if enabled else None


class DecoderLayer(nn.Module):
    """One decoder layer, with the family switches of `ModelArch`: the norms' layout (see `forward`), q/k
    norms, the activation, the residual scale, the attention's scale, sliding window and soft-cap."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, index: int = 0) -> None:
        super().__init__()
        h, f, qkv = arch.hidden_size, arch.intermediate_size, arch.q_size + 2 * arch.kv_size
        self.arch = arch
        self.index = index  # which layer: a kernel set may keep per-layer state (e.g. decode rows)
        self.scale = arch.scale
        self.window = arch.window(index)  # sliding window (None: full causal)
        self.softcap = float(arch.attn_softcap) if arch.attn_softcap is not None else None
        layout = arch.norm_layout
        # pre: input_norm before attention, post_norm before the MLP; post (OLMo 2): post_norm after
        # attention, post_ff_norm after the MLP; sandwich (Gemma): all four
        self.input_norm = _param(h, dtype=dtype) if layout != "post" else None
        self.post_norm = _param(h, dtype=dtype)
        self.pre_ff_norm = _param(h, dtype=dtype) if layout == "sandwich" else None
        self.post_ff_norm = _param(h, dtype=dtype) if layout != "pre" else None
        q_norm, k_norm = {"head": (arch.head_dim, arch.head_dim), "full": (arch.q_size, arch.kv_size)}.get(
            arch.qk_norm or "", (0, 0))
        self.q_norm = _param(q_norm, dtype=dtype) if q_norm else None
        self.k_norm = _param(k_norm, dtype=dtype) if k_norm else None
        self.qkv_w = _param(qkv, h, dtype=dtype)
        self.qkv_b = _bias(arch.qkv_bias, qkv, dtype)
        self.o_w = _param(h, arch.q_size, dtype=dtype)
        self.o_b = _bias(arch.o_bias, h, dtype)
        self.moe = arch.is_moe_layer(index)
        dense_mlp = not self.moe or arch.shared_expert  # a dense MLP, or Qwen2-MoE's shared expert
        self.gate_up_w = _param(2 * f, h, dtype=dtype) if dense_mlp else None
        self.gate_up_b = _bias(arch.mlp_bias, 2 * f, dtype) if dense_mlp else None
        self.down_w = _param(h, f, dtype=dtype) if dense_mlp else None
        self.down_b = _bias(arch.mlp_bias, h, dtype) if dense_mlp else None
        if self.moe:
            E, fe = arch.num_experts, arch.moe_intermediate_size
            self.router_w = _param(E, h, dtype=dtype)
            self.experts_gate_up = nn.ParameterList(_param(2 * fe, h, dtype=dtype) for _ in range(E))
            self.experts_down = nn.ParameterList(_param(h, fe, dtype=dtype) for _ in range(E))
            self.shared_gate_w = _param(1, h, dtype=dtype) if arch.shared_expert else None
        self.router: LinearOp = _unbound
        self.shared_gate: LinearOp = _unbound
        self.experts: MoeOp = _unbound_moe
        self.qkv: LinearOp = _unbound
        self.o_proj: LinearOp = _unbound
        self.gate_up: LinearOp = _unbound
        self.down: LinearOp = _unbound

    def bind(self, ops: KernelSet) -> None:
        """Hand the loaded projections to the kernel set (which may take their storage over); its attention
        must have this layer's features (a sliding window, soft-capping)."""
        ops.check_attention_options(self.window, self.softcap)
        self.ops = ops
        self.qkv = bind_linear(ops, self.qkv_w, self.qkv_b)
        self.o_proj = bind_linear(ops, self.o_w, self.o_b)
        if self.gate_up_w is not None and self.down_w is not None:
            self.gate_up = bind_linear(ops, self.gate_up_w, self.gate_up_b)
            self.down = bind_linear(ops, self.down_w, self.down_b)
        if self.moe:
            self.router = ops.linear(self.router_w)
            self.experts = ops.moe(list(self.experts_gate_up), list(self.experts_down))
            if self.shared_gate_w is not None:
                self.shared_gate = ops.linear(self.shared_gate_w)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The dense MLP: (M, hidden) -> (M, hidden)."""
        gate_up = self.gate_up(h)  # (M, 2f)
        if self.arch.hidden_act == "silu":
            act = self.ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
        return self.down(act)  # (M, hidden)

    def _moe(self, h: torch.Tensor) -> torch.Tensor:
        """The routed experts (troupe.kernels.moe), plus the gated shared expert where the model has one."""
        a = self.arch
        weights, ids = route(self.router(h), a.experts_per_token, a.norm_topk_prob)  # (M, k) each
        out = self.experts(h, ids, weights)  # (M, hidden)
        if a.shared_expert:
            out = out + torch.sigmoid(self.shared_gate(h)) * self._mlp(h)
        return out

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden): the previous layer's output (the embedding for layer 0)
        residual: torch.Tensor | None,  # (T, hidden): the residual stream before x was added; None at layer 0
        positions: torch.Tensor,  # (T,)
        rope: torch.Tensor,  # (max_pos, D) float32 cos | sin
        kv: LayerKV,
        meta: AttentionMetadata,
        rows: torch.Tensor | Sequence[int] | None = None,  # (N,) token indices that go on past attention
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream it is to be added to): (T, hidden) each, or
        with `rows` (N, hidden), those tokens' alone. Every token's K/V is written either way; `rows`
        only spares the output projection and the MLP of tokens whose output nothing reads (the last
        layer's, for tokens that need no logits).

        The layouts (HF's `residual + branch(x)` written as vLLM's (output, residual) stream):
        pre: `h = norm_in(x + r)`, `r' = x + r + attn(h)`, out = `mlp(norm_post(r'))`;
        sandwich: the same with `norm_post(attn(h))` added and `norm_post_ff(mlp(norm_pre_ff(r')))` out;
        post: `h = x + r` unnormed, `r' = h + norm_post(attn(h))`, out = `norm_post_ff(mlp(r'))`."""
        a, eps, ops = self.arch, self.arch.rms_norm_eps, self.ops
        T = x.shape[0]
        if a.norm_layout == "post":
            h = residual = x if residual is None else x + residual
        elif residual is None:
            h, residual = ops.rms_norm(x, _given(self.input_norm), eps), x  # (T, hidden) each
        else:
            h, residual = ops.add_rms_norm(x, residual, _given(self.input_norm), eps)
        qkv = self.qkv(h)  # (T, q_size + 2 * kv_size)
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        if a.qk_norm == "full":  # over all heads at once (OLMo 2)
            q, k = ops.rms_norm(q.contiguous(), _given(self.q_norm), eps), ops.rms_norm(k.contiguous(), _given(self.k_norm), eps)
        q = q.reshape(T, a.num_heads, a.head_dim)  # (T, H, D)
        k = k.reshape(T, a.num_kv_heads, a.head_dim)  # (T, KVH, D)
        v = v.reshape(T, a.num_kv_heads, a.head_dim)  # (T, KVH, D)
        if a.qk_norm == "head":  # each head on its own (Qwen3, Gemma 3)
            q = ops.rms_norm(q.reshape(-1, a.head_dim), _given(self.q_norm), eps).view(T, a.num_heads, a.head_dim)
            k = ops.rms_norm(k.reshape(-1, a.head_dim), _given(self.k_norm), eps).view(T, a.num_kv_heads, a.head_dim)
        q, k = ops.rope_and_cache(positions, q, k, v, rope, kv, meta)
        # attention runs for every token even so: a kernel set may keep per-layer state in it (the eager
        # set's decode rows), and a prefill's attention is a few percent of its projections
        o = ops.attention(q, k, v, kv, meta, self.scale, self.index, sliding_window=self.window, softcap=self.softcap)
        o = o.reshape(T, a.q_size)  # (T, H * D)
        if rows is not None:
            if len(rows) == 0:  # K/V written; no token's output is wanted
                return x.new_empty((0, x.shape[1])), residual.new_empty((0, x.shape[1]))
            o, residual = o[rows], residual[rows]  # (N, H * D), (N, hidden): copies
        attn = self.o_proj(o)  # (T or N, hidden)
        if a.residual_scale != 1.0:
            attn = attn * a.residual_scale
        if a.norm_layout == "pre":
            h, residual = ops.add_rms_norm(attn, residual, self.post_norm, eps)
        elif a.norm_layout == "sandwich":
            h, residual = ops.add_rms_norm(ops.rms_norm(attn, self.post_norm, eps), residual, _given(self.pre_ff_norm), eps)
        else:
            h = residual = ops.rms_norm(attn, self.post_norm, eps) + residual
        out = self._moe(h) if self.moe else self._mlp(h)  # (T or N, hidden)
        if a.residual_scale != 1.0:
            out = out * a.residual_scale
        if self.post_ff_norm is not None:
            out = ops.rms_norm(out, _given(self.post_ff_norm), eps)
        return out, residual


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
        length = max_len or arch.max_position_embeddings
        self.register_buffer("rope_cache", rope_table(arch.rope, arch.head_dim, length, arch.max_position_embeddings),
                             persistent=False)  # (max_len, D) float32
        local = arch.local_rope  # the sliding layers' own rotary table (Gemma 3)
        self.register_buffer("rope_local", rope_table(local, arch.head_dim, length, arch.max_position_embeddings)
                             if local is not None else None, persistent=False)
        self.head: LinearOp = _unbound
        self.embedding: Callable[[torch.Tensor], torch.Tensor] = _unbound
        self.stack: DecoderStack | None = None  # the kernel set's one-call stack of the layers, if it has one
        self.trunk: DecoderStack | None = None  # the same of all but the last layer

    def bind(self, ops: KernelSet) -> None:
        """Once the weights are loaded: hand every projection, the embedding and the LM head to the kernel
        set, which may take their storage over (so `load_weights` cannot run again afterwards). A tied LM
        head gets its own copy, since the embedding lookup still needs the table."""
        self.ops = ops
        if ops.device.type != "cpu":
            self.to(ops.device)
        self.embedding = ops.embedding(self.embed)
        if not self.arch.tie_word_embeddings:
            self.head = bind_linear(ops, self.lm_head, None)
        elif isinstance(self.embed, QuantizedTensor):  # never modified: the head may share it
            self.head = ops.linear(self.embed)
        else:
            self.head = ops.linear(self.embed.detach().clone())
        for layer in self.layers:
            layer.bind(ops)  # type: ignore[operator]
        a, layers = self.arch, cast(list[DecoderLayer], list(self.layers))
        if not a.is_plain:  # a family switch the stacks do not have: the per-layer loop
            self.stack = self.trunk = None
            return
        weights = [LayerWeights(ly.input_norm, ly.post_norm, ly.qkv, ly.o_proj, ly.gate_up, ly.down)  # type: ignore[arg-type]
                   for ly in layers]
        shape = (a.num_heads, a.num_kv_heads, a.head_dim, a.rms_norm_eps, a.head_dim**-0.5)
        self.stack = ops.decoder_stack(weights, *shape)
        # all but the last layer, for steps whose last layer runs on fewer rows (`forward`'s `rows`)
        self.trunk = ops.decoder_stack(weights[:-1], *shape) if self.stack is not None else None

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
        rows: torch.Tensor | Sequence[int] | None = None,
    ) -> torch.Tensor:
        """The final hidden states: (T, hidden), or with `rows` (increasing token indices of the step, e.g.
        the tokens that need logits) (N, hidden) of those tokens alone.

        With `rows` shorter than the step, the last layer computes its output projection and MLP on those
        rows only (its q/k/v, the K/V write and attention still run for every token): the other tokens'
        outputs would be discarded, and in a prefill they are nearly all of them. llama.cpp trims its last layer the same way.
        """
        rope: torch.Tensor = self.rope_cache  # type: ignore[assignment]  # a registered buffer
        local: torch.Tensor | None = self.rope_local  # type: ignore[assignment]
        x = self.embedding(input_ids)  # (T, hidden)
        if self.arch.embed_scale != 1.0:
            x = x * torch.tensor(self.arch.embed_scale, dtype=x.dtype)
        trim = rows is not None and len(rows) < x.shape[0]
        last = len(self.layers) - 1
        residual: torch.Tensor | None = None
        if self.stack is not None and x.dtype == torch.float32:  # the layers in one call, same results
            if not trim:
                x, residual = self.stack(x, positions, rope, kv_caches, meta)
            else:
                if self.trunk is not None:
                    x, residual = self.trunk(x, positions, rope, kv_caches[:last], meta)
                x, residual = self.layers[last](x, residual, positions, rope, kv_caches[last], meta, rows)
        else:
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
                table = local if local is not None and layer.window is not None else rope
                x, residual = layer(x, residual, positions, table, kv, meta, rows if trim and i == last else None)
        assert residual is not None, "a model has at least one layer"
        return self.ops.add_rms_norm(x, residual, self.norm, self.arch.rms_norm_eps)[0]  # (T or N, hidden)

    @contextlib.contextmanager
    def per_layer_loop(self) -> Iterator[None]:
        """Within the block, `forward` calls each layer's ops from Python even where the kernel set has a
        decoder stack (for what replaces or times those ops one by one)."""
        stack, self.stack = self.stack, None
        try:
            yield
        finally:
            self.stack = stack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32, scaled and soft-capped where the family does."""
        logits = self.head(hidden).float()
        if self.arch.logit_scale != 1.0:
            logits = logits * self.arch.logit_scale
        cap = self.arch.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, get: WeightGetter) -> None:
        """Fill every parameter from HF-named tensors; `get(name, shape)` returns one checked tensor."""
        a, p = self.arch, "model."
        with torch.no_grad():
            set_weight(self, "embed", [get(p + "embed_tokens.weight", (a.vocab_size, a.hidden_size))])
            load_norm(self.norm, get(p + "norm.weight", (a.hidden_size,)), a)
            if not a.tie_word_embeddings:
                set_weight(self, "lm_head", [get("lm_head.weight", (a.vocab_size, a.hidden_size))])
            elif isinstance(self.embed, QuantizedTensor):  # the tied head follows the table out of the params
                delattr(self, "lm_head")
                self.lm_head = self.embed
            for i, layer in enumerate(self.layers):
                load_layer(layer, f"{p}layers.{i}.", a, get)  # type: ignore[arg-type]


def _given(weight: torch.Tensor | None) -> torch.Tensor:
    """A norm's weight that this layer's layout has (the layout decides which it reads)."""
    assert weight is not None
    return weight


def _unbound(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the model is not bound to a kernel set yet (LlamaModel.bind)")


def _unbound_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the model is not bound to a kernel set yet (LlamaModel.bind)")


def bind_linear(ops: KernelSet, weight: Weight | list[Weight], bias: torch.Tensor | None) -> LinearOp:
    """The kernel set's projection of `weight`; a list of weights (row groups) gives one projection per group,
    each with its slice of the bias, and the concatenation of their outputs."""
    if not isinstance(weight, list):
        return ops.linear(weight, bias)
    sizes = [w.shape[0] for w in weight]
    biases = list(bias.split(sizes)) if bias is not None else [None] * len(weight)
    projections = [ops.linear(w, b) for w, b in zip(weight, biases, strict=True)]
    return lambda x: torch.cat([f(x) for f in projections], dim=-1)
