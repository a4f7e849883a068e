"""CPR version 4 on a GPU (a probe, not a benchmark of record): does the chunk form on the native WY
kernels (``isoexec_kernels/gdn_core/cpr_chunk.py``) give trainer == engine prefill split anywhere ==
decode, bitwise, at Qwen3.5-9B's GDN sizes, also inside a CUDA graph; and what does it cost against
the native composition and CPR version 3, stage by stage (the shapes of ``isoexec bench cpr``)?

Bits: three sequences (300, 70 and 129 tokens) driven through random prefill pieces and decode
steps (``tests/kernels/test_gdn_core.random_plan``) against the trainer's rows, with the row decode
(as pinned, on C-row tiles, and each of ``VARIANTS``) and with the prefix decode; then 40 row-decode
steps of 256 lanes replayed from a CUDA graph against
the same steps run eagerly (outputs and states). ``--fp32``: the same plans with fp32 values only.
Last, the row decode's kernels under torch.profiler, and the prefill's against the trainer forward's
(kernels and host time).
Timings (forward only for the trainer, the backward being the native one in both): trainer forward
5 x 2048, prefill 5 x 2048 from fresh slots, decode 256 lanes with random fills under a CUDA graph.

    python3 scripts/cpr4_probe.py [--out $OUT/cpr4_probe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))

from isoexec.bench.common import time_ms  # noqa: E402
from isoexec.bench.cpr import FULL, GDN_DIMS, _graphed, _inputs  # noqa: E402
from isoexec.bits import count_differing  # noqa: E402
from isoexec.envinfo import git_commit  # noqa: E402
from isoexec_kernels import gdn_core as cpr  # noqa: E402
from isoexec_kernels.gdn_core import GDNState, HostPlan  # noqa: E402
from isoexec_kernels.gdn_core import cpr_chunk as C4  # noqa: E402
from isoexec_kernels.gdn_core import cpr_row_decode as RD  # noqa: E402
from isoexec_kernels.gdn_core import native as nat  # noqa: E402


def _state(n, dims, dev, q=True, value_dtype=torch.bfloat16):
    """A state of ``n`` slots; version 4's (``q``) keeps the open chunk's values in bf16, the values'
    dtype here, as the hybrid model allocates it (``value_dtype=torch.float32``: the fp32 buffer that
    was the only one before)."""
    return GDNState.allocate(n, dims["H"], dims["Dk"], dims["Dv"], dev, chunk=dims["chunk"], with_q=q,
                             value_dtype=value_dtype)


def _row_decode(**kw):
    """The row decode with ``kw`` (``row_tile``, ``row_warps``) instead of the pinned ones."""
    def run(q, k, v, g, beta, slots, state, *, chunk):
        return RD.cpr4_decode_rows_triton(q, k, v, g, beta, slots, state, C4.CPR4_CHOICE, chunk=chunk, **kw)
    return run


_rows_c = _row_decode(row_tile=C4.CHUNK)      # C-row tiles: the native kernels' own
VARIANTS = {   # name: (decode, the state's value dtype)
    # the tiles pinned before 57e4664 (row kernel 64-wide on 2 warps, two dots with S; the
    # row-inverse and W/M parts in 64-column blocks, W/M on 4 warps)
    "rows_before_57e4664": (_row_decode(row_bv=64, row_warps=2, stack=False, inv_bk=64, wm_bk=64, wm_warps=4),
                            torch.bfloat16),
    # the completion kernel with a program per lane (and head), as before COMPLETE_LANES
    "complete_lanes1": (_row_decode(complete_lanes=1), torch.bfloat16),
}
"""Decode choices besides the pinned one, each checked for bits against the trainer and the pinned
decode and timed in the same run."""


def bits(dims, dev) -> dict:
    from test_gdn_core import random_plan, run_engine

    C = dims["chunk"]
    lens = [300, 70, 129]
    xs, cu = _inputs(lens, dims, dev, torch.bfloat16, seed=5)
    trainer = C4.cpr4_varlen_triton(*xs, cu, chunk=C)
    out = {"elements": trainer.numel(), "plans": []}
    for seed in (1, 2, 3):
        plan = random_plan(lens, seed, max_decode=80)
        row = {"seed": seed, "calls": len(plan), "decode_calls": sum(k == "decode" for k, _ in plan)}
        got = {}
        decs = {"rows": (C4.cpr4_decode_triton, torch.bfloat16), "prefix": (C4.cpr4_decode_prefix_triton, torch.bfloat16),
                "rows_c": (_rows_c, torch.bfloat16), **VARIANTS}
        for name, (dec, vdt) in list(decs.items()):
            st = _state(len(lens) + 2, dims, dev, value_dtype=vdt)
            try:
                got[name] = run_engine((*xs, cu), lens, plan, [4, 1, 2], st, C4.cpr4_engine_triton, dec, C)
            except Exception as exc:  # noqa: BLE001 - a variant may not compile (registers, shared memory)
                row[f"error_{name}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                continue
            row[f"differing_{name}"] = count_differing(got[name], trainer)
            if name == "rows":   # the state's operand copy kept equal to its fp32 boundary, rounded
                row["boundary_op_vs_boundary"] = count_differing(st.boundary_op, st.boundary.to(torch.bfloat16))
                row["vn_op_vs_vn"] = count_differing(st.buf_vn_op, st.buf_vn.to(torch.bfloat16))
        row["rows_vs_prefix"] = count_differing(got["rows"], got["prefix"])
        for v in ("rows_c", *VARIANTS):
            if v in got:
                row[f"{v}_vs_rows"] = count_differing(got[v], got["rows"])
        out["plans"].append(row)
    # decode in a CUDA graph == eager (outputs of every step and the final state)
    B = 256
    gen = torch.Generator(device="cpu").manual_seed(6)
    steps = [_inputs([B], dims, dev, torch.bfloat16, seed=100 + i)[0] for i in range(40)]
    slots = torch.arange(B, device=dev)
    fills = torch.randint(0, C, (B + 1,), generator=gen, dtype=torch.int32).to(dev)
    res = {}
    for mode in ("eager", "graph"):
        st = _state(B + 1, dims, dev)
        st.fill.copy_(fills)
        st.boundary.copy_(torch.randn(st.boundary.shape, generator=torch.Generator().manual_seed(7)).to(dev) * 0.05)
        inp = [torch.empty_like(x) for x in steps[0]]
        outs = []
        fn = lambda: C4.cpr4_decode_triton(*inp, slots, st, chunk=C)  # noqa: E731
        if mode == "graph":
            keep = {f: getattr(st, f).clone() for f in ("boundary", "fill", "buf_q", "buf_k", "buf_v", "buf_g", "buf_beta",
                                                          "buf_vn", "buf_T", "boundary_op", "buf_vn_op")}
            for x, y in zip(inp, steps[0]):
                x.copy_(y)
            graph = torch.cuda.CUDAGraph()
            fn()                                   # compile outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                o_static = fn()
            for f, t in keep.items():              # capture and warm-up ran steps: start over
                getattr(st, f).copy_(t)
        for x_step in steps:
            for x, y in zip(inp, x_step):
                x.copy_(y)
            if mode == "graph":
                graph.replay()
                outs.append(o_static.clone())
            else:
                outs.append(fn())
        res[mode] = (torch.stack(outs), st.boundary.clone())
    out["graph_vs_eager_outputs"] = count_differing(res["graph"][0], res["eager"][0])
    out["graph_vs_eager_boundary"] = count_differing(res["graph"][1], res["eager"][1])
    return out


def _row_decode_fp32(**kw):
    """The row decode of fp32 values (``CPR4_CHOICE_FP32``) with ``kw`` instead of the pinned tiles."""
    def run(q, k, v, g, beta, slots, state, *, chunk):
        return RD.cpr4_decode_rows_triton(q, k, v, g, beta, slots, state, C4.CPR4_CHOICE_FP32, chunk=chunk, **kw)
    return run


def bits_fp32(dims, dev) -> dict:
    """fp32 values (``cpr_chunk.CPR4_CHOICE_FP32``: tf32x3 dots, no bf16 rounding): trainer == engine
    prefill split anywhere == decode (rows and prefix), as ``bits`` does for bf16; and the trainer's
    distance from version 3's (both fp32-accurate: a relative L2 near 1e-6 says the dots are fp32)."""
    from test_gdn_core import random_plan, run_engine

    C = dims["chunk"]
    lens = [300, 70, 129]
    xs, cu = _inputs(lens, dims, dev, torch.float32, seed=5)
    trainer = C4.cpr4_varlen_triton(*xs, cu, chunk=C)
    v3 = cpr.gdn_cpr_varlen_triton(*xs, cu, chunk=C)
    out = {"elements": trainer.numel(), "choice_dot": C4.cpr4_choice(torch.float32).dot,
           "rel_l2_vs_v3": float((trainer - v3).norm() / v3.norm()), "plans": []}
    for seed in (1, 2, 3):
        plan = random_plan(lens, seed, max_decode=80)
        row = {"seed": seed, "calls": len(plan), "decode_calls": sum(k == "decode" for k, _ in plan)}
        # pinned: what ``cpr4_decode_triton`` runs for fp32 values (the prefix decode since the row
        # decode in tf32x3 missed the bits at 1f3c6ee: rows 22,074-62,239 differing, every tile
        # variant the same, 93-247 with q S in BK blocks)
        decs = {"pinned": C4.cpr4_decode_triton, "prefix": C4.cpr4_decode_prefix_triton, "rows": _row_decode_fp32()}
        for name, dec in decs.items():
            st = _state(len(lens) + 2, dims, dev, value_dtype=torch.float32)
            got = run_engine((*xs, cu), lens, plan, [4, 1, 2], st, C4.cpr4_engine_triton, dec, C)
            row[f"differing_{name}"] = count_differing(got, trainer)
            row["state_has_op_copies"] = st.boundary_op is not None
        out["plans"].append(row)
    return out


