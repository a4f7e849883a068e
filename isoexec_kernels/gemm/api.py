"""Batch-invariant linear layer: ``out = x @ weight.T (+ bias)``.

Public API
  ``linear(x, weight, bias=None, out_dtype=None, leaves=None, residual=None)``  dispatcher (CUDA -> Triton, else reference),
                                               differentiable (backward uses the same kernels)
  ``linear_reference(x, weight, bias=None)``  CPU/any-device torch twin
  ``leaf_sum(partials, bias=None, out_dtype=fp32)``  K-leaf partials -> the rounded output (the
                                               epilogue of a row-parallel linear's gathered leaves)
  ``linear_triton(x, weight, bias=None, impl=None, tile=None)``  Triton twin
  ``BLOCK_K``, ``GROUP_M``, ``block_k_for(N, K)``, ``k_leaves_for(N, K)``, ``tile_for_m(M, dtype, N, K, leaves)``,
  ``gemm_path(N, K, dtype, device, M, leaves)``

Rounding schedule (every output element, whatever M, the row's position or its neighbours)
  inputs bf16/fp16/fp32; products and accumulation in fp32; K is cut into fixed blocks of
  ``BLOCK_K = 64`` (the last zero-padded), and the blocks into ``L = k_leaves_for(N, K)``
  contiguous K leaves (a function of the weight shape only; leaf j holds blocks
  ``[j*nb//L, (j+1)*nb//L)`` of the nb blocks; L = 1 for most shapes). Inside a leaf the blocks
  are accumulated sequentially in K order into an fp32 accumulator that starts at +0; the
  leaves are summed left to right in fp32, the first taken as it is; bias (if any) is added in
  fp32 after the last leaf; one round-to-nearest-even cast to the input dtype at the end (or to
  ``out_dtype``: fp32 output of 16-bit inputs keeps the fp32 accumulator unrounded; the MoE
  router's logits are made this way). ``residual`` (optional, the output's shape and dtype):
  ``out + residual`` after that rounding, added in fp32 and rounded once more, i.e. torch's
  elementwise add of the two; the Triton kernels do it in their epilogue (one launch instead of
  two, the same bits as the separate add). No TF32. A small batch may compute the leaves in separate programs (split-K) and sum them in a
  second pass; a large batch walks them in one program; both are the schedule above, so a
  row's bits never depend on M. (The leaves exist for speed: a weight with few output tiles,
  such as Qwen3-0.6B's o_proj and down_proj, otherwise leaves most SMs idle at decode sizes.)

  * reference (impl ``ref_gemm``): the 64 products of a block are exact-rounded fp32 products
    summed by the halves pairwise tree of :func:`isoexec_kernels._ref.tree_sum0`.
  * Triton (impl ``triton_gemm``): the block is one ``tl.dot`` (tensor cores for 16-bit
    inputs, ``input_precision="ieee"`` FMA for fp32) accumulating into the fp32 tile
    accumulator. Two kernels run this same loop: a persistent one with tensor descriptors
    (TMA, descriptors made on the host on a GPU, optional warp specialisation, GROUP_M raster)
    and a plain pointer one (fallback, interpreter, small M). Kernel and tile (BLOCK_M x
    BLOCK_N) are picked by an M bucket (:func:`tile_for_m`); BLOCK_K and the sequential K order never change, and on the H200
    all tiles and both kernels gave identical bits (gated per bucket on each GPU). At M <= 256 a
    launch may take 2 or 4 blocks per ``tl.dot`` (the tile's ``K_TILE``, 16-bit inputs only):
    the tensor cores chain the dot's k16 steps into the accumulator in K order, so it is the
    same sequence of accumulations as one dot per block (identical bits on the H200 for every
    tile, K tile and M swept; ``test_linear_cuda_k_tile_never_changes_bits``).

Speed: see :func:`tile_for_m` (per-entry ratios to cuBLAS on an H200, CUDA-graph replay) and
``results/h200/bench/gemm.json``. Eager calls add ~20-60 us of Python/Triton launch overhead per
call, which dominates at small M: decode should run under CUDA graphs.

The reference and the Triton kernel are different implementations (different bits); each is
invariant on its own. Autograd (deterministic, not batch invariant: only forward bits must match
between trainer and engine): on CUDA ``grad_x = grad @ W`` and ``grad_W = grad^T @ x`` are cuBLAS
products (the same algorithm and bits for the same shapes on every run) and ``grad_b`` a torch
sum over tokens; on CPU they run through the reference kernel (``grad_W`` reduces over tokens,
BLOCK_K over M) and ``grad_b`` is a fixed-leaf tree sum over tokens.
"""

from __future__ import annotations

import torch

from .. import _ref
from .._triton_util import want_triton
from .reference import _check, _GRAD_BIAS_LEAF, _reference_2d, leaf_sum_reference
from .triton_kernels import _triton_2d, leaf_sum_triton


