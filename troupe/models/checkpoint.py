"""An HF folder's weights as the model asks for them (`CheckpointWeights`), and the rule that every tensor a
checkpoint holds is used or accounted for (`check_unused`).

1. `CheckpointWeights(folder, scheme, keep_blocks)` opens the folder's safetensors files (those
   `model.safetensors.index.json` names, else every `*.safetensors`).
2. `get(name, shape)` returns one shape-checked weight: a plain tensor as stored; in an fp8 checkpoint a
   float8 weight times its scale; in a GPTQ / AWQ one, `X.weight` from `X.qweight` / `qzeros` / `scales`
   (/ `g_idx`) (`troupe.models.checkpoint_quant`). A float8 weight outside an fp8 checkpoint, or without its scale, is a
   `ModelLoadError`: upcast alone it would be wrong from the first token.
3. Every tensor `get` reads is marked used. After the model has loaded, `unused()` holds the rest and
   `check_unused` turns them into a `ModelLoadError` naming them (a checkpoint of another variant, a weight
   troupe would silently drop), except the known-harmless ones (`harmless_reason`: the rotary inverse
   frequencies old checkpoints store, a tied `lm_head.weight`, static fp8 activation and KV-cache scales,
   all-zero biases GPTQ exports add), which get one logged line. GGUF files go through `check_unused` too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import structlog
import torch

from troupe.errors import ModelLoadError
from troupe.kernels.quant import Weight
from troupe.models.checkpoint_quant import (
    AwqScheme,
    Fp8Scheme,
    GptqScheme,
    QuantScheme,
    awq_weight,
    dequantize_fp8,
    gptq_weight,
    is_fp8,
    packed_shapes,
)

log = structlog.get_logger("troupe.models")

_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale", ".q_scale", ".prob_scale")


class CheckpointWeights:
    """Name -> tensor over the folder's safetensors files (module docstring); use as a context manager."""

    def __init__(self, path: Path, scheme: QuantScheme = None, keep_blocks: bool = False,
                 weight_map: dict[str, Any] | None = None) -> None:
        self.path, self.scheme, self.keep_blocks = path, scheme, keep_blocks
        index = path / "model.safetensors.index.json"
        if weight_map is not None:
            files = sorted({path / f for f in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise ModelLoadError(f"{index}: names weights file {f.name}, which does not exist")
        else:
            files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{path}: no *.safetensors weights file found")
        self._handles: list[Any] = []
        self._where: dict[str, tuple[Any, Path]] = {}
        self._files = files
        self._used: set[str] = set()

    def __enter__(self) -> CheckpointWeights:
        from safetensors import safe_open

        for f in self._files:
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as e:  # safetensors raises its own SafetensorError and OSErrors
                raise ModelLoadError(f"{f}: not a valid safetensors file ({e})") from e
            self._handles.append(handle)
            for name in handle.keys():
                self._where[name] = (handle, f)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handles.clear()

    def get(self, name: str, shape: tuple[int, ...]) -> Weight:
        """The weight `name` of `shape`, in the form the checkpoint's format gives (module docstring, 2)."""
        base = name.removesuffix(".weight")
        if isinstance(self.scheme, GptqScheme | AwqScheme) and name not in self._where and base + ".qweight" in self._where:
            return self._packed(base, shape)
        w = self.read(name, shape)
        if not is_fp8(w):
            return w
        if not isinstance(self.scheme, Fp8Scheme):
            raise ModelLoadError(f"{self._file(name)}: weight {name!r} is stored in {w.dtype}, but config.json has "
                                 "no quantization_config with quant_method 'fp8' to give its scale")
        scale_name = f"{base}.{self.scheme.scale_suffix}"
        if scale_name not in self._where:
            raise ModelLoadError(f"{self._file(name)}: {self.scheme.describe} weight {name!r} has no scale "
                                 f"{scale_name!r}")
        return dequantize_fp8(w, self.read(scale_name), self.scheme.block, f"{self._file(name)}: {scale_name!r}")

    def read(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The stored tensor `name` as it is (its shape checked against `shape` if given); marks it used."""
        if name not in self._where:
            names = ", ".join(f.name for f in self._files)
            raise ModelLoadError(f"weight {name!r} is missing (looked in {names})")
        handle, f = self._where[name]
        got = tuple(handle.get_slice(name).get_shape())
        if shape is not None and got != tuple(shape):
            raise ModelLoadError(f"{f}: weight {name!r} has shape {list(got)}, config.json implies {list(shape)}")
        try:
            t = handle.get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"{f}: cannot read weight {name!r} ({e})") from e
        self._used.add(name)
        return t

    def _packed(self, base: str, shape: tuple[int, ...]) -> Weight:
        """A GPTQ / AWQ weight from its packed tensors (`checkpoint_quant`)."""
        scheme = self.scheme
        assert isinstance(scheme, GptqScheme | AwqScheme)
        out, inp = shape
        where = f"{self._file(base + '.qweight')}: {base!r}"
        if inp % scheme.pack or out % scheme.pack or (scheme.group_size > 0 and inp % scheme.group_size):
            raise ModelLoadError(f"{where}: a packed weight of {list(shape)} does not fit {32 // scheme.pack}-bit "
                                 f"words and group_size {scheme.group_size}")
        parts = {k: self.read(f"{base}.{k}", s) for k, s in packed_shapes(scheme, out, inp).items()
                 if k != "g_idx" or f"{base}.g_idx" in self._where}
        if isinstance(scheme, AwqScheme):
            return awq_weight(parts, scheme)
        return gptq_weight(parts, scheme, self.keep_blocks, where)

    def _file(self, name: str) -> Path:
        return self._where[name][1] if name in self._where else self.path

    def unused(self) -> list[str]:
        """The stored tensors no `get` / `read` has read, in name order."""
        return sorted(set(self._where) - self._used)

    def is_all_zeros(self, name: str) -> bool:
        handle, _ = self._where[name]
        return not bool(handle.get_tensor(name).any())

    def harmless_reason(self, tied: bool) -> Callable[[str], str | None]:
        """Why an unused tensor of this checkpoint may be skipped (None: it may not); `tied`: the model ties its
        LM head to the embedding."""

        def reason(name: str) -> str | None:
            if name.endswith("rotary_emb.inv_freq"):
                return "rotary inverse frequencies (troupe computes its own)"
            if name == "lm_head.weight" and tied:
                return "an LM head tied to the embedding (tie_word_embeddings)"
            if self.scheme is not None and name.endswith(".input_scale"):
                return "static fp8 activation scales (troupe does not quantize activations)"
            if self.scheme is not None and name.endswith(_SCALE_SUFFIXES):
                return "fp8 KV-cache / attention scales (troupe's KV cache is not fp8)"
            if name.endswith(".bias") and self.is_all_zeros(name):
                return "all-zero biases of layers without one"
            return None

        return reason


def check_unused(unused: Iterable[str], where: str, reason: Callable[[str], str | None]) -> None:
    """The unused tensors: an error naming those without a harmless `reason`, else one log line (if any)."""
    skipped: dict[str, list[str]] = {}
    bad: list[str] = []
    for name in unused:
        why = reason(name)
        if why is None:
            bad.append(name)
        else:
            skipped.setdefault(why, []).append(name)
    if bad:
        shown = ", ".join(repr(n) for n in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise ModelLoadError(f"{where}: {len(bad)} tensor(s) in the checkpoint that the model does not use: {shown} "
                             "(a variant troupe does not run? it will not drop weights silently)")
    if skipped:
        log.info("checkpoint tensors not used", path=where,
                 skipped={why: f"{len(names)}, e.g. {names[0]}" for why, names in skipped.items()})
