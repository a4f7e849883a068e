"""The linear backward on CUDA (isoexec_kernels/gemm/): cuBLAS products, correct against float64 and
deterministic run to run (only forward bits must match trainer and engine; the backward must give
the same gradient bits for the same inputs, which bit-identical resume needs)."""

from __future__ import annotations

import pytest
import torch

from isoexec_kernels import gemm


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(4096, 1024, 2048), (4096, 6144, 1024), (77, 1024, 3072)])
def test_linear_cuda_backward_bf16_matches_float64_and_is_deterministic(kb, M, N, K):
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) / K ** 0.5).bfloat16()
    dy = torch.randn(M, N, generator=g).bfloat16()

    def grads():
        xc, wc = x.cuda().requires_grad_(), w.cuda().requires_grad_()
        gemm.linear(xc, wc).backward(dy.cuda())
        return xc.grad, wc.grad

    gx, gw = grads()
    dyd = dy.cuda().double()
    assert kb.rel_l2(gx, dyd @ w.cuda().double()) < kb.TOL[torch.bfloat16]
    assert kb.rel_l2(gw, dyd.t() @ x.cuda().double()) < kb.TOL[torch.bfloat16]
    gx2, gw2 = grads()
    kb.assert_bitwise(gx2, gx, "grad_x run to run")
    kb.assert_bitwise(gw2, gw, "grad_w run to run")
