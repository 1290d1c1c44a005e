"""Filling a `LlamaModel`'s parameters from a checkpoint's HF-named tensors (`load_layer`, `set_weight`).

Per family (`ModelArch`): the norms of its layout, with Gemma's (1 + w) folded in; q/k norms; q/k/v and
gate/up either separate (most families) or fused in the checkpoint (Phi-3); a partial rotary embedding's
per-head row order of q and k (`troupe.models.rope`); a mixture of experts' router, experts and shared
expert under the family's names. Dense parts of one fused projection are concatenated into its float
parameter; quantized parts (GGUF blocks) replace it, grouped into runs of one format (`group_rows`), but
for an expert's gate and up, which stay two weights (`[gate, up]`: the file's blocks, mapped, not copied).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from troupe.kernels.quant import QuantizedTensor, Weight, dense
from troupe.models.arch import ModelArch
from troupe.models.rope import partial_rotary_order

if TYPE_CHECKING:
    from troupe.models.llama import DecoderLayer

WeightGetter = Callable[[str, tuple[int, ...]], Weight]  # (HF name, expected shape) -> tensor or quantized


def set_weight(module: nn.Module, name: str, parts: list[Weight], stack: bool = True) -> None:
    """Fill the weight `name` of `module` from its row parts (q, k, v / gate, up / one): dense parts are
    concatenated into the float parameter; with a quantized part, the parameter is replaced by the parts
    grouped into runs of one format (`group_rows`): one weight, or a list of them. `stack=False` keeps
    quantized parts apart, as they come (an expert's gate and up: views of the file that a stack would copy;
    the kernel sets take the list, `troupe.kernels.moe`)."""
    if all(isinstance(w, torch.Tensor) for w in parts):
        getattr(module, name).copy_(torch.cat(parts) if len(parts) > 1 else parts[0])  # type: ignore[arg-type]
        return
    dtype = getattr(module, name).dtype
    groups = group_rows(parts, dtype) if stack else [w if isinstance(w, QuantizedTensor) else dense(w, dtype)
                                                      for w in parts]
    delattr(module, name)  # the float parameter goes; nn.Module then keeps the weight as a plain attribute
    setattr(module, name, groups[0] if len(groups) == 1 else groups)


def group_rows(parts: list[Weight], dtype: torch.dtype) -> list[Weight]:
    """Consecutive parts of one format stacked into one weight each (dense ones in `dtype`)."""
    groups: list[list[Weight]] = []
    for w in parts:
        kind = w.qtype if isinstance(w, QuantizedTensor) else None
        last = groups[-1][0] if groups else None
        if last is not None and (last.qtype if isinstance(last, QuantizedTensor) else None) == kind:
            groups[-1].append(w)
        else:
            groups.append([w])
    out: list[Weight] = []
    for g in groups:
        if isinstance(g[0], QuantizedTensor):
            out.append(QuantizedTensor.cat(g) if len(g) > 1 else g[0])  # type: ignore[arg-type]
        else:
            out.append(torch.cat([dense(w, dtype) for w in g]))
    return out


def load_norm(param: torch.Tensor, weight: Weight, a: ModelArch) -> None:
    """A norm's weight, with the family's offset folded in (Gemma's (1 + w))."""
    w = dense(weight).float()
    param.copy_(w + a.norm_offset if a.norm_offset else w)


def load_layer(layer: DecoderLayer, p: str, a: ModelArch, get: WeightGetter) -> None:
    h, f = a.hidden_size, a.intermediate_size
    norms = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
             "pre_ff_norm": "pre_feedforward_layernorm", "post_ff_norm": "post_feedforward_layernorm"}
    for attr, name in norms.items():
        param = getattr(layer, attr)
        if param is not None:
            load_norm(param, get(f"{p}{name}.weight", (h,)), a)
    att, mlp = p + "self_attn.", p + "mlp."
    order = _rotary_rows(a)
    for attr, name in (("q_norm", "q_norm"), ("k_norm", "k_norm")):
        param = getattr(layer, attr)
        if param is not None:
            w = dense(get(f"{att}{name}.weight", (param.shape[0],)))
            load_norm(param, w if order is None else w.view(-1, a.head_dim)[:, order].reshape(-1), a)
    sizes = {"q_proj": a.q_size, "k_proj": a.kv_size, "v_proj": a.kv_size}
    if a.fused_checkpoint:  # Phi-3: one qkv_proj, one gate_up_proj (gate first)
        qkv = dense(get(att + "qkv_proj.weight", (a.q_size + 2 * a.kv_size, h)))
        parts: list[Weight] = list(qkv.split(list(sizes.values())))
    else:
        parts = [get(f"{att}{n}.weight", (s, h)) for n, s in sizes.items()]
    if order is not None:  # partial rotary: q and k rows in the table's layout (troupe.models.rope)
        parts[0], parts[1] = _permute_heads(parts[0], order, a), _permute_heads(parts[1], order, a)
    set_weight(layer, "qkv_w", parts)
    if layer.qkv_b is not None:
        biases = [dense(get(f"{att}{n}.bias", (s,))) for n, s in sizes.items()]
        if order is not None:
            biases[0], biases[1] = (_permute_heads(b.unsqueeze(1), order, a).squeeze(1) for b in biases[:2])
        layer.qkv_b.copy_(torch.cat(biases))
    set_weight(layer, "o_w", [get(att + "o_proj.weight", (h, a.q_size))])
    if layer.o_b is not None:
        layer.o_b.copy_(dense(get(att + "o_proj.bias", (h,))))
    if layer.moe:
        _load_experts(layer, p, a, get)
        if not a.shared_expert:
            return
        mlp = mlp + "shared_expert."
    if a.fused_checkpoint:
        set_weight(layer, "gate_up_w", [get(mlp + "gate_up_proj.weight", (2 * f, h))])
    else:
        set_weight(layer, "gate_up_w", [get(mlp + "gate_proj.weight", (f, h)), get(mlp + "up_proj.weight", (f, h))])
    set_weight(layer, "down_w", [get(mlp + "down_proj.weight", (h, f))])
    if layer.gate_up_b is not None and layer.down_b is not None:
        layer.gate_up_b.copy_(torch.cat([dense(get(mlp + "gate_proj.bias", (f,))),
                                         dense(get(mlp + "up_proj.bias", (f,)))]))
        layer.down_b.copy_(dense(get(mlp + "down_proj.bias", (h,))))


