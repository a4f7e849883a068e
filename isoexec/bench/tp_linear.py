"""``isoexec bench tp_linear``: the TP-invariant row-parallel linear at tp = 1 against the plain
invariant GEMM, same run, same inputs (docs/benchmarks.md).

The tensor-parallel composition (``isoexec_tp4``) pins ``K_LEAVES`` on its row-parallel regions
(o_proj, down_proj, the GDN out_proj): the K sum cut into L leaves whatever the tp size, so that
tp = 1, 2, 4 give one bit pattern. On one rank that costs the leaf walk: each output tile adds L
fp32 leaf sums instead of running one K loop. Rows, per (shape, M):

- ``baseline``: ``linear(x, w)``, the invariant GEMM with the weight shape's own leaves (one for
  these shapes), what a single-GPU run of the plain composition calls;
- ``ours``: ``row_parallel_linear(x, w, in_features=K, leaves=L)`` with no process group (one
  rank: the one-launch walk of the L leaves, ``isoexec/dist/row_parallel.py``);
- ``by_partials_ms``: the same bits the way a group of more than one rank makes them (each leaf's
  fp32 partial alone, all in one launch, then the sum in leaf order), which tp = 1 ran before the
  walk (then one launch a leaf);
- ``cublas_ms``: ``torch.nn.functional.linear``, the stock GEMM, for scale;
- ``same_bits``: whether ours and the partials gave the same output (they must).

Shapes: o_proj and down_proj of Qwen3-0.6B and Qwen3-8B (the 8B's are also Qwen3.5-9B's), M from a
decode batch to a training micro-batch. On CUDA every time is a CUDA-graph replay; on CPU the
reference twins on small shapes (ratios only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from isoexec_kernels.gemm import linear

from ..bits import int_view
from ..compose import load_composition
from ..contract import K_LEAVES
from ..dist.row_parallel import row_parallel_linear, row_parallel_linear_by_partials
from .common import print_rows, rotating, row, time_ms

# (name, K, N): the row-parallel projections (input features K, output N)
SHAPES = [("0.6b.o", 2048, 1024), ("0.6b.down", 3072, 1024), ("8b.o", 4096, 4096), ("8b.down", 12288, 4096)]
M_VALUES = [1, 64, 256, 2048, 8192]
QUICK_SHAPES = [("tiny.o", 256, 64), ("tiny.down", 384, 64)]
QUICK_M = [1, 64]
COMPOSITION = "isoexec_tp4"


def pinned_leaves(composition: str = COMPOSITION) -> int:
    """The ``K_LEAVES`` the composition pins on its row-parallel regions (one value for all)."""
    _, spec = load_composition(composition)
    found = {e["constants"][K_LEAVES] for e in spec["entries"] if K_LEAVES in e.get("constants", {})}
    if len(found) != 1:
        raise ValueError(f"composition {composition!r} pins {K_LEAVES} {sorted(found)}: expected one value")
    return found.pop()


def bench_tp_linear(device: str, quick: bool = False, log=print) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    on_gpu = device == "cuda" and not quick
    shapes, ms = (SHAPES, M_VALUES) if on_gpu else (QUICK_SHAPES, QUICK_M)
    timer = "cuda-graph" if device == "cuda" else device
    L = pinned_leaves()
    log(f"row-parallel linear at tp = 1 with {K_LEAVES}={L} ({COMPOSITION}) vs the invariant GEMM")
    rows = []
    for name, k, n in shapes:
        w = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
        for m in ms:
            nxt = rotating(lambda: (torch.randn(m, k, device=device, dtype=dtype),), 4)
            with torch.no_grad():
                x = nxt()[0]
                same = torch.equal(int_view(row_parallel_linear(x, w, in_features=k, leaves=L)),
                                   int_view(row_parallel_linear_by_partials(x, w, in_features=k, leaves=L)))
                if not same:
                    log(f"WARNING {name} M={m}: the walk and the leaf partials gave different bits")
                base = time_ms(lambda: linear(nxt()[0], w), timer)
                ours = time_ms(lambda: row_parallel_linear(nxt()[0], w, in_features=k, leaves=L), timer)
                parts = time_ms(lambda: row_parallel_linear_by_partials(nxt()[0], w, in_features=k, leaves=L), timer)
                cublas = time_ms(lambda: F.linear(nxt()[0], w), timer)
            r = row({"shape": name, "M": m, "K": k, "N": n, "leaves": L, "dtype": str(dtype).replace("torch.", ""),
                     "by_partials_ms": round(parts, 6), "cublas_ms": round(cublas, 6),
                     "ours_vs_cublas": round(cublas / ours, 4), "same_bits": bool(same)},
                    "invariant_gemm", base, ours)
            rows.append(r)
            print_rows([r], ["shape", "M", "K", "N"], log)
    return rows
