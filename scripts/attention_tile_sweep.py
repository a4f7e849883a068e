"""Tile sweep for the invariant attention kernel on a GPU (a tuning tool, not a benchmark of record).

For each candidate launch (BLOCK_M, BLOCK_N, warps, stages, FMA contraction, TMA loads of the
packed varlen K/V) of ``isoexec_kernels.attention.triton_kernels``, this

1. checks invariance with THAT candidate used for every case: the decode row of each sequence
   equals the last row of a one-shot paged prefill, a chunked prefill (chunks of 97 tokens)
   equals the one-shot prefill, and the trainer's varlen forward equals the paged prefill
   (integer views, differing-element counts); and across tiles: decode and paged prefill with
   the pinned tile vs the candidate's prefill (whether the candidate could serve prefill beside
   the pinned decode tile);
2. times prefill (varlen, the trainer and engine-prefill kernel) and decode (paged, page 16)
   against SDPA flash in the same run;
3. times the trainer's fwd+bwd with the backward's loads through TMA descriptors and through
   pointer loads against SDPA flash fwd+bwd.

A candidate whose BLOCK_N differs from the pinned 64 changes the rounding schedule (block
boundaries), so it is timed and checked for self-invariance but reported as a schedule change.
Usage on the GPU machine:

    python3 scripts/attention_tile_sweep.py --out $OUT/attention_sweep.json [--head-dim 256]

``--head-dim 256`` sweeps the mla_moe family's expanded MLA width (GLM-4.7-Flash heads) instead.

``--decode-tiles`` asks a narrower question: can decode run a SMALLER row tile than prefill with the
same bits? A decode tile holds GROUP live rows of BLOCK_M (2 of 64 at Qwen3-0.6B), and the sweep
above found the 128-row tile decoding 1.6-1.8x slower than the 64-row one at the same loads: the
dead rows' dots and softmax cost more than the K/V reads. Smaller tiles select other MMA
instructions (mma.sync below 64 rows instead of wgmma) and other register layouts, so the bits are
an empirical question: each candidate decode tile (BLOCK_N stays 64: the block boundaries are the
rounding schedule) is checked against the PINNED prefill (one-shot and chunked, several seeds,
contexts 1..5000) and timed against the pinned decode tile under CUDA graphs, at every head shape
of the four families (head_dim 128 and 256).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from isoexec.bench.common import time_ms
from isoexec_kernels.attention import triton_kernels as at

HEADS = [("0.6b", 16, 8, 128), ("8b", 32, 8, 128)]
PREFILL = [(8, 2048), (32, 512), (8, 512)]
DECODE = [(64, 2048), (256, 2048), (64, 384)]
PAGE = 16


def _c(bm, bn, w, s, fuse=False, tma=False):
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, fp_fusion=fuse, tma=tma)


# tma: the trainer's varlen prefill reads packed K/V through tensor descriptors (paged prefill
# and decode always use pointer loads)
CANDIDATES = [_c(64, 64, 4, 2), _c(64, 64, 4, 3, tma=True), _c(128, 64, 8, 3, tma=True)]
# head width 256: the mla_moe family's expanded MLA (GLM-4.7-Flash: 20 heads, q/k 192 + 64, v 256,
# both zero-padded to 256; no GQA) -- ``--head-dim 256``
HEADS_256 = [("glm.mla", 20, 20, 256)]
CANDIDATES_256 = [_c(64, 64, 8, 2), _c(64, 64, 4, 2), _c(64, 64, 8, 2, tma=True), _c(64, 64, 8, 3, tma=True),
                  _c(128, 64, 8, 2, tma=True), _c(128, 32, 8, 2, tma=True)]


# --decode-tiles: (name, q heads, kv heads, head_dim) of every family's attention, and the decode
# tiles tried beside the pinned prefill tile (BLOCK_N 64 always)
DECODE_HEADS = [("0.6b", 16, 8, 128), ("8b", 32, 8, 128), ("qwen3.5", 16, 4, 256), ("glm.mla", 20, 20, 256)]
DECODE_TILES = [_c(16, 64, 4, 2), _c(16, 64, 4, 3), _c(16, 64, 2, 2), _c(16, 64, 1, 2), _c(32, 64, 4, 2),
                _c(32, 64, 2, 2), _c(16, 64, 8, 2)]
DECODE_SHAPES = [(64, 384), (64, 2048), (256, 2048), (8, 4096)]


def _launch(q, kc, vc, bt, cu, lens, scale, maxq, page, cfg, kv_tma=False):
    kcfg = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
    return at._launch(q, kc, vc, bt, cu, lens, scale, maxq, True, page, kv_tma=kv_tma, _cfg=kcfg,
                      _fp_fusion=cfg["fp_fusion"])


def _varlen(q, k, v, cu, maxlen, scale, cfg):
    t, hkv, d = k.shape
    kp = k.as_strided((t, 1, hkv, d), (k.stride(0), k.stride(0), k.stride(1), 1))
    vp = v.as_strided((t, 1, hkv, d), (v.stride(0), v.stride(0), v.stride(1), 1))
    bt = cu[:-1].to(torch.int32).reshape(-1, 1).contiguous()
    lens = (cu[1:] - cu[:-1]).to(torch.int32)
    return _launch(q, kp, vp, bt, cu, lens, scale, maxlen, at.VARLEN_PAGE_SIZE, cfg,
                   kv_tma=cfg.get("tma", False))


def _ndiff(a, b):
    return int((a.contiguous().view(torch.int16) != b.contiguous().view(torch.int16)).sum())


def _paged_case(lens_l, hkv, d, g):
    """Random paged K/V for sequences of ``lens_l`` tokens (pages of PAGE, a random page table):
    (k cache, v cache, block table, context lengths, cu_seqlens)."""
    b = len(lens_l)
    max_pages = max(-(-n // PAGE) for n in lens_l)
    pages = b * max_pages
    kc = torch.randn(pages, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(pages, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = torch.randperm(pages, device="cuda", generator=g).to(torch.int32).view(b, max_pages)
    lens = torch.tensor(lens_l, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0] + lens_l, device="cuda").cumsum(0).to(torch.int32)
    return kc, vc, bt, lens, cu


def _decode_case(b, ctx, hkv, d):
    """Paged K/V of b sequences of ctx tokens each for a decode timing: (k cache, v cache, block
    table, context lengths, the decode cu_seqlens)."""
    pages = b * ctx // PAGE
    kc = torch.randn(pages, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.randperm(pages, device="cuda").to(torch.int32).view(b, ctx // PAGE)
    lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    cu = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    return kc, vc, bt, lens, cu


def invariance(cfg, hq, hkv, d, pinned):
    """Differing elements: decode vs prefill last row, chunked vs one-shot prefill, varlen vs paged,
    and across tiles: decode and paged prefill with the pinned tile vs this candidate's prefill
    (a candidate could serve prefill beside the pinned decode tile only if both are 0)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    lens_l = [1, 63, 64, 65, 200, 517, 1000]
    b = len(lens_l)
    scale = d ** -0.5
    kc, vc, bt, lens, cu = _paged_case(lens_l, hkv, d, g)
    t = int(cu[-1])
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    one, _ = _launch(q, kc, vc, bt, cu, lens, scale, max(lens_l), PAGE, cfg)
    # decode: the last query of each sequence alone
    last = cu[1:].long() - 1
    dec, _ = _launch(q[last].contiguous(), kc, vc, bt, torch.arange(b + 1, device="cuda", dtype=torch.int32),
                     lens, scale, 1, PAGE, cfg)
    d_dec = _ndiff(dec, one[last])
    # chunked prefill: chunks of 97 queries, each over the keys up to its end
    d_chunk = 0
    for s in range(b):
        n = lens_l[s]
        for c0 in range(0, n, 97):
            c1 = min(n, c0 + 97)
            rows = slice(int(cu[s]) + c0, int(cu[s]) + c1)
            out, _ = _launch(q[rows].contiguous(), kc, vc, bt[s:s + 1],
                             torch.tensor([0, c1 - c0], device="cuda", dtype=torch.int32),
                             torch.tensor([c1], device="cuda", dtype=torch.int32), scale, c1 - c0, PAGE, cfg)
            d_chunk += _ndiff(out, one[rows])
    # varlen (packed K/V) vs paged
    pos = torch.cat([torch.arange(n, device="cuda") for n in lens_l])
    seq = torch.repeat_interleave(torch.arange(b, device="cuda"), torch.tensor(lens_l, device="cuda"))
    slot = bt[seq, pos // PAGE].long() * PAGE + pos % PAGE
    kf = kc.view(-1, hkv, d)[slot].contiguous()
    vf = vc.view(-1, hkv, d)[slot].contiguous()
    var, _ = _varlen(q, kf, vf, cu, max(lens_l), scale, cfg)
    dec_pinned, _ = _launch(q[last].contiguous(), kc, vc, bt, torch.arange(b + 1, device="cuda", dtype=torch.int32),
                            lens, scale, 1, PAGE, pinned)
    one_pinned, _ = _launch(q, kc, vc, bt, cu, lens, scale, max(lens_l), PAGE, pinned)
    return {"decode_vs_prefill": d_dec, "chunked_vs_oneshot": d_chunk, "varlen_vs_paged": _ndiff(var, one),
            "pinned_decode_vs_prefill": _ndiff(dec_pinned, one[last]),
            "pinned_prefill_vs_prefill": _ndiff(one_pinned, one)}


def timings(cfg, hq, hkv, d, with_baseline):
    scale = d ** -0.5
    res = []
    for b, s in PREFILL:
        qs = [torch.randn(b * s, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        ks = [torch.randn(b * s, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        vs = [torch.randn(b * s, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
        i = {"i": 0}

        def nxt():
            i["i"] = (i["i"] + 1) % 3
            return qs[i["i"]], ks[i["i"]], vs[i["i"]]

        ours = time_ms(lambda: _varlen(*nxt(), cu, s, scale, cfg), "cuda")
        r = {"stage": "prefill", "batch": b, "seqlen": s, "ours_ms": round(ours, 5)}
        if with_baseline:
            def sdpa():
                q, k, v = nxt()
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return F.scaled_dot_product_attention(q.view(b, s, hq, d).transpose(1, 2),
                                                          k.view(b, s, hkv, d).transpose(1, 2),
                                                          v.view(b, s, hkv, d).transpose(1, 2),
                                                          is_causal=True, scale=scale, enable_gqa=True)
            r["sdpa_ms"] = round(time_ms(sdpa, "cuda"), 5)
        res.append(r)
    for b, ctx in DECODE:
        kc, vc, bt, lens, cu = _decode_case(b, ctx, hkv, d)
        qs = [torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        i = {"i": 0}

        def nq():
            i["i"] = (i["i"] + 1) % 3
            return qs[i["i"]]

        ours = time_ms(lambda: _launch(nq(), kc, vc, bt, cu, lens, scale, 1, PAGE, cfg), "cuda-graph")
        r = {"stage": "decode", "batch": b, "context": ctx, "ours_ms": round(ours, 5)}
        if with_baseline:
            kd = kc[bt.long()].reshape(b, ctx, hkv, d).transpose(1, 2).contiguous()
            vd = vc[bt.long()].reshape(b, ctx, hkv, d).transpose(1, 2).contiguous()

            def sdpa_dec():
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return F.scaled_dot_product_attention(nq()[:, :, None], kd, vd, scale=scale, enable_gqa=True)
            r["sdpa_ms"] = round(time_ms(sdpa_dec, "cuda-graph"), 5)
        res.append(r)
    return res


def backward_timings(hq, hkv, d):
    """fwd+bwd of the trainer's varlen attention with the backward's loads through TMA
    descriptors vs pointer loads, and SDPA flash fwd+bwd, same inputs (ms)."""
    scale = d ** -0.5
    res = []
    for b, s in PREFILL[:2]:
        q, k, v = (torch.randn(b * s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for h in (hq, hkv, hkv))
        dout = torch.randn(b * s, hq, d, device="cuda", dtype=torch.bfloat16)
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
        row = {"batch": b, "seqlen": s}
        with torch.no_grad():
            out, lse = at.varlen_attention_triton(q, k, v, cu, s, scale)
        for tma in (False, True):
            def ours():
                at.varlen_attention_triton(q, k, v, cu, s, scale)
                return at.varlen_attention_backward_triton(q, k, v, out, lse, dout, cu, s, scale, True,
                                                           _tma=(tma, tma))
            row[f"ours_{'tma' if tma else 'pointer'}_ms"] = round(time_ms(ours, "cuda"), 5)

        def sdpa():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                o = F.scaled_dot_product_attention(q.view(b, s, hq, d).transpose(1, 2), k.view(b, s, hkv, d).transpose(1, 2),
                                                   v.view(b, s, hkv, d).transpose(1, 2), is_causal=True, scale=scale,
                                                   enable_gqa=True)
            return torch.autograd.grad(o, (q, k, v), dout.view(b, s, hq, d).transpose(1, 2))
        row["sdpa_ms"] = round(time_ms(sdpa, "cuda"), 5)
        row.update({f"ratio_{n}": round(row["sdpa_ms"] / row[f"ours_{n}_ms"], 4) for n in ("pointer", "tma")})
        res.append(row)
    return res


def decode_tile_invariance(cand, pinned, hq, hkv, d, seeds=(0, 1, 2)) -> dict:
    """Differing elements between the candidate tile's decode rows and the pinned tile's prefill
    rows at the same positions: one-shot prefill's last row of each sequence, and every row of a
    prefill chunked into 97-query pieces decoded one query at a time for one sequence."""
    lens_l = [1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 200, 517, 1000, 2049, 5000]
    scale = d ** -0.5
    out = {"decode_vs_pinned_prefill": 0, "decode_steps_vs_pinned_prefill": 0, "elements": 0}
    for seed in seeds:
        g = torch.Generator(device="cuda").manual_seed(seed)
        b = len(lens_l)
        kc, vc, bt, lens, cu = _paged_case(lens_l, hkv, d, g)
        q = torch.randn(int(cu[-1]), hq, d, device="cuda", dtype=torch.bfloat16, generator=g) * (1 + seed)
        one, _ = _launch(q, kc, vc, bt, cu, lens, scale, max(lens_l), PAGE, pinned)
        last = cu[1:].long() - 1
        ar = torch.arange(b + 1, device="cuda", dtype=torch.int32)
        dec, _ = _launch(q[last].contiguous(), kc, vc, bt, ar, lens, scale, 1, PAGE, cand)
        out["decode_vs_pinned_prefill"] += _ndiff(dec, one[last])
        out["elements"] += dec.numel()
        # every position of one 517-token sequence as a decode step (context = position + 1)
        s = lens_l.index(517)
        n = lens_l[s]
        rows = torch.arange(int(cu[s]), int(cu[s]) + n, device="cuda")
        steps, _ = _launch(q[rows].contiguous(), kc, vc, bt[s:s + 1].expand(n, -1).contiguous(),
                           torch.arange(n + 1, device="cuda", dtype=torch.int32),
                           torch.arange(1, n + 1, device="cuda", dtype=torch.int32), scale, 1, PAGE, cand)
        out["decode_steps_vs_pinned_prefill"] += _ndiff(steps, one[rows])
        out["elements"] += steps.numel()
    return out


def decode_tile_timings(cfg, hq, hkv, d) -> list[dict]:
    scale = d ** -0.5
    res = []
    for b, ctx in DECODE_SHAPES:
        kc, vc, bt, lens, cu = _decode_case(b, ctx, hkv, d)
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        ms = time_ms(lambda: _launch(q, kc, vc, bt, cu, lens, scale, 1, PAGE, cfg), "cuda-graph")
        kv_bytes = 2 * b * ctx * hkv * d * 2
        res.append({"batch": b, "context": ctx, "ms": round(ms, 5), "kv_tb_s": round(kv_bytes / ms / 1e9, 3)})
    return res


def decode_tiles(out_path: str) -> None:
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "heads": {}}
    with torch.no_grad():
        for name, hq, hkv, d in DECODE_HEADS:
            pinned = {**at.tile_config(d), "fp_fusion": False, "tma": False}
            base = decode_tile_timings(pinned, hq, hkv, d)
            print(f"{name} pinned {pinned}: " + " ".join(f"{r['batch']}x{r['context']}:{r['ms']:.4f}ms"
                                                         f"({r['kv_tb_s']}TB/s)" for r in base), flush=True)
            rows = []
            for cand in DECODE_TILES:
                t0 = time.time()
                try:
                    inv = decode_tile_invariance(cand, pinned, hq, hkv, d)
                    tm = decode_tile_timings(cand, hq, hkv, d)
                except Exception as e:  # noqa: BLE001 - a candidate that does not compile is reported
                    print(f"{name} {cand} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    rows.append({"cfg": cand, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    continue
                for r, r0 in zip(tm, base):
                    r["speedup_vs_pinned"] = round(r0["ms"] / r["ms"], 4)
                rows.append({"cfg": cand, "invariance": inv, "timings": tm})
                print(f"{name} {cand} inv={inv} " + " ".join(
                    f"{r['batch']}x{r['context']}:{r['ms']:.4f}ms x{r['speedup_vs_pinned']:.2f}" for r in tm)
                    + f" ({time.time() - t0:.0f}s)", flush=True)
            results["heads"][name] = {"hq": hq, "hkv": hkv, "d": d, "pinned": pinned, "pinned_timings": base,
                                      "rows": rows}
            with open(out_path, "w") as f:   # after every head shape: a cut-short run keeps the finished ones
                json.dump(results, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--head-dim", type=int, default=128, choices=(128, 256))
    ap.add_argument("--decode-tiles", action="store_true",
                    help="only the decode-tile question (module docstring): candidate decode tiles vs the pinned prefill")
    args = ap.parse_args()
    if args.decode_tiles:
        decode_tiles(args.out)
        return
    global HEADS, CANDIDATES
    if args.head_dim == 256:
        HEADS, CANDIDATES = HEADS_256, CANDIDATES_256
    current = {**at.tile_config(args.head_dim), "fp_fusion": False, "tma": True}   # the product's varlen path
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "current": current,
               "heads": {}}
    with torch.no_grad():
        for name, hq, hkv, d in HEADS:
            rows = []
            base = None
            for cfg in [current] + CANDIDATES:
                t0 = time.time()
                try:
                    inv = invariance(cfg, hq, hkv, d, current)
                    tm = timings(cfg, hq, hkv, d, with_baseline=base is None)
                except Exception as e:  # noqa: BLE001 - a candidate that does not compile is reported
                    print(f"{name} {cfg} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    rows.append({"cfg": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    continue
                if base is None:
                    base = {(r["stage"], r.get("seqlen", r.get("context")), r["batch"]): r["sdpa_ms"] for r in tm}
                for r in tm:
                    r["ratio_vs_sdpa"] = round(base[(r["stage"], r.get("seqlen", r.get("context")), r["batch"])]
                                               / r["ours_ms"], 4)
                rows.append({"cfg": cfg, "invariance": inv, "timings": tm, "schedule_change": cfg["BLOCK_N"] != 64})
                summary = " ".join(f"{r['stage'][0]}{r['batch']}x{r.get('seqlen', r.get('context'))}:{r['ratio_vs_sdpa']:.2f}"
                                   for r in tm)
                print(f"{name} {cfg} inv={inv} {summary} ({time.time() - t0:.0f}s)", flush=True)
            results["heads"][name] = {"hq": hq, "hkv": hkv, "d": d, "sdpa_ms": {str(k): v for k, v in base.items()},
                                      "rows": rows}
    for name, hq, hkv, d in HEADS:
        results["heads"][name]["backward"] = bwd = backward_timings(hq, hkv, d)
        print(f"{name} fwd+bwd vs SDPA flash: " + " ".join(
            f"{r['batch']}x{r['seqlen']}: pointer {r['ratio_pointer']:.2f} tma {r['ratio_tma']:.2f}" for r in bwd), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