def timings(dims, dev, decode_only=False) -> list[dict]:
    C = dims["chunk"]
    rows = []
    b, L = FULL["train"]
    xs, cu = _inputs([L] * b, dims, dev, torch.bfloat16, seed=1)
    with torch.no_grad():
        for name, fn in () if decode_only else (("native", lambda: nat.gdn_chunk_varlen(*xs, cu, chunk=C)),
                         ("cpr_v3", lambda: cpr.gdn_cpr_varlen(*xs, cu, chunk=C)),
                         ("cpr_v4", lambda: C4.cpr4_varlen_triton(*xs, cu, chunk=C))):
            rows.append({"stage": "trainer_fwd", "impl": name, "ms": round(time_ms(fn, "cuda"), 4)})
        slots = torch.arange(b, device=dev)
        for name, fn, q in () if decode_only else (("native", nat.gdn_chunk_engine, False), ("cpr_v3", cpr.gdn_cpr_engine, False),
                            ("cpr_v4", C4.cpr4_engine_triton, True)):
            st = _state(b, dims, dev, q)
            rows.append({"stage": "prefill", "impl": name,
                         "ms": round(time_ms(lambda: fn(*xs, cu, slots, st, chunk=C), "cuda"), 4)})
        del xs
        B = FULL["decode"]
        xs, _ = _inputs([B], dims, dev, torch.bfloat16, seed=3)
        slots = torch.arange(B, device=dev)
        gen = torch.Generator().manual_seed(4)
        fills = torch.randint(0, C, (B + 1,), generator=gen, dtype=torch.int32).to(dev)
        for name, fn, q, vdt in (("native", nat.gdn_recurrent_decode, False, torch.float32),
                                 ("cpr_v3", cpr.gdn_cpr_decode, False, torch.float32),
                                 ("cpr_v4_prefix", C4.cpr4_decode_prefix_triton, True, torch.bfloat16),
                                 ("cpr_v4", C4.cpr4_decode_triton, True, torch.bfloat16),
                                 *((f"cpr_v4_{n}", d, True, t) for n, (d, t) in VARIANTS.items())):
            st = _state(B + 1, dims, dev, q, value_dtype=vdt)
            st.fill.copy_(fills)
            try:
                run = _graphed(lambda: fn(*xs, slots, st, chunk=C), "cuda")
                rows.append({"stage": "decode", "impl": name, "graphs": True, "ms": round(time_ms(run, "cuda"), 4)})
            except Exception as exc:  # noqa: BLE001 - a variant may not compile (registers, shared memory)
                print(f"decode {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    for r in rows:
        nat_ms = next(x["ms"] for x in rows if x["stage"] == r["stage"] and x["impl"] == "native")
        r["vs_native"] = round(r["ms"] / nat_ms, 3)
        print(f"{r['stage']:12s} {r['impl']:13s} {r['ms']:9.4f} ms  x{r['vs_native']:.2f} native", flush=True)
    return rows


def decode_profile(dims, dev) -> list[dict]:
    """The row decode's kernels at 256 lanes (eager, 20 steps, random fills): device time per kernel."""
    from torch.profiler import ProfilerActivity, profile

    C, B = dims["chunk"], FULL["decode"]
    xs, _ = _inputs([B], dims, dev, torch.bfloat16, seed=3)
    slots = torch.arange(B, device=dev)
    st = _state(B + 1, dims, dev)
    st.fill.copy_(torch.randint(0, C, (B + 1,), generator=torch.Generator().manual_seed(4), dtype=torch.int32).to(dev))
    C4.cpr4_decode_triton(*xs, slots, st, chunk=C)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            C4.cpr4_decode_triton(*xs, slots, st, chunk=C)
        torch.cuda.synchronize()
    rows = []
    # the prep kernel's two launches per step apart (row-inverse, then W/M), by their order in time
    try:
        from torch.autograd import DeviceType
        prep = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA
                       and e.name.startswith("_cpr4_row_prep_kernel")), key=lambda e: e.time_range.start)
        for part, evs in (("row_inverse", prep[0::2]), ("w_m", prep[1::2])):
            us = sum(e.time_range.elapsed_us() for e in evs) / 20
            rows.append({"kernel": f"_cpr4_row_prep_kernel ({part})", "calls": len(evs), "us_per_step": round(us, 1)})
            print(f"  {us:9.1f} us/step  {len(evs):4d}x  prep part {part}", flush=True)
    except Exception as exc:  # noqa: BLE001 - the split is a convenience
        print(f"  (no split of the prep kernel: {type(exc).__name__}: {exc})", flush=True)
    # what each compiled kernel of the decode holds per program (registers and shared memory bound
    # how many programs an SM keeps in flight)
    for name in ("_cpr4_append_kernel", "_cpr4_row_prep_kernel", "_cpr4_row_kernel", "_cpr4_complete_kernel"):
        try:
            jf = getattr(RD, name)._get()
            for dev_cache in getattr(jf, "device_caches", {}).values():
                for ck in dev_cache[0].values():
                    md = ck.metadata
                    info = {"kernel": name, "num_warps": md.num_warps, "n_regs": ck.n_regs, "n_spills": ck.n_spills,
                            "shared": md.shared}
                    rows.append(info)
                    print("  compiled", json.dumps(info), flush=True)
        except Exception as exc:  # noqa: BLE001 - introspection of triton internals is best effort
            print(f"  (no compile info for {name}: {type(exc).__name__}: {exc})", flush=True)
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]:
        rows.append({"kernel": e.key[:90], "calls": e.count, "us_per_step": round(e.device_time_total / 20, 1)})
        print(f"  {rows[-1]['us_per_step']:9.1f} us/step  {e.count:4d}x  {rows[-1]['kernel']}", flush=True)
    return rows


