"""The linear layer: the fixed-order torch twin (runs on any device; the CPU path of the public API).
The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .. import _ref


BLOCK_K = 64
"""K block of every path (reference tree width, Triton K tile). Pinned in the contract."""
# Bias-add leaf width for grad_b (sum over tokens) in the backward.
_GRAD_BIAS_LEAF = 64


def block_k_for(N: int, K: int) -> int:
    """BLOCK_K as a function of the weight shape only. Constant today (64); keyed on (N, K) so
    a future table can never depend on M."""
    return BLOCK_K


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2:
        raise ValueError(f"linear: weight must be [N, K], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: x has K={x.shape[-1]} but weight is {tuple(weight.shape)} (expected [N, K])"
        )
    if x.dtype != weight.dtype:
        raise TypeError(f"linear: x is {x.dtype} but weight is {weight.dtype}; cast one of them")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"linear: bias must be [N]={weight.shape[0]}, got {tuple(bias.shape)}")


def _reference_2d(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    M, K = x2.shape
    N = w.shape[0]
    out_dtype = x2.dtype
    acc_out = torch.empty((M, N), dtype=torch.float32, device=x2.device)
    if M == 0 or N == 0:
        return acc_out.to(out_dtype)
    # Weight blocks, K-major: wT[k, n]. fp32 conversion of bf16/fp16 is exact.
    wf = w.float()
    blocks = []
    for k0 in range(0, K, BLOCK_K):
        blocks.append((k0, min(K, k0 + BLOCK_K), wf[:, k0:k0 + BLOCK_K].t().contiguous()))
    xf = x2.float()
    rows = min(M, _ref.rows_per_chunk(BLOCK_K * N))
    scratch = torch.empty(BLOCK_K * rows * N, dtype=torch.float32, device=x2.device)
    for r0 in range(0, M, rows):
        xc = xf[r0:r0 + rows]
        m = xc.shape[0]
        acc = torch.zeros((m, N), dtype=torch.float32, device=x2.device)
        for k0, k1, wT in blocks:
            bk = k1 - k0
            p = 1 << (bk - 1).bit_length()  # last block: zero-pad to a power of two
            prod = scratch[:p * m * N].view(p, m, N)
            # exact-rounded fp32 products, K-major so each tree level is one contiguous add
            torch.mul(xc[:, k0:k1].t().contiguous()[:, :, None], wT[:, None, :], out=prod[:bk])
            if p > bk:
                prod[bk:].zero_()
            acc.add_(_ref.tree_sum0_(prod))
        acc_out[r0:r0 + rows] = acc
    if bias is not None:
        acc_out = acc_out + bias.float()
    return acc_out.to(out_dtype)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``x[..., K] @ weight[N, K].T (+ bias[N])`` -> ``[..., N]`` in x.dtype, by the reference
    schedule (api.py's docstring): fp32 products, halves tree per 64-wide K block, blocks
    accumulated in K order from +0, bias in fp32, one rounding. Not differentiable by itself
    (use :func:`linear`)."""
    _check(x, weight, bias)
    K = x.shape[-1]
    out = _reference_2d(x.reshape(-1, K), weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])
