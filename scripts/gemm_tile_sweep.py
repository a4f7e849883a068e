"""Tile sweep for the invariant GEMM on a GPU (a tuning tool, not a benchmark of record).

For each dense-family projection shape and M, times every candidate launch (kernel path, BLOCK_M,
BLOCK_N, warps, stages, warp specialisation) of ``isoexec_kernels.gemm.linear_triton`` and cuBLAS
as CUDA-graph replays, checks that every candidate gives the same bits as the current table's
choice (BLOCK_K and the K order never change, so they must), and writes one JSON with every
timing and the best candidate per (shape, M). Usage on the GPU machine:

    python3 scripts/gemm_tile_sweep.py --out $OUT/gemm_sweep.json [--small] [--large]
    python3 scripts/gemm_tile_sweep.py --out $OUT/gemm_leaves.json --leaves
    python3 scripts/gemm_tile_sweep.py --out $OUT/gemm_walk.json --leafwalk     # or --occupancy
    python3 scripts/gemm_tile_sweep.py --out $OUT/gemm_block_k.json --block-k   # K tiles 64/128/256, ~1 min
    python3 scripts/gemm_tile_sweep.py --out $OUT/gemm_block_k.json --block-k-all   # every small-M row

``--leaves`` sweeps the K-leaf count of the small-N shapes instead (1, 2, 4, 8 leaves; split-K
tiles at M <= 256, the one-program leaf walk above): each leaf count has its own bits, so the
candidates are compared with the leaf walk of the same count, and the count to pin per shape is
the one whose worst M is best.

``--block-k`` times K tiles of 128 (and 256 at M <= 256) against BLOCK_K 64 (pinned in the contract)
at the latency-bound small-M rows (``--block-k-all``: every small-M row), and reports whether each
candidate still gives the bits of the table's tile at a K tile of 64 (see ``sweep_block_k`` and
``isoexec_kernels.gemm.triton_kernels.k_tile_for``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from isoexec.bench.common import graph_time_ms
from isoexec.envinfo import git_commit
from isoexec_kernels.gemm import k_leaves_for, linear_triton, tile_for_m

LARGE_SHAPES = [("0.6b.o", 2048, 1024), ("0.6b.down", 3072, 1024), ("0.6b.qkv", 1024, 4096),
                ("0.6b.gate_up", 1024, 6144)]
SMALL_SHAPES = LARGE_SHAPES + [("8b.qkv", 4096, 6144), ("8b.o", 4096, 4096), ("8b.gate_up", 4096, 24576),
                               ("8b.down", 12288, 4096)]
LARGE_M = [2048, 4096, 8192]
SMALL_M = [1, 16, 64, 256]


def _cfg(path, bm, bn, warps, stages, ws=False):
    return dict(path=path, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, warp_specialize=ws)


LARGE_CANDIDATES = [_cfg("tma", bm, bn, w, s, ws)
                    for bm, bn, w in ((64, 128, 4), (128, 64, 4), (128, 128, 4), (128, 128, 8), (64, 256, 8),
                                      (128, 256, 8), (64, 64, 4))
                    for s in (3, 4) for ws in (False, True)]
SMALL_CANDIDATES = ([_cfg("pointer", bm, bn, w, s) for bm, bn, w, s in
                     ((16, 32, 4, 4), (16, 64, 4, 6), (16, 128, 4, 4), (32, 32, 4, 4), (32, 64, 4, 4),
                      (64, 32, 4, 8), (64, 64, 4, 4), (64, 128, 4, 4), (16, 16, 2, 6))]
                    + [_cfg("tma", bm, bn, w, s) for bm, bn, w, s in
                       ((64, 32, 4, 8), (64, 64, 4, 4), (64, 128, 4, 4), (128, 128, 8, 4))])


def _bits(t):
    return t.contiguous().view(torch.int16)


def _cycle(xs):
    """The inputs in turn (repeated calls do not just hit L2)."""
    it = {"i": 0}

    def nxt():
        it["i"] = (it["i"] + 1) % len(xs)
        return xs[it["i"]]

    return nxt


def _row(M, N, K, w):
    """One (shape, M) row's inputs (four, cycled), the table's bits and tile, and cuBLAS's time."""
    xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    nxt = _cycle(xs)
    ref = linear_triton(xs[0], w)
    cublas = graph_time_ms(lambda: F.linear(nxt(), w), 60)
    return xs, nxt, ref, cublas, tile_for_m(M, torch.bfloat16, N, K)


