"""Does one row of a tensor-core product round like the same row inside a 64-row product? (A probe
for the GPU, not a test; the question docs/cpr.md puts first for CPR's matrix-form schedule.)

CPR's within-chunk outputs could come from matrix products over the chunk's 64 rows (the causal
q k^T, the triangular solve's products) instead of a 64-step per-token recurrence, if decode could
reproduce row t of those products from row t alone. That needs a product whose row t has the
same bits whether the tile holds 64 live rows or one (the others zero, or a smaller tile). This
compares, for each operand precision the CPR kernels could use (bf16 operands with fp32
accumulation, fp32 with ``tf32x3``, fp32 ``ieee``) and a few (K, N):

* ``full64``: one 64 x K @ K x N ``tl.dot`` (the trainer's chunk);
* ``alone64``: the same 64-row tile with only row t loaded, the rest zero;
* ``alone16``: a 16-row tile (the smallest ``tl.dot``) holding row t alone;
* ``alone16w1``: the same on one warp (a decode kernel's launch).

and prints the control (``full64`` twice: 0 differing, or the rest means nothing) and, per variant, how many of the 64 rows' outputs differ from ``full64`` (integer views).

    python3 scripts/row_product_probe.py [--out $OUT/row_product_probe.json]

Runs under ``TRITON_INTERPRET=1`` on the CPU too (where ``tl.dot`` is the host's matmul and its
bf16 dot is broken: a format check only, not an answer).
"""

from __future__ import annotations

import argparse
import json

import torch

from isoexec.bits import count_differing
from isoexec_kernels._triton_util import jit, tl

PRECISIONS = {"bf16": (torch.bfloat16, "ieee"), "tf32x3": (torch.float32, "tf32x3"), "ieee": (torch.float32, "ieee")}
SHAPES = ((64, 64), (128, 128), (64, 128))   # (K, N): a chunk's q k^T is (Dk, 64), its p v (64, Dv)


@jit
def _rows_dot_kernel(a_ptr, b_ptr, c_ptr, row0, n_rows, K: tl.constexpr, N: tl.constexpr,
                     BLOCK_M: tl.constexpr, PREC: tl.constexpr):
    # rows row0 .. row0 + n_rows of a [*, K] in a BLOCK_M-row tile (the rest zero) times b [K, N]
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, K)
    ns = tl.arange(0, N)
    live = rows < n_rows
    a = tl.load(a_ptr + (row0 + rows)[:, None] * K + ks[None, :], mask=live[:, None], other=0.0)
    b = tl.load(b_ptr + ks[:, None] * N + ns[None, :])
    c = tl.dot(a, b, input_precision=PREC, out_dtype=tl.float32)
    tl.store(c_ptr + (row0 + rows)[:, None] * N + ns[None, :], c, mask=live[:, None])


def _run(a, b, row0, n_rows, block_m, prec, warps, out):
    K, N = b.shape
    _rows_dot_kernel[(1,)](a, b, out, row0, n_rows, K=K, N=N, BLOCK_M=block_m, PREC=prec, num_warps=warps)


def probe(device: str, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for name, (dtype, prec) in PRECISIONS.items():
        for K, N in SHAPES:
            a = torch.randn(64, K, generator=g).to(dtype).to(device)
            b = (torch.randn(K, N, generator=g) / K ** 0.5).to(dtype).to(device)
            full = torch.empty(64, N, dtype=torch.float32, device=device)
            _run(a, b, 0, 64, 64, prec, 4, full)
            again = torch.empty_like(full)
            _run(a, b, 0, 64, 64, prec, 4, again)
            # the control: the same 64-row product twice must agree, or nothing below means anything
            row = {"precision": name, "K": K, "N": N, "repeat64_elements_differing": count_differing(again, full)}
            for variant, block_m, warps in (("alone64", 64, 4), ("alone16", 16, 4), ("alone16w1", 16, 1)):
                got = torch.empty_like(full)
                for t in range(64):
                    _run(a, b, t, 1, block_m, prec, warps, got)
                row[variant] = {"rows_differing": sum(int(count_differing(got[t], full[t]) > 0) for t in range(64)),
                                "elements_differing": count_differing(got, full)}
            want = a.double() @ b.double()
            row["full64_max_rel_err"] = float(((full.double() - want).abs().max() / want.abs().max()).item())
            rows.append(row)
            print(f"{name:7s} K={K:3d} N={N:3d}: repeat64 {row['repeat64_elements_differing']} differ, " + ", ".join(
                f"{v} {row[v]['rows_differing']}/64 rows differ" for v in ("alone64", "alone16", "alone16w1")),
                flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    rows = probe(args.device)
    if args.out:
        env = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "torch": torch.__version__}
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
