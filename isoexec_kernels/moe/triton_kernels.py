"""The MoE expert layer: the Triton twin (grouped GEMM; CUDA, or CPU under ``TRITON_INTERPRET=1``).
The layer's rounding schedule is the docstring of ``api.py`` in this folder (step 4, experts); the
torch twin is :func:`reference.experts_forward` (a per-expert loop of the invariant linear).

Grouped GEMM (:func:`grouped_linear`): ONE launch computes, for every dispatch row r,

    out[r] = x[idx[r]] @ W[e(r)]^T          (idx = the dispatch's token ids, or r itself)

where expert e owns rows ``offsets[e]:offsets[e+1]`` (``types.Dispatch``: expert-major,
token-ascending). Weights are stacked ``[E, N, K]`` (transformers' layout: gate_up [E, 2I, H],
down [E, H, I]); rows are gathered through the index inside the kernel (no gathered copy of x).

Rounding schedule (every output element; identical to the invariant linear's, ``gemm/api.py``):
  products and accumulation in fp32; K cut into fixed blocks of ``BLOCK_K = 64``
  (``gemm.block_k_for``; the last block zero-padded); blocks accumulated sequentially in K order
  into an fp32 accumulator that starts at +0, one ``tl.dot`` per block (``input_precision="ieee"``:
  tensor cores for 16-bit inputs, FMA for fp32); one round-to-nearest-even cast to the output
  dtype (x's dtype) at the end. No split-K, no TF32, no atomics.

Grid and tiles. The m-tiles are cut per expert: tile j of expert e holds rows
``offsets[e] + j*BLOCK_M ...`` (a row's place in its tile is its rank inside its expert modulo
BLOCK_M, as in the linear applied to that expert's rows alone). Axis 0 of the grid is an upper
bound on the number of m-tiles of all experts, ``R // BLOCK_M + min(E, R)`` for R dispatch rows
(known on the host: no ``.tolist()``, no host sync, one grid per R so CUDA-graph capturable);
each program finds its (expert, m-tile) on the device from the offsets (the prefix sum of the
experts' tile counts) and programs past the last tile return at once. Axis 1 is the n-tile.
Tile constants are pinned per dtype and dispatch-row bucket (:func:`grouped_tile`: below or from
:data:`LARGE_ROWS` rows, a count the host knows; no autotune, nothing keyed on the experts' loads).
BLOCK_K and the K order never change, so -- as for the linear, whose tiles all gave the same bits
on the H200 -- a row's bits are those of the invariant linear for that row alone whatever its
expert's load and whichever tile serves it; the GPU tests check exactly this
(``tests/kernels/test_moe_grouped_gemm.py``).

Backward (:class:`_GroupedLinearFn`; deterministic, not batch invariant: only forward bits must
match between trainer and engine): the input gradient is the same grouped kernel with the weights
transposed (a strided view, no copy), written in fp32; for gathered rows each token's k rows are
then summed in fp32 over a fixed [T, k] layout (``Dispatch.row_of_pair``: no scatter, no atomics)
and rounded once. The weight gradient ``dW[e] = g[rows_e]^T @ x[idx[rows_e]]`` is
:func:`_grouped_wgrad_kernel`: one program per (expert, n-tile, k-tile) walking its expert's rows
in order in blocks of ``BLOCK_R`` (fp32 accumulator, one rounding to W's dtype; an expert with no
rows gets zeros, and a dispatch of no row at all, a batch of no token, zeros for every expert, so the
weights get a gradient in every backward; the input gradient of no row is empty, as is the
output). No float64 anywhere on this path.
"""

from __future__ import annotations

import torch

from .._triton_util import jit, next_pow2, tl, triton
from ..activation.api import silu_and_mul
from ..gemm.reference import BLOCK_K, block_k_for
from .types import Dispatch


