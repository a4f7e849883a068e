"""The Gluon K-leaf walk (128 x 256 tiles, the running sum in shared memory) against the Triton walk:
bits and speed on an sm_90 GPU (a tuning probe).

Bits: every Gluon variant (``block_k`` x ``stages`` of the operand ring, gluon_leaf_walk.VARIANTS)
against ``gemm.linear(x, w, leaves=4)`` (the Triton walk) and, on some rows, against
``gemm.linear(x, w, leaves=1)`` and with a bias and a residual; counted as differing bf16 elements
(int16 views). Every x has an all-zero row and every w a row of negative entries (products of -0:
the sign of that output zero shows how a leaf's accumulator starts). An edge row (M = N = 1000,
K = 2080: partial tiles, a half-padded last block, where every variant loads 64 columns:
gluon_leaf_walk.whole_loads_past_k) takes a different Triton launch (the loop per leaf). A diagnostic row runs the variant that starts each leaf with
``use_acc=False`` instead of adding to zeros.

Speed: CUDA-graph replay (``graph_time_ms``) of the Gluon variants, the Triton 4-leaf walk, the
Triton one-leaf GEMM (the baseline) and cuBLAS ``F.linear``; the table prints baseline_ms / ms.
A failing variant (compile or launch error) is recorded and the others go on.

    PYTHONPATH=$PWD python3 scripts/gluon_leaf_walk_probe.py --out $OUT/gluon_leaf_walk_probe.json
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch
import torch.nn.functional as F

from isoexec.bench.common import graph_time_ms
from isoexec.envinfo import git_commit
from isoexec_kernels import gemm
from isoexec_kernels.gemm import gluon_leaf_walk as glw

SHAPES = (("0.6b.o", 2048, 1024), ("0.6b.down", 3072, 1024), ("8b.o", 4096, 4096), ("8b.down", 12288, 4096))
MS = (256, 1024, 2048, 8192)
EDGE = ("edge", 2080, 1000, 1000)   # name, K, N, M
LEAVES = 4


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.contiguous().view(torch.int16) != b.contiguous().view(torch.int16)).sum())


def _inputs(M, N, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) / K ** 0.5
    x[3] = 0
    w[5] = -w[5].abs() - 0.01
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g)
    r = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, w, b, r


def _variant_name(bk, st):
    return f"gluon_bk{bk}_s{st}"


def _guard(fn):
    """(value, None) or (None, the error's first line): one variant's failure never stops the rest."""
    try:
        return fn(), None
    except Exception as exc:   # compile errors, launch errors, out of resources
        traceback.print_exc()
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"


def _check_row(x, w, b, r, variants, leaves_one, with_bias_res):
    """{variant: {check: differing elements or the error}} for one input set."""
    want = {"leaves4": gemm.linear(x, w, leaves=LEAVES)}
    if leaves_one:
        want["leaves1"] = gemm.linear(x, w, leaves=1)
    if with_bias_res:
        want["leaves4_bias_res"] = gemm.linear(x, w, b, leaves=LEAVES, residual=r)
    out = {}
    for bk, st in variants:
        res = {}
        for check, ref in want.items():
            leaves = 1 if check == "leaves1" else LEAVES
            extra = dict(bias=b, residual=r) if check.endswith("bias_res") else {}
            got, err = _guard(lambda: glw.linear_leaf_walk_gluon(x, w, leaves, block_k=bk, stages=st, **extra))
            res[check] = err if err else _differing(got, ref)
        out[_variant_name(bk, st)] = res
    return out


def _compiled_usage():
    """Registers, spills and shared memory of every compiled Gluon kernel, from triton's cache."""
    rows = []
    try:
        for caches in glw._leaf_walk_kernel.device_caches.values():
            for key, k in caches[0].items():
                k._init_handles()
                rows.append({"key": str(key)[:400], "registers": k.n_regs, "spills": k.n_spills,
                             "shared": k.metadata.shared})
    except Exception as exc:   # the cache's layout is triton-internal
        rows.append({"error": repr(exc)[:300]})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rep-ms", type=float, default=40.0, help="graph replay time per measurement")
    ap.add_argument("--variants", default=",".join(f"{bk}x{st}" for bk, st in glw.VARIANTS),
                    help="block_k x stages pairs, e.g. 64x2,32x4")
    args = ap.parse_args()
    t_start = time.time()
    if not glw.gluon_leaf_walk_supported(torch.device("cuda")):
        raise SystemExit("needs an sm_90 GPU and triton's Gluon")
    variants = [tuple(int(v) for v in s.split("x")) for s in args.variants.split(",")]
    import triton

    out = {"commit": git_commit(), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "triton": triton.__version__, "leaves": LEAVES, "rep_ms": args.rep_ms,
           "variants": [_variant_name(bk, st) for bk, st in variants], "rows": [], "diagnostics": {}}

    def save():
        out["seconds"] = round(time.time() - t_start, 1)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    # bits of the edge row (no timing), with the one-leaf and the bias / residual checks
    name, K, N, M = EDGE
    x, w, b, r = _inputs(M, N, K, 1)
    with torch.no_grad():
        edge = _check_row(x, w, b, r, variants, leaves_one=True, with_bias_res=True)
        # diagnostic: each leaf's first MMA as D = A B (use_acc=False) instead of D = A B + 0
        got, err = _guard(lambda: glw.linear_leaf_walk_gluon(x, w, LEAVES, block_k=variants[0][0],
                                                             stages=variants[0][1], first_use_acc=False))
        out["diagnostics"]["first_use_acc_false_vs_triton_walk"] = err if err else _differing(
            got, gemm.linear(x, w, leaves=LEAVES))
        out["diagnostics"]["zero_row_sign_bits_triton_walk"] = int(
            (gemm.linear(x, w, leaves=LEAVES)[3, 5:6].view(torch.int16)).item())
    out["rows"].append({"shape": name, "M": M, "K": K, "N": N, "bits": edge})
    print(f"{name} M={M} K={K} N={N}: {edge}", flush=True)
    print(f"diagnostics: {out['diagnostics']}", flush=True)
    save()

    print(f"{'shape':<10} {'M':>5}  {'cublas':>7} {'tri_L1':>7} {'tri_L4':>7}  "
          + "  ".join(f"{_variant_name(bk, st):>14}" for bk, st in variants) + "   (ratio = triton one-leaf ms / ms)")
    for si, (name, K, N) in enumerate(SHAPES):
        for M in MS:
            t0 = time.time()
            x, w, b, r = _inputs(M, N, K, 10 + si)
            with torch.no_grad():
                # one-leaf and bias / residual bits at M = 2048 (the same kernels as other M)
                bits = _check_row(x, w, b, r, variants, leaves_one=M == 2048, with_bias_res=M == 2048)
                ms = {"cublas": graph_time_ms(lambda: F.linear(x, w), args.rep_ms),
                      "triton_leaves1": graph_time_ms(lambda: gemm.linear(x, w, leaves=1), args.rep_ms),
                      "triton_leaves4": graph_time_ms(lambda: gemm.linear(x, w, leaves=LEAVES), args.rep_ms)}
                for bk, st in variants:
                    v = _variant_name(bk, st)
                    if isinstance(bits[v].get("leaves4"), str):
                        ms[v] = None   # it failed its bits run already
                        continue
                    t, err = _guard(lambda: graph_time_ms(
                        lambda: glw.linear_leaf_walk_gluon(x, w, LEAVES, block_k=bk, stages=st), args.rep_ms))
                    ms[v] = t if err is None else None
                    if err:
                        bits[v]["timing_error"] = err
            base = ms["triton_leaves1"]
            ratio = {k: (round(base / v, 4) if v else None) for k, v in ms.items()}
            row = {"shape": name, "M": M, "K": K, "N": N, "ms": {k: (round(v, 5) if v else None) for k, v in ms.items()},
                   "ratio_to_triton_leaves1": ratio, "bits": bits, "seconds": round(time.time() - t0, 1)}
            out["rows"].append(row)

            def cell(v):
                rt = ratio[_variant_name(*v)]
                d = bits[_variant_name(*v)]
                ok = all(val == 0 for val in d.values())
                return f"{rt if rt is not None else 'fail':>9}{'' if ok else ' DIFF':>5}"

            print(f"{name:<10} {M:>5}  {ratio['cublas']:>7} {ratio['triton_leaves1']:>7} {ratio['triton_leaves4']:>7}  "
                  + "  ".join(f"{cell(v):>14}" for v in variants) + f"   {row['seconds']} s", flush=True)
            save()
    out["compiled"] = _compiled_usage()
    for c in out["compiled"]:
        print(c, flush=True)
    save()
    print(f"total {out['seconds']} s; bits: 0 everywhere is the gate (the JSON has each count)")


if __name__ == "__main__":
    main()
