"""Finds which kernel of the native WY backward is not deterministic run to run (a diagnostic for the
GPU, not a test): runs ``wy_chunk_backward_triton`` twice on the same inputs with every Triton launch
of the forward recompute and the backward wrapped, snapshots every tensor argument after each launch,
and reports, launch by launch, which buffers differ between the two runs (integer views). A third
run fills every fresh ``torch.empty`` buffer with NaN first, to show reads of memory no kernel
wrote. Then it replays the WY-part kernel on the captured inputs, twice in each way of forming
k k^T (``KK_MODE``), with its intermediates stored (``DBG``), and counts what differs.

    python3 scripts/wy_bwd_determinism_probe.py --out $OUT/wy_bwd_probe.json [--warps 4 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

sys.path.insert(0, "tests/kernels")
from gdn_inputs import make_inputs  # noqa: E402

from isoexec_kernels.gdn_core import native_wy as NW  # noqa: E402
from isoexec_kernels.gdn_core import native_wy_backward as NB  # noqa: E402

QWEN35 = dict(Hk=16, H=32, Dk=128, Dv=128)
KERNELS = [(NW, "_wy_inverse_kernel"), (NW, "_wy_wu_kernel"), (NW, "_wy_state_kernel"),
           (NB, "_wyb_dvloc_kernel"), (NB, "_wyb_dhu_kernel"), (NB, "_wyb_dqk_kernel"), (NB, "_wyb_wy_kernel")]


class Spy:
    """Stands in for a Triton kernel object: launches it, then records clones of its tensor args."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def launch(*args, **kw):
            # the inputs as the launch found them (dg and dk are read and then written)
            self.last = (grid, [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args], dict(kw))
            self.kernel[grid](*args, **kw)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            snap = [(i, a.detach().clone()) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            self.log.append((self.name, snap))
        return launch


def run_once(inp, do, choice, poison):
    log = []
    saved = {(m, n): getattr(m, n) for m, n in KERNELS}
    empty = torch.empty

    def poisoned(*a, **kw):
        t = empty(*a, **kw)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t
    spies = {}
    try:
        for (m, n), k in saved.items():
            spies[n] = Spy(k, n, log)
            setattr(m, n, spies[n])
        if poison:
            torch.empty = poisoned
        grads = NB.wy_chunk_backward_triton(*inp, do, choice=choice)
    finally:
        torch.empty = empty
        for (m, n), k in saved.items():
            setattr(m, n, k)
    return grads, log, spies


def replay_wy(last):
    """Re-launches the WY-part kernel on the captured inputs, twice per ``KK_MODE``, with its
    intermediates (k k^T, dT, dA, R) stored: which of them differ between the two launches."""
    grid, args, kw = last
    kw = {k: v for k, v in kw.items() if k not in ("KK_MODE", "DBG")}   # the launcher's pin
    out = {}
    for mode in (0, 1, 2):
        runs = []
        for _ in range(2):
            a = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]
            P, H = grid[1], grid[0]
            C = kw["C"]
            dbg = torch.full((P, H, 5, C, C), float("nan"), device=a[0].device)
            a[13] = dbg   # dbg_ptr
            NB._wyb_wy_kernel[grid](*a, **kw, KK_MODE=mode, DBG=True)
            runs.append(dict(dg=a[10], dv=a[11], dbeta=a[12], dk=a[9], kk=dbg[:, :, 0], dT=dbg[:, :, 1],
                             dA=dbg[:, :, 2], R=dbg[:, :, 3], dbeta_vpart=dbg[:, :, 4, 0],
                             dG_after_PA=dbg[:, :, 4, 1], dbeta_after_R=dbg[:, :, 4, 2],
                             dG_before_cumsum=dbg[:, :, 4, 3], dbeta_final=dbg[:, :, 4, 4]))
        out[f"kk_mode{mode}"] = {n: int((bits(runs[0][n]) != bits(runs[1][n])).sum()) for n in runs[0]}
        print(f"   replay KK_MODE={mode}: {out[f'kk_mode{mode}']}", flush=True)
    return out


def bits(x):
    x = x.contiguous()
    if x.element_size() == 4:
        return x.view(torch.int32)
    if x.element_size() == 2:
        return x.view(torch.int16)
    return x.view(torch.uint8)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--warps", type=int, nargs="*", default=[4, 8], help="wyb_warps values to try")
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    dev = "cpu" if args.quick else "cuda"
    lens, dims = ([20, 0, 9], dict(Hk=1, H=2, Dk=16, Dv=16)) if args.quick else ([300, 64, 1, 129, 0, 77], QWEN35)
    inp = [x.to(dev) for x in make_inputs(lens, **dims, seed=47, v_dtype=torch.bfloat16)]
    gen = torch.Generator().manual_seed(48)
    do = torch.randn(sum(lens), dims["H"], dims["Dv"], generator=gen).to(dev)
    names = ("dq", "dk", "dv", "dg", "dbeta")
    report = dict(torch=torch.__version__, device=torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", cases=[])
    for wyb in args.warps:
        for dqk in (8, 4):
            choice = dataclasses.replace(NW.NATIVE_WY, wyb_warps=wyb, dqk_warps=dqk)
            case = dict(wyb_warps=wyb, dqk_warps=dqk, runs={})
            g1, l1, spies = run_once(inp, do, choice, False)
            g2, l2, _ = run_once(inp, do, choice, False)
            case["final_differing"] = {n: int((bits(a) != bits(b)).sum()) for n, a, b in zip(names, g1, g2)}
            launches = []
            for (n1, s1), (n2, s2) in zip(l1, l2):
                assert n1 == n2
                diffs = {}
                for (i, a), (_, b) in zip(s1, s2):
                    d = int((bits(a) != bits(b)).sum())
                    if d:
                        diffs[f"arg{i}{list(a.shape)}"] = d
                launches.append(dict(kernel=n1, differing=diffs))
            case["launches"] = launches
            g3, l3, _ = run_once(inp, do, choice, True)
            case["poisoned_nan"] = {n: int(torch.isnan(a).sum()) for n, a in zip(names, g3)}
            case["poisoned_vs_clean_differing"] = {n: int((bits(a) != bits(b)).sum()) for n, a, b in zip(names, g1, g3)}
            case["wy_kernel_replays"] = replay_wy(spies["_wyb_wy_kernel"].last)
            report["cases"].append(case)
            print(json.dumps(dict((k, v) for k, v in case.items() if k != "launches")), flush=True)
            for ln in launches:
                if ln["differing"]:
                    print("   ", ln, flush=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
