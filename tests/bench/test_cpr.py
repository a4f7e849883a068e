"""CPR per-layer benchmark: the quick CPU run produces the BENCHMARKS.md result format with one
row per (stage, baseline)."""

import json

import pytest

from isoexec.bench.cpr import bench_cpr


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
        assert r["speed_ratio"] == pytest.approx(r["baseline_ms"] / r["ours_ms"], rel=1e-3)
        native = next(x for x in rows if x["stage"] == r["stage"] and x["baseline"] == "native_mixed")
        assert r["overhead_vs_native"] == pytest.approx(r["ours_ms"] / native["baseline_ms"], rel=1e-3)
        assert r["heads_v"] % r["heads_qk"] == 0 and r["tokens"] == r["batch"] * r["seqlen"]
