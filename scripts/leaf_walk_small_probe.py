"""Probe (GPU): launches of the 4-leaf walk at the rows of ``bench tp_linear`` where it trails the
plain invariant GEMM at small M (a tuning tool, not a benchmark of record).

For each (shape, M) row: the one-leaf table launch (``linear_triton(x, w)``, the baseline), the
current 4-leaf launch (``linear_triton(x, w, leaves=4)``), and candidate launches of the 4 leaves
(kernel path, tile, warps, stages, K tile), each checked for the current 4-leaf bits and timed as a
CUDA-graph replay. Usage on the GPU machine: ``python3 scripts/leaf_walk_small_probe.py --out F``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_tile_sweep import _bits, _cycle  # noqa: E402

from isoexec.bench.common import graph_time_ms  # noqa: E402
from isoexec.envinfo import git_commit  # noqa: E402
from isoexec_kernels.gemm import linear_triton, tile_for_m  # noqa: E402

LEAVES = 4
ROWS = [("8b.down", 12288, 4096, 1), ("0.6b.o", 2048, 1024, 256), ("0.6b.down", 3072, 1024, 256),
        ("8b.o", 4096, 4096, 256), ("8b.down", 12288, 4096, 256)]


def _c(path, bm, bn, warps, stages, kt=64):
    return dict(path=path, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, warp_specialize=False,
                K_TILE=kt)


CANDIDATES = {
    1: [_c("pointer", 16, 16, 2, 6, 256), _c("pointer", 16, 16, 2, 6, 128), _c("pointer", 16, 32, 4, 4, 256),
        _c("pointer", 16, 64, 4, 4, 128), _c("split", 16, 64, 4, 4), _c("split", 16, 128, 4, 4),
        _c("split", 16, 256, 4, 4)],
    256: [_c("tma", 64, 64, 4, 5, 128), _c("tma", 64, 64, 4, 6, 128), _c("tma", 64, 32, 4, 6, 128),
          _c("tma", 64, 64, 4, 3, 256), _c("tma", 64, 64, 2, 4, 128), _c("pointer", 32, 64, 4, 4, 128),
          _c("tma", 64, 128, 4, 4, 128), _c("tma", 64, 128, 4, 3, 128), _c("tma", 64, 128, 4, 4),
          _c("tma", 64, 128, 4, 5), _c("tma", 64, 64, 4, 4, 128), _c("tma", 64, 64, 4, 6),
          _c("pointer", 64, 32, 4, 4, 128), _c("pointer", 64, 64, 4, 4, 128), _c("pointer", 64, 128, 4, 4, 128),
          _c("split", 64, 64, 4, 4), _c("split", 64, 128, 4, 3)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="rows as name:M, comma separated (default: all)")
    a = ap.parse_args()
    only = {tuple(s.split(":")) for s in a.only.split(",") if s}
    out = {"commit": git_commit(), "device": torch.cuda.get_device_name(0), "leaves": LEAVES, "rows": []}
    for name, K, N, M in ROWS:
        if only and (name, str(M)) not in only:
            continue
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        nxt = _cycle(xs)
        with torch.no_grad():
            ref = linear_triton(xs[0], w, leaves=LEAVES)
            base = graph_time_ms(lambda: linear_triton(nxt(), w), 80)
            cur = graph_time_ms(lambda: linear_triton(nxt(), w, leaves=LEAVES), 80)
            row = {"shape": name, "M": M, "K": K, "N": N, "baseline_ms": round(base, 5),
                   "baseline_tile": tile_for_m(M, torch.bfloat16, N, K),
                   "current_ms": round(cur, 5), "current_tile": tile_for_m(M, torch.bfloat16, N, K, LEAVES),
                   "current_vs_baseline": round(base / cur, 4), "candidates": []}
            print(f"{name:<10} M={M:<5} baseline {base * 1e3:7.2f} us  current {cur * 1e3:7.2f} us "
                  f"({base / cur:.3f})", flush=True)
            for c in CANDIDATES[M]:
                tile = {k: v for k, v in c.items() if k != "path"}
                try:
                    got = linear_triton(xs[0], w, impl=c["path"], tile=tile, leaves=LEAVES)
                    same = bool(torch.equal(_bits(got), _bits(ref)))
                    t = graph_time_ms(lambda: linear_triton(nxt(), w, impl=c["path"], tile=tile, leaves=LEAVES), 80)
                except Exception as exc:  # noqa: BLE001 - a candidate may not fit
                    row["candidates"].append({**c, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
                    print(f"    {c}  error {type(exc).__name__}", flush=True)
                    continue
                row["candidates"].append({**c, "ms": round(t, 5), "vs_baseline": round(base / t, 4), "same_bits": same})
                print(f"    {c['path']:<7} {c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']} "
                      f"kt{c['K_TILE']}: {t * 1e3:7.2f} us  vs baseline {base / t:.3f}  bits {'same' if same else 'DIFFER'}",
                      flush=True)
        out["rows"].append(row)
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