TILES = {
    # dtype -> launch of the forward / input-gradient grouped GEMM below LARGE_ROWS dispatch rows
    # (scheduling only: BLOCK_K is the linear's 64 everywhere). 16-bit: 64-row tiles (one wgmma M
    # block, the least padding for the few rows an expert gets in decode), 128 columns, 3 stages
    # (72 KiB of shared memory).
    torch.bfloat16: dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
    torch.float16: dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
    # fp32 (``ieee`` dot: an FMA chain): the linear's fp32 tile.
    torch.float32: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
}
"""Pinned tiles of :func:`grouped_linear` per input dtype, below :data:`LARGE_ROWS` rows."""

LARGE_ROWS = 8192
TILES_LARGE = {
    # from LARGE_ROWS dispatch rows on (training and long prefill chunks: ~64+ rows per expert):
    # 128 x 256 tiles, 8 warps. On the H200 at 4096 tokens (scripts/moe_grouped_probe.py, 4f3e26e)
    # they gave the 64 x 128 tile's bits and took 0.49 / 0.28 ms instead of 0.57 / 0.35 ms for
    # GLM-4.7-Flash's gate_up / down (Qwen3.5-35B-A3B: 0.41 / 0.28 instead of 0.47 / 0.32), the
    # input gradients 0.51 / 0.26 instead of 0.68 / 0.34
    torch.bfloat16: dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=3),
    torch.float16: dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=3),
}
"""Pinned tiles of :func:`grouped_linear` per input dtype from :data:`LARGE_ROWS` rows on."""

WGRAD_TILES = {
    # 128 x 128 output tiles, 64-row steps: 0.32 / 0.81 ms instead of 0.44 / 0.98 ms (64 x 64) for
    # GLM-4.7-Flash's down / gate_up weight gradients at 4096 tokens on the H200 (the probe above)
    torch.bfloat16: dict(BLOCK_N=128, BLOCK_KW=128, BLOCK_R=64, num_warps=4, num_stages=3),
    torch.float16: dict(BLOCK_N=128, BLOCK_KW=128, BLOCK_R=64, num_warps=4, num_stages=3),
    torch.float32: dict(BLOCK_N=32, BLOCK_KW=32, BLOCK_R=32, num_warps=4, num_stages=2),
}
"""Pinned tiles of the weight-gradient kernel (backward only)."""


def grouped_tile(rows: int, dtype: torch.dtype) -> dict:
    """The pinned launch of :func:`grouped_linear` for ``rows`` dispatch rows (a host-known
    count: no sync). Scheduling only: every tile runs the same K loop, so a row's bits do not
    depend on which one serves it (the GPU tests compare a token alone, on the small tile, with
    the token in 4096-token batches, on the large one)."""
    if rows >= LARGE_ROWS and dtype in TILES_LARGE:
        return TILES_LARGE[dtype]
    return TILES[dtype]


def _e_pow2(E: int) -> int:
    return max(16, next_pow2(E))