def _time(row, xs, w, nxt, ref, cublas, leaves=None):
    """``row`` (a candidate launch: path and tile keys, maybe more) with its time, ratio to cuBLAS and
    whether it gives the reference bits, or the error of a candidate that does not fit."""
    tile = {k: v for k, v in row.items() if k not in ("path", "BLOCK_K", "table")}
    if "BLOCK_K" in row:   # the --block-k modes: the K tile of the launch
        tile["K_TILE"] = row["BLOCK_K"]
    try:
        got = linear_triton(xs[0], w, impl=row["path"], tile=tile, leaves=leaves)
        same = bool(torch.equal(_bits(got), _bits(ref)))
        ms_ = graph_time_ms(lambda: linear_triton(nxt(), w, impl=row["path"], tile=tile, leaves=leaves), 60)
    except Exception as exc:  # noqa: BLE001 - a candidate may not fit (shared memory, registers)
        return {**row, "error": f"{type(exc).__name__}: {str(exc)[:120]}"}
    return {**row, "ms": round(ms_, 5), "ratio": round(cublas / ms_, 4), "same_bits": same}


def sweep(shapes, ms, candidates, log, only=None):
    """Every candidate at every (shape, M); ``only``: a set of (name, M) to restrict it to."""
    out = []
    for name, K, N in shapes:
        if only is not None and not any(n == name for n, _ in only):
            continue
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        for M in ms:
            if only is not None and (name, M) not in only:
                continue
            with torch.no_grad():
                xs, nxt, ref, cublas, current = _row(M, N, K, w)
                rows = [_time(dict(c), xs, w, nxt, ref, cublas) for c in candidates]
                ok = [r for r in rows if "ms" in r]
                best = min(ok, key=lambda r: r["ms"]) if ok else None
                cur = next((r for r in ok if all(r[k] == current[k] for k in current if k in r)), None)
                out.append({"shape": name, "M": M, "K": K, "N": N, "cublas_ms": round(cublas, 5), "current": current,
                            "current_ratio": cur["ratio"] if cur else None, "best": best, "candidates": rows,
                            "all_same_bits": all(r["same_bits"] for r in ok)})
                log(f"{name:<13} M={M:<5} cublas {cublas * 1000:7.1f} us  current "
                    f"{(cur['ratio'] if cur else float('nan')):.3f}  best {best['ratio'] if best else float('nan'):.3f} "
                    f"{ {k: best[k] for k in ('path', 'BLOCK_M', 'BLOCK_N', 'num_warps', 'num_stages', 'warp_specialize', 'programs_per_sm') if k in best} if best else ''}"
                    f"  bits {'same' if out[-1]['all_same_bits'] else 'DIFFER'}")
    return out


LEAF_SHAPES = [("0.6b.o", 2048, 1024), ("0.6b.down", 3072, 1024), ("8b.o", 4096, 4096), ("8b.down", 12288, 4096)]
LEAF_COUNTS = (1, 2, 4, 8)
LEAF_M = [1, 64, 256, 2048, 8192]
LEAF_SMALL = [_cfg("split", bm, bn, 4, 4) for bm, bn in ((16, 32), (16, 64), (64, 32), (64, 64), (64, 128))]
LEAF_LARGE = [_cfg("tma", 128, 128, 8, 4), _cfg("tma", 64, 128, 4, 4), _cfg("tma", 128, 128, 4, 4),
              _cfg("tma", 128, 256, 8, 3)]


