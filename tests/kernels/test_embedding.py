"""Gates for the embedding lookup (isoexec_kernels/embedding/): an exact gather."""

from __future__ import annotations

import pytest
import torch

from isoexec_kernels import embedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_are_exact_table_rows_bitwise(kb, dtype):
    g = torch.Generator().manual_seed(1)
    table = torch.randn(100, 24, generator=g).to(dtype)
    table[3] = -0.0
    table[4, ::2] = 1e-40 if dtype == torch.float32 else 0.0
    ids = torch.tensor([[3, 4, 99, 0], [4, 4, 1, 3]])
    out = embedding.embedding(ids, table)
    assert out.shape == (2, 4, 24)
    for i in range(2):
        for j in range(4):
            kb.assert_bitwise(out[i, j], table[ids[i, j]], f"id {int(ids[i, j])}")
    kb.assert_bitwise(embedding.embedding_native(ids, table), out, "native")


def test_embedding_token_alone_equals_token_in_batch_bitwise(kb):
    g = torch.Generator().manual_seed(2)
    table = torch.randn(1000, 32, generator=g).bfloat16()
    alone = embedding.embedding(torch.tensor([777]), table)[0]
    for m in (2, 64, 256):
        ids = torch.randint(0, 1000, (m,), generator=g)
        idx = int(torch.randint(0, m, (1,), generator=g))
        ids[idx] = 777
        kb.assert_bitwise(embedding.embedding(ids, table)[idx], alone, f"M={m}")


def test_embedding_gradient_matches_float64_and_is_deterministic(kb):
    g = torch.Generator().manual_seed(3)
    table = torch.randn(50, 16, generator=g).requires_grad_()
    ids = torch.randint(0, 10, (200,), generator=g)  # many repeated ids
    dy = torch.randn(200, 16, generator=g)
    embedding.embedding(ids, table).backward(dy)
    first = table.grad.clone()
    want = torch.zeros(50, 16, dtype=torch.float64).index_add_(0, ids, dy.double())
    assert kb.rel_l2(first, want) < 1e-6
    table.grad = None
    embedding.embedding(ids, table).backward(dy)
    kb.assert_bitwise(table.grad, first, "second backward")


def test_embedding_errors_name_the_problem():
    with pytest.raises(TypeError, match="int32/int64"):
        embedding.embedding(torch.tensor([1.0]), torch.randn(4, 2))


@pytest.mark.gpu
def test_embedding_cuda_equals_table_rows_and_backward_is_deterministic(kb):
    g = torch.Generator().manual_seed(4)
    table = torch.randn(5000, 256, generator=g).bfloat16().cuda().requires_grad_()
    ids = torch.randint(0, 50, (4096,), generator=g).cuda()
    out = embedding.embedding(ids, table)
    kb.assert_bitwise(out, table.detach()[ids], "cuda gather")
    dy = torch.randn(4096, 256, generator=g).bfloat16().cuda()
    out.backward(dy)
    first = table.grad.clone()
    for _ in range(3):
        table.grad = None
        embedding.embedding(ids, table).backward(dy)
        kb.assert_bitwise(table.grad, first, "cuda embedding backward run to run")
