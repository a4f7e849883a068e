"""The vocabulary-parallel token logprob under the Triton kernel's schedule (the one ``token_logprobs``
runs on a GPU) keeps the bits of the one-row kernel on the whole rows: forward and gradient, at
TP = 1, 2 and 4 on gloo, each rank under the Triton interpreter on CPU (vocab_triton_workers.py; the
whole rows run in the same processes). On a device, the same pieces composed in one process against
``token_logprobs`` on CUDA at real vocabulary sizes. Bits compared through integer views."""

from __future__ import annotations

import importlib.util
import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import dist_workers as dw  # noqa: E402
import vocab_triton_workers as vw  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]


def _interpreter_unusable() -> str | None:
    """Why the Triton interpreter cannot run here (None: it can). Triton 3.6's interpreter fails
    inside any kernel loop with numpy 2.3 or later (seen on the GPU machine: numpy 2.5), as
    tests/kernels/conftest.py notes for the kernel folder's interpreter checks."""
    import numpy
    import triton

    if triton.__version__.startswith("3.6") and tuple(int(v) for v in numpy.__version__.split(".")[:2]) >= (2, 3):
        return f"triton 3.6's interpreter needs numpy < 2.3 (have {numpy.__version__})"
    return None


interpreted = pytest.mark.skipif(importlib.util.find_spec("triton") is not None and _interpreter_unusable() is not None,
                                 reason="the Triton interpreter cannot run here (numpy >= 2.3 with triton 3.6)")


def _reports(worlds, field, want_field):
    return {f"{name} TP={tp} rank {r}": dw.bit_report(res[name][field], res[name][want_field])
            for tp, ranks in worlds.items() for r, res in enumerate(ranks) for name, _, _ in vw.CASES}


@interpreted
def test_vocab_parallel_triton_schedule_tp1_tp2_tp4_bitwise_equal_to_the_one_row_kernel(tp_vocab_triton_worlds):
    reps = _reports(tp_vocab_triton_worlds, "out", "want")
    bad = {k: v for k, v in reps.items() if v["differing"]}
    assert not bad, f"differing logprobs per rank: {bad}"
    # the slices really are slices: at TP = 4 each rank holds one chunk of 4096 logits
    assert [res["v13000_fp32"]["range"] for res in tp_vocab_triton_worlds[4]] == \
        [(0, 4096), (4096, 8192), (8192, 12288), (12288, 13000)]
    want = tp_vocab_triton_worlds[1][0]["v13000_fp32"]["want"]
    assert torch.isfinite(want).all()


@interpreted
def test_vocab_parallel_triton_schedule_gradient_slices_equal_the_one_row_backward(tp_vocab_triton_worlds):
    reps = _reports(tp_vocab_triton_worlds, "grad", "want_grad")
    bad = {k: v for k, v in reps.items() if v["differing"]}
    assert not bad, f"differing gradient elements per rank: {bad}"


@interpreted
def test_stock_all_reduce_logprob_does_not_give_the_one_row_kernel_bits(tp_vocab_triton_worlds):
    """Negative control: the max all-reduced, each rank's sum-exp and the target logit summed by
    all_reduce(SUM); it must differ from the one-row kernel somewhere."""
    counts = {}
    for tp in (2, 4):
        for name, _, _ in vw.CASES:
            res = tp_vocab_triton_worlds[tp][0][name]
            counts[f"{name} TP={tp}"] = dw.bit_report(res["all_reduce"], res["want"])["differing"]
    print(f"\nall_reduce(SUM) vocabulary-parallel logprobs differing from the one-row kernel: {counts}")
    assert any(counts.values()), counts


@interpreted
def test_triton_schedule_refuses_fewer_chunks_than_ranks(tp_vocab_triton_worlds):
    assert all(ranks[0]["refuse/v5000"] == "accepted" for tp, ranks in tp_vocab_triton_worlds.items() if tp < 4)
    for res in tp_vocab_triton_worlds[4]:
        msg = res["refuse/v5000"]
        assert msg.startswith("ValueError") and "2 chunk(s) of 4096" in msg and "tp=4" in msg, msg


# ------------------------------------------------------------------------------------ device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("V", [151936, 151552, 248320, 151937, 13000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_schedule_slices_equal_token_logprobs_on_cuda_bitwise(V, dtype):
    # the pieces each rank would run, composed in one process for TP = 1, 2, 4, 8 against the one-row
    # kernel that token_logprobs runs on CUDA (which the one process of TP = 1 calls itself); 151937 is a vocabulary that is not a multiple of 16
    # (the slice kernel's unspecialised compilation); 13000 has 4 chunks (TP = 8 falls back to leaves)
    from isoexec.dist import vocab_parallel_token_logprobs, vocab_shard_range
    from isoexec_kernels.logprob import BLOCK_V, token_logprobs
    from isoexec_kernels.logprob import triton_shards as ts

    g = torch.Generator().manual_seed(31)
    for rows in (1, 7, 300):
        z = (torch.randn(rows, V, generator=g) * 4).to(dtype).cuda()
        t = torch.randint(0, V, (rows,), generator=g).cuda()
        want = token_logprobs(z, t)
        got = vocab_parallel_token_logprobs(z, t, vocab_size=V)   # one process: TP = 1 on CUDA
        assert dw.bit_report(got, want)["differing"] == 0, (V, dtype, rows, "tp=1")
        for tp in (1, 2, 4, 8):
            bounds = [vocab_shard_range(V, tp, r) for r in range(tp)]
            if any(a % BLOCK_V for a, _ in bounds):
                continue
            cmax = torch.cat([ts.chunk_maxes_triton(z[:, a:b]) for a, b in bounds], dim=1)
            prefix = ts.prefix_maxes_triton(cmax)
            sums = torch.cat([ts.chunk_sums_triton(z[:, a:b], prefix, a // BLOCK_V, V) for a, b in bounds], dim=1)
            lp, _ = ts.chain_triton(prefix, sums, z.gather(1, t[:, None])[:, 0].float())
            rep = dw.bit_report(lp, want)
            assert rep["differing"] == 0, (V, dtype, rows, tp, rep)
