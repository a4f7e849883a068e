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


def test_decode_floor_counts_the_bytes_each_step_must_move_from_the_states_dtypes_and_fill():
    import torch

    from isoexec.bench.cpr import decode_floor
    from isoexec_kernels.gdn_core import GDNState

    H, Dk, Dv = 4, 16, 8
    native = GDNState.allocate(5, H, Dk, Dv, "cpu", chunk=16)
    bf16_op = GDNState.allocate(5, H, Dk, Dv, "cpu", chunk=16, with_q=True, value_dtype=torch.bfloat16)
    fp32_op = GDNState.allocate(5, H, Dk, Dv, "cpu", chunk=16, with_q=True, value_dtype=torch.float32)
    assert bf16_op.boundary_op is not None and fp32_op.boundary_op is None
    bf16_op.fill[:4] = torch.tensor([0, 3, 15, 9], dtype=torch.int32)   # the 4th slot is no lane
    f = decode_floor(native, bf16_op, lanes=3, bandwidth=1e9)
    # native: 3 lanes' fp32 states read and written; CPR: the bf16 operand copy read once, plus the
    # open chunk's rows so far (fill + the token: 1 + 4 + 16) of fp32 k, bf16 v and bf16 Vn
    assert f["native_state_bytes"] == 2 * 3 * H * Dk * Dv * 4
    assert f["cpr_state_bytes"] == 3 * H * Dk * Dv * 2
    assert f["cpr_open_rows"] == 21
    assert f["cpr_bytes"] == f["cpr_state_bytes"] + 21 * H * (Dk * 4 + Dv * 2 + Dv * 2)
    assert f["native_floor_ms"] == round(f["native_state_bytes"] / 1e9 * 1e3, 5)
    assert f["cpr_floor_ms"] == round(f["cpr_bytes"] / 1e9 * 1e3, 5)
    # without the bf16 copies CPR reads the fp32 boundary and fp32 rows (fill 0: one row a lane)
    g = decode_floor(native, fp32_op, lanes=3, bandwidth=1e9)
    assert g["cpr_state_bytes"] == 3 * H * Dk * Dv * 4
    assert g["cpr_bytes"] == g["cpr_state_bytes"] + 3 * H * (Dk + 2 * Dv) * 4


def test_cpr_table_states_the_decode_floor_and_keeps_older_results_readable(tmp_path):
    from isoexec.bench.report import write_cpr_table

    res = bench_cpr(quick=True, device="cpu", log=lambda s: None)
    dec = next(r for r in res["rows"] if r["stage"] == "decode" and r["baseline"] == "native_mixed")
    assert dec["copy_gb_s"] > 0 and 0 < dec["cpr_state_floor_ms"] < dec["cpr_floor_ms"]
    src, md = tmp_path / "cpr.json", tmp_path / "cpr.md"
    src.write_text(json.dumps(res))
    assert write_cpr_table(src, md, "quick") == 3
    text = md.read_text()
    assert "Decode's memory floor" in text
    assert f"{dec['baseline_ms'] / dec['native_floor_ms']:.2f}× it" in text
    # a result from before the floor was measured renders without the paragraph
    for r in res["rows"]:
        for k in ("copy_gb_s", "native_state_bytes", "cpr_state_bytes", "cpr_open_rows", "cpr_bytes",
                  "native_floor_ms", "cpr_state_floor_ms", "cpr_floor_ms"):
            r.pop(k, None)
    src.write_text(json.dumps(res))
    write_cpr_table(src, md, "quick")
    assert "memory floor" not in md.read_text()