# --occupancy: the persistent TMA kernel with 2 or 3 programs per SM (small tiles sharing an SM),
# against the table's entry, at the sizes where one program per SM leaves cuBLAS ahead
OCC_SHAPES = [("0.6b.o", 2048, 1024), ("0.6b.down", 3072, 1024), ("0.6b.gate_up", 1024, 6144),
              ("0.6b.qkv", 1024, 4096), ("8b.o", 4096, 4096)]
OCC_M = [64, 256, 2048]
OCC_CANDIDATES = [dict(_cfg("tma", bm, bn, w, s), programs_per_sm=k)
                  for bm, bn, w, s in ((64, 32, 4, 8), (64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4),
                                       (128, 128, 4, 4), (128, 128, 8, 4))
                  for k in (1, 2, 3)]


# --leafwalk: register leaf-walk tiles with one fp32 tile per 64 registers a thread or fewer for
# both accumulators (64 x 256 over 8 warps), against the 128 x 128 walk and the one-leaf table
WALK_SHAPES = [("0.6b.o", 2048, 1024), ("0.6b.down", 3072, 1024), ("8b.o", 4096, 4096), ("8b.down", 12288, 4096)]
WALK_M = [2048, 8192]
WALK_COUNTS = (1, 4)   # one leaf (the plain table) and the K_LEAVES isoexec_tp4 pins
WALK_LARGE = [_cfg("tma", 64, 256, 8, 3), _cfg("tma", 64, 256, 8, 4), _cfg("tma", 128, 128, 8, 3, True),
              _cfg("tma", 128, 128, 8, 4, True), _cfg("tma", 256, 64, 8, 3)]
# K tiles of 128 in the walk (one tl.dot over two blocks: half the loop trips, the pipeline refilled
# half as often at each leaf start; k_tile_for keeps them only where the leaves start on a K tile)
WALK_K_TILE = [dict(_cfg("tma", 128, 128, 8, 3), K_TILE=128), dict(_cfg("tma", 64, 256, 8, 2), K_TILE=128)]
# the TMA kernel walks (tile, leaf) items by default where the leaves are even (LEAF_MAJOR, one
# flattened pipelined loop); the loop per leaf (leaf_major False) and deeper pipelines against it
WALK_LEAF_MAJOR = [dict(_cfg("tma", 128, 128, 8, 4), leaf_major=False), _cfg("tma", 128, 128, 8, 5),
                   _cfg("tma", 128, 128, 4, 5), _cfg("tma", 64, 256, 8, 5)]


# --leaves-small: the walk of the pinned leaves at the M of decode and prefill batches (the split-K
# programs, the leaf-major TMA walk with small tiles, pointer walks) against the one-leaf table
SMALL_WALK_M = [64, 256, 1024]
SMALL_WALK = [_cfg("tma", 64, 128, 4, 4), dict(_cfg("tma", 64, 128, 4, 3), K_TILE=128), _cfg("tma", 64, 64, 4, 4),
              dict(_cfg("tma", 128, 128, 8, 3), K_TILE=128), _cfg("tma", 64, 256, 8, 4),
              dict(_cfg("pointer", 64, 64, 4, 4), K_TILE=128), dict(_cfg("pointer", 64, 32, 4, 4), K_TILE=128),
              _cfg("split", 64, 128, 4, 3), _cfg("split", 128, 128, 8, 3)]


