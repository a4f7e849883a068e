"""A region's output for a batch of no token, kept in the autograd graph.

The FSDP2 trainer's lockstep runs empty passes (a forward, and in training a backward, of a batch
with no token) on the ranks that packed fewer micro-batches, so that every rank takes part in every
collective (isoexec/dist/fsdp/trainer.py). Their backward must give every trainable parameter a
gradient, zeros, as a backward of tokens does (FSDP2 reduce-scatters the parameters that hold
one). A region whose stock kernel cannot run on no token (a padded SDPA over no sequence, a
FlashAttention-2 varlen launch of batch 0, the chunk planning of the Gated DeltaNet kernels) returns
:func:`no_token` instead: an empty tensor of the output's shape whose backward gives each input
that asks for one a zero gradient of its own shape, so the parameters upstream of the region
still get theirs (the experts region's ``moe.reference.no_rows`` is this with its inputs). No
kernel runs, forward or backward. Used only on that early return: a batch with tokens never
reaches it.
"""

from __future__ import annotations

import torch


class _NoTokenFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shape, dtype, *inputs):
        ctx.like = [(t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else None for t in inputs]
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
        return torch.empty(shape, dtype=dtype, device=device)

    @staticmethod
    def backward(ctx, grad):
        zeros = tuple(torch.zeros(like[0], dtype=like[1], device=like[2]) if need and like is not None else None
                      for like, need in zip(ctx.like, ctx.needs_input_grad[2:]))
        return (None, None, *zeros)


def no_token(shape, dtype: torch.dtype, *inputs) -> torch.Tensor:
    """An empty tensor of ``shape`` (one of its sizes 0) and ``dtype`` on the inputs' device,
    differentiable: its backward gives every tensor of ``inputs`` that requires a gradient zeros of
    its shape and dtype (non-tensor entries, None say, are skipped)."""
    shape = tuple(int(s) for s in shape)
    if 0 not in shape:
        raise ValueError(f"no_token: the output of a batch of no token is empty; got shape {shape}")
    return _NoTokenFn.apply(shape, dtype, *inputs)


__all__ = ["no_token"]