@jit
def _grouped_gemm_kernel(
    x_ptr, idx_ptr, w_ptr, out_ptr, offsets_ptr, N, K, E,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    GATHER: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K_: tl.constexpr,
):
    t = tl.program_id(0)  # m-tile slot over all experts (upper bound; the excess returns)
    tn = tl.program_id(1)
    # (expert, m-tile) of slot t from the offsets: experts' tile counts, their inclusive prefix
    # sum; e = the number of experts whose tiles all come before t.
    es = tl.arange(0, E_POW2)
    e_ok = es < E
    lo = tl.load(offsets_ptr + es, mask=e_ok, other=0).to(tl.int32)
    hi = tl.load(offsets_ptr + es + 1, mask=e_ok, other=0).to(tl.int32)
    tiles = (hi - lo + (BLOCK_M - 1)) // BLOCK_M
    ends = tl.cumsum(tiles, 0)
    before = ends <= t
    e = tl.sum(before.to(tl.int32), 0)
    if e >= E:
        return
    first_tile = tl.sum(tl.where(before, tiles, 0), 0)
    row_lo = tl.load(offsets_ptr + e).to(tl.int32)
    row_hi = tl.load(offsets_ptr + e + 1).to(tl.int32)
    rows = row_lo + (t - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rows < row_hi
    if GATHER:
        src = tl.load(idx_ptr + rows, mask=m_ok, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    offs_n = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K_)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K_):
        k_ok = (k0 + offs_k) < K
        a = tl.load(x_ptr + src[:, None] * stride_xm + (k0 + offs_k)[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_base + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :] * stride_wk,
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, b.T, acc, input_precision="ieee")
    out_rows = rows.to(tl.int64)
    tl.store(out_ptr + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@jit
def _grouped_wgrad_kernel(
    g_ptr, x_ptr, idx_ptr, out_ptr, offsets_ptr, N, K,
    stride_gm, stride_gn, stride_xm, stride_xk, stride_oe, stride_on, stride_ok,
    GATHER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # dW[e, n, k] = sum over the rows r of expert e, in row order, of g[r, n] * x[idx[r], k].
    tn = tl.program_id(0)
    tk = tl.program_id(1)
    e = tl.program_id(2)
    row_lo = tl.load(offsets_ptr + e).to(tl.int32)
    row_hi = tl.load(offsets_ptr + e + 1).to(tl.int32)
    offs_n = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tk * BLOCK_KW + tl.arange(0, BLOCK_KW)
    n_ok = offs_n < N
    k_ok = offs_k < K
    acc = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
    for r0 in range(row_lo, row_hi, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        r_ok = rows < row_hi
        if GATHER:
            src = tl.load(idx_ptr + rows, mask=r_ok, other=0).to(tl.int64)
        else:
            src = rows.to(tl.int64)
        gt = tl.load(g_ptr + rows.to(tl.int64)[:, None] * stride_gm + offs_n[None, :] * stride_gn,
                     mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        xt = tl.load(x_ptr + src[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                     mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(gt.T, xt, acc, input_precision="ieee")
    tl.store(out_ptr + e.to(tl.int64) * stride_oe + offs_n[:, None] * stride_on + offs_k[None, :] * stride_ok,
             acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


def _check(x, w, offsets, idx):
    if w.dim() != 3:
        raise ValueError(f"moe grouped_linear: weight must be [E, N, K], got {tuple(w.shape)}")
    if x.dim() != 2 or x.shape[1] != w.shape[2]:
        raise ValueError(f"moe grouped_linear: x must be [*, K={w.shape[2]}], got {tuple(x.shape)}")
    if x.dtype != w.dtype:
        raise TypeError(f"moe grouped_linear: x is {x.dtype} but weight is {w.dtype}")
    if x.dtype not in TILES:
        raise TypeError(f"moe grouped_linear: unsupported dtype {x.dtype}")
    if offsets.shape != (w.shape[0] + 1,):
        raise ValueError(f"moe grouped_linear: offsets must be [E+1={w.shape[0] + 1}], got {tuple(offsets.shape)}")
    if idx is not None and idx.dim() != 1:
        raise ValueError("moe grouped_linear: idx must be 1-D")


def _grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, idx: torch.Tensor | None,
             rows: int, out_dtype: torch.dtype | None = None, tile: dict | None = None) -> torch.Tensor:
    """Launch :func:`_grouped_gemm_kernel`: out [rows, N] (``out_dtype``, default x's); ``tile``
    overrides :data:`TILES` (tuning probes only)."""
    E, N, K = w.shape
    out = torch.empty((rows, N), dtype=out_dtype or x.dtype, device=x.device)
    if rows == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    cfg = dict(grouped_tile(rows, x.dtype), **(tile or {}))
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid = (rows // bm + min(E, rows), triton.cdiv(N, bn))
    _grouped_gemm_kernel[grid](
        x, idx if idx is not None else offsets, w, out, offsets, N, K, E,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        GATHER=idx is not None, E_POW2=_e_pow2(E), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K_=block_k_for(N, K),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def _wgrad(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, idx: torch.Tensor | None,
           E: int, out_dtype: torch.dtype, tile: dict | None = None) -> torch.Tensor:
    """dW [E, N, K] = per expert, g[rows]^T @ x[idx[rows]] (fp32 accumulation in row order);
    ``tile`` overrides :data:`WGRAD_TILES` (tuning probes only)."""
    N, K = g.shape[1], x.shape[1]
    out = torch.empty((E, N, K), dtype=out_dtype, device=g.device)
    if E == 0 or N == 0 or K == 0:
        return out
    if g.shape[0] == 0:
        return out.zero_()
    cfg = dict(WGRAD_TILES[g.dtype], **(tile or {}))
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_KW"]
    grid = (triton.cdiv(N, bn), triton.cdiv(K, bk), E)
    _grouped_wgrad_kernel[grid](
        g, x, idx if idx is not None else offsets, out, offsets, N, K,
        g.stride(0), g.stride(1), x.stride(0), x.stride(1), out.stride(0), out.stride(1), out.stride(2),
        GATHER=idx is not None, BLOCK_N=bn, BLOCK_KW=bk, BLOCK_R=cfg["BLOCK_R"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets, idx, row_of_pair, top_k):
        rows = idx.numel() if idx is not None else x.shape[0]
        ctx.save_for_backward(x, w, offsets, idx, row_of_pair)
        ctx.top_k = top_k
        return _grouped(x, w, offsets, idx, rows)

    @staticmethod
    def backward(ctx, grad):
        x, w, offsets, idx, row_of_pair = ctx.saved_tensors
        g = grad.to(w.dtype).contiguous()
        gx = gw = None
        if ctx.needs_input_grad[0]:
            # rows' input gradient g[r] @ W[e(r)]: the grouped kernel on W^T [E, K, N] (a view)
            if idx is None:
                gx = _grouped(g, w.transpose(1, 2), offsets, None, g.shape[0])
            else:
                rows = _grouped(g, w.transpose(1, 2), offsets, None, g.shape[0], torch.float32)
                T = row_of_pair.numel() // ctx.top_k
                # each token's k rows in slot order, summed in fp32 over a fixed layout
                # (the width named: a view of no row cannot infer it)
                gx = rows[row_of_pair].view(T, ctx.top_k, rows.shape[1]).sum(1).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gw = _wgrad(g, x.to(w.dtype), offsets, idx, w.shape[0], w.dtype)
        return gx, gw, None, None, None, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, idx: torch.Tensor | None = None,
                   row_of_pair: torch.Tensor | None = None, top_k: int = 1) -> torch.Tensor:
    """``out[r] = x[idx[r]] @ w[e(r)]^T`` for every row r (module docstring): x [T, K] (or
    [R, K] with ``idx=None``: row r reads x[r]), w [E, N, K], offsets [E+1] int (expert e owns
    rows offsets[e]:offsets[e+1]; offsets[E] = R), idx [R] int (token of each row). Output
    [R, N] in x's dtype. Differentiable; the gradient of a gathered x needs ``row_of_pair`` and
    ``top_k`` (each token appears in exactly ``top_k`` rows, ``Dispatch``). Runs on CUDA tensors,
    or on CPU tensors under ``TRITON_INTERPRET=1`` (fp32/fp16: the interpreter's bf16 dot is
    broken)."""
    _check(x, w, offsets, idx)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        if idx is not None and x.requires_grad and row_of_pair is None:
            raise ValueError("moe grouped_linear: the gradient of gathered rows needs row_of_pair and top_k")
        return _GroupedLinearFn.apply(x, w, offsets, idx, row_of_pair, top_k)
    return _grouped(x, w, offsets, idx, idx.numel() if idx is not None else x.shape[0])


def experts_forward_triton(x: torch.Tensor, disp: Dispatch, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Triton twin of :func:`reference.experts_forward`: expert output rows [T*k, H] in dispatch
    order (x's dtype) = grouped GEMM (x gathered by ``disp.token``, gate_up [E, 2I, H]) ->
    the invariant ``silu_and_mul`` (activation op's public API, on the concatenated [R, 2I]) ->
    grouped GEMM (down [E, H, I]). Three launches, no host sync; differentiable."""
    h = grouped_linear(x, gate_up, disp.offsets, disp.token, disp.row_of_pair, disp.top_k)
    return grouped_linear(silu_and_mul(h), down, disp.offsets)


__all__ = ["TILES", "TILES_LARGE", "LARGE_ROWS", "grouped_tile", "WGRAD_TILES", "BLOCK_K", "grouped_linear", "experts_forward_triton"]
