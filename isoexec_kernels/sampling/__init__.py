"""Gumbel-max next-token choice, one fused pass per logits row (the engine's sampler)."""

from .api import gumbel_argmax
from .reference import gumbel_argmax_reference, mix32, noise_uniform
from .triton_kernels import BLOCK_V, CHUNKS, gumbel_argmax_triton

__all__ = [name for name in dir() if not name.startswith("_")]
