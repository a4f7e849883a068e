"""Probe for the MoE router's fp32 GEMM (a tuning tool, GPU only).

``scripts/moe_profile.py`` found one fp32 invariant-GEMM launch (the router logits
lin(fp32(x), fp32(W_router)), N = experts = 64 or 256, K = 2048) taking 2.35 ms of the MoE
layer's 2.8 ms at M = 1 on the H200: N fits one or four 64-wide tiles, so one program (or four)
walks all of K with the fp32 ``ieee`` dot. This times the candidate launches of the same GEMM as
CUDA-graph replays against cuBLAS fp32 (``F.linear``, TF32 off) and checks, for each candidate,
that a row alone gives the bits it gets inside a batch of 4096 rows (M-invariance) and the error
against float64:

  current      the table's fp32 launch (TMA, 64 x 64, ieee)
  pointer      the pointer kernel, 16/64-row tiles, ieee
  split L      K cut into L leaves (split-K at small M), ieee
  tf32x3       the same launches with input_precision "tf32x3" (three TF32 tensor-core products)

    python3 scripts/router_gemm_probe.py [--out router_probe.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from isoexec.bench.common import graph_time_ms
from isoexec_kernels.gemm import linear_triton

SHAPES = [("glm47_flash.router", 64, 2048), ("qwen35_35b_a3b.router", 256, 2048)]
MS = [1, 64, 256, 4096]


def _candidates():
    out = [("current", {}, {})]
    for bm in (16, 64):
        out.append((f"pointer {bm}x64", dict(impl="pointer"), dict(BLOCK_M=bm, BLOCK_N=64, num_warps=4, num_stages=3)))
    for leaves in (4, 8, 16, 32):
        out.append((f"split {leaves}", dict(impl="split", leaves=leaves),
                    dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=3)))
    for name, kw, tile in list(out):
        out.append((name + " tf32x3", dict(kw, precision="tf32x3"), tile))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    res = []
    g = torch.Generator().manual_seed(0)
    for name, E, K in SHAPES:
        w = (torch.randn(E, K, generator=g) * 0.02).cuda()
        big = torch.randn(4096, K, generator=g).cuda()
        want = (big.double() @ w.double().T)
        for cname, kw, tile in _candidates():
            def run(x, kw=kw, tile=tile):
                return linear_triton(x, w, tile=tile or None, **kw)
            try:
                full = run(big)
                err = float(((full.double() - want).norm() / want.norm()).item())
                alone_same = all(torch.equal(run(big[i:i + 1]).view(torch.int32), full[i:i + 1].view(torch.int32))
                                 for i in (0, 777, 4095))
                times = {}
                for m in MS:
                    xs = [big[j * m % 4096:][:m].contiguous() for j in range(3)]
                    it = {"i": 0}

                    def nxt():
                        it["i"] = (it["i"] + 1) % 3
                        return xs[it["i"]]
                    ours = graph_time_ms(lambda: run(nxt()), 40)
                    cublas = graph_time_ms(lambda: F.linear(nxt(), w), 40)
                    times[m] = {"ours_ms": round(ours, 5), "cublas_fp32_ms": round(cublas, 5),
                                "ratio": round(cublas / ours, 4)}
                row = {"shape": name, "E": E, "K": K, "candidate": cname, "rel_err_vs_f64": err,
                       "row_alone_equals_row_in_batch": alone_same, "times": times}
            except Exception as exc:  # noqa: BLE001 - a candidate may not compile
                row = {"shape": name, "candidate": cname, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            res.append(row)
            if "error" in row:
                print(f"{name:<22} {cname:<20} ERROR {row['error']}", flush=True)
            else:
                print(f"{name:<22} {cname:<20} err {err:.2e} invariant {alone_same}  " +
                      "  ".join(f"M={m}: {t['ours_ms'] * 1e3:8.1f} us ({t['ratio']:.2f}x cuBLAS fp32)"
                                for m, t in times.items()), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": res}, f, indent=1)


if __name__ == "__main__":
    main()
