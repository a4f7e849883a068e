"""Render benchmark result JSON (docs/benchmarks.md format) into paper_figures tables.

One markdown section per benchmark: the rows as measured (shape fields, baseline, baseline_ms,
ours_ms, speed_ratio), the measuring environment, and a one-line summary of the ratios. A CSV
holds every row of every benchmark with a ``name`` column.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Iterable

from ..paths import atomic_write
from ..report import run_cli

TIME_FIELDS = ("baseline", "baseline_ms", "ours_ms", "speed_ratio")


def load(path: str | Path) -> dict:
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    for key in ("name", "env", "rows"):
        if key not in obj:
            raise ValueError(f"{path}: not a benchmark result (no {key!r})")
    return obj


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):   # e.g. bench train's rounds_ms: "native 103.8, 112.6; isoexec 78.19, 85.35"
        return "; ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    if isinstance(v, list):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def section(obj: dict) -> list[str]:
    rows = obj["rows"]
    # rows of one benchmark may carry different shape fields (bench train's regions): union, in order
    shape_keys = list(dict.fromkeys(k for r in rows for k in r if k not in TIME_FIELDS))
    env = obj["env"]
    ratios = [r["speed_ratio"] for r in rows if isinstance(r.get("speed_ratio"), (int, float))]
    lines = [f"## {obj['name']}", "",
             f"Measured on {env.get('device', '?')} (torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, "
             f"commit {env.get('commit', '?')}, {env.get('date', '?')}). speed_ratio = baseline_ms / ours_ms "
             "(1.0 parity, 0.5 = ours twice as slow).", ""]
    if ratios:
        lines += [f"speed_ratio over {len(ratios)} rows: min {min(ratios):.3f}, median "
                  f"{sorted(ratios)[len(ratios) // 2]:.3f}, max {max(ratios):.3f}.", ""]
    header = shape_keys + list(TIME_FIELDS)
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(k, "")) for k in header) + " |")
    return lines + [""] + _profile_lines(obj.get("profile"))


def _profile_lines(prof) -> list[str]:
    """bench train's whole-step profile: per composition, host/device time and the top kernels."""
    if not isinstance(prof, dict) or not prof.get("compositions"):
        return []
    lines = [f"Profile of one trainer step ({prof.get('model', '?')}, T={prof.get('T', '?')}, torch.profiler): "
             "host = time until the last launch returned, wall = until the device finished.", "",
             "| composition | host ms | wall ms | device ms | launches | top kernels (device ms, calls) |",
             "|---|---|---|---|---|---|"]
    for comp, p in prof["compositions"].items():
        top = "; ".join(f"{k['name'][:48]} {k['total_ms']:.2f} (x{k['calls']})" for k in p.get("top", [])[:5])
        lines.append(f"| {comp} | {_fmt(p.get('host_ms'))} | {_fmt(p.get('wall_ms'))} | {_fmt(p.get('device_ms'))} | "
                     f"{_fmt(p.get('kernel_launches'))} | {top.replace('|', '/')} |")
    return lines + [""]


def write_bench_report(paths: Iterable[str | Path], md_out: str | Path, csv_out: str | Path, run: str) -> int:
    objs = [load(p) for p in paths]
    lines = [f"# Kernel benchmarks ({run})", "",
             "Ours vs the stock path, measured in the same run on the same random inputs "
             "(`isoexec bench NAME`).", ""]
    buf = io.StringIO()
    keys = ["name"]
    for o in objs:
        for r in o["rows"]:
            for k in r:
                if k not in keys:
                    keys.append(k)
    w = csv.DictWriter(buf, fieldnames=keys + ["device"])
    w.writeheader()
    for o in objs:
        lines += section(o)
        for r in o["rows"]:
            # nested values (bench train's rounds_ms) as JSON, which a CSV reader can parse back
            w.writerow({"name": o["name"], "device": o["env"].get("device", ""),
                        **{k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()}})
    atomic_write(md_out, "\n".join(lines))
    atomic_write(csv_out, buf.getvalue())
    return sum(len(o["rows"]) for o in objs)


def run_bench(name: str, out: str, device: str, quick: bool, log: str) -> None:
    """The workflow's bench job: ``isoexec bench NAME`` with its output logged."""
    with open(log, "w") as lf:
        run_cli(["bench", name, "--out", out, "--device", device, *(["--quick"] if quick else [])], lf)


def render(paths, md_out: str, csv_out: str, run: str, log: str) -> None:
    """The workflow's kernels_table job."""
    n = write_bench_report(paths, md_out, csv_out, run)
    Path(log).write_text(f"{n} benchmark rows rendered\n")


