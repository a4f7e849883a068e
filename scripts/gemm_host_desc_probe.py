"""Host-side vs device-side TMA descriptors for the persistent invariant GEMM (a tuning probe).

The persistent TMA kernel builds its three tensor descriptors on the device: each program writes
three tensormaps to a global workspace and fences them before its first load. Made on the host
instead (``tile={"host_desc": True}``), they are kernel parameters and the programs start loading
at once. At the sizes where a kernel lasts 10-30 us (Qwen3-0.6B projections at M = 2048) that
start-up is a few percent of the time. Per row: cuBLAS, the table's tile with device descriptors
and with host descriptors, timed as CUDA-graph replays in interleaved rounds (the median ratio
over rounds, so a drifting clock moves all three alike), and the bits of both against each other.

    python3 scripts/gemm_host_desc_probe.py --out $OUT/gemm_host_desc.json [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from isoexec.bench.common import graph_time_ms
from isoexec.envinfo import git_commit
from isoexec_kernels.gemm import linear_triton, tile_for_m

# (name, M, K, N): every M >= 1024 row of the dense family plus the TMA rows at M = 256
ROWS = [("0.6b.o", 2048, 2048, 1024), ("0.6b.down", 2048, 3072, 1024), ("0.6b.qkv", 2048, 1024, 4096),
        ("0.6b.gate_up", 2048, 1024, 6144), ("0.6b.o", 4096, 2048, 1024), ("0.6b.down", 8192, 3072, 1024),
        ("0.6b.gate_up", 8192, 1024, 6144), ("8b.o", 2048, 4096, 4096), ("8b.qkv", 4096, 4096, 6144),
        ("8b.down", 2048, 12288, 4096), ("0.6b.o", 1024, 2048, 1024), ("8b.o", 1024, 4096, 4096),
        ("8b.qkv", 256, 4096, 6144), ("lm_head", 256, 1024, 151936)]
# extra tiles per row (besides the table's): the former o_proj entry
EXTRA = {("0.6b.o", 2048): [dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=4, warp_specialize=False)]}


def _bits(t):
    return t.contiguous().view(torch.int16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    out = {"commit": git_commit(), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "rounds": args.rounds, "rows": []}
    import triton
    out["triton"] = triton.__version__
    for name, M, K, N in ROWS:
        t0 = time.time()
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        it = {"i": 0}

        def nxt():
            it["i"] = (it["i"] + 1) % len(xs)
            return xs[it["i"]]

        table = {k: v for k, v in tile_for_m(M, torch.bfloat16, N, K).items() if k != "path"}
        variants = {"device": dict(table, host_desc=False), "host": dict(table, host_desc=True)}
        for j, extra in enumerate(EXTRA.get((name, M), [])):
            variants[f"alt{j}_device"] = dict(extra, host_desc=False)
            variants[f"alt{j}_host"] = dict(extra, host_desc=True)
        ref = linear_triton(xs[0], w, tile=variants["device"])
        same = {k: bool(torch.equal(_bits(linear_triton(xs[0], w, tile=v)), _bits(ref))) for k, v in variants.items()}
        ratios = {k: [] for k in variants}
        times = {k: [] for k in list(variants) + ["cublas"]}
        with torch.no_grad():
            for _ in range(args.rounds):
                cb = graph_time_ms(lambda: F.linear(nxt(), w), 60)
                times["cublas"].append(cb)
                for k, v in variants.items():
                    ms = graph_time_ms(lambda: linear_triton(nxt(), w, tile=v), 60)
                    times[k].append(ms)
                    ratios[k].append(cb / ms)
        row = {"shape": name, "M": M, "K": K, "N": N, "table": table, "same_bits": same,
               "median_ratio": {k: round(statistics.median(r), 4) for k, r in ratios.items()},
               "median_ms": {k: round(statistics.median(t), 5) for k, t in times.items()},
               "ratios": {k: [round(x, 4) for x in r] for k, r in ratios.items()},
               "seconds": round(time.time() - t0, 1)}
        out["rows"].append(row)
        print(f"{name:<13} M={M:<5} cublas {row['median_ms']['cublas'] * 1000:7.1f} us  "
              + "  ".join(f"{k} {r:.3f}{'' if same[k] else ' DIFFER'}" for k, r in row["median_ratio"].items())
              + f"  {row['seconds']} s", flush=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