def prefill_profile(dims, dev) -> dict:
    """Where the prefill's time goes beyond the trainer forward's (5 x 2048 from fresh slots, eager,
    10 calls each): device time per kernel, and the host time of one call; CPR's and the native
    prefill with the layout read back from the device and given on the host (``HostPlan``)."""
    from torch.profiler import ProfilerActivity, profile

    C = dims["chunk"]
    b, L = FULL["train"]
    xs, cu = _inputs([L] * b, dims, dev, torch.bfloat16, seed=1)
    slots = torch.arange(b, device=dev)
    st = _state(b, dims, dev)
    st_nat = _state(b, dims, dev, q=False)
    # the layout on the host as the engine's batches give it (fresh slots: every open chunk empty)
    plan_h = HostPlan.of([L] * b, range(b), [0] * b)
    runs = {"trainer_fwd": lambda: C4.cpr4_varlen_triton(*xs, cu, chunk=C),
            "prefill": lambda: C4.cpr4_engine_triton(*xs, cu, slots, st, chunk=C),
            "prefill_host_plan": lambda: C4.cpr4_engine_triton(*xs, cu, slots, st, chunk=C, host=plan_h),
            "native_prefill": lambda: nat.gdn_chunk_engine(*xs, cu, slots, st_nat, chunk=C),
            "native_prefill_host_plan": lambda: nat.gdn_chunk_engine(*xs, cu, slots, st_nat, chunk=C, host=plan_h)}
    out = {}
    for name, fn in runs.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        host = (time.perf_counter() - t0) / 10
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        evs = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        out[name] = {"host_ms_per_call": round(host * 1e3, 3), "wall_ms_per_call": round(wall * 1e3, 3),
                     "device_ms_per_call": round(sum(e.device_time_total for e in evs) / 10 / 1e3, 3),
                     "kernels": [{"kernel": e.key[:90], "calls": e.count,
                                  "us_per_call": round(e.device_time_total / 10, 1)} for e in evs[:12]]}
        print(f"{name}: host {out[name]['host_ms_per_call']} ms, wall {out[name]['wall_ms_per_call']} ms, "
              f"device {out[name]['device_ms_per_call']} ms per call", flush=True)
        for k in out[name]["kernels"]:
            print(f"  {k['us_per_call']:9.1f} us/call  {k['calls']:4d}x  {k['kernel']}", flush=True)
    return out


