"""Batch-invariant linear layer: ``out = x @ weight.T (+ bias)``.

Public API
  ``linear(x, weight, bias=None, out_dtype=None, leaves=None, residual=None)``  dispatcher (CUDA -> Triton, else reference),
                                               differentiable (backward uses the same kernels)
  ``linear_reference(x, weight, bias=None)``  CPU/any-device torch twin
  ``leaf_partials(x_slice, w_slice, *, in_features, leaves, first_leaf, count)``  fp32 [count, M, N]:
                                               K leaves first_leaf.. of the whole K's schedule, from the
                                               K slice holding them (a row-parallel rank's leaves; one
                                               launch on CUDA), differentiable; its twins
                                               ``leaf_partials_reference`` / ``leaf_partials_triton``
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
    tile, K tile and M swept; ``test_linear_cuda_k_tile_never_changes_bits``). Several K
    leaves in bf16 at large M on sm_90 run a third kernel with the same schedule, a
    warp-specialised Gluon walk (``gluon_ws_walk.py``; ``triton_kernels.ws_walk_for`` picks it):
    the same bits as the Triton walk (``tests/kernels/test_gemm_ws_walk.py``).

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
from .reference import (_check, _GRAD_BIAS_LEAF, _reference_2d, leaf_partials_reference, leaf_slice_columns,
                        leaf_sum_reference)
from .triton_kernels import _triton_2d, leaf_partials_triton, leaf_sum_triton


def _linear_2d(x2, w, bias, out_dtype=None, leaves=None, residual=None):
    if want_triton(x2):
        return _triton_2d(x2, w, bias, leaves=leaves, out_dtype=out_dtype, residual=residual)
    return _reference_2d(x2, w, bias, leaves=leaves, out_dtype=out_dtype, residual=residual)


def _product_grads(grad2, x2, w, wide, need_x, need_w):
    """(g, grad_x [M, K], grad_w [N, K]) of ``x2 @ w.T`` from the output's gradient ``grad2
    [M, N]``: g is that gradient as the products take it, grad_x and grad_w are None where not
    needed and not yet rounded to the inputs' dtypes."""
    if wide:
        # a wider output (fp32 logits of 16-bit inputs): the gradient keeps its precision, the
        # products run on fp32 copies of the inputs, one rounding to each input's dtype (what
        # autograd computes for linear(x.float(), w.float()))
        g2, x2, w = grad2.float(), x2.float(), w.float()
    else:
        g2 = grad2.to(w.dtype)
    gx = gw = None
    if x2.is_cuda:
        # Only forward bits must match trainer and engine; the backward needs to be
        # deterministic, not batch invariant. cuBLAS is: for fixed shapes, dtypes and GPU it
        # picks the same algorithm and gives the same bits on every run (no split-K atomics
        # on one stream), at stock speed.
        if need_x:
            gx = torch.mm(g2, w)
        if need_w:
            gw = torch.mm(g2.t(), x2)
    else:
        if need_x:
            # grad_x[M, K] = g[M, N] @ w[N, K]: a linear with weight w^T [K, N].
            gx = _linear_2d(g2, w.t(), None)
        if need_w:
            # grad_w[N, K] = g^T[N, M] @ x[M, K]: a linear with weight x^T [K, M].
            gw = _linear_2d(g2.t(), x2.t(), None)
    return g2, gx, gw


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
        x_dtype, w_dtype = x2.dtype, w.dtype
        g2, gx, gw = _product_grads(grad.reshape(-1, w.shape[0]), x2, w, ctx.wide,
                                    ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        gb = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            if g2.is_cuda:
                gb = _ref.batch_sum0(g2.float(), _GRAD_BIAS_LEAF)
            else:
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


def _leaf_partials(x, weight, in_features, leaves, first_leaf, count):
    twin = leaf_partials_triton if want_triton(x) else leaf_partials_reference
    return twin(x, weight, in_features=in_features, leaves=leaves, first_leaf=first_leaf, count=count)


class _LeafPartialsFn(torch.autograd.Function):
    """The leaves' partials with the gradient of each leaf's one-leaf fp32-output linear (what a
    loop of those calls had): each leaf's input and weight gradients are its own columns'."""

    @staticmethod
    def forward(ctx, x, weight, in_features, leaves, first_leaf, count):
        ctx.cols = leaf_slice_columns(x, weight, in_features, leaves, first_leaf, count)
        ctx.save_for_backward(x, weight)
        return _leaf_partials(x, weight, in_features, leaves, first_leaf, count)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        wide = x.dtype.itemsize < 4   # the partials are fp32, wider than 16-bit inputs
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad.shape[0] > 1 and grad.stride(0) == 0:
            # one gradient for every leaf (a row-parallel sum's, where each leaf enters with weight
            # 1, arrives expanded): the leaves' products side by side are that gradient's products
            # with the whole slice, two matmuls instead of two a leaf (deterministic; on the CPU
            # twin, whose output columns are independent, the same bits as leaf by leaf)
            _, gx, gw = _product_grads(grad[0], x, w, wide, need_x, need_w)
        else:
            # leaf by leaf (the products of a leaf's gradient with its own columns), side by side
            per_leaf = [_product_grads(grad[j], x[:, a:b], w[:, a:b], wide, need_x, need_w)[1:]
                        for j, (a, b) in enumerate(ctx.cols)]
            gx = torch.cat([g for g, _ in per_leaf], dim=1) if need_x else None
            gw = torch.cat([g for _, g in per_leaf], dim=1) if need_w else None
        return (None if gx is None else gx.to(x.dtype), None if gw is None else gw.to(w.dtype),
                None, None, None, None)


def leaf_partials(x: torch.Tensor, weight: torch.Tensor, *, in_features: int, leaves: int,
                  first_leaf: int, count: int) -> torch.Tensor:
    """fp32 ``[count, M, N]``: the unrounded accumulators of K leaves ``first_leaf`` to
    ``first_leaf + count - 1`` of ``linear(x_full, w_full, leaves=leaves)``, from the K slice
    that holds them: ``x [M, w]`` and ``weight [N, w]`` are the columns of those leaves side by
    side, from the first leaf's first column (a row-parallel rank's shard). Rounding schedule
    (module docstring): the leaves are those of the whole K of ``in_features`` columns (leaf j
    holds the BLOCK_K blocks ``[j*nb//L, (j+1)*nb//L)`` of its nb, the last block of K
    zero-padded), each accumulated alone from +0 in K order in fp32 and returned as it is: no
    leaf sum, no bias, no rounding (:func:`leaf_sum` adds them). Each is bit for bit the leaf's
    one-leaf fp32-output linear, ``linear(x[:, a:b], weight[:, a:b], out_dtype=torch.float32,
    leaves=1)`` (on CUDA where the launch's K tile differs from that call's, by the rule of
    ``triton_kernels.k_tile_for``; tests/kernels/test_gemm_leaf_partials.py has the GPU gate).
    Triton on CUDA (one launch for all the leaves), the reference twin elsewhere; differentiable
    (each leaf's gradient is that one-leaf linear's). A slice that is not those leaves' columns,
    leaves outside ``0 .. leaves-1`` or shapes that are not [M, w] and [N, w]: ValueError; inputs
    of different or unsupported dtypes: TypeError (as :func:`linear`)."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if needs_grad:
        return _LeafPartialsFn.apply(x, weight, in_features, leaves, first_leaf, count)
    return _leaf_partials(x, weight, in_features, leaves, first_leaf, count)
