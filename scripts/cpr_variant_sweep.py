"""Variant sweep for CPR's Triton kernels on a GPU, and the native chunk forward's comparison (a
tuning tool, not a benchmark of record).

Default mode, for each candidate ``CPRKernelChoice`` (dot precision, the boundary update's form,
"rows" or "wy" with its dot block and warps, the per-token kernel's Dv tile, warps and next-row
prefetch), with the native chunk baseline (``native.py``: the WY forward) timed in the same run:

1. checks the candidate against itself in every case: the trainer's varlen output equals the
   engine's one-shot prefill, and an engine run that prefills in random pieces and decodes the
   last tokens one by one (integer views, differing-element counts); its trainer output against
   the same choice without the prefetch (a scheduling change: 0 differing); and its accuracy
   against the float64 per-token recurrence (relative L2 and max abs error);
2. times the three stages of ``isoexec bench cpr`` (trainer forward 5 x 2048, prefill 5 x 2048,
   decode 256 lanes in a CUDA graph);
3. profiles one call of each stage (torch.profiler): the kernels and their device time, so the
   stage's time is split by kernel (prep, state chain, per-token pass, host-side glue).

A candidate other than ``PINNED`` gives other bits than the committed gates saw: picking one
means a new ``gdn_cpr`` version and new GPU gates.

``--native`` mode (issue #14): the native chunk path, old ("legacy": CPR's prep and state kernels
at TF32 plus an output kernel, and the shared backward of ``chunk_backward.py``) against the WY
kernels of ``native_wy.py`` and ``native_wy_backward.py`` (the pinned ``NATIVE_WY``, the WY forward
with the shared backward, and other ``NativeWYChoice`` tiles), and pinned CPR, per stage (trainer
forward, trainer forward + backward, prefill, decode), each native candidate checked on the GPU
(float64 recurrence: relative L2 and max abs error with bf16 and fp32 values; engine one-shot and
engine split + decode against float64; gradients against float64 autograd; two calls bitwise) and
profiled by kernel; the published stock (FLA) timings and the 1.5x target ride along in the JSON.
Usage on the GPU machine:

    python3 scripts/cpr_variant_sweep.py --out $OUT/cpr_sweep.json [--quick]
    python3 scripts/cpr_variant_sweep.py --native --out $OUT/native_sweep.json [--quick]

``--quick`` (tiny shapes, a few variants) runs anywhere, also under ``TRITON_INTERPRET=1`` on a CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from torch.autograd import DeviceType

from isoexec.bench.common import time_ms
from isoexec.bench.cpr import FULL, GDN_DIMS, QUICK, QUICK_DIMS, _decode_state, _graphed, _inputs
from isoexec.envinfo import env_info
import dataclasses

from isoexec_kernels import gdn_core as cpr
from isoexec_kernels.gdn_core import GDNState, native as nat, torch_recurrence
from isoexec_kernels.gdn_core import native_wy as nwy
from isoexec_kernels.gdn_core import triton_kernels as tk
from isoexec_kernels.gdn_core.triton_kernels import CPRKernelChoice

_C = CPRKernelChoice
VARIANTS = [
    tk.PINNED,                                              # version 3: wy boundary form, prefetch
    _C(boundary="rows"),                                    # version 2
    _C(boundary="rows", rec_prefetch=True),                 # version 2's bits, prefetched
    _C(boundary="wy"),                                      # version 3's bits without the prefetch
    _C(boundary="wy", rec_prefetch=True, rec_bv=16, rec_warps=1),
    _C(boundary="wy", rec_prefetch=True, wy_bk=32),
]
QUICK_VARIANTS = [tk.PINNED, _C(boundary="rows")]


def _name(c: CPRKernelChoice) -> str:
    return ",".join(f"{f.name}={getattr(c, f.name)}" for f in dataclasses.fields(c)
                    if getattr(c, f.name) != f.default or f.name in ("boundary", "rec_bv", "rec_warps"))


def _diff(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.contiguous().view(torch.int32) != b.contiguous().view(torch.int32)).sum())


def _check(choice, dims, device, seed=7):
    """Trainer vs engine one-shot vs engine pieces + decode, and accuracy vs float64."""
    lens = [300, 64, 517, 1, 129] if dims is GDN_DIMS else [40, 16, 33]
    C = dims["chunk"]
    (q, k, v, g, beta), cu = _inputs(lens, dims, device, torch.bfloat16 if device == "cuda" else torch.float32,
                                     seed)
    o = tk.gdn_cpr_varlen_triton(q, k, v, g, beta, cu, chunk=C, choice=choice)
    # a scheduling-only change (the prefetch) must keep the bits of the same choice without it
    same_arith = dataclasses.replace(choice, rec_prefetch=False)
    o_plain = tk.gdn_cpr_varlen_triton(q, k, v, g, beta, cu, chunk=C, choice=same_arith)
    ref = torch_recurrence(*(x.double() for x in (q, k, v, g, beta)), cu).float()
    err = dict(rel_l2=float((o - ref).norm() / ref.norm()), max_abs=float((o - ref).abs().max()))

    def engine_run(pieces_of):
        st = GDNState.allocate(len(lens) + 1, dims["H"], dims["Dk"], dims["Dv"], device, chunk=C)
        out = torch.full_like(o, float("nan"))
        for b, L in enumerate(lens):
            s0 = int(cu[b])
            pre, ndec = pieces_of(L)
            pos = 0
            for n in pre:
                rows = torch.arange(s0 + pos, s0 + pos + n, device=device)
                out[rows] = tk.gdn_cpr_engine_triton(
                    *(x[rows] for x in (q, k, v, g, beta)), torch.tensor([0, n], dtype=torch.int32, device=device),
                    torch.tensor([b + 1], device=device), st, chunk=C, choice=choice)
                pos += n
            for _ in range(ndec):
                r = torch.tensor([s0 + pos], device=device)
                out[r] = tk.gdn_cpr_decode_triton(*(x[r] for x in (q, k, v, g, beta)),
                                                  torch.tensor([b + 1], device=device), st, chunk=C, choice=choice)
                pos += 1
        return out

    rng = random.Random(seed)

    def pieces(L):
        ndec = min(L, rng.randint(0, 2 * C + 3))
        pre, left = [], L - ndec
        while left:
            n = min(left, rng.randint(1, 2 * C))
            pre.append(n)
            left -= n
        return pre, ndec

    one_shot = engine_run(lambda L: ([L] if L else [], 0))
    split = engine_run(pieces)
    return dict(err, differ_engine_one_shot=_diff(one_shot, o), differ_engine_split_decode=_diff(split, o),
                differ_vs_no_prefetch=_diff(o_plain, o), compared=o.numel())


def _profile(fn, device, top=8):
    """The kernels of one call of ``fn`` (after a warm-up call) by device time; on a CPU, the
    torch ops by their own host time."""
    fn()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if device == "cuda" and e.device_type == DeviceType.CUDA:
            rows.append(dict(name=e.key[:100], us=float(e.device_time_total), calls=int(e.count)))
        elif device != "cuda":
            rows.append(dict(name=e.key[:100], us=float(e.self_cpu_time_total), calls=int(e.count)))
    rows.sort(key=lambda r: -r["us"])
    return rows[:top]


def _stages(choice, dims, sizes, device, rep_ms, profile):
    """(times, profiles) of trainer fwd, prefill and decode for ``choice`` (None: native)."""
    C = dims["chunk"]
    out, prof = {}, {}
    b, s = sizes["train"]
    xs, cu = _inputs([s] * b, dims, device, torch.bfloat16 if device == "cuda" else torch.float32, seed=1)
    with torch.no_grad():
        if choice is None:
            fwd = lambda: nat.gdn_chunk_varlen(*xs, cu, chunk=C)  # noqa: E731
        else:
            fwd = lambda: tk.gdn_cpr_varlen_triton(*xs, cu, chunk=C, choice=choice)  # noqa: E731
        out["trainer_fwd_ms"] = time_ms(fwd, device, rep_ms=rep_ms)
        if profile:
            prof["trainer_fwd"] = _profile(fwd, device)
        b, s = sizes["prefill"]
        xs, cu = _inputs([s] * b, dims, device, torch.bfloat16 if device == "cuda" else torch.float32, seed=2)
        slots = torch.arange(b, device=device)

        def prefill():
            st = GDNState.allocate(b, dims["H"], dims["Dk"], dims["Dv"], device, chunk=C)
            if choice is None:
                return nat.gdn_chunk_engine(*xs, cu, slots, st, chunk=C)
            return tk.gdn_cpr_engine_triton(*xs, cu, slots, st, chunk=C, choice=choice)
        out["prefill_ms"] = time_ms(prefill, device, rep_ms=rep_ms)
        if profile:
            prof["prefill"] = _profile(prefill, device)
        B = sizes["decode"]
        xs, _ = _inputs([1] * B, dims, device, torch.bfloat16 if device == "cuda" else torch.float32, seed=3)
        slots = torch.arange(B, device=device)
        st = _decode_state(B, dims, device, seed=4)
        if choice is None:
            dec = _graphed(lambda: nat.gdn_recurrent_decode(*xs, slots, st, chunk=C), device)
        else:
            dec = _graphed(lambda: tk.gdn_cpr_decode_triton(*xs, slots, st, chunk=C, choice=choice), device)
        out["decode_ms"] = time_ms(dec, device, rep_ms=rep_ms)
        if profile:
            eager = (lambda: tk.gdn_cpr_decode_triton(*xs, slots, st, chunk=C, choice=choice)) if choice else \
                (lambda: nat.gdn_recurrent_decode(*xs, slots, st, chunk=C))
            prof["decode_eager"] = _profile(eager, device)
    return out, prof


# --------------------------------------------------------------------------- --native mode

FLA_H200_MS = dict(prefill_ms=0.844, trainer_fwd_bwd_ms=5.18, decode_ms=0.0612)
"""The published stock (flash-linear-attention) chunk kernels on the H200 at these shapes."""
TARGET_RATIO = 1.5
"""Issue #14's target: the native composition within this factor of the stock kernels."""

