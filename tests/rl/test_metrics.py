"""Rollout-vs-trainer logprob statistics and the metrics.jsonl writer (validation, resume)."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from isoexec.rl.metrics import (REQUIRED_KEYS, MetricsFileError, MetricsWriter, argmax_flips,
                                logprob_diff_stats, read_metrics, summary_line)


def _logprobs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [-torch.rand(n, generator=g) * 5 for n in lengths]


def test_identical_logprobs_give_exact_zeros():
    r = _logprobs([7, 1, 12])
    r[1][0] = float("-inf")                      # a zero-probability token on both sides
    t = [x.clone() for x in r]
    s = logprob_diff_stats(r, t)
    assert s == {"logprob_abs_diff_mean": 0.0, "logprob_abs_diff_std": 0.0, "logprob_abs_diff_max": 0.0,
                 "bitwise_equal_frac": 1.0, "tokens": 20, "first_differing": None,
                 "kl_k1": 0.0, "kl_k3": 0.0}


def test_one_ulp_is_found():
    r = _logprobs([5, 6, 4])
    t = [x.clone() for x in r]
    t[1][3] = torch.nextafter(t[1][3], torch.tensor(0.0))
    s = logprob_diff_stats(r, t)
    assert s["bitwise_equal_frac"] == 14 / 15 and s["first_differing"] == (1, 3)
    ulp = float(t[1][3].double() - r[1][3].double())
    assert ulp > 0 and s["logprob_abs_diff_max"] == ulp
    assert s["kl_k1"] == pytest.approx(-ulp / 15, rel=1e-12)


def test_signed_zero_is_a_bitwise_difference():
    s = logprob_diff_stats([torch.tensor([0.0, -1.0])], [torch.tensor([-0.0, -1.0])])
    assert s["bitwise_equal_frac"] == 0.5 and s["first_differing"] == (0, 0)
    assert s["logprob_abs_diff_max"] == 0.0          # same value, different bits


def test_perturbed_statistics_match_a_float64_reference():
    r = _logprobs([50, 30, 20], seed=1)
    g = torch.Generator().manual_seed(2)
    t = [x + torch.randn(x.shape, generator=g) * 0.05 for x in r]
    s = logprob_diff_stats(r, t)
    R = torch.cat(r).double()
    T = torch.cat(t).double()
    d = (T - R).abs()
    log_r = T - R
    assert s["tokens"] == 100 and s["bitwise_equal_frac"] < 0.05 and s["first_differing"] == (0, 0)
    assert s["logprob_abs_diff_mean"] == pytest.approx(float(d.mean()), rel=1e-12)
    assert s["logprob_abs_diff_std"] == pytest.approx(float(d.std(unbiased=False)), rel=1e-12)
    assert s["logprob_abs_diff_max"] == float(d.max())
    assert s["kl_k1"] == pytest.approx(float((R - T).mean()), rel=1e-9)
    assert s["kl_k3"] == pytest.approx(float((log_r.exp() - 1 - log_r).mean()), rel=1e-9)
    assert s["kl_k3"] > 0


def test_kl_direction():
    # trainer lower than rollout on every sampled token: KL(rollout || trainer) estimate > 0
    r = [torch.full((4,), -1.0)]
    t = [torch.full((4,), -1.5)]
    s = logprob_diff_stats(r, t)
    assert s["kl_k1"] == 0.5
    assert s["kl_k3"] == pytest.approx(torch.tensor(-0.5).double().exp().item() - 1 + 0.5, rel=1e-12)


def test_input_errors():
    with pytest.raises(ValueError, match="sequence 1"):
        logprob_diff_stats(_logprobs([3, 4]), _logprobs([3, 5]))
    with pytest.raises(ValueError, match="2 rollout sequences vs 1"):
        logprob_diff_stats(_logprobs([3, 4]), _logprobs([3]))
    with pytest.raises(ValueError, match="sequence 0"):
        logprob_diff_stats([torch.zeros(3)], [torch.zeros(3, dtype=torch.float64)])
    with pytest.raises(TypeError, match="floating"):
        logprob_diff_stats([torch.zeros(3, dtype=torch.int64)], [torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match="no tokens"):
        logprob_diff_stats([torch.zeros(0)], [torch.zeros(0)])


def test_argmax_flips():
    a = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    b = [torch.tensor([1, 9, 3]), torch.tensor([5])]
    assert argmax_flips(a, b) == {"argmax_flips": 2, "argmax_flip_frac": 0.5}
    s = logprob_diff_stats(_logprobs([3, 1]), _logprobs([3, 1]), a, b)
    assert s["argmax_flips"] == 2
    with pytest.raises(ValueError, match="both"):
        logprob_diff_stats(_logprobs([3]), _logprobs([3]), rollout_top1=a)


# --------------------------------------------------------------------------- writer


def _step(k):
    """Deterministic metrics of step k (timings included, so runs can be compared byte for byte)."""
    m = {key: 0.001 * (k + 1) * (i + 1) for i, key in enumerate(REQUIRED_KEYS)}
    m.update(step=k, first_differing=(k, 2 * k), tokens=torch.tensor(10 * k))
    return m


def test_lines_are_validated(tmp_path):
    with MetricsWriter(tmp_path / "m.jsonl") as w:
        bad = _step(0)
        del bad["time_scoring_s"], bad["reward_mean"]
        with pytest.raises(MetricsFileError, match="reward_mean, time_scoring_s"):
            w.write(bad)
        with pytest.raises(MetricsFileError, match="logprob_abs_diff_max.*nan"):
            w.write({**_step(0), "logprob_abs_diff_max": float("nan")})
        with pytest.raises(MetricsFileError, match="step"):
            w.write({**_step(0), "step": 1.0})
        w.write(_step(0))
        with pytest.raises(MetricsFileError, match="steps must increase"):
            w.write(_step(0))
    rows = read_metrics(tmp_path / "m.jsonl")
    assert len(rows) == 1 and list(rows[0])[0] == "step"
    assert rows[0]["first_differing"] == [0, 0] and rows[0]["tokens"] == 0


def test_opening_an_old_run_never_mixes_two_runs(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as w:
        w.write(_step(0))
        w.write(_step(1))
    with MetricsWriter(path) as w:               # opening keeps the lines ...
        assert w.last_step == 1
        with pytest.raises(MetricsFileError, match="truncate_after"):
            w.write(_step(0))                    # ... and a new run cannot append step 0 to them
        assert w.truncate_after(-1) == 0         # what a fresh run does
        w.write(_step(0))
    assert [m["step"] for m in read_metrics(path)] == [0]


def test_a_torn_file_must_be_truncated_before_writing(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as w:
        w.write(_step(0))
    with open(path, "a") as f:
        f.write(json.dumps({"step": 1}))         # whole JSON but no newline: the kill came first
    with MetricsWriter(path) as w:
        with pytest.raises(MetricsFileError, match="torn"):
            w.write(_step(1))
        assert w.truncate_after(5) == 1
        w.write(_step(1))
    assert [m["step"] for m in read_metrics(path)] == [0, 1]


def test_killed_and_resumed_run_ends_with_the_uninterrupted_lines(tmp_path):
    with MetricsWriter(tmp_path / "straight.jsonl") as w:
        for k in range(6):
            w.write(_step(k))

    path = tmp_path / "killed.jsonl"
    with MetricsWriter(path) as w:                   # checkpoint after step 2, killed in step 4
        for k in range(4):
            w.write(_step(k))
    with open(path, "a") as f:
        f.write('{"step": 4, "logprob_abs_d')     # torn line
    with MetricsWriter(path, resume_from=2) as w:
        assert w.last_step == 2
        for k in range(3, 6):
            w.write(_step(k))
    assert path.read_bytes() == (tmp_path / "straight.jsonl").read_bytes()
    assert [m["step"] for m in read_metrics(path)] == list(range(6))


def test_truncate_after_refuses_a_damaged_middle(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(_step(0) | {"tokens": 0}) + "\ngarbage\n" + json.dumps({"step": 2}) + "\n")
    with pytest.raises(MetricsFileError, match="line 2"):
        MetricsWriter(path, resume_from=5)


def test_resume_on_a_missing_file_starts_empty(tmp_path):
    with MetricsWriter(tmp_path / "new.jsonl", resume_from=3) as w:
        assert w.last_step is None
        w.write(_step(0))


def test_wandb_is_off_by_default_and_optional(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)               # not importable
    with MetricsWriter(tmp_path / "a.jsonl") as w:                # default: never touches wandb
        w.write(_step(0))
    with pytest.warns(UserWarning, match="wandb is not installed"):
        w = MetricsWriter(tmp_path / "b.jsonl", wandb=True)
    w.write(_step(0))
    w.close()
    assert len(read_metrics(tmp_path / "b.jsonl")) == 1


def test_wandb_mirror_logs_offline(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with MetricsWriter(tmp_path / "m.jsonl", wandb=True, run_name="r1") as w:
        w.write(_step(1))
    assert calls[0][0] == "init" and calls[0][1]["mode"] == "offline" and calls[0][1]["name"] == "r1"
    assert calls[1][:2] == ("log", 1) and "step" not in calls[1][2]
    assert calls[1][2]["reward_mean"] == _step(1)["reward_mean"] and calls[-1] == ("finish",)


def test_summary_line():
    m = {"step": 3, "reward_mean": 0.25, "logprob_abs_diff_mean": 0.016, "logprob_abs_diff_max": 5.07,
         "bitwise_equal_frac": 0.084, "time_generation_s": 1.2, "time_scoring_s": 0.3,
         "time_training_s": 0.9, "time_step_s": 2.5, "first_differing": (0, 4)}
    line = summary_line(m)
    assert "\n" not in line
    assert line == ("step 3 | reward +0.250 | |dlp| mean 1.60e-02 max 5.07e+00 | equal 8.40% | "
                    "gen 1.20s score 0.30s train 0.90s step 2.50s | first diff seq 0 tok 4")
    assert summary_line({"step": 0}).startswith("step 0 | reward - |")
