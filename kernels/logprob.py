"""Token log-probabilities and log-softmax with a fixed vocabulary reduction order.

Public API
  ``token_logprobs(logits[T, V], targets[T]) -> fp32[T]``   dispatcher (CUDA -> Triton)
  ``log_softmax(logits[T, V]) -> fp32[T, V]``               dispatcher (for top-k logprobs)
  ``*_reference`` / ``*_triton`` twins, ``BLOCK_V``, ``REF_LEAF_V``
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

from . import _ref
from ._triton_util import jit, tl, triton, want_triton

__all__ = [
    "token_logprobs",
    "log_softmax",
    "token_logprobs_reference",
    "log_softmax_reference",
    "token_logprobs_triton",
    "log_softmax_triton",
    "BLOCK_V",
    "REF_LEAF_V",
    "IMPL_REFERENCE",
    "IMPL_TRITON",
]

BLOCK_V = 4096
"""Triton vocabulary chunk (online max/sum, chunks in order). Pinned in the contract."""
REF_LEAF_V = 1024
"""Reference vocabulary leaf (halves tree inside, leaves in order). Pinned in the contract."""
IMPL_REFERENCE = "ref_logprob"
IMPL_TRITON = "triton_logprob"
_NUM_WARPS = 8


def _rows(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() < 1:
        raise ValueError("logprob: logits must be [..., V]")
    V = logits.shape[-1]
    t = logits.reshape(-1, V)
    return t if t.stride(-1) == 1 else t.contiguous()


# ---------------------------------------------------------------------------------------------
# Reference twin
# ---------------------------------------------------------------------------------------------


def _ref_stats(z: torch.Tensor):
    """(m, zm, lse_rel) for fp32 rows z [R, V]: zm = z - m, lse_rel = log(sum exp(zm))."""
    m = z.max(dim=-1).values + 0.0
    zm = z - m[:, None]
    e = _ref.exp64(zm.double()).float()
    s = _ref.blocked_sum(e, 1, REF_LEAF_V)
    lse_rel = _ref.log64(s.double()).float()
    return zm, lse_rel


def _ref_chunks(z2: torch.Tensor):
    R, V = z2.shape
    rows = _ref.rows_per_chunk(V, budget=1 << 19)
    for r0 in range(0, R, rows):
        yield r0, z2[r0:r0 + rows].float()


def token_logprobs_reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fp32 ``log_softmax(logits)[t, targets[t]]`` by the reference schedule."""
    z2 = _rows(logits)
    tg = targets.reshape(-1).long()
    if tg.shape[0] != z2.shape[0]:
        raise ValueError(f"token_logprobs: {z2.shape[0]} logit rows but {tg.shape[0]} targets")
    out = torch.empty(z2.shape[0], dtype=torch.float32, device=z2.device)
    if z2.shape[1] == 0:
        raise ValueError("token_logprobs: empty vocabulary")
    for r0, z in _ref_chunks(z2):
        zm, lse_rel = _ref_stats(z)
        zt = zm.gather(1, tg[r0:r0 + z.shape[0], None])[:, 0]
        out[r0:r0 + z.shape[0]] = zt - lse_rel
    return out.reshape(targets.shape)


def log_softmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dim by the reference schedule."""
    z2 = _rows(logits)
    out = torch.empty(z2.shape, dtype=torch.float32, device=z2.device)
    for r0, z in _ref_chunks(z2):
        zm, lse_rel = _ref_stats(z)
        out[r0:r0 + z.shape[0]] = zm - lse_rel[:, None]
    return out.reshape(logits.shape)


# ---------------------------------------------------------------------------------------------
# Triton twin
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Dispatchers and autograd
# ---------------------------------------------------------------------------------------------


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