_P = nwy.NATIVE_WY
_R = dataclasses.replace
NATIVE_CANDIDATES = [   # (name, forward kind, NativeWYChoice, backward kind)
    ("legacy", "legacy", _P, "shared"),                                # the old native path
    ("wy", "wy", _P, "wy"),                                            # pinned
    ("wy_fwd_shared_bwd", "wy", _P, "shared"),
    ("wy_state_bv32", "wy", _R(_P, state_bv=32), "wy"),               # pinned until the 616e196 sweep
    ("wy_state_w8", "wy", _R(_P, state_warps=8), "wy"),
    ("wy_state_stages3", "wy", _R(_P, state_stages=3), "wy"),
    ("wy_out_bv128_w8", "wy", _R(_P, out_bv=128, out_warps=8), "wy"),
    ("wy_out_w8_stages3", "wy", _R(_P, out_warps=8, out_stages=3), "wy"),
    ("wy_prep_w8", "wy", _R(_P, prep_warps=8), "wy"),
    ("wy_bk32", "wy", _R(_P, bk=32), "wy"),
    ("wy_bwd_warps", "wy", _R(_P, dhu_warps=4, dqk_warps=4, wyb_warps=8), "wy"),
    ("wy_tf32_operands", "wy", _R(_P, dot="tf32"), "wy"),             # fp32 operands, TF32 dots
]
QUICK_NATIVE_CANDIDATES = NATIVE_CANDIDATES[:2]


