"""Does the native WY chunk forward give token t the same bits whatever comes after t? (A probe for
the GPU, not a test; the first question of CPR version 4 in docs/cpr.md.)

CPR version 4 would take every output inside a chunk from the chunk form (the native path's
inverse, W/U, state and output kernels) instead of a per-token recurrence. Decode can only
reproduce token t's output if the chunk form's row t does not depend on the chunk's later rows:
the causal mask and the lower-triangular inverse multiply them by exact zeros, a row of a
tensor-core product rounds alone as in the full tile (``scripts/row_product_probe.py``), and
``tl.cumsum``'s prefix at t combines only positions up to t. Whether all of that holds through the
real kernels is what this asks: one packed batch holds a sequence of L tokens and every prefix of
it (lengths 1..L, the same rows copied), all run by ``wy_chunk_triton`` in one call; each prefix's
rows are compared with the same rows of the full sequence (integer views of the fp32 outputs).
A prefix of length n is what decode would recompute at position n - 1 (its last row is the new
token's output); rows before it are what prefill gave earlier.

Each case runs from a zero state and from a random start state (a prefill continuing from a
stored boundary), for the native choice (bf16 operands) and, with ``--fp32``, fp32 operands with
tf32x3 dots. The control is the full batch run twice (0 differing, or the rest means nothing).

    python3 scripts/chunk_prefix_probe.py [--length 128] [--fp32] [--out $OUT/chunk_prefix_probe.json]

Runs under ``TRITON_INTERPRET=1`` on the CPU too (fp32 only, tiny sizes: a format check, not an
answer; the interpreter's dots are the host's matmul).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from isoexec.bits import count_differing
from isoexec.envinfo import git_commit
from isoexec_kernels.gdn_core.native_wy import NativeWYChoice, wy_chunk_triton

# Qwen3.5-9B's GDN layer: 16 q/k heads, 32 value heads, head dim 128
SIZES = {"qwen3p5": dict(Hk=16, H=32, Dk=128, Dv=128), "tiny": dict(Hk=1, H=2, Dk=16, Dv=16)}


def inputs(L, Hk, H, Dk, Dv, dtype, device, seed=0):
    """One sequence's q, k (L2-normalised rows, as the prep makes them), v, g (log decays <= 0) and
    beta (in (0, 1)), and a random fp32 start state."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(L, Hk, Dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(L, Hk, Dk, generator=gen), dim=-1)
    v = torch.randn(L, H, Dv, generator=gen)
    g = -F.softplus(torch.randn(L, H, generator=gen)) * 0.5
    beta = torch.sigmoid(torch.randn(L, H, generator=gen))
    init = torch.randn(1, H, Dk, Dv, generator=gen) * 0.1
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), k.to(dtype=dtype, **to), v.to(dtype=dtype, **to), g.to(**to),
            beta.to(**to), init.to(**to))


def prefix_batch(x, L):
    """Rows of every prefix of x (lengths 1..L) packed one after another (the prefix of length n
    starts at row n (n - 1) / 2)."""
    return torch.cat([x[:n] for n in range(1, L + 1)])


def probe(L, size, dot, device, with_init):
    dims = SIZES[size]
    dtype = torch.bfloat16 if dot == "bf16" else torch.float32
    q, k, v, g, beta, init0 = inputs(L, **dims, dtype=dtype, device=device)
    choice = NativeWYChoice(dot=dot)
    packed = [prefix_batch(t, L) for t in (q, k, v, g, beta)]
    lens = list(range(1, L + 1))
    starts = [n * (n - 1) // 2 for n in lens]
    init = init0.expand(L, -1, -1, -1).contiguous() if with_init else None
    fin_idx = [-1] * L

    def run():
        return wy_chunk_triton(*packed, starts, lens, init, None, fin_idx, choice=choice)

    out = run()
    control = count_differing(run(), out)
    full = out[starts[-1]:starts[-1] + L]
    per_len, last_row, first_bad = [], 0, None
    for n, s in zip(lens, starts):
        d = count_differing(out[s:s + n], full[:n])
        dl = count_differing(out[s + n - 1], full[n - 1])
        per_len.append(d)
        last_row += int(dl > 0)
        if d and first_bad is None:
            first_bad = n
    elements = sum(n * dims["H"] * dims["Dv"] for n in lens)
    return {"length": L, "size": size, "dot": dot, "init": with_init, "control_differing": control,
            "elements_compared": elements, "elements_differing": sum(per_len),
            "prefixes_differing": sum(d > 0 for d in per_len), "last_rows_differing": last_row,
            "first_differing_length": first_bad, "differing_by_length": per_len}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--length", type=int, default=128, help="tokens of the full sequence (two chunks: 128)")
    ap.add_argument("--fp32", action="store_true", help="also fp32 operands with tf32x3 dots")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    device = torch.device(a.device)
    size = "qwen3p5" if device.type == "cuda" else "tiny"
    dots = (["bf16"] if device.type == "cuda" else []) + (["tf32x3"] if a.fp32 or device.type != "cuda" else [])
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (interpreter)",
           "torch": torch.__version__, "commit": git_commit(), "rows": []}
    for dot in dots:
        for with_init in (False, True):
            r = probe(a.length, size, dot, device, with_init)
            res["rows"].append(r)
            print(f"dot={dot:<7} init={'random' if with_init else 'zero':<6} L={r['length']}  control "
                  f"{r['control_differing']}  prefixes differing {r['prefixes_differing']}/{r['length']}  "
                  f"last rows differing {r['last_rows_differing']}  elements {r['elements_differing']}/"
                  f"{r['elements_compared']}  first length {r['first_differing_length']}", flush=True)
    res["seconds"] = round(time.time() - t0, 1)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {a.out} in {res['seconds']} s")


if __name__ == "__main__":
    main()
