"""The batch-invariant linear layer ``out = x @ weight.T (+ bias)``, forward and backward."""

from ..impl import Constant, Impl
from .api import leaf_partials, leaf_sum, linear
from .reference import (BLOCK_K, K_LEAVES, block_k_for, k_leaves_for, leaf_bounds, leaf_partials_reference,
                        linear_reference)
from .triton_kernels import GROUP_M, M_BUCKET_BOUNDS, gemm_path, leaf_partials_triton, linear_triton, tile_for_m
from .native import linear_native

# Version 1 still: K_LEAVES is empty, so every shape computes the plain K loop of version 1; the
# version must change with the first entry of that table (the bits of that shape change).
# The contract constant K_LEAVES (optional: absent unless an entry pins it) is L, the number of K
# leaves of every call of the region, whatever the weight shape (``linear(..., leaves=L)``). A
# tensor-parallel row-parallel linear (o_proj, down_proj) needs the same L at every TP size, so a
# composition for a TP-served model pins it (docs/scale_out.md); unpinned, the shape table decides.
IMPLS = (
    Impl("gemm_fixed_k", "1", "linear", linear,
         constants={"BLOCK_K": Constant(64, (32, 64, 128), fixed=BLOCK_K), "ACC_DTYPE": Constant("fp32"),
                    "K_LEAVES": Constant(1, (1, 2, 4, 8, 16), arg="leaves", optional=True)},
         fusable=True, hazards=("signed_zero", "subnormal", "k_not_tile_multiple", "noncontiguous"),
         doc="fixed BLOCK_K, sequential K-block accumulation in fp32 within fixed K leaves keyed on (N, K) "
             "only, leaves summed left to right (split-K at small M, one program at large M: same bits)"),
    Impl("torch_linear", "torch", "linear", linear_native, fusable=True, native=True,
         doc="torch.nn.functional.linear: cuBLAS / CPU BLAS, batch-variant"),
)

__all__ = [name for name in dir() if not name.startswith("_")]
