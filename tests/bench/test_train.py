"""Training-step benchmark: the quick CPU run covers every region forward + backward and the whole
trainer step, in the BENCHMARKS.md row format."""

import pytest

from isoexec.bench.train import bench_train


def test_bench_train_quick_cpu_rows_cover_every_region_and_the_model_step():
    rows = bench_train("cpu", quick=True, log=lambda s: None)
    stages = [r["stage"] for r in rows]
    assert {"linear.qkv", "linear.lm_head", "rmsnorm", "attention.varlen", "logprob", "model.trainer_step"} <= set(stages)
    for r in rows:
        assert r["pass"] == "fwd+bwd"
        assert r["baseline_ms"] > 0 and r["ours_ms"] > 0
        assert r["speed_ratio"] == pytest.approx(r["baseline_ms"] / r["ours_ms"], rel=1e-3, abs=1e-4)  # rounded to 4 places
    model = next(r for r in rows if r["stage"] == "model.trainer_step")
    assert model["baseline"] == "native_composition" and model["T"] > 0
