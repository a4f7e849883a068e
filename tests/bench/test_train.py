"""Training-step benchmark: the quick CPU run covers every region of the dense model forward +
backward and the whole trainer step, in the docs/benchmarks.md row format, and profiles one step of
each composition. Format only: timings are never compared."""

import json

from isoexec.bench.train import bench_train, profile_step
from isoexec.cli import main

REGIONS = {"linear.qkv", "linear.o", "linear.lm_head", "rmsnorm", "rmsnorm.qk_head", "rope", "attention.varlen",
           "act.silu_mul", "embed", "logprob", "model.trainer_step"}


def test_bench_train_quick_cpu_rows_cover_every_region_and_profile_each_composition(tmp_path):
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--device", "cpu", "--quick", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert REGIONS <= {r["stage"] for r in rows}
    for r in rows:
        assert r["pass"] == "fwd+bwd"
        assert r["baseline_ms"] > 0 and r["ours_ms"] > 0 and r["speed_ratio"] > 0
    model = next(r for r in rows if r["stage"] == "model.trainer_step")
    assert model["baseline"] == "native_composition" and model["T"] > 0
    # each composition timed in its own process: the row's times are those rounds' medians
    assert model["rounds_ms"]["native"] == [model["baseline_ms"]] and model["rounds_ms"]["isoexec"] == [model["ours_ms"]]
    prof = res["profile"]
    assert prof["model"] == model["model"] and set(prof["compositions"]) == {"native", "isoexec"}
    for p in prof["compositions"].values():
        assert p["host_ms"] > 0 and p["wall_ms"] >= p["host_ms"]
        assert 0 < len(p["top"]) <= 15
        assert all(k["calls"] > 0 and k["total_ms"] >= 0 and k["name"] for k in p["top"])


def test_profile_step_lists_the_ops_a_step_runs():
    import torch

    a = torch.randn(64, 64, requires_grad=True)

    def step():
        torch.autograd.grad((a @ a).tanh().sum(), [a])

    p = profile_step(step, "cpu", top=50)
    names = " ".join(k["name"] for k in p["top"])
    assert "aten::mm" in names and "tanh" in names
