"""The batch-invariant linear layer ``out = x @ weight.T (+ bias)``, forward and backward.

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``triton_kernels.py`` (the Triton twin),
``native.py`` (the stock twin).
"""

from .api import linear
from .reference import BLOCK_K, block_k_for, linear_reference
from .triton_kernels import GROUP_M, M_BUCKET_BOUNDS, gemm_path, linear_triton, tile_for_m
from .native import linear_native

__all__ = [
    "linear",
    "BLOCK_K",
    "block_k_for",
    "linear_reference",
    "GROUP_M",
    "M_BUCKET_BOUNDS",
    "gemm_path",
    "linear_triton",
    "tile_for_m",
    "linear_native",
]