def _linear_2d(x2, w, bias, out_dtype=None, leaves=None, residual=None):
    if want_triton(x2):
        return _triton_2d(x2, w, bias, leaves=leaves, out_dtype=out_dtype, residual=residual)
    return _reference_2d(x2, w, bias, leaves=leaves, out_dtype=out_dtype, residual=residual)


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype, leaves, residual):
        K = x.shape[-1]
        x2 = x.reshape(-1, K)
        ctx.save_for_backward(x2, weight)
        ctx.x_shape = x.shape
        ctx.has_bias = bias is not None
        ctx.wide = out_dtype is not None and out_dtype.itemsize > x.dtype.itemsize
        out = _linear_2d(x2, weight, bias, out_dtype, leaves, residual)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x2, w = ctx.saved_tensors
        N = w.shape[0]
        x_dtype, w_dtype = x2.dtype, w.dtype
        if ctx.wide:
            # a wider output (fp32 logits of 16-bit inputs): the gradient keeps its precision, the
            # products run on fp32 copies of the inputs, one rounding to each input's dtype (what
            # autograd computes for linear(x.float(), w.float()))
            g2, x2, w = grad.reshape(-1, N).float(), x2.float(), w.float()
        else:
            g2 = grad.reshape(-1, N).to(w.dtype)
        gx = gw = gb = None
        if x2.is_cuda:
            # Only forward bits must match trainer and engine; the backward needs to be
            # deterministic, not batch invariant. cuBLAS is: for fixed shapes, dtypes and GPU it
            # picks the same algorithm and gives the same bits on every run (no split-K atomics
            # on one stream), at stock speed.
            if ctx.needs_input_grad[0]:
                gx = torch.mm(g2, w)
            if ctx.needs_input_grad[1]:
                gw = torch.mm(g2.t(), x2)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                gb = _ref.batch_sum0(g2.float(), _GRAD_BIAS_LEAF)
        else:
            if ctx.needs_input_grad[0]:
                # grad_x[M, K] = g[M, N] @ w[N, K]: a linear with weight w^T [K, N].
                gx = _linear_2d(g2, w.t(), None)
            if ctx.needs_input_grad[1]:
                # grad_w[N, K] = g^T[N, M] @ x[M, K]: a linear with weight x^T [K, M].
                gw = _linear_2d(g2.t(), x2.t(), None)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                gb = _ref.blocked_sum(g2.float(), 0, _GRAD_BIAS_LEAF)
        # out = y + residual: the residual's gradient is the output's, passed on as it is
        gr = grad if ctx.needs_input_grad[5] else None
        return (None if gx is None else gx.to(x_dtype).reshape(ctx.x_shape),
                None if gw is None else gw.to(w_dtype), None if gb is None else gb.to(w_dtype), None, None, gr)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, leaves: int | None = None,
           residual: torch.Tensor | None = None):
    """Batch-invariant ``x[..., K] @ weight[N, K].T (+ bias)``: Triton on CUDA, the reference
    twin elsewhere; differentiable. Rounding schedule: module docstring; ``out_dtype`` (default
    x's dtype) is the dtype of the one final rounding: fp32 for 16-bit inputs gives the fp32
    accumulator itself, which for bf16/fp16 values equals ``linear(x.float(), weight.float())``
    on the reference (exact products) at the cost of a 16-bit GEMM on the GPU. ``leaves``
    (default :func:`k_leaves_for` of the weight shape) sets the number of K leaves: a caller that
    holds a slice of a larger weight passes the whole weight's count (a column shard, whose N is
    smaller) or computes one leaf alone with ``leaves=1`` (a row-parallel linear under tensor parallelism).
    The backward does not depend on it. ``residual`` (the output's shape and dtype) returns
    ``residual + x @ weight.T`` with the bits of that separate add (module docstring): a decoder
    layer's residual stream in the same launch."""
    _check(x, weight, bias, out_dtype, residual)
    if out_dtype == x.dtype:
        out_dtype = None
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        or (residual is not None and residual.requires_grad)
    )
    if needs_grad:
        return _LinearFn.apply(x, weight, bias, out_dtype, leaves, residual)
    K = x.shape[-1]
    return _linear_2d(x.reshape(-1, K), weight, bias, out_dtype, leaves,
                      residual).reshape(*x.shape[:-1], weight.shape[0])


def leaf_sum(partials: torch.Tensor, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[L, M, N] fp32 K-leaf partials (each leaf's accumulator, from +0 in K order) -> the
    rounded [M, N] output: leaves left to right in fp32 (the first as it is), the bias in fp32,
    one rounding to ``out_dtype`` -- what ``linear(..., leaves=L)`` does after its leaves. Triton on
    CUDA (one launch), the reference twin elsewhere; not differentiable (a row-parallel linear's
    autograd function passes the gradient through)."""
    if partials.dim() != 3 or partials.dtype != torch.float32:
        raise ValueError(f"leaf_sum: partials must be [L, M, N] float32, got {tuple(partials.shape)} {partials.dtype}")
    if bias is not None and tuple(bias.shape) != (partials.shape[2],):
        raise ValueError(f"leaf_sum: bias must be [N]=[{partials.shape[2]}], got shape {tuple(bias.shape)}")
    if want_triton(partials):
        return leaf_sum_triton(partials, bias, out_dtype)
    return leaf_sum_reference(partials, bias, out_dtype)
