"""CPR per-layer benchmark: the quick CPU run produces the docs/benchmarks.md result format with one
row per (stage, baseline)."""

import json

from isoexec.bench.cpr import bench_cpr


def test_bench_cpr_quick_cpu_writes_result_format(ratio_of_rounded):
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
