"""Sampling on the GPU: troupe's one sampler (`troupe.core.sampler.Sampler`) on CUDA logits.

The sampler is written in batched torch for every device, so no sampling feature exists on one device
only: on CUDA logits it keeps them on the GPU, carries the step's parameters there with a few pinned,
non-blocking copies (`troupe.core.sampling_metadata`), and brings back only the sampled ids and the
asked-for logprobs. Its one device-specific choice is top-p's sort: the whole row on the GPU (no host
read mid-step), a top slice first on the CPU. `DeviceSampler` is the name the GPU code paths use.
"""

from __future__ import annotations

from troupe.core.sampler import Sampler

DeviceSampler = Sampler

__all__ = ["DeviceSampler"]
