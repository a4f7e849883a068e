"""Probe of the warp-specialised Gluon leaf walk (isoexec_kernels/gemm/gluon_ws_walk.py) on an
sm_90 GPU: its bits against the Triton walk (``linear`` with the same leaves) and its speed
against the Triton walk, the one-leaf invariant GEMM (the plain table) and cuBLAS, same run,
CUDA-graph replays.

    python3 scripts/gluon_ws_walk_probe.py --out probe.json [--stages 4 5 6] [--quick]

Bits: every variant (stages) on the row-parallel shapes at each M, plus edge shapes (M, N, K not
multiples of the tile, K not a multiple of 64, 1 and 4 leaves, bias and residual): the count of
differing bf16 elements (integer views) against the Triton walk. Times: the ratio to the one-leaf
table (what ``isoexec bench tp_linear`` calls ``invariant_gemm``) and to the Triton walk.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from isoexec.bench.common import graph_time_ms  # noqa: E402
from isoexec_kernels.gemm import linear  # noqa: E402
from isoexec_kernels.gemm.gluon_ws_walk import linear_ws_walk_gluon  # noqa: E402

SHAPES = [("0.6b.o", 2048, 1024), ("0.6b.down", 3072, 1024), ("8b.o", 4096, 4096), ("8b.down", 12288, 4096)]
M_VALUES = [1024, 2048, 8192]
EDGES = [(1000, 1000, 1000), (77, 136, 4160), (300, 264, 192), (129, 1024, 2048)]   # (M, N, K)
LEAVES = 4


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int16) != b.view(torch.int16)).sum().item())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", type=int, nargs="+", default=[4, 5, 6])
    ap.add_argument("--group-m", type=int, nargs="+", default=[8],
                    help="raster groups to time at the best ring depth (scheduling only; bits checked)")
    ap.add_argument("--quick", action="store_true", help="one shape, one M (a smoke run)")
    a = ap.parse_args()
    t0 = time.time()
    dev = "cuda"
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "edges": [], "rows": []}
    import triton
    res["triton"] = triton.__version__

    # bits at the edges: bias and residual, 1 and 4 leaves, every ring depth
    g = torch.Generator(device=dev).manual_seed(0)
    for (M, N, K) in EDGES[: 1 if a.quick else None]:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g) / K ** 0.5
        b = torch.randn(N, device=dev, dtype=torch.bfloat16, generator=g)
        r = torch.randn(M, N, device=dev, dtype=torch.bfloat16, generator=g)
        for leaves in (1, LEAVES):
            if leaves > -(-K // 64):
                continue
            for bias, resid in ((None, None), (b, None), (b, r), (None, r)):
                ref = linear(x, w, bias, leaves=leaves, residual=resid)
                for st in a.stages:
                    out = linear_ws_walk_gluon(x, w, leaves, bias=bias, residual=resid, stages=st)
                    torch.cuda.synchronize()
                    d = differing(out, ref)
                    res["edges"].append({"M": M, "N": N, "K": K, "leaves": leaves, "bias": bias is not None,
                                         "residual": resid is not None, "stages": st, "differing": d})
                    print(f"edge M={M} N={N} K={K} L={leaves} bias={bias is not None} res={resid is not None} "
                          f"stages={st}: {d} differing", flush=True)

    shapes = SHAPES[:1] if a.quick else SHAPES
    ms = [2048] if a.quick else M_VALUES
    for name, K, N in shapes:
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
        for M in ms:
            xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(4)]
            state = {"i": 0}

            def nxt():
                state["i"] = (state["i"] + 1) % len(xs)
                return xs[state["i"]]

            with torch.no_grad():
                ref = linear(xs[0], w, leaves=LEAVES)
                row = {"shape": name, "M": M, "K": K, "N": N, "leaves": LEAVES}
                row["cublas_ms"] = graph_time_ms(lambda: F.linear(nxt(), w))
                row["table_ms"] = graph_time_ms(lambda: linear(nxt(), w))            # one leaf
                row["triton_walk_ms"] = graph_time_ms(lambda: linear(nxt(), w, leaves=LEAVES))
                for st in a.stages:
                    out = linear_ws_walk_gluon(xs[0], w, LEAVES, stages=st)
                    row[f"ws{st}_differing"] = differing(out, ref)
                    row[f"ws{st}_ms"] = graph_time_ms(lambda: linear_ws_walk_gluon(nxt(), w, LEAVES, stages=st))
                best = min(a.stages, key=lambda s: row[f"ws{s}_ms"])
                row["best_stages"] = best
                for gm in a.group_m:
                    if gm == 8:
                        continue   # the default raster: the ws{s} rows above
                    out = linear_ws_walk_gluon(xs[0], w, LEAVES, stages=best, group_m=gm)
                    row[f"ws{best}_g{gm}_differing"] = differing(out, ref)
                    row[f"ws{best}_g{gm}_ms"] = graph_time_ms(
                        lambda: linear_ws_walk_gluon(nxt(), w, LEAVES, stages=best, group_m=gm))
                    print(f"   group_m {gm}: {row['table_ms'] / row[f'ws{best}_g{gm}_ms']:.3f}x the table, "
                          f"{row[f'ws{best}_g{gm}_differing']} differing", flush=True)
                row["ws_vs_table"] = round(row["table_ms"] / row[f"ws{best}_ms"], 4)
                row["triton_walk_vs_table"] = round(row["table_ms"] / row["triton_walk_ms"], 4)
                row["ws_vs_triton_walk"] = round(row["triton_walk_ms"] / row[f"ws{best}_ms"], 4)
            res["rows"].append(row)
            print(f"{name:<10} M={M:<5} table {row['table_ms'] * 1e3:8.1f} us  triton walk "
                  f"{row['triton_walk_vs_table']:.3f}x  ws walk " +
                  " ".join(f"s{s} {row['table_ms'] / row[f'ws{s}_ms']:.3f}x/{row[f'ws{s}_differing']}d" for s in a.stages) +
                  f"  (best vs triton walk {row['ws_vs_triton_walk']:.3f}x)", flush=True)
            json.dump(res, open(a.out, "w"), indent=1)
    res["seconds"] = round(time.time() - t0, 1)
    json.dump(res, open(a.out, "w"), indent=1)
    bad = sum(e["differing"] for e in res["edges"]) + sum(v for r in res["rows"] for k, v in r.items()
                                                          if k.endswith("_differing"))
    print(f"total differing {bad}; wrote {a.out} in {res['seconds']} s")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
