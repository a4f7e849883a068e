"""Compile every kernel variant a training run will need before its first timed step.

The invariant GEMM picks its launch (tile, pipeline depth, kernel path) by the bucket of M, the
number of rows, and Triton compiles one variant per launch and per integer specialisation
(M divisible by 16 or not, M == 1). RL batches vary in length from step to step, so without a
warm-up a step whose mini-batch first reaches a new bucket compiles kernels inside its timing.
(The H200 DAPO pair of 2026-12-01 shows IsoExec policy-training times of 1.0-3.1 s that do not
follow the steps' token counts, a 1,686-token step taking 2.5 s, which is the pattern of such
compiles; ``kernels_compiled`` in the metrics now says which steps compiled.)

``warm_up_kernel_shapes`` runs the trainer's scoring forward (``trainer_score``) and its training
forward + backward (``trainer_fwd``) on random tokens packed as one sequence and as two, at each
packed length around every bucket bound (``b - 1, b, b + 1``: both sides of each bound and both
divisibility classes, for the body's rows and for the lm_head's rows, one fewer; for an MoE
model also the token count at which the grouped expert GEMM switches tiles). The engine's
eager prefill runs the same GEMMs at the same M buckets; its own variants (paged attention) are
warmed by ``isoexec.engine.warmup``, and its decode steps are captured in CUDA graphs at start-up. Gradients are dropped afterwards and no optimizer state is touched:
the run's results do not change, only where the compile time is paid.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from isoexec_kernels.gemm import M_BUCKET_BOUNDS
from isoexec_kernels.moe.triton_kernels import LARGE_ROWS as MOE_LARGE_ROWS

from .. import kernel_compiles
from .scoring import PackedSequences, score_logprobs


def warm_up_lengths(bucket_bounds: tuple[int, ...], largest: int) -> list[int]:
    """Packed lengths that meet each side of every bound (and the smallest cases, 2 and 3)."""
    lengths = {2, 3}
    for b in (*bucket_bounds, largest):
        lengths.update((b - 1, b, b + 1))
    return sorted(n for n in lengths if n >= 2)


def _pieces(n: int, cap: int) -> list[int]:
    """``n`` tokens as sequences of at most ``cap`` (>= 3) tokens, each at least 2 (scoring needs 2)."""
    out = []
    while n > cap:
        take = cap if n - cap >= 2 else cap - 1      # never leave a 1-token sequence
        out.append(take)
        n -= take
    return out + [n]


def warm_up_kernel_shapes(model, vocab_size: int, log: Callable[[str], None] = print,
                          largest: int = 4096) -> dict:
    """Run the trainer cases at every warm-up length (module docstring); returns
    ``{"lengths", "seconds", "kernels_compiled"}``. Only meaningful on a GPU (no-op elsewhere)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return {"lengths": [], "seconds": 0.0, "kernels_compiled": 0}
    kernel_compiles.install()
    before = kernel_compiles.count()
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    bounds = tuple(M_BUCKET_BOUNDS)
    top_k = getattr(model.cfg, "num_experts_per_tok", 0)
    if top_k:
        # the MoE grouped GEMM switches tiles at MOE_LARGE_ROWS dispatch rows (tokens x top_k)
        bounds += (-(-MOE_LARGE_ROWS // top_k),)
    lengths = warm_up_lengths(bounds, largest)
    cap = max(3, int(getattr(model.cfg, "max_position_embeddings", 1 << 30)))
    for n in lengths:
        # one sequence, and two (an integer argument equal to 1, such as a sequence count, is
        # a specialisation of its own); a length past the model's positions is packed from
        # several sequences, which is the same M for every GEMM
        for lens in ([n], [2, n - 2]) if n >= 4 else ([n],):
            lens = [piece for k in lens for piece in _pieces(k, cap)]
            seqs = [torch.randint(0, vocab_size, (k,), generator=gen).tolist() for k in lens]
            packed = PackedSequences.from_lists(seqs, device)
            score_logprobs(model, packed, grad=False)
            score_logprobs(model, packed, grad=True).sum().backward()
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize(device)
    out = {"lengths": lengths, "seconds": time.perf_counter() - t0,
           "kernels_compiled": kernel_compiles.count() - before}
    log(f"kernel warm-up: {len(lengths)} packed lengths ({lengths[0]}..{lengths[-1]}) in {out['seconds']:.1f}s, "
        f"{out['kernels_compiled']} kernel(s) compiled")
    return out