def sweep_leaves(log, shapes=LEAF_SHAPES, ms=LEAF_M, counts=LEAF_COUNTS, extra_large=()):
    out = []
    for name, K, N in shapes:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        for M in ms:
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
            nxt = _cycle(xs)

            with torch.no_grad():
                cublas = graph_time_ms(lambda: F.linear(nxt(), w), 60)
                for leaves in counts:
                    # K_TILE 64 named: a tile override keeps the table entry's other keys, and the
                    # one-leaf entries at M <= 256 take K tiles of 128 / 256 (no 4-stage fit here)
                    walk = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, K_TILE=64)
                    ref = linear_triton(xs[0], w, impl="tma", tile=walk, leaves=leaves)
                    cands = (LEAF_SMALL if M <= 256 and leaves > 1 else []) + LEAF_LARGE + list(extra_large)
                    if leaves == 1:   # the shape's own entry of the tile table (the plain invariant GEMM)
                        cands = cands + [tile_for_m(M, torch.bfloat16, N, K)]
                    if M <= 256:
                        cands = cands + [dict(tile_for_m(M, torch.bfloat16, 1, 1), path="pointer")]
                    rows = [_time(dict(c), xs, w, nxt, ref, cublas, leaves=leaves) for c in cands]
                    ok = [r for r in rows if "ms" in r]
                    best = max(ok, key=lambda r: r["ratio"]) if ok else None
                    out.append({"shape": name, "M": M, "K": K, "N": N, "leaves": leaves, "cublas_ms": round(cublas, 5),
                                "best": best, "candidates": rows, "all_same_bits": all(r["same_bits"] for r in ok),
                                "pinned_leaves": k_leaves_for(N, K)})
                    log(f"{name:<10} M={M:<5} leaves={leaves} cublas {cublas * 1000:7.1f} us  best "
                        f"{best['ratio'] if best else float('nan'):.3f} "
                        f"{ {k: best[k] for k in ('path', 'BLOCK_M', 'BLOCK_N', 'num_warps', 'num_stages')} if best else ''}"
                        f"  bits {'same' if out[-1]['all_same_bits'] else 'DIFFER'}")
    summary = {}
    for name, K, N in shapes:
        for leaves in counts:
            r = [o["best"]["ratio"] for o in out if o["shape"] == name and o["leaves"] == leaves and o["best"]]
            # against the one-leaf table entry of the same (shape, M): the plain invariant GEMM
            vs = [round(_table_ms(out, name, o["M"]) / o["best"]["ms"], 4) for o in out
                  if o["shape"] == name and o["leaves"] == leaves and o["best"] and _table_ms(out, name, o["M"])]
            summary[f"{name} leaves={leaves}"] = {"worst": min(r), "by_M": r, "vs_one_leaf_table": vs} if r else None
            log(f"summary {name:<10} leaves={leaves}: worst {min(r) if r else float('nan'):.3f} by M {r}; "
                f"vs the one-leaf table {vs}")
    return out, summary


def _table_ms(out, name, M):
    """The time of the one-leaf row's table entry (the tile_for_m launch) at (shape, M), or None."""
    for o in out:
        if o["shape"] == name and o["M"] == M and o["leaves"] == 1:
            table = tile_for_m(M, torch.bfloat16, o["N"], o["K"])
            for c in o["candidates"]:
                if "ms" in c and all(c.get(k) == v for k, v in table.items() if k not in ("K_TILE",)) \
                        and c.get("K_TILE", 64) == table.get("K_TILE", 64):
                    return c["ms"]
    return None


# --block-k: K tiles of 128/256 against the pinned BLOCK_K of 64 (the tile key ``K_TILE``, see
# ``k_tile_for``). Hopper's wgmma chains its k16 steps into one fp32 accumulator in K order, so a longer
# K tile may give the same bits while halving the K loop's trips, which is what the latency-bound
# small-M rows (0.62-0.68x cuBLAS) pay for; two large-M rows are the control. Rows are (name, M, K, N).
# ``--block-k-all`` takes every small-M row of the --small sweep instead (M 1, 16, 64, 256 of the eight
# dense-family shapes), to pick K_TILE for each bucket entry of the table.
BLOCK_K_SHAPES = [("0.6b.gate_up", 256, 1024, 6144), ("0.6b.down", 256, 3072, 1024), ("8b.o", 64, 4096, 4096),
                  ("0.6b.down", 64, 3072, 1024), ("8b.o", 256, 4096, 4096), ("0.6b.gate_up", 64, 1024, 6144),
                  ("0.6b.o", 2048, 2048, 1024), ("0.6b.gate_up", 4096, 1024, 6144)]
