"""Token logprobs and log-softmax: the Triton twin (kernels and their launchers; CUDA, or CPU under
``TRITON_INTERPRET=1``). The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .._triton_util import jit, tl, triton
from .reference import _rows


BLOCK_V = 4096
"""Triton vocabulary chunk (online max/sum, chunks in order). Pinned in the contract."""
_NUM_WARPS = 8


@jit
def _logprob_kernel(z_ptr, tgt_ptr, lp_ptr, ls_ptr, stats_ptr, V, stride_z, stride_ls,
                    WANT_TOKEN: tl.constexpr, WANT_FULL: tl.constexpr, WANT_STATS: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride_z
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    for v0 in range(0, V, BLOCK):
        ok = (v0 + offs) < V
        z = tl.load(base + v0 + offs, mask=ok, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0)) + 0.0
        # shift by 0 while everything seen is -inf (avoids -inf - -inf)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        e = tl.where(ok, tl.exp(z - shift), 0.0)
        s = s * tl.exp(m - shift) + tl.sum(e, axis=0)
        m = m_new
    log_s = tl.log(s)
    if WANT_STATS:
        # (m, log s) for the backward; storing them changes nothing in the forward's bits
        tl.store(stats_ptr + 2 * row, m)
        tl.store(stats_ptr + 2 * row + 1, log_s)
    if WANT_TOKEN:
        t = tl.load(tgt_ptr + row).to(tl.int64)
        zt = tl.load(base + t).to(tl.float32)
        tl.store(lp_ptr + row, (zt - m) - log_s)
    if WANT_FULL:
        obase = ls_ptr + row * stride_ls
        for v0 in range(0, V, BLOCK):
            ok = (v0 + offs) < V
            z = tl.load(base + v0 + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(obase + v0 + offs, (z - m) - log_s, mask=ok)


@jit
def _logprob_bwd_kernel(z_ptr, tgt_ptr, stats_ptr, dy_ptr, dz_ptr, V, stride_z, stride_dz,
                        BLOCK: tl.constexpr):
    # d logits[row, j] = (onehot(j == target) - exp((z_j - m) - log s)) * dy[row], fp32, one
    # rounding to the logits dtype. Program (row, chunk): elementwise, no reduction at all.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    m = tl.load(stats_ptr + 2 * row)
    log_s = tl.load(stats_ptr + 2 * row + 1)
    dy = tl.load(dy_ptr + row)
    t = tl.load(tgt_ptr + row).to(tl.int64)
    zr = tl.load(z_ptr + row * stride_z + cols, mask=ok, other=0.0)
    p = tl.exp((zr.to(tl.float32) - m) - log_s)
    g = (tl.where(cols == t, 1.0, 0.0) - p) * dy
    tl.store(dz_ptr + row * stride_dz + cols, g.to(zr.dtype), mask=ok)


def _triton_launch(z2, targets, want_token, want_full, want_stats=False):
    R, V = z2.shape
    lp = torch.empty(R if want_token else 1, dtype=torch.float32, device=z2.device)
    ls = torch.empty((R, V) if want_full else (1, 1), dtype=torch.float32, device=z2.device)
    stats = torch.empty((R, 2) if want_stats else (1, 2), dtype=torch.float32, device=z2.device)
    tg = targets if want_token else lp
    if R:
        _logprob_kernel[(R,)](z2, tg, lp, ls, stats, V, z2.stride(0), ls.stride(0),
                              WANT_TOKEN=want_token, WANT_FULL=want_full, WANT_STATS=want_stats,
                              BLOCK=BLOCK_V, num_warps=_NUM_WARPS)
    return lp, ls, stats


_BWD_BLOCK = 2048


def _token_logprobs_backward_triton(z2, tg, stats, dy):
    """d logits [R, V] (logits dtype) from the forward's per-row (m, log s): one elementwise pass."""
    R, V = z2.shape
    dz = torch.empty((R, V), dtype=z2.dtype, device=z2.device)
    if R and V:
        _logprob_bwd_kernel[(R, triton.cdiv(V, _BWD_BLOCK))](
            z2, tg, stats, dy.float().contiguous(), dz, V, z2.stride(0), dz.stride(0),
            BLOCK=_BWD_BLOCK, num_warps=4)
    return dz


def token_logprobs_triton(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fp32 token logprobs by the Triton schedule. CUDA, or CPU under the interpreter."""
    z2 = _rows(logits)
    tg = targets.reshape(-1).contiguous()
    if tg.shape[0] != z2.shape[0]:
        raise ValueError(f"token_logprobs: {z2.shape[0]} logit rows but {tg.shape[0]} targets")
    lp, _, _ = _triton_launch(z2, tg, True, False)
    return lp[: z2.shape[0]].reshape(targets.shape)


def log_softmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax by the Triton schedule. CUDA, or CPU under the interpreter."""
    z2 = _rows(logits)
    _, ls, _ = _triton_launch(z2, None, False, True)
    return ls.reshape(logits.shape)
