"""``isoexec bench tp_dist``: the tensor-parallel reductions across the ranks of a process group, ours
against the stock all-reduce path, same run, same inputs (docs/benchmarks.md).

Run it under torchrun, one rank per GPU (``torchrun --standalone --nproc_per_node=N -m isoexec.cli
bench tp_dist``); without torchrun it makes a group of this process alone, where the collectives
send nothing (a check of the plumbing, not a figure). Rows, per (op, shape, M), each at the
group's size:

- ``row_parallel``: ``row_parallel_linear`` with the ``K_LEAVES`` of ``isoexec_tp4`` (each rank's
  L/tp leaf partials in fp32, all L gathered, added in leaf order on every rank) against
  ``all_reduce_row_parallel_linear`` (each rank's K shard in one GEMM, the bf16 partials
  all-reduced: the row-parallel linear of Megatron and vLLM); o_proj and down_proj of Qwen3-0.6B
  and Qwen3-8B. ``owners_ms`` / ``owners_vs_stock`` / ``owners_same_bits``: the same with
  ``combine="owners"`` (each rank sums its block of the output columns, the blocks gathered), the
  measurement that decides between the two combines;
- ``vocab_logprob``: ``vocab_parallel_token_logprobs`` (the Triton schedule on CUDA: chunk maxes
  and chunk sums gathered, the chain on every rank) against
  ``all_reduce_vocab_parallel_token_logprobs`` (max, sum-exp and target logit all-reduced);
  Qwen3's vocabulary of 151,936.

``same_bits``: ours equals one process's kernel on the whole inputs (``linear(x, w, leaves=L)``,
``token_logprobs``), as it must; ``stock_same_bits``: whether the stock path happened to. Every
rank makes the same inputs from one seed and times the same fixed number of calls (a collective
needs every rank in it); the slowest rank's mean is kept. The issue's bar: ours at least 0.8x the
stock path at tp = 2. On CPU (gloo) small shapes and the reference schedules (ratios only).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from isoexec_kernels.gemm import linear
from isoexec_kernels.logprob import token_logprobs

from ..bits import int_view
from ..dist import (all_reduce_row_parallel_linear, all_reduce_vocab_parallel_token_logprobs, row_parallel_linear,
                    row_shard_range, vocab_parallel_token_logprobs, vocab_shard_range)
from ..errors import ConfigError
from ..gates.topology_gates import process_group
from .common import print_rows, row
from .tp_linear import pinned_leaves

# (name, K, N) of the row-parallel projections; the vocabulary
ROW_SHAPES = [("0.6b.o", 2048, 1024), ("0.6b.down", 3072, 1024), ("8b.o", 4096, 4096), ("8b.down", 12288, 4096)]
ROW_M = [1, 64, 2048, 8192]
VOCAB = 151936
VOCAB_T = [1, 256, 4096]
QUICK_ROW_SHAPES, QUICK_ROW_M = [("tiny.down", 384, 64)], [1, 16]
QUICK_VOCAB, QUICK_VOCAB_T = 9000, [1, 8]
BATCHES, CALLS = 5, 10   # timed batches of calls; the median batch mean is kept


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(int_view(a), int_view(b)))


def _timed_ms(fn, device: str, group) -> float:
    """Mean milliseconds of ``fn()`` on the slowest rank: every rank makes the same number of calls
    (warm-up, then BATCHES batches of CALLS), the median of the batch means, the max over ranks."""
    for _ in range(3):
        fn()
    means = []
    for _ in range(BATCHES):
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        means.append((time.perf_counter() - t0) * 1000 / CALLS)
    mine = torch.tensor([statistics.median(means)], dtype=torch.float64,
                        device="cuda" if device == "cuda" else "cpu")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return float(mine.item())


def _inputs(shape, seed: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """The same random tensor on every rank (one seed, the device's own generator)."""
    g = torch.Generator(device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)


def _row_parallel_rows(tp: int, rank: int, device: str, dtype, shapes, ms, L: int, log) -> list[dict]:
    rows = []
    for s, (name, K, N) in enumerate(shapes):
        w = _inputs((N, K), 100 + s, device, dtype) / K ** 0.5
        k0, k1 = row_shard_range(K, L, tp, rank)
        ws = w[:, k0:k1].contiguous()
        for m in ms:
            x = _inputs((m, K), 200 + m, device, dtype)
            xs = x[:, k0:k1].contiguous()
            with torch.no_grad():
                ours_out = row_parallel_linear(xs, ws, in_features=K, leaves=L)
                owners_out = row_parallel_linear(xs, ws, in_features=K, leaves=L, combine="owners")
                stock_out = all_reduce_row_parallel_linear(xs, ws)
                one = linear(x, w, leaves=L)
                ours = _timed_ms(lambda: row_parallel_linear(xs, ws, in_features=K, leaves=L), device, None)
                owners = _timed_ms(lambda: row_parallel_linear(xs, ws, in_features=K, leaves=L, combine="owners"),
                                   device, None)
                stock = _timed_ms(lambda: all_reduce_row_parallel_linear(xs, ws), device, None)
            r = row({"op": "row_parallel", "shape": name, "M": m, "K": K, "N": N, "leaves": L, "tp": tp,
                     "same_bits": _same(ours_out, one), "stock_same_bits": _same(stock_out, one),
                     "owners_ms": round(owners, 6), "owners_vs_stock": round(stock / owners, 4),
                     "owners_same_bits": _same(owners_out, one)},
                    "all_reduce", stock, ours)
            rows.append(r)
            print_rows([r], ["op", "shape", "M", "tp"], log)
    return rows


def _vocab_rows(tp: int, rank: int, device: str, dtype, V: int, ts, log) -> list[dict]:
    rows = []
    v0, v1 = vocab_shard_range(V, tp, rank)
    for t_count in ts:
        z = _inputs((t_count, V), 300 + t_count, device, dtype) * 4
        g = torch.Generator(device).manual_seed(400 + t_count)
        targets = torch.randint(0, V, (t_count,), generator=g, device=device)
        zs = z[:, v0:v1].contiguous()
        with torch.no_grad():
            ours_out = vocab_parallel_token_logprobs(zs, targets, vocab_size=V)
            stock_out = all_reduce_vocab_parallel_token_logprobs(zs, targets, vocab_size=V)
            one = token_logprobs(z, targets)
            ours = _timed_ms(lambda: vocab_parallel_token_logprobs(zs, targets, vocab_size=V), device, None)
            stock = _timed_ms(lambda: all_reduce_vocab_parallel_token_logprobs(zs, targets, vocab_size=V), device, None)
        r = row({"op": "vocab_logprob", "shape": f"V{V}", "M": t_count, "V": V, "tp": tp,
                 "same_bits": _same(ours_out, one), "stock_same_bits": _same(stock_out, one)},
                "all_reduce", stock, ours)
        rows.append(r)
        print_rows([r], ["op", "shape", "M", "tp"], log)
    return rows


def bench_tp_dist(device: str, quick: bool = False, log=print) -> list[dict]:
    arch = "cpu" if device == "cpu" else "sm90"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    on_gpu = device == "cuda" and not quick
    L = pinned_leaves()
    with process_group(arch):
        tp, rank = dist.get_world_size(), dist.get_rank()
        if L % tp:
            raise ConfigError(f"bench tp_dist: {tp} ranks do not divide the {L} K leaves of isoexec_tp4; run it on "
                              f"a number of ranks that divides {L}")
        say = log if rank == 0 else (lambda _line: None)
        say(f"tensor-parallel reductions at tp = {tp} ({dist.get_backend()}), ours vs the stock all-reduce path")
        rows = _row_parallel_rows(tp, rank, device, dtype, ROW_SHAPES if on_gpu else QUICK_ROW_SHAPES,
                                  ROW_M if on_gpu else QUICK_ROW_M, L, say)
        rows += _vocab_rows(tp, rank, device, dtype, VOCAB if on_gpu else QUICK_VOCAB,
                            VOCAB_T if on_gpu else QUICK_VOCAB_T, say)
        bad = [f"{r['op']} {r['shape']} M={r['M']}" for r in rows if not r["same_bits"]]
        if bad:
            say(f"WARNING: ours differs from one process's kernel in {', '.join(bad)}")
    return rows