BLOCK_K_ALL_SHAPES = [(name, M, K, N) for name, K, N in SMALL_SHAPES for M in SMALL_M]
BLOCK_K_SMALL = (64, 128, 256)
BLOCK_K_LARGE = (64, 128)   # at 256 one stage of a large tile is 128-192 KiB: no pipeline fits
# the best launches of the --small / --large sweeps (with the table's own entry), by M range
BLOCK_K_TINY_TILES = [_cfg("pointer", 16, 32, 4, 4), _cfg("pointer", 16, 64, 4, 6), _cfg("pointer", 16, 16, 2, 6),
                      _cfg("pointer", 64, 32, 4, 8)]
BLOCK_K_SMALL_TILES = [_cfg("pointer", 64, 32, 4, 8), _cfg("pointer", 64, 64, 4, 4), _cfg("tma", 64, 32, 4, 8),
                       _cfg("tma", 128, 128, 8, 4), _cfg("pointer", 64, 128, 4, 4), _cfg("tma", 128, 64, 4, 4),
                       _cfg("pointer", 16, 32, 4, 4)]
BLOCK_K_LARGE_TILES = [_cfg("tma", 128, 256, 8, 3, True)]
# --wide adds these at M <= 256 (for the rows --rows names: the entries no tile has lifted yet, such as
# 0.6B gate_up at M = 256, 0.69x): wider N tiles, 8 warps, warp specialisation, other pipeline depths
BLOCK_K_WIDE_TILES = [_cfg("tma", 64, 128, 4, 4), _cfg("tma", 64, 256, 8, 3), _cfg("pointer", 64, 128, 8, 4),
                      _cfg("pointer", 128, 64, 8, 4), _cfg("tma", 128, 128, 8, 3, True), _cfg("tma", 64, 128, 4, 4, True),
                      _cfg("pointer", 32, 128, 4, 4), _cfg("pointer", 32, 64, 4, 4), _cfg("pointer", 64, 64, 4, 3),
                      _cfg("pointer", 64, 64, 8, 4), _cfg("pointer", 128, 128, 8, 3)]
SMEM_FALLBACK = 232448   # sm90's opt-in shared memory per block (227 KiB), for a torch that does not say


def block_k_tiles(M, N, K, wide=False):
    """The table's entry for (M, N, K) (its own K tile dropped) first, then the picks of the M range
    it is not already."""
    cur = {k: v for k, v in tile_for_m(M, torch.bfloat16, N, K).items() if k != "K_TILE"}
    picks = BLOCK_K_TINY_TILES if M <= 16 else BLOCK_K_SMALL_TILES if M <= 256 else BLOCK_K_LARGE_TILES
    if wide and M <= 256:
        picks = picks + [c for c in BLOCK_K_WIDE_TILES if c not in picks]
    return [cur] + [c for c in picks if c != cur]


