"""Token log-probabilities and log-softmax with a fixed vocabulary reduction order.

Public API
  ``token_logprobs(logits[T, V], targets[T]) -> fp32[T]``   dispatcher (CUDA -> Triton)
  ``log_softmax(logits[T, V]) -> fp32[T, V]``               dispatcher (for top-k logprobs)
  ``*_reference`` / ``*_triton`` twins, ``BLOCK_V``, ``REF_LEAF_V``
  ``shards``: the reference schedule's pieces for a slice of the vocabulary (vocabulary-parallel)
Both accept ``logits[..., V]`` (leading dims flattened into rows) in any float dtype; a row's
result never depends on T, on the row's position or on the other rows. Differentiable
(``token_logprobs`` / ``log_softmax`` backward: softmax-weighted, see below).

Rounding schedule (per row, z = fp32(logits))
  * reference (impl ``ref_logprob``), two passes:
      m = max(z) (exact; -0 normalised to +0 by ``m + 0.0``);
      e_j = fp32(exp(z_j - m)) with z_j - m rounded in fp32 and exp evaluated in float64
        from basic operations (``_ref.exp64``, position-free);
      s = sum_j e_j: V cut into leaves of ``REF_LEAF_V = 1024`` (last zero-padded), halves
        tree inside a leaf, leaves accumulated left to right from +0;
      lse_rel = fp32(log(s)) (``_ref.log64``);
      logprob_t = (z_t - m) - lse_rel ; log_softmax_j = (z_j - m) - lse_rel  (fp32).
  * Triton (impl ``triton_logprob``), one program per row, one streaming pass:
      V cut into chunks of ``BLOCK_V = 4096`` visited left to right with an online max/sum:
      m' = max(m, max(chunk)); s = s * exp(m - m') + sum(exp(chunk - m')) (``tl.sum`` over
      the chunk, fixed layout: num_warps 8); -0 normalised; then
      logprob_t = (z_t - m) - log(s). log_softmax does a second pass writing (z_j - m) - log(s).
  Masked vocabulary entries may be -inf; a row that is entirely -inf gives NaN.

Backward (deterministic, not batch invariant; only forward bits must match trainer and engine):
  d logits = (onehot(target) - softmax) * dy  for token_logprobs,
  d logits = dy - softmax * sum_j(dy_j)      for log_softmax (sum by the fixed leaf tree);
  rounded once to the logits dtype.
  * token_logprobs on CUDA: the forward kernel also stores each row's (m, log s); the backward is
    one elementwise fp32 Triton pass, softmax_j = exp((z_j - m) - log s) with Triton's exp (no
    float64, no [T, V] fp32 temporaries).
  * reference (CPU) and log_softmax: softmax = exp(log_softmax) via ``_ref.exp64`` in torch ops.
"""

from __future__ import annotations

import torch

from .. import _ref
from .._triton_util import want_triton
from .reference import _rows, log_softmax_reference, REF_LEAF_V, token_logprobs_reference
from .triton_kernels import (
    _token_logprobs_backward_triton,
    _triton_launch,
    log_softmax_triton,
    token_logprobs_triton,
)


def _softmax_from_log(ls: torch.Tensor) -> torch.Tensor:
    return _ref.exp64(ls.double()).float()


class _TokenLogprobFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets):
        if want_triton(logits):
            z2 = _rows(logits)
            tg = targets.reshape(-1).contiguous()
            if tg.shape[0] != z2.shape[0]:
                raise ValueError(f"token_logprobs: {z2.shape[0]} logit rows but {tg.shape[0]} targets")
            lp, _, stats = _triton_launch(z2, tg, True, False, want_stats=True)
            ctx.save_for_backward(z2, tg, stats)
            ctx.shape = logits.shape
            return lp[: z2.shape[0]].reshape(targets.shape)
        ctx.save_for_backward(logits, targets)
        ctx.shape = None
        return token_logprobs_reference(logits, targets)

    @staticmethod
    def backward(ctx, dy):
        if ctx.shape is not None:  # Triton: one fp32 elementwise pass from the saved (m, log s)
            z2, tg, stats = ctx.saved_tensors
            return _token_logprobs_backward_triton(z2, tg, stats, dy.reshape(-1)).reshape(ctx.shape), None
        logits, targets = ctx.saved_tensors
        p = _softmax_from_log(log_softmax(logits.detach()))
        onehot = torch.zeros_like(p)
        onehot.scatter_(-1, targets.long().unsqueeze(-1), 1.0)
        g = (onehot - p) * dy.float().unsqueeze(-1)
        return g.to(logits.dtype), None


class _LogSoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits):
        out = log_softmax_triton(logits) if want_triton(logits) else log_softmax_reference(logits)
        ctx.save_for_backward(out)
        ctx.dtype = logits.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        (out,) = ctx.saved_tensors
        p = _softmax_from_log(out)
        V = out.shape[-1]
        dyf = dy.float().reshape(-1, V)
        tot = _ref.blocked_sum(dyf, 1, REF_LEAF_V).reshape(out.shape[:-1] + (1,))
        g = dy.float() - p * tot
        return g.to(ctx.dtype)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Batch-invariant fp32 logprob of ``targets`` under ``logits[..., V]`` (Triton on CUDA,
    reference elsewhere); differentiable in logits. Schedule: module docstring."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _TokenLogprobFn.apply(logits, targets)
    if want_triton(logits):
        return token_logprobs_triton(logits, targets)
    return token_logprobs_reference(logits, targets)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Batch-invariant fp32 log-softmax over the last dim; differentiable."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _LogSoftmaxFn.apply(logits)
    if want_triton(logits):
        return log_softmax_triton(logits)
    return log_softmax_reference(logits)
