"""CPR per-layer benchmark: the quick CPU run produces the docs/benchmarks.md result format with one
row per (stage, baseline)."""

import json
import math

from isoexec.bench.cpr import bench_cpr


def ratio_of_rounded(num_ms: float, den_ms: float, ratio: float) -> bool:
    """Whether ``ratio`` (written rounded to 4 decimals) is num/den for some timings that round to
    ``num_ms`` and ``den_ms`` (written rounded to 6 decimals, isoexec.bench.common.row): the
    check allows exactly what rounding allows, so it holds whatever the timings were."""
    h, r = 0.5e-6, 0.5e-4
    lo = (num_ms - h) / (den_ms + h)
    hi = (num_ms + h) / (den_ms - h) if den_ms > h else math.inf
    return lo - r - 1e-12 <= ratio <= hi + r + 1e-12


def test_bench_cpr_quick_cpu_writes_result_format():
    res = bench_cpr(quick=True, device="cpu", log=lambda s: None)
    json.dumps(res)  # serialisable as written by the CLI
    assert res["name"] == "cpr"
    assert {"device", "torch", "triton", "transformers", "commit", "date"} <= set(res["env"])
    rows = res["rows"]
    keys = {(r["stage"], r["baseline"]) for r in rows}
    assert keys == {(s, b) for s in ("trainer_fwd_bwd", "prefill", "decode")
                    for b in ("native_mixed", "recurrent_everywhere")}
    assert len(rows) == 6
    for r in rows:
        assert r["baseline_ms"] > 0 and r["ours_ms"] > 0
        assert ratio_of_rounded(r["baseline_ms"], r["ours_ms"], r["speed_ratio"]), r
        native = next(x for x in rows if x["stage"] == r["stage"] and x["baseline"] == "native_mixed")
        assert ratio_of_rounded(r["ours_ms"], native["baseline_ms"], r["overhead_vs_native"]), (r, native)
        assert r["ours_ms"] == native["ours_ms"]  # one measurement of ours per stage
        assert r["heads_v"] % r["heads_qk"] == 0 and r["tokens"] == r["batch"] * r["seqlen"]