def stage_variants(c, bk):
    """``c`` and, at BLOCK_K > 64, ``c`` with num_stages halved: each stage holds a BLOCK_K slice of the
    x and w tiles, so the stage count that fit at 64 needs twice (four times) the shared memory."""
    half = max(2, c["num_stages"] // 2)
    return [c] if bk == 64 or half == c["num_stages"] else [c, dict(c, num_stages=half)]


def smem_floor(c, bk):
    """Shared memory the K pipeline needs at the least: num_stages - 1 bf16 slices of x and w (the
    kernels hold at least that many; the TMA epilogue adds its output tile)."""
    return (c["num_stages"] - 1) * (c["BLOCK_M"] + c["BLOCK_N"]) * bk * 2


def _smem_limit():
    props = torch.cuda.get_device_properties(0)
    return int(getattr(props, "shared_memory_per_block_optin", SMEM_FALLBACK))


def _time_candidate(c, bk, xs, w, nxt, ref, cublas, smem):
    """One candidate as ``sweep`` times it (K tile ``bk``), or why it did not run: skipped
    when even its least shared memory is over the SM's (compiling it would only waste the budget)."""
    row = {**c, "BLOCK_K": bk}
    if smem_floor(c, bk) > smem:
        return {**row, "skipped": f"shared memory >= {smem_floor(c, bk)} B > {smem} B"}
    return _time(row, xs, w, nxt, ref, cublas)


def sweep_block_k(log, shapes=BLOCK_K_SHAPES, on_row=None, wide=False):
    """Per row: cuBLAS, then each K tile x tile x stage count, then the table's own launch; the
    reference bits are the table's tile with a K tile of 64 (the contract's BLOCK_K), so ``same_bits``
    says whether that K tile keeps the schedule. ``on_row(rows so far)`` after each row (the caller
    saves them, so a run cut by its time limit keeps what it measured)."""
    out = []
    smem = _smem_limit()
    for name, M, K, N in shapes:
        t0 = time.time()
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        with torch.no_grad():
            xs, nxt, _, cublas, table_tile = _row(M, N, K, w)
            current = {k: v for k, v in table_tile.items() if k != "K_TILE"}
            ref = linear_triton(xs[0], w, tile={"K_TILE": 64})
            rows = [_time_candidate(v, bk, xs, w, nxt, ref, cublas, smem)
                    for bk in (BLOCK_K_SMALL if M <= 256 else BLOCK_K_LARGE)
                    for c in block_k_tiles(M, N, K, wide) for v in stage_variants(c, bk)]
            table = _time({**table_tile, "table": True}, xs, w, nxt, ref, cublas)
        by_bk = {}
        for bk in sorted({r["BLOCK_K"] for r in rows}):
            ok = [r for r in rows if r["BLOCK_K"] == bk and "ms" in r]
            by_bk[str(bk)] = {"best": max(ok, key=lambda r: r["ratio"]) if ok else None, "ran": len(ok),
                              "all_same_bits": all(r["same_bits"] for r in ok)}
        cur = next((r for r in rows if r["BLOCK_K"] == 64 and "ms" in r and all(r[k] == current[k] for k in current)),
                   None)
        out.append({"shape": name, "M": M, "K": K, "N": N, "cublas_ms": round(cublas, 5), "current": current,
                    "current_ratio": cur["ratio"] if cur else None, "table": table, "by_block_k": by_bk,
                    "candidates": rows, "all_same_bits": all(r["same_bits"] for r in rows + [table] if "ms" in r),
                    "seconds": round(time.time() - t0, 1)})
        if on_row is not None:
            on_row(out)
        per_bk = "  ".join(f"bk{bk} {b['best']['ratio'] if b['best'] else float('nan'):.3f} "
                           f"{'same' if b['all_same_bits'] else 'DIFFER'}" for bk, b in by_bk.items())
        log(f"{name:<13} M={M:<5} K={K:<5} N={N:<5} cublas {cublas * 1000:7.1f} us  current "
            f"{(cur['ratio'] if cur else float('nan')):.3f}  table {table.get('ratio', float('nan')):.3f}  "
            f"best {per_bk}  {out[-1]['seconds']:.1f} s")
    return out


def select_rows(shapes, spec):
    """The rows of ``shapes`` that ``spec`` ("name:M,name:M", empty: all) names; an unknown name
    stops the run before any GPU work (a typo must not sweep nothing for minutes)."""
    if not spec:
        return shapes
    want = []
    for item in spec.split(","):
        name, _, m = item.strip().partition(":")
        if not m.isdigit():
            raise SystemExit(f"--rows: expected name:M, got {item.strip()!r}")
        want.append((name, int(m)))
    known = {(name, M) for name, M, _, _ in shapes}
    missing = [f"{n}:{m}" for n, m in want if (n, m) not in known]
    if missing:
        raise SystemExit(f"--rows: no such row {', '.join(missing)} (rows: "
                         f"{', '.join(sorted({n for n, _, _, _ in shapes}))} at M {sorted({M for _, M, _, _ in shapes})})")
    return [r for r in shapes if (r[0], r[1]) in set(want)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--large", action="store_true")
    ap.add_argument("--leaves", action="store_true")
    ap.add_argument("--occupancy", action="store_true")
    ap.add_argument("--leafwalk", action="store_true")
    ap.add_argument("--leaves-small", action="store_true", help="the pinned leaves' walk at M 64..1024 (~3 min)")
    ap.add_argument("--block-k", action="store_true", help="K tiles 64/128/256 at the small-M rows (~1 min)")
    ap.add_argument("--block-k-all", action="store_true",
                    help="K tiles 64/128/256 at every small-M row of the eight shapes (~4 min)")
    ap.add_argument("--rows", default="", help="with --block-k-all, --large or --small: only these rows, "
                                                "e.g. 0.6b.gate_up:256,8b.down:64 or 0.6b.o:2048")
    ap.add_argument("--wide", action="store_true", help="with --block-k(-all): more tiles at M <= 256")
    a = ap.parse_args()
    both = not (a.small or a.large or a.leaves or a.occupancy or a.leafwalk or a.block_k or a.block_k_all
                or a.leaves_small)
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if a.block_k or a.block_k_all:
        res["commit"] = git_commit()

        def save(rows):
            with open(a.out, "w") as f:
                json.dump({**res, "rows": rows, "seconds": round(time.time() - t0, 1)}, f, indent=1)

        rows = select_rows(BLOCK_K_ALL_SHAPES if a.block_k_all else BLOCK_K_SHAPES, a.rows)
        res["rows"] = sweep_block_k(lambda line: print(line, flush=True), rows, save, a.wide)
    if a.leaves:
        res["leaves"], res["leaves_summary"] = sweep_leaves(print)
    if a.leafwalk:
        res["leafwalk"], res["leafwalk_summary"] = sweep_leaves(print, WALK_SHAPES, WALK_M, WALK_COUNTS,
                                                                WALK_LARGE + WALK_K_TILE + WALK_LEAF_MAJOR)
    if a.leaves_small:
        res["commit"] = git_commit()
        res["leaves_small"], res["leaves_small_summary"] = sweep_leaves(print, WALK_SHAPES, SMALL_WALK_M, WALK_COUNTS,
                                                                        SMALL_WALK)
    if a.occupancy:
        res["occupancy"] = sweep(OCC_SHAPES, OCC_M, OCC_CANDIDATES, print)
    if a.large or both:
        only = ({(n, m) for n, m, _, _ in select_rows([(n, m, K, N) for n, K, N in LARGE_SHAPES for m in LARGE_M],
                                                      a.rows)} if a.rows and not a.block_k_all else None)
        res["large"] = sweep(LARGE_SHAPES, LARGE_M, LARGE_CANDIDATES, print, only)
    if a.small or both:
        only = ({(n, m) for n, m, _, _ in select_rows([(n, m, K, N) for n, K, N in SMALL_SHAPES for m in SMALL_M],
                                                      a.rows)} if a.rows and not a.block_k_all else None)
        res["small"] = sweep(SMALL_SHAPES, SMALL_M, SMALL_CANDIDATES, print, only)
    res["seconds"] = round(time.time() - t0, 1)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {a.out} in {res['seconds']} s")


if __name__ == "__main__":
    main()