# The seed's CPR table (docs/benchmarks.md): per-layer latency relative to native mixed.
_CPR_STAGES = (("trainer_fwd_bwd", "trainer fwd+bwd"), ("prefill", "rollout prefill"), ("decode", "decode"))
_CPR_PUBLISHED = {"trainer_fwd_bwd": (1.43, 4.42), "prefill": (1.67, 4.31), "decode": (1.38, 1.00)}
# the seed's absolute times at the same shapes (H100): its native mixed (the stock chunk kernels) and
# its CPR, in ms
_CPR_PUBLISHED_MS = {"trainer_fwd_bwd": (5.177, 7.386), "prefill": (0.844, 1.412), "decode": (0.0612, 0.0846)}


def write_cpr_table(path: str | Path, md_out: str | Path, run: str) -> int:
    """``paper_figures/<run>/cpr.md`` from ``bench/cpr.json``: one row per stage, columns native
    mixed / recurrent everywhere / CPR in ms and the cost of each relative to native mixed (the
    seed's layout, its published ratios beside ours), then the seed's absolute times (H100) and
    ours against them."""
    obj = load(path)
    by = {(r["stage"], r["baseline"]): r for r in obj["rows"]}
    env = obj["env"]
    impl = next((r["impl"] for r in obj["rows"] if r.get("impl")), None)
    lines = [f"# CPR Gated DeltaNet per-layer latency ({run})", "",
             f"Measured on {env.get('device', '?')} (torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, "
             f"commit {env.get('commit', '?')}, {env.get('date', '?')}) by `isoexec bench cpr`"
             + (f", CPR = `{impl}`" if impl else "")
             + ". Cost = time / native mixed time (1.00 = parity; lower is better). Published: the seed's "
             "IsoExec CPR and recurrent-everywhere costs, and its absolute native mixed (stock chunk kernels) "
             "and CPR times on an H100; the last two columns are ours over those.", "",
             "| stage | shape | native mixed ms | recurrent everywhere ms | CPR ms | CPR cost | recurrent cost | "
             "published CPR | published recurrent | published native ms | published CPR ms | native / published "
             "| CPR / published |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    n = 0
    for stage, label in _CPR_STAGES:
        nat, rec = by.get((stage, "native_mixed")), by.get((stage, "recurrent_everywhere"))
        if nat is None or rec is None:
            continue
        ours = nat["ours_ms"]
        shape = f"{nat.get('batch', '?')}×{nat.get('seqlen', '?')}"
        pub, pub_ms = _CPR_PUBLISHED[stage], _CPR_PUBLISHED_MS[stage]
        lines.append(f"| {label} | {shape} | {_fmt(nat['baseline_ms'])} | {_fmt(rec['baseline_ms'])} | {_fmt(ours)} | "
                     f"{ours / nat['baseline_ms']:.2f}× | {rec['baseline_ms'] / nat['baseline_ms']:.2f}× | "
                     f"{pub[0]:.2f}× | {pub[1]:.2f}× | {_fmt(pub_ms[0])} | {_fmt(pub_ms[1])} | "
                     f"{nat['baseline_ms'] / pub_ms[0]:.2f}× | {ours / pub_ms[1]:.2f}× |")
        n += 1
    if n == 0:
        raise ValueError(f"{path}: no (stage, baseline) rows of the CPR benchmark")
    lines += _decode_floor_lines(by.get(("decode", "native_mixed")))
    atomic_write(md_out, "\n".join(lines) + "\n")
    return n


def _decode_floor_lines(dec: dict | None) -> list[str]:
    """The decode row's memory floor (``isoexec.bench.cpr.decode_floor``) as a paragraph under the
    table, with our times and the seed's published ones over it; nothing for a result made before
    the benchmark measured it."""
    if not dec or "cpr_state_floor_ms" not in dec:
        return []
    nf, sf, cf = dec["native_floor_ms"], dec["cpr_state_floor_ms"], dec["cpr_floor_ms"]
    pub_native, pub_cpr = _CPR_PUBLISHED_MS["decode"]
    return ["", f"Decode's memory floor, from the same run: the bytes one step must move at least once over the "
            f"copy bandwidth measured there ({dec['copy_gb_s'] / 1000:.2f} TB/s, read + write); a lower bound. "
            f"Native mixed reads and writes its running states ({_fmt(dec['native_state_bytes'] / 1e6)} MB): "
            f"floor {_fmt(nf)} ms, ours {dec['baseline_ms'] / nf:.2f}× it. CPR reads the boundary once as its "
            f"dots' operand ({_fmt(dec['cpr_state_bytes'] / 1e6)} MB, floor {_fmt(sf)} ms) and the open chunk's "
            f"rows of k, v and Vn so far ({dec['cpr_open_rows']:,} lane rows; {_fmt(dec['cpr_bytes'] / 1e6)} MB "
            f"in all): floor {_fmt(cf)} ms, ours {dec['ours_ms'] / cf:.2f}× it. The seed's published decode "
            f"times, measured on an H100 (at most 3.35 TB/s), are {pub_native / nf:.2f}× our native floor "
            f"(native, {_fmt(pub_native)} ms) and {pub_cpr / cf:.2f}× our CPR floor (CPR, {_fmt(pub_cpr)} ms)."]
