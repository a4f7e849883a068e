"""Gated DeltaNet short convolution: the Triton twin (kernels and their launchers; CUDA, or CPU under
``TRITON_INTERPRET=1``). The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .._triton_util import jit, next_pow2, tl
from .reference import _check, _token_meta


_BLOCK_D = 256


@jit
def _conv_kernel(x_ptr, w_ptr, start_ptr, slot_ptr, state_ptr, out_ptr, D, stride_x, stride_o,
                 stride_ss, stride_sd, W: tl.constexpr, HAS_STATE: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = d < D
    start = tl.load(start_ptr + t)
    slot = tl.load(slot_ptr + t)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(W):
        src = t - (W - 1) + j
        inside = src >= start
        xv = tl.load(x_ptr + src * stride_x + d, mask=ok & inside, other=0.0).to(tl.float32)
        if HAS_STATE:
            hidx = (W - 1) + (src - start)
            hv = tl.load(state_ptr + slot * stride_ss + d * stride_sd + hidx,
                         mask=ok & (src < start) & (slot >= 0), other=0.0).to(tl.float32)
            xv = tl.where(inside, xv, hv)
        wv = tl.load(w_ptr + d * W + j, mask=ok, other=0.0).to(tl.float32)
        if j == 0:
            acc = xv * wv
        else:
            acc = acc + xv * wv
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + t * stride_o + d, y.to(out_ptr.dtype.element_ty), mask=ok)


def causal_conv1d_triton(x, weight, cu_seqlens, slots=None, conv_state=None) -> torch.Tensor:
    """Outputs [T, D] by the Triton schedule (no state update). CUDA, or CPU under the
    interpreter."""
    _check(x, weight, conv_state)
    T, D = x.shape
    W = weight.shape[1]
    out = torch.empty((T, D), dtype=x.dtype, device=x.device)
    if T == 0 or D == 0:
        return out
    x2 = x if x.stride(1) == 1 else x.contiguous()
    start, slot = _token_meta(T, cu_seqlens, slots)
    state = conv_state if conv_state is not None else out
    if conv_state is not None and conv_state.stride(2) != 1:
        raise ValueError("gdn_conv: conv_state must be contiguous in its last dim")
    block = min(_BLOCK_D, next_pow2(D))
    grid = (T, -(-D // block))
    _conv_kernel[grid](x2, weight.contiguous(), start, slot, state, out, D, x2.stride(0), out.stride(0),
                       state.stride(0) if conv_state is not None else 0,
                       state.stride(1) if conv_state is not None else 0,
                       W=W, HAS_STATE=conv_state is not None, BLOCK_D=block, num_warps=4,
                       enable_fp_fusion=False)
    return out
