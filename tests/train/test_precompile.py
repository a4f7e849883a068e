"""The kernel warm-up before an RL run's first step (isoexec/train/precompile.py): its packed
lengths reach every launch variant of the invariant GEMM, it leaves the model untouched, and on a
GPU a later step at lengths never seen compiles nothing."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402
from isoexec_kernels.gemm import M_BUCKET_BOUNDS, tile_for_m  # noqa: E402

from isoexec import kernel_compiles  # noqa: E402
from isoexec.assembly import installed_model  # noqa: E402
from isoexec.bits import count_differing  # noqa: E402
from isoexec.train import PackedSequences, score_logprobs  # noqa: E402
from isoexec.train.precompile import warm_up_kernel_shapes, warm_up_lengths  # noqa: E402

# Qwen3-0.6B and Qwen3-8B projections (K, N), lm_head included
SHAPES = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (1024, 151936),
          (4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (4096, 151936)]


def _variant(M, N, K):
    """What Triton compiles a separate kernel for: the launch and M's integer specialisation."""
    return (tuple(sorted(tile_for_m(M, torch.bfloat16, N, K).items())), M == 1, M % 16 == 0)


@pytest.mark.parametrize("K,N", SHAPES)
def test_warm_up_lengths_reach_every_gemm_variant_of_the_model_shapes(K, N):
    lengths = warm_up_lengths(M_BUCKET_BOUNDS, 4096)
    # a single packed sequence of n tokens runs the body's GEMMs at M = n and the lm_head at n - 1
    reached = {_variant(m, N, K) for n in lengths for m in (n, n - 1)}
    every = {_variant(m, N, K) for m in range(1, 8193)}
    assert every <= reached, sorted(every - reached)


def test_bucket_bounds_are_where_the_gemm_launch_changes():
    for K, N in SHAPES:
        changes = {m for m in range(1, 8192) if tile_for_m(m, torch.bfloat16, N, K) != tile_for_m(m + 1, torch.bfloat16, N, K)}
        assert changes <= set(M_BUCKET_BOUNDS), (K, N, sorted(changes))


def test_warm_up_is_a_no_op_on_a_cpu_model():
    got = installed_model("dense", "isoexec", "cpu", "dense_tiny")
    m, cfg = got.model, got.hf_config
    before = [p.detach().clone() for p in m.parameters()]
    out = warm_up_kernel_shapes(m, cfg["vocab_size"], log=lambda s: None)
    assert out == {"lengths": [], "seconds": 0.0, "kernels_compiled": 0}
    assert all(count_differing(a, p) == 0 and p.grad is None for a, p in zip(before, m.parameters()))


@pytest.mark.gpu
def test_after_the_warm_up_new_lengths_compile_no_kernel():
    got = installed_model("dense", "isoexec", "sm90", "dense_tiny", dtype=torch.bfloat16, device="cuda")
    m, cfg = got.model, got.hf_config
    before = [p.detach().clone() for p in m.parameters()]
    logs = []
    warm_up_kernel_shapes(m, cfg["vocab_size"], log=logs.append)
    assert logs and "kernel warm-up" in logs[0]
    assert all(count_differing(a, p) == 0 and p.grad is None for a, p in zip(before, m.parameters()))
    start = kernel_compiles.count()
    g = torch.Generator().manual_seed(1)
    for lens in ([37], [5, 700], [1000, 500, 33, 9], [1000, 1000, 1001], [64, 64, 64]):   # dense_tiny: <= 1,024 positions
        packed = PackedSequences.from_lists([torch.randint(0, cfg["vocab_size"], (n,), generator=g).tolist()
                                             for n in lens], "cuda")
        score_logprobs(m, packed, grad=False)
        score_logprobs(m, packed, grad=True).sum().backward()
    torch.cuda.synchronize()
    assert kernel_compiles.count() - start == 0, "\n".join(kernel_compiles.compiled_since(start))


@pytest.mark.parametrize("n,cap", [(4097, 1024), (1025, 1024), (1026, 1024), (2, 1024), (3000, 2999), (10, 3)])
def test_long_warm_up_lengths_are_packed_from_sequences_the_model_can_hold(n, cap):
    from isoexec.train.precompile import _pieces

    pieces = _pieces(n, cap)
    assert sum(pieces) == n and all(2 <= p <= cap for p in pieces)
