"""The synchronous RL loop end to end on CPU: bitwise 0 under IsoExec, non-zero under native,
the live check stops before the backward pass, and a killed run resumes to the same metrics."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from isoexec.rl.loop import LiveCheckFailed, RLConfig, RLRun

TINY = dict(steps=2, prompts_per_step=2, samples_per_prompt=4, mini_batch_size=1, max_prompt_tokens=16,
            max_response_tokens=8, overlong_cache=2, prompt_style="compact", warmup_sft_steps=0,
            synthetic={"n": 40, "max_operand": 9, "min_terms": 2, "max_terms": 2, "ops": "+"},
            train={"lr": 3e-3})
TIMING = ("time_generation_s", "time_scoring_s", "time_training_s", "time_weight_sync_s", "time_step_s",
          "time_generation_per_1k_tokens_s")


def _lines(path):
    return [json.loads(x) for x in open(path) if x.strip()]


def test_isoexec_run_is_bitwise_and_native_is_not(tmp_path):
    iso = RLRun(RLConfig.from_dict(dict(TINY, composition="isoexec")), tmp_path / "iso", log=lambda s: None).run()
    nat = RLRun(RLConfig.from_dict(dict(TINY, composition="native")), tmp_path / "nat", log=lambda s: None).run()
    assert all(x["logprob_abs_diff_max"] == 0 and x["bitwise_equal_frac"] == 1.0 for x in iso)
    assert all(x["tokens"] > 0 for x in iso)
    assert all(x["kernels_compiled"] == 0 for x in iso + nat)   # recorded per step; a CPU run compiles none
    assert any(x["bitwise_equal_frac"] < 1.0 for x in nat), "stock CPU kernels agreed: the control proves nothing"
    assert _lines(tmp_path / "iso" / "metrics.jsonl") == iso


def test_live_check_stops_before_backward(tmp_path, monkeypatch):
    run = RLRun(RLConfig.from_dict(dict(TINY, composition="isoexec")), tmp_path / "r", log=lambda s: None)
    with torch.no_grad():                       # the engine's weights drift from the trainer's by one ulp
        p = next(run.engine_model.parameters())
        p.view(torch.int32)[0] += 1
    called = []
    monkeypatch.setattr(run.trainer, "train", lambda *a, **k: called.append(1))
    monkeypatch.setattr(run, "_sync_weights", lambda: 0.0)
    with pytest.raises(LiveCheckFailed, match="first differing token: response") as ei:
        run.run_step()
    assert "first divergence at region embed" in str(ei.value)   # the drifted tensor is the embedding
    assert not called


def test_killed_run_resumes_to_the_same_metrics(tmp_path):
    cfg = dict(TINY, steps=4, warmup_sft_steps=60, warmup_batch_size=16, max_response_tokens=16, prompts_per_step=4)
    cfg_path = tmp_path / "rl.yaml"
    cfg_path.write_text(yaml.safe_dump({"rl": cfg}))
    cmd = [sys.executable, "-m", "isoexec.cli", "run", "--config", str(cfg_path)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    full = tmp_path / "full"
    subprocess.run([*cmd, "--out", str(full)], check=True, capture_output=True, timeout=600, env=env)
    cut = tmp_path / "cut"
    proc = subprocess.Popen([*cmd, "--out", str(cut)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 600
    while time.time() < deadline:
        m = cut / "metrics.jsonl"
        if m.exists() and len(_lines(m)) >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(_lines(cut / "metrics.jsonl")) < 4, "the run finished before it could be killed"
    subprocess.run([*cmd, "--out", str(cut)], check=True, capture_output=True, timeout=600, env=env)
    a, b = _lines(full / "metrics.jsonl"), _lines(cut / "metrics.jsonl")
    assert [x["step"] for x in b] == [0, 1, 2, 3]
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert strip(a) == strip(b)
    assert any(x.get("train_updates", 0) for x in a), "no update happened: resume would be trivially equal"


def test_a_kv_cache_cap_shrinks_the_engine_and_changes_no_metric(tmp_path):
    """kv_cache_gib caps each engine's KV pages at what that budget holds; with room for three of
    the step's eight sequences the engine queues and preempts, and under IsoExec every token,
    logprob and metric is the uncapped run's. A cap below one longest sequence is refused in one
    line before any work."""
    from isoexec.errors import ConfigError
    from isoexec.rl.loop import kv_page

    full = RLRun(RLConfig.from_dict(dict(TINY, composition="isoexec")), tmp_path / "full", log=lambda s: None)
    page_bytes, page_size = kv_page(RLConfig.from_dict(dict(TINY, kv_cache_gib=1.0)), full.trainer_model.cfg,
                                    full.contract)
    need = -(-(TINY["max_prompt_tokens"] + TINY["max_response_tokens"]) // page_size)
    gib = 3 * need * page_bytes / (1 << 30)
    capped = RLRun(RLConfig.from_dict(dict(TINY, composition="isoexec", kv_cache_gib=gib)), tmp_path / "cap",
                   log=lambda s: None)
    assert capped.engine.config.num_pages == 3 * need < full.engine.config.num_pages
    a, b = full.run(), capped.run()
    drop = lambda lines: [{k: v for k, v in x.items() if not k.startswith("time_")} for x in lines]  # noqa: E731
    assert drop(a) == drop(b) and all(x["bitwise_equal_frac"] == 1.0 for x in b)
    with pytest.raises(ConfigError, match=r"kv_cache_gib=.* holds \d+ KV pages .* needs \d+; raise kv_cache_gib"):
        RLRun(RLConfig.from_dict(dict(TINY, kv_cache_gib=gib / (3 * need))), tmp_path / "tiny", log=lambda s: None)
    assert not (tmp_path / "tiny").exists()