def _load_experts(layer: DecoderLayer, p: str, a: ModelArch, get: WeightGetter) -> None:
    """The router, each expert's gate|up and down, and a shared expert's gate, under the family's names."""
    h, fe = a.hidden_size, a.moe_intermediate_size
    block = p + ("block_sparse_moe." if a.expert_naming == "mixtral" else "mlp.")
    names = ("w1", "w3", "w2") if a.expert_naming == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    layer.router_w.copy_(dense(get(block + "gate.weight", (a.num_experts, h))))
    for e in range(a.num_experts):
        ex = f"{block}experts.{e}."
        gate, up, down = (get(f"{ex}{n}.weight", shape) for n, shape in zip(names, ((fe, h), (fe, h), (h, fe)),
                                                                                strict=True))
        set_weight(layer.experts_gate_up, str(e), [gate, up], stack=False)  # blocks: [gate, up], not copied
        set_weight(layer.experts_down, str(e), [down])
    if layer.shared_gate_w is not None:
        layer.shared_gate_w.copy_(dense(get(p + "mlp.shared_expert_gate.weight", (1, h))))


def _rotary_rows(a: ModelArch) -> torch.Tensor | None:
    """The per-head dim order of q and k for a partial rotary embedding; None when every dim rotates."""
    if a.rotary_dim in (0, a.head_dim):
        return None
    return partial_rotary_order(a.head_dim, a.rotary_dim)


def _permute_heads(w: Weight, order: torch.Tensor, a: ModelArch) -> torch.Tensor:
    """The rows of a q or k projection (heads * D, ...) with each head's dims in `order`."""
    if isinstance(w, QuantizedTensor):
        raise ValueError("a partial rotary embedding on quantized q/k weights is not supported")
    rows = w.shape[0]
    return w.reshape(rows // a.head_dim, a.head_dim, -1)[:, order].reshape(rows, -1)
