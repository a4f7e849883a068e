"""Benchmarks: the CLI writes the docs/benchmarks.md result format and the renderer tables it."""

import json
import os
import subprocess
import sys

import pytest

from isoexec.bench.report import write_bench_report
from isoexec.bench.tp_linear import pinned_leaves

REQUIRED_ROW = {"baseline", "baseline_ms", "ours_ms", "speed_ratio"}


# `bench engine --quick` on CPU serves 8 requests x 32 prompt tokens x 16 new tokens and 12
# staggered ones through the IsoExec, native and transformers engines; the format check needs only
# every row kind, which the same code writes at any size, so the child shrinks those CPU sizes
# (about 8 of its 22 s of CPU; the rest is start-up and model building).
SMALLER = ("import isoexec.bench.engine as e; "
           "e.SIZES['cpu'].update(requests=4, prompt_len=16, max_tokens=4); "
           "e.STAGGERED['cpu'].update(requests=4, max_prompt=16, max_tokens=4)")
NAMES = ["gemm", "rmsnorm", "logprob", "attention", "engine", "moe", "tp_linear", "tp_dist"]
# One child runs the CLI's main() for every benchmark, one after the other, as `isoexec bench NAME
# --quick --device cpu --out FILE` would: a child per benchmark spent most of its time starting
# (torch, the package) rather than benchmarking. Each call's exit code and stderr are kept apart.
CHILD = """\
import contextlib, io, json, sys, traceback
{smaller}
from isoexec.cli import main
out = {{}}
for name in sys.argv[2:]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(["bench", name, "--quick", "--device", "cpu", "--out", f"{{sys.argv[1]}}/{{name}}.json"])
        except SystemExit as e:
            rc = e.code
        except Exception:   # what the command would die of: this benchmark fails, the next still runs
            rc = "uncaught exception"
            traceback.print_exc()
    out[name] = {{"returncode": rc, "stderr": err.getvalue()}}
print("RESULTS " + json.dumps(out))
"""


def test_every_benchmark_names_a_function_the_cli_can_call():
    """``BENCHES`` names each benchmark's function as a string (the CLI lists the names without
    importing torch): each must exist and take the CLI's call, ``fn(device, quick=...)``."""
    import inspect

    from isoexec.bench import BENCHES, bench_function

    for name in BENCHES:
        inspect.signature(bench_function(name)).bind("cpu", quick=True)


