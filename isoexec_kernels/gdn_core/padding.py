"""Sequences of a packed varlen batch as a zero-padded [B, H, width, ...] block (and back): the layout
the torch chunk form and the chunk backward's torch twin compute on. Padding tokens have g = 0,
beta = 0 and k = q = v = 0, so they leave the state unchanged and receive zero gradient."""

from __future__ import annotations

import torch

from .plan import _host_lens


def _pad_seqs(x, starts, lens, width):
    """[T, ...] rows of B segments -> [B, width, ...] zero padded (differentiable)."""
    B = len(lens)
    dev = x.device
    if B == 0:
        return x.new_zeros((0, width) + tuple(x.shape[1:]))
    src = torch.cat([torch.arange(s, s + n, device=dev) for s, n in zip(starts, lens)])
    dst = torch.cat([torch.arange(n, device=dev) + b * width for b, n in enumerate(lens)])
    flat = x.new_zeros((B * width,) + tuple(x.shape[1:]))
    flat = flat.index_copy(0, dst, x.index_select(0, src))
    return flat.view(B, width, *x.shape[1:])


def _unpad_seqs(x, starts, lens, T):
    """[B, width, ...] -> [T, ...] (rows of segment b at starts[b])."""
    B, width = x.shape[:2]
    dev = x.device
    out = x.new_zeros((T,) + tuple(x.shape[2:]))
    if B == 0 or T == 0:
        return out
    src = torch.cat([torch.arange(n, device=dev) + b * width for b, n in enumerate(lens)])
    dst = torch.cat([torch.arange(s, s + n, device=dev) for s, n in zip(starts, lens)])
    return out.index_copy(0, dst, x.reshape(B * width, *x.shape[2:]).index_select(0, src))


def _prepare(q, k, v, g, beta, cu_seqlens, width_multiple):
    starts, lens = _host_lens(cu_seqlens)
    T, Hk, Dk = k.shape
    H = v.shape[1]
    rep = H // Hk
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    L = max(lens + [1])
    width = -(-L // width_multiple) * width_multiple
    heads = torch.arange(H, device=v.device) // rep  # GQA by indexing
    xs = [_pad_seqs(x.to(dt), starts, lens, width) for x in (q, k, v, g, beta)]
    qp, kp = xs[0][:, :, heads], xs[1][:, :, heads]
    # [B, H, width, ...]
    qp, kp, vp = (x.transpose(1, 2) for x in (qp, kp, xs[2]))
    gp, bp = (x.transpose(1, 2) for x in xs[3:])
    return starts, lens, T, dt, qp, kp, vp, gp, bp