SWEEP = [dict(), dict(prep_warps=1), dict(prep_warps=2), dict(prep_warps=1, out_warps=8),
         dict(prep_warps=2, out_warps=8), dict(prep_warps=1, out_warps=2)]
"""CPR4_CHOICE variants for ``--sweep`` (fields of NativeWYChoice over the pinned ``dot="bf16"``): the
inverse kernel's warps (its 15-step substitution reduces 16 x 16 tiles across warps) and the output
kernel's, which the row decode takes too."""


def sweep(dims, dev) -> list[dict]:
    """Each variant of ``SWEEP`` pinned in turn for trainer, prefill and decode alike: the bits of one
    random plan (row decode against the trainer) and the three stages' times."""
    import dataclasses

    from test_gdn_core import random_plan, run_engine

    C, B = dims["chunk"], FULL["decode"]
    keep = C4.CPR4_CHOICE
    lens = [300, 70, 129]
    xs, cu = _inputs(lens, dims, dev, torch.bfloat16, seed=5)
    b, L = FULL["train"]
    xt, cut = _inputs([L] * b, dims, dev, torch.bfloat16, seed=1)
    xd, _ = _inputs([B], dims, dev, torch.bfloat16, seed=3)
    fills = torch.randint(0, C, (B + 1,), generator=torch.Generator().manual_seed(4), dtype=torch.int32).to(dev)
    out = []
    try:
        for var in SWEEP:
            C4.CPR4_CHOICE = dataclasses.replace(keep, **var)
            row = {"variant": var}
            try:
                trainer = C4.cpr4_varlen_triton(*xs, cu, chunk=C)
                st = _state(len(lens) + 2, dims, dev)
                o = run_engine((*xs, cu), lens, random_plan(lens, 1, max_decode=80), [4, 1, 2], st,
                               C4.cpr4_engine_triton, C4.cpr4_decode_triton, C)
                row["differing"] = count_differing(o, trainer)
                row["trainer_fwd_ms"] = round(time_ms(lambda: C4.cpr4_varlen_triton(*xt, cut, chunk=C), "cuda"), 4)
                sp = _state(b, dims, dev)
                slots = torch.arange(b, device=dev)
                row["prefill_ms"] = round(time_ms(lambda: C4.cpr4_engine_triton(*xt, cut, slots, sp, chunk=C), "cuda"), 4)
                sd = _state(B + 1, dims, dev)
                sd.fill.copy_(fills)
                dslots = torch.arange(B, device=dev)
                run = _graphed(lambda: C4.cpr4_decode_triton(*xd, dslots, sd, chunk=C), "cuda")
                row["decode_ms"] = round(time_ms(run, "cuda"), 4)
            except Exception as exc:  # noqa: BLE001 - a variant may not compile (registers, shared memory)
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print("sweep", json.dumps(row), flush=True)
            out.append(row)
    finally:
        C4.CPR4_CHOICE = keep
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="only the CPR4_CHOICE variants of SWEEP")
    ap.add_argument("--fp32", action="store_true", help="only the bits with fp32 values (bits_fp32)")
    ap.add_argument("--prefill-profile", action="store_true", help="only prefill_profile")
    ap.add_argument("--decode", action="store_true",
                    help="only the decode: bits of every decode variant, their times, the decode profile")
    args = ap.parse_args()
    dev = "cuda"
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": git_commit(),
           "dims": GDN_DIMS}
    if args.decode:
        with torch.no_grad():
            res["bits"] = bits(GDN_DIMS, dev)
            print("bits:", json.dumps(res["bits"]), flush=True)
            res["timings"] = timings(GDN_DIMS, dev, decode_only=True)
            res["decode_profile"] = decode_profile(GDN_DIMS, dev)
        res["seconds"] = round(time.time() - t0, 1)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return
    if args.prefill_profile:
        with torch.no_grad():
            res["prefill_profile"] = prefill_profile(GDN_DIMS, dev)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return
    if args.sweep or args.fp32:
        with torch.no_grad():
            if args.sweep:
                res["sweep"] = sweep(GDN_DIMS, dev)
            else:
                res["bits_fp32"] = bits_fp32(GDN_DIMS, dev)
                print("bits_fp32:", json.dumps(res["bits_fp32"]), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return
    with torch.no_grad():
        res["bits"] = bits(GDN_DIMS, dev)
    print("bits:", json.dumps(res["bits"]), flush=True)
    res["timings"] = timings(GDN_DIMS, dev)
    res["decode_profile"] = decode_profile(GDN_DIMS, dev)
    with torch.no_grad():
        res["prefill_profile"] = prefill_profile(GDN_DIMS, dev)
    res["seconds"] = round(time.time() - t0, 1)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