@pytest.fixture(scope="module")
def bench_runs(tmp_path_factory):
    """{name: (exit code, stderr, result file)} of every benchmark, from one child process."""
    folder = tmp_path_factory.mktemp("bench")
    r = subprocess.run([sys.executable, "-c", CHILD.format(smaller=SMALLER), str(folder), *NAMES],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "RESULTS " in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.split("RESULTS ", 1)[1])
    return {n: (got[n]["returncode"], got[n]["stderr"], folder / f"{n}.json") for n in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_bench_cli_writes_result_format(bench_runs, name, ratio_of_rounded):
    returncode, stderr, out = bench_runs[name]
    assert returncode == 0, stderr
    obj = json.loads(out.read_text())
    assert obj["name"] == name
    assert {"device", "torch", "triton", "transformers", "commit", "date"} <= set(obj["env"])
    assert obj["rows"] and all(REQUIRED_ROW <= set(row) for row in obj["rows"])
    for row in obj["rows"]:
        assert row["baseline_ms"] > 0 and row["ours_ms"] > 0
        assert ratio_of_rounded(row["baseline_ms"], row["ours_ms"], row["speed_ratio"]), row
    if name == "engine":  # the smaller sizes took effect, and every row kind is there
        assert {(r["workload"], r["baseline"]) for r in obj["rows"]} == {
            ("batch", "native_engine"), ("batch", "transformers_generate"), ("staggered", "native_engine")}
        assert all(r["requests"] == 4 for r in obj["rows"])
        # the decode-lookahead runs: one batch and one staggered row (same tokens, tested in tests/engine)
        assert sorted(r["workload"] for r in obj["rows"] if r.get("overlap_decode")) == ["batch", "staggered"]
    if name == "tp_linear":  # the composition's pinned leaves, and the walk gave the partials' bits
        assert {r["leaves"] for r in obj["rows"]} == {pinned_leaves()} and all(r["same_bits"] for r in obj["rows"])
        assert all(r["baseline"] == "invariant_gemm" and r["by_partials_ms"] > 0 for r in obj["rows"])
    if name == "tp_dist":  # without torchrun: a group of this process alone, ours the one-process bits
        assert {(r["op"], r["tp"]) for r in obj["rows"]} == {("row_parallel", 1), ("vocab_logprob", 1)}
        assert all(r["same_bits"] and r["baseline"] == "all_reduce" for r in obj["rows"])
    if name == "moe":  # both layer shapes, fwd at every M and fwd+bwd at the training size; then MLA
        moe = [r for r in obj["rows"] if r["stage"].startswith("moe.")]
        mla = [r for r in obj["rows"] if r["stage"].startswith("mla.")]
        assert len(moe) + len(mla) == len(obj["rows"])
        assert {(r["stage"], r["M"]) for r in moe} == {
            (f"moe.{s}.{p}", m) for s in ("glm47_flash", "qwen35_35b_a3b")
            for p, ms in (("fwd", (1, 16, 64)), ("fwd+bwd", (64,))) for m in ms}
        assert all(r["pass"] == r["stage"].rsplit(".", 1)[1] and r["speed_ratio"] > 0 for r in obj["rows"])
        # the mla_moe attention region in each case the model calls it, at mla_moe_tiny's dims
        # (4 heads, q/k 8 + 8, v 8, padded to 16), each side the implementation its composition binds
        assert {(r["stage"], r["case"], r["M"], r["batch"], r.get("seqlen"), r.get("context")) for r in mla} == {
            ("mla.glm47_flash.trainer.fwd", "trainer_score", 64, 2, 32, None),
            ("mla.glm47_flash.trainer.fwd+bwd", "trainer_fwd", 64, 2, 32, None),
            ("mla.glm47_flash.prefill.fwd", "engine_prefill", 64, 2, 32, 32),
            ("mla.glm47_flash.decode.fwd", "engine_decode", 4, 4, None, 64)}
        for r in mla:
            assert (r["heads"], r["qk_head_dim"], r["v_head_dim"], r["attn_width"]) == (4, 16, 8, 16), r
            assert (r["impl"], r["baseline_impl"], r["baseline"]) == ("mla_expanded_walk", "torch_mla_sdpa", "torch")
            assert r["dtype"] == "float32" and r["timing"] == "eager"
            assert r.get("page_size") == (None if r["case"].startswith("trainer") else 16), r


def test_report_renders_every_row(tmp_path):
    res = {"name": "gemm", "env": {"device": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "transformers":
                                   "5.17.0", "commit": "abc", "date": "2026-11-30"},
           "rows": [{"M": 1, "K": 64, "N": 64, "baseline": "cublas", "baseline_ms": 1.0, "ours_ms": 2.0,
                     "speed_ratio": 0.5},
                    {"M": 256, "K": 64, "N": 64, "baseline": "cublas", "baseline_ms": 1.0, "ours_ms": 1.0,
                     "speed_ratio": 1.0}]}
    p = tmp_path / "gemm.json"
    p.write_text(json.dumps(res))
    n = write_bench_report([p], tmp_path / "k.md", tmp_path / "k.csv", "h200")
    md = (tmp_path / "k.md").read_text()
    assert n == 2 and "## gemm" in md and "| 256 | 64 | 64 | cublas | 1 | 1 | 1 |" in md
    assert "min 0.500" in md and "NVIDIA H200" in md
    assert len((tmp_path / "k.csv").read_text().strip().splitlines()) == 3


def test_report_writes_per_round_times_as_text_not_a_python_repr(tmp_path):
    res = {"name": "train", "env": {"device": "cpu", "torch": "2", "triton": "3", "transformers": "5", "commit": "c",
                                    "date": "d"},
           "rows": [{"stage": "model.trainer_step", "rounds_ms": {"native": [2.0, 2.5], "isoexec": [1.0, 1.25]},
                     "baseline": "native_composition", "baseline_ms": 2.25, "ours_ms": 1.125, "speed_ratio": 2.0}]}
    p = tmp_path / "train.json"
    p.write_text(json.dumps(res))
    write_bench_report([p], tmp_path / "k.md", tmp_path / "k.csv", "h200")
    md = (tmp_path / "k.md").read_text()
    assert "| native 2, 2.5; isoexec 1, 1.25 |" in md and "{" not in md.split("## train")[1]
    import csv
    (got,) = csv.DictReader((tmp_path / "k.csv").open())
    assert json.loads(got["rounds_ms"]) == res["rows"][0]["rounds_ms"]


def test_report_refuses_a_non_result(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{}")
    with pytest.raises(ValueError, match="not a benchmark result"):
        write_bench_report([p], tmp_path / "k.md", tmp_path / "k.csv", "x")


def test_bench_tp_dist_under_torchrun_on_two_gloo_ranks_keeps_one_process_bits_and_rank0_writes(tmp_path):
    out = tmp_path / "tp_dist.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "isoexec.cli", "bench", "tp_dist", "--quick", "--device", "cpu", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("wrote ") == 1            # rank 0 alone writes and reports
    rows = json.loads(out.read_text())["rows"]
    assert {r["op"] for r in rows} == {"row_parallel", "vocab_logprob"} and all(r["tp"] == 2 for r in rows)
    # ours keeps the one-process bits at tp = 2; the stock all-reduce row-parallel sum does not everywhere
    assert all(r["same_bits"] for r in rows), rows
    assert all(r["owners_same_bits"] and r["owners_ms"] > 0 for r in rows if r["op"] == "row_parallel"), rows
    assert not all(r["stock_same_bits"] for r in rows if r["op"] == "row_parallel"), rows


def test_bench_tp_dist_refuses_a_group_that_does_not_divide_the_leaves(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                           "-m", "isoexec.cli", "bench", "tp_dist", "--quick", "--device", "cpu", "--out",
                           str(tmp_path / "x.json")], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0 and not (tmp_path / "x.json").exists()
    # one line a rank, no frame of ours (torchrun's own report of the failed ranks follows)
    assert proc.stderr.count("isoexec: error: bench tp_dist: 3 ranks do not divide the 4 K leaves of "
                             "isoexec_tp4") == 3, proc.stderr[-2000:]
    assert "isoexec/bench" not in proc.stderr and "isoexec/cli.py" not in proc.stderr
