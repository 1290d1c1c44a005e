"""Rotary tables: `rope_table(rope, head_dim, max_len)` for every RoPE type troupe runs.

The kernels rotate a head in HF's rotate-half layout with one table: (max_len, D) float32, cos of each
position's angles in the first D/2 columns, sin in the last. Per type (transformers'
`modeling_rope_utils` has the same formulas):

- `default`: angle p * theta^(-2i/d); `linear`: divided by `factor`; `llama3`: low frequencies divided by
  `factor`, high ones kept, a smooth blend between;
- `yarn`: the blend of interpolated and extrapolated frequencies over the correction range given by
  `beta_fast` / `beta_slow`, and cos/sin scaled by the attention factor (`0.1 ln(factor) + 1` unless given);
- `dynamic` (NTK): HF rescales the base once a sequence passes `max_position_embeddings`; troupe decides
  once, from the table's length: the plain table while `max_len` fits, else the base for `max_len`;
- `longrope` (Phi-3.5, Phi-4-mini): positions below `original_max_position_embeddings` use
  `short_factor`, positions from there on `long_factor` (what HF computes when a sequence grows past it
  one token at a time; a single prefill past it is rotated with the long factors throughout in HF), and
  cos/sin are scaled by the attention factor.

Partial rotary (`partial_rotary_factor`, rotary_dim R < D): HF rotates the first R dims of each head
(pairs i, i + R/2) and passes the rest. The table here pairs i with i + D/2, so the model permutes the
rows of the q and k projections (`partial_rotary_order`) so that the rotated dims sit where the table
rotates them and the passed ones where its angle is 0 (cos 1, sin 0); q.k is unchanged by a permutation
applied to both.
"""

from __future__ import annotations

import math

import torch

from troupe.models.rope_params import Rope


def inv_freq(rope: Rope, max_len: int, max_position_embeddings: int, long: bool = False) -> torch.Tensor:
    """(R/2,) float64 inverse frequencies of the rotated dims (`long`: longrope's long factors)."""
    R, base, sc = rope.rotary_dim, rope.theta, rope.scaling
    exponents = torch.arange(0, R, 2, dtype=torch.float64) / R
    kind = sc["rope_type"] if sc else "default"
    if kind == "dynamic" and max_len > max_position_embeddings:
        factor = float(sc["factor"])  # type: ignore[index]
        base = base * ((factor * max_len / max_position_embeddings) - (factor - 1)) ** (R / (R - 2))
    inv = 1.0 / base**exponents
    if sc is None or kind == "dynamic":
        return inv
    if kind == "factors":  # per-frequency divisors (a GGUF's rope_freqs tensor)
        return inv / torch.tensor(sc["factors"], dtype=torch.float64)
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "longrope":
        return inv / torch.tensor(sc["long_factor" if long else "short_factor"], dtype=torch.float64)
    if kind == "yarn":
        return _yarn_inv_freq(inv, sc, R, base, max_position_embeddings)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between
    factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_len = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, smoothed, scaled)


def _factor(sc: dict, max_position_embeddings: int) -> float:
    factor = sc.get("factor")
    if factor is None:
        factor = max_position_embeddings / float(sc["original_max_position_embeddings"])
    return float(factor)


def _yarn_inv_freq(inv: torch.Tensor, sc: dict, R: int, base: float, max_position_embeddings: int) -> torch.Tensor:
    factor = _factor(sc, max_position_embeddings)
    original = float(sc.get("original_max_position_embeddings") or max_position_embeddings)
    fast, slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dim whose wavelength makes `rotations` turns over `original`
        return R * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(R // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return inv / factor * (1 - keep) + inv * keep


def attention_factor(rope: Rope, max_position_embeddings: int) -> float:
    """The factor cos and sin are scaled by (yarn, longrope; 1 otherwise)."""
    sc = rope.scaling
    kind = sc["rope_type"] if sc else "default"
    if kind not in ("yarn", "longrope"):
        return 1.0
    assert sc is not None
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    factor = _factor(sc, max_position_embeddings)
    if kind == "yarn":
        mscale, mscale_all = sc.get("mscale"), sc.get("mscale_all_dim")

        def get(scale: float, m: float = 1.0) -> float:
            return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0

        return get(factor, mscale) / get(factor, mscale_all) if mscale and mscale_all else get(factor)
    original = float(sc["original_max_position_embeddings"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_table(rope: Rope, head_dim: int, max_len: int, max_position_embeddings: int) -> torch.Tensor:
    """(max_len, head_dim) float32 cos | sin (see the module docstring); the dims beyond `rope.rotary_dim`
    (in the layout `partial_rotary_order` gives q and k) get cos 1 and sin 0."""
    positions = torch.arange(max_len, dtype=torch.float64)
    freqs = inv_freq(rope, max_len, max_position_embeddings)  # (R/2,)
    angles = torch.outer(positions, freqs)  # (max_len, R/2)
    sc = rope.scaling
    if sc is not None and sc["rope_type"] == "longrope":
        original = int(sc["original_max_position_embeddings"])
        if max_len > original:
            angles[original:] = torch.outer(positions[original:], inv_freq(rope, max_len, max_position_embeddings, True))
    mscale = attention_factor(rope, max_position_embeddings)
    cos, sin = angles.cos() * mscale, angles.sin() * mscale  # (max_len, R/2) each
    pad = head_dim // 2 - angles.shape[1]  # passed dims: cos 1, sin 0 (unscaled, as HF passes them)
    if pad:
        cos = torch.cat([cos, cos.new_ones(max_len, pad)], dim=1)  # (max_len, D/2)
        sin = torch.cat([sin, sin.new_zeros(max_len, pad)], dim=1)
    return torch.cat([cos, sin], dim=-1).float()  # (max_len, D)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """(D,) the HF dim of each of troupe's dims in one head (see the module docstring): troupe's dim i
    (i < D/2) is paired with i + D/2; HF's rotated pairs (j, j + R/2) go to (j, j + D/2), the passed dims
    fill the rest in order."""
    D, R = head_dim, rotary_dim
    half, rhalf = D // 2, R // 2
    passed = list(range(R, D))
    first = list(range(rhalf)) + passed[: half - rhalf]
    second = list(range(rhalf, R)) + passed[half - rhalf:]
    return torch.tensor(first + second)