def _use_native(kind, choice, bwd="wy"):
    nat.NATIVE_CHUNK_KIND = kind
    nat.NATIVE_BWD_KIND = bwd
    nwy.NATIVE_WY = choice


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


_REF64 = {}


def _native_check(dims, device, seed=8):
    """The current native chunk configuration against the float64 recurrence (bf16 and fp32
    values), its engine (one shot; prefill pieces + decode) and itself (a second call)."""
    lens = [300, 64, 517, 1, 129] if dims is GDN_DIMS else [40, 16, 33]
    C = dims["chunk"]
    H, Dk, Dv = dims["H"], dims["Dk"], dims["Dv"]
    out = {}
    for v_dtype in ((torch.bfloat16, torch.float32) if device == "cuda" else (torch.float32,)):
        tag = str(v_dtype).replace("torch.", "")
        (q, k, v, g, beta), cu = _inputs(lens, dims, device, v_dtype, seed)
        key = (tag, device, tuple(lens))
        if key not in _REF64:
            _REF64[key] = torch_recurrence(*(x.double() for x in (q, k, v, g, beta)), cu).float()
        ref = _REF64[key]
        starts, L = nat._host_lens(cu)
        o = nat._varlen_triton(q, k, v, g, beta, cu, C, "chunk")
        o2 = nat._varlen_triton(q, k, v, g, beta, cu, C, "chunk")
        row = dict(rel_l2=_rel(o, ref), max_abs=float((o - ref).abs().max()), differ_second_call=_diff(o, o2),
                   compared=o.numel())
        if v_dtype is (torch.bfloat16 if device == "cuda" else torch.float32):
            st = GDNState.allocate(len(lens), H, Dk, Dv, device, chunk=C)
            slots = torch.arange(len(lens), device=device)
            one = nat._engine(q, k, v, g, beta, cu, slots, st, C, "chunk", triton=True)
            row["engine_one_shot_rel_l2"] = _rel(one, ref)
            row["engine_one_shot_differ_from_varlen"] = _diff(one, o)
            # pieces off the chunk grid, then decode steps, one sequence at a time
            rng = random.Random(seed)
            st = GDNState.allocate(len(lens), H, Dk, Dv, device, chunk=C)
            eng = torch.full_like(o, float("nan"))
            for b, n in enumerate(L):
                pos, ndec = 0, min(n, rng.randint(0, 8))
                while pos < n - ndec:
                    m = min(n - ndec - pos, rng.randint(1, 2 * C + 7))
                    r = torch.arange(starts[b] + pos, starts[b] + pos + m, device=device)
                    eng[r] = nat._engine(*(x[r] for x in (q, k, v, g, beta)),
                                         torch.tensor([0, m], dtype=torch.int32, device=device),
                                         torch.tensor([b], device=device), st, C, "chunk", triton=True)
                    pos += m
                for _ in range(ndec):
                    r = torch.tensor([starts[b] + pos], device=device)
                    if device == "cuda":
                        eng[r] = nat.gdn_recurrent_decode(*(x[r] for x in (q, k, v, g, beta)),
                                                          torch.tensor([b], device=device), st, chunk=C)
                    else:   # the decode kernel itself (the public function takes the torch path on a CPU)
                        lane = torch.zeros(1, dtype=torch.int32)
                        eng[r] = torch.empty(1, H, Dv)
                        tmp = torch.empty(1, H, Dv)
                        tk.launch_recurrent(*(x[r] for x in (q, k, v, g, beta)), tmp, st.running, st.running, lane,
                                            torch.ones_like(lane), torch.tensor([b], dtype=torch.int32),
                                            torch.tensor([b], dtype=torch.int32), H, H // dims["Hk"])
                        eng[r] = tmp
                    pos += 1
            row["engine_split_decode_rel_l2"] = _rel(eng, ref)
            # gradients (the trainer's backward of this configuration) against float64 autograd
            # through the torch chunk form, and a second backward's bits
            from isoexec_kernels.gdn_core.chunk_form import torch_chunk_form

            do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed)).to(device)
            ref_in = [x.double().requires_grad_() for x in (q, k, v, g, beta)]
            want = torch.autograd.grad(torch_chunk_form(*ref_in, cu, chunk=C), ref_in, do.double())
            inputs = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
            got = nat._trainer_backward(inputs, cu, C, do, "chunk")
            got2 = nat._trainer_backward(inputs, cu, C, do, "chunk")
            row["grad_rel_l2"] = {n: _rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta"), got, want)}
            row["grad_differ_second_call"] = sum(_diff(a.float(), b.float()) for a, b in zip(got, got2))
        out[tag] = row
    return out


def _native_times(dims, sizes, device, rep_ms, profile, fns):
    """Times (and profiles) of trainer forward, trainer forward + backward and prefill for the
    (varlen, engine) pair ``fns``; inputs as ``isoexec bench cpr``."""
    C = dims["chunk"]
    varlen, engine = fns
    v_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out, prof = {}, {}
    b, s = sizes["train"]
    xs, cu = _inputs([s] * b, dims, device, v_dtype, seed=1)
    with torch.no_grad():
        fwd = lambda: varlen(*xs, cu, chunk=C)  # noqa: E731
        out["trainer_fwd_ms"] = time_ms(fwd, device, rep_ms=rep_ms)
        if profile:
            prof["trainer_fwd"] = _profile(fwd, device)
    xg = [x.detach().clone().requires_grad_() for x in xs]
    do = torch.randn(b * s, dims["H"], dims["Dv"], device=device)

    def fwd_bwd():
        torch.autograd.grad(varlen(*xg, cu, chunk=C), xg, do)
    out["trainer_fwd_bwd_ms"] = time_ms(fwd_bwd, device, rep_ms=rep_ms)
    if profile:   # the backward (chunk_backward.py, shared by every trainer path) by kernel
        prof["trainer_fwd_bwd"] = _profile(fwd_bwd, device, top=14)
    del xg, do
    b, s = sizes["prefill"]
    xs, cu = _inputs([s] * b, dims, device, v_dtype, seed=2)
    slots = torch.arange(b, device=device)
    st = GDNState.allocate(b, dims["H"], dims["Dk"], dims["Dv"], device, chunk=C)
    with torch.no_grad():
        pre = lambda: engine(*xs, cu, slots, st, chunk=C)  # noqa: E731
        out["prefill_ms"] = time_ms(pre, device, rep_ms=rep_ms)
        if profile:
            prof["prefill"] = _profile(pre, device, top=12)
    return out, prof


def _decode_ms(dims, sizes, device, rep_ms, fn):
    B = sizes["decode"]
    xs, _ = _inputs([1] * B, dims, device, torch.bfloat16 if device == "cuda" else torch.float32, seed=3)
    slots = torch.arange(B, device=device)
    st = _decode_state(B, dims, device, seed=4)
    with torch.no_grad():
        return time_ms(_graphed(lambda: fn(*xs, slots, st, chunk=dims["chunk"]), device), device, rep_ms=rep_ms)


def native_main(args, device) -> int:
    dims, sizes = (QUICK_DIMS, QUICK) if args.quick else (GDN_DIMS, FULL)
    cands = QUICK_NATIVE_CANDIDATES if args.quick else NATIVE_CANDIDATES
    rep_ms = 5.0 if args.quick else args.rep_ms
    result = dict(name="native_wy_sweep", env=env_info("sm90" if device == "cuda" else "cpu"), dims=dims,
                  sizes=sizes, pinned=dataclasses.asdict(_P), reference_fla_ms=FLA_H200_MS,
                  target_ratio=TARGET_RATIO, rows=[])
    t0 = time.time()

    def dump():
        with open(args.out, "w") as f:   # after every row: a run cut short keeps the finished ones
            json.dump(result, f, indent=1)

    # decode: the native composition's decode is the fused recurrent step whatever the chunk path
    result["decode_ms"] = dict(native=_decode_ms(dims, sizes, device, rep_ms, nat.gdn_recurrent_decode),
                               cpr=_decode_ms(dims, sizes, device, rep_ms, cpr.gdn_cpr_decode))
    print(f"decode: native {result['decode_ms']['native']:.4f} ms  cpr {result['decode_ms']['cpr']:.4f} ms  "
          f"(stock {FLA_H200_MS['decode_ms']} ms)", flush=True)
    def cpr_row():
        times, prof = _native_times(dims, sizes, device, rep_ms, True, (cpr.gdn_cpr_varlen, cpr.gdn_cpr_engine))
        result["cpr"] = dict(times, profile=prof)
        print(f"{'cpr (pinned)':<20} " + "  ".join(f"{k} {v:.3f}" for k, v in times.items()), flush=True)
        dump()

    # legacy, the pinned WY tiles and CPR first: a run cut short by its time limit keeps those
    for i, (name, kind, choice, bwd) in enumerate(cands):
        if i == 2:
            cpr_row()
        row = dict(variant=name, kind=kind, bwd=bwd, choice=dataclasses.asdict(choice) if kind == "wy" else None)
        _use_native(kind, choice, bwd)
        try:
            row["check"] = _native_check(dims, device)
            times, prof = _native_times(dims, sizes, device, rep_ms, True,
                                        (nat.gdn_chunk_varlen, nat.gdn_chunk_engine))
            row.update(times)
            row["profile"] = prof
            row["vs_stock"] = {k: round(times[k] / FLA_H200_MS[k], 3) for k in FLA_H200_MS if k in times}
        except Exception as e:  # one failing candidate (compile, shared memory) must not end the sweep
            row["error"] = f"{type(e).__name__}: {e}"[:600]
        finally:
            _use_native("wy", _P, "wy")
        result["rows"].append(row)
        chk = row.get("check", {})
        acc = "  ".join(f"{t}: rel_l2 {c['rel_l2']:.2e} max_abs {c['max_abs']:.2e} differ2 {c['differ_second_call']}"
                        + (f" grad max rel_l2 {max(c['grad_rel_l2'].values()):.2e}" if "grad_rel_l2" in c else "")
                        for t, c in chk.items())
        print(f"{name:<20} " + (row.get("error") or "  ".join(
            f"{k} {row[k]:.3f}" for k in ("trainer_fwd_ms", "trainer_fwd_bwd_ms", "prefill_ms"))
            + f"  vs stock {row['vs_stock']}  | {acc}"), flush=True)
        dump()
    if "cpr" not in result:
        cpr_row()
    print(f"done in {time.time() - t0:.0f}s -> {args.out}")
    for r in result["rows"]:
        for stage, ks in r.get("profile", {}).items():
            print(f"  {r['variant']} {stage}: " + ", ".join(f"{k['name'][:40]} {k['us']:.0f}us" for k in ks[:8]))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="tiny shapes and two variants (CPU interpreter)")
    ap.add_argument("--rep-ms", type=float, default=150.0)
    ap.add_argument("--first", type=int, default=0, help="only the first N candidates (a short GPU call)")
    ap.add_argument("--native", action="store_true",
                    help="native chunk forward: legacy vs WY candidates vs CPR (module docstring)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.native:
        return native_main(args, device)
    dims, sizes = (QUICK_DIMS, QUICK) if args.quick else (GDN_DIMS, FULL)
    variants = QUICK_VARIANTS if args.quick else VARIANTS
    if args.first:
        variants = variants[:args.first]
    rep_ms = 5.0 if args.quick else args.rep_ms
    result = dict(name="cpr_variant_sweep", env=env_info("sm90" if device == "cuda" else "cpu"),
                  dims=dims, sizes=sizes, pinned=_name(tk.PINNED), rows=[])
    t0 = time.time()
    times, prof = _stages(None, dims, sizes, device, rep_ms, profile=True)
    result["native"] = dict(times, profile=prof)
    print("native mixed: " + "  ".join(f"{k} {v:.3f}" for k, v in times.items()), flush=True)
    for choice in variants:
        row = dict(variant=_name(choice), **dataclasses.asdict(choice))
        try:
            row["check"] = _check(choice, dims, device)
            times, prof = _stages(choice, dims, sizes, device, rep_ms, profile=True)
            row.update(times)
            row["profile"] = prof
            row["cost_vs_native"] = {k: round(v / result["native"][k], 3) for k, v in times.items()}
        except Exception as e:  # one failing candidate (e.g. out of shared memory) must not end the sweep
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        result["rows"].append(row)
        chk = row.get("check", {})
        print(f"{row['variant']:<38} " + (row.get("error") or
              "  ".join(f"{k} {row[k]:.3f}" for k in ("trainer_fwd_ms", "prefill_ms", "decode_ms")) +
              f"  cost {row['cost_vs_native']}  differ {chk['differ_engine_one_shot']}/"
              f"{chk['differ_engine_split_decode']} of {chk['compared']}, vs no prefetch "
              f"{chk['differ_vs_no_prefetch']}  rel_l2 {chk['rel_l2']:.2e}"),
              flush=True)
        with open(args.out, "w") as f:   # after every candidate: a run cut short keeps the finished ones
            json.dump(result, f, indent=1)
    print(f"done in {time.time() - t0:.0f}s -> {args.out}")
    for r in result["rows"]:
        for stage, ks in r.get("profile", {}).items():
            print(f"  {r['variant']} {stage}: " + ", ".join(f"{k['name'][:40]} {k['us']:.0f}us"
                                                          for k in ks[:5]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
