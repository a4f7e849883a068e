"""The synchronous DAPO run of an MoE family with the trainer's experts over ``trainer_ep`` ranks:
the tiny GLM-style model (``mla_moe_tiny``, 8 experts, 4 per rank) under ``isoexec_ep4`` on two gloo
ranks with ``trainer_ep: 2`` (rl_ep_workers.py), against the same run in one process
(``trainer_ep: 1``), two steps from one warm-up checkpoint:

- the trainer is ``ExpertParallelTrainer`` and the IsoExec live check finds 0 differing tokens on
  both ranks' engines at every step (the engine holds whole weights; the trainer's EP forward
  scores them bitwise);
- step 0 (the same weights) gives the one-process rollouts bitwise; after the first update the
  weights differ from the one-process run's within rounding (an expert's gradient adds the ranks'
  rows in another association), so step 1 gives the same tokens with logprobs within 1e-4, and
  every metric but the timings is equal, the training statistics within 1e-4 relative;
- the fp32 masters after the two steps are within a stated tolerance of the one-process run's,
  and each rank's engine holds them (the weight sync gathers the expert slices whole);
- a run checkpointed after one step (replicated shards and expert slices) and resumed in a new
  run is bitwise the uninterrupted run;
- an ep the contract does not claim and an ep that does not divide the world are refused on every
  rank before any collective, in one line; a one-process run and a family without experts refuse
  ``trainer_ep`` > 1 from the configuration.
"""

from __future__ import annotations

import os
import sys
import time

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import rl_ep_workers as rew  # noqa: E402
import rl_workers as rw  # noqa: E402
from dist_workers import bit_report  # noqa: E402
from isoexec.errors import ConfigError  # noqa: E402
from isoexec.rl.loop import RLConfig, RLRun, warm_up  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

WS = 2
TIMING = rw.TIMING
# The tolerance of the trained weights against the one-process run (the reasoning of
# test_ep_trainer.py: the same fp32 gradient terms in another association, amplified by AdamW up
# to lr per update where a gradient is all cancellation), over the run's updates and step 1's data
# scored by the slightly different weights. Measured on this CPU: relative L2 of the updates
# 4.4e-5, largest fp32 difference 1.8e-5 (lr 1e-3, 6-7 updates).
UPDATE_REL_L2 = 1e-3
STATS_REL = 1e-4
LOGPROB_ABS = 1e-4   # step 1's engine logprobs (measured: at most 7.9e-6 with one warm-up, 1.9e-6 with another)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The run configuration, from a warm-up checkpoint made here once (its record removed, as in
    test_distributed_rl.py). One thread: the warm-up is the longest part of this file on a small
    CPU, and oversubscribed threads only slow it."""
    folder = tmp_path_factory.mktemp("warm_ep")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        warm_up(RLConfig.from_dict(rew.EP_WARM), folder, log=lambda s: None)
    finally:
        torch.set_num_threads(threads)
    os.remove(folder / "warmup.json")
    return {"cfg": dict(rew.EP_CFG, checkpoint=str(folder))}


@pytest.fixture(scope="module")
def single(job, tmp_path_factory):
    run = rw.RecordingRun(RLConfig.from_dict(job["cfg"]), tmp_path_factory.mktemp("single_ep"), log=lambda s: None)

    def masters():
        return {n: m.clone() for n, m in zip(run.trainer.optimizer.names, run.trainer.optimizer.masters)}

    start = masters()
    lines = run.run()
    return {"lines": lines, "rollouts": run.rollouts, "params": masters(), "start": start}


@pytest.fixture(scope="module")
def world(job, tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_ep")
    t0 = time.monotonic()
    ranks = rew.run_world(WS, out, job)
    errors = [r["__error__"] for r in ranks if "__error__" in r]
    assert not errors, f"a rank failed:\n{errors[0]}"
    print(f"\nworld of {WS}: {time.monotonic() - t0:.1f} s; seconds since each rank's start: "
          f"{[r.get('times') for r in ranks]}")
    return ranks


def test_the_trainer_holds_half_the_experts_and_the_live_check_is_zero_on_every_rank(world):
    for rank, res in enumerate(world):
        assert res["trainer_class"] == "ExpertParallelTrainer"
        assert res["expert_rows"] == [4, 4], res["expert_rows"]   # 8 experts over 2 ranks, both MoE layers
        assert res["engine_prompts"] > 0, f"rank {rank}'s engine generated nothing: the check covers no engine"
        assert [x["step"] for x in res["lines"]] == [0, 1]
        for x in res["lines"]:
            assert x["world_size"] == WS
            assert x["live_check_differing_per_rank"] == [0] * WS, (rank, x["step"])
            assert x["bitwise_equal_frac"] == 1.0 and x["logprob_abs_diff_max"] == 0.0 and x["tokens"] > 0
    untimed = lambda lines: [{k: v for k, v in x.items() if k not in TIMING} for x in lines]  # noqa: E731
    assert untimed(world[1]["lines"]) == untimed(world[0]["lines"])


def test_rollouts_and_metrics_equal_the_one_process_run_within_tolerance(world, single):
    want = single["rollouts"]
    assert len(want) > 2, "no refill round: the uneven deal of a round is not exercised"
    assert any(x.get("train_updates", 0) for x in single["lines"]), "nothing trained: the comparison is empty"
    worst = 0.0
    for rank, res in enumerate(world):
        got = res["rollouts"]
        assert [(r["step"], r["round"]) for r in got] == [(r["step"], r["round"]) for r in want]
        for g, w in zip(got, want):
            assert g["prompts"] == w["prompts"] and g["ids"] == w["ids"], (rank, g["step"], g["round"])
            for a, b in zip(g["logprobs"], w["logprobs"]):
                if g["step"] == 0:   # the same weights: the one-process bits
                    assert bit_report(a, b)["differing"] == 0, (rank, g["round"])
                elif a.numel():
                    worst = max(worst, float((a - b).abs().max()))
    assert worst <= LOGPROB_ABS, worst
    for got, w in zip(world[0]["lines"], single["lines"]):
        for k in w:
            if k in TIMING or k in ("world_size", "live_check_differing_per_rank"):
                continue
            if k.startswith("train_") and isinstance(w[k], float):
                assert got[k] == pytest.approx(w[k], rel=STATS_REL, abs=1e-7), (got["step"], k, got[k], w[k])
            else:
                assert got[k] == w[k], (got["step"], k, got[k], w[k])
    print(f"\nstep 1 engine logprobs: largest difference from the one-process run {worst:.2e}")


def test_trained_weights_are_within_tolerance_and_every_engine_holds_them(world, single):
    want, start = single["params"], single["start"]
    lr = RLConfig.from_dict(rew.EP_CFG).train["lr"]
    updates = sum(x.get("train_updates", 0) for x in single["lines"])
    for rank, res in enumerate(world):
        got = res["params"]
        assert got.keys() == res["engine_params"].keys() and set(want) <= set(got)
        dg = torch.cat([(got[n] - start[n]).double().reshape(-1) for n in want])
        dw = torch.cat([(want[n] - start[n]).double().reshape(-1) for n in want])
        rel = float((dg - dw).norm() / dw.norm())
        worst = max(float((got[n] - want[n]).abs().max()) for n in want)
        assert rel <= UPDATE_REL_L2 and worst <= 2 * lr * updates, (rank, rel, worst)
        # the weight sync: each rank's engine holds the trainer's weights whole (fp32: the masters)
        bad = {n: bit_report(p, got[n]) for n, p in res["engine_params"].items() if bit_report(p, got[n])["differing"]}
        assert not bad, f"rank {rank}: engine weights differ from the trainer's: {bad}"
    print(f"\nfp32 masters after {updates} updates: relative L2 of the updates {rel:.2e}, largest difference "
          f"{worst:.2e}")


def test_checkpointed_and_resumed_run_equals_the_uninterrupted_one(world):
    untimed = lambda x: {k: v for k, v in x.items() if k not in TIMING}  # noqa: E731
    for rank, res in enumerate(world):
        r = res["resumed"]
        assert r["start_step"] == 1, rank
        assert "checkpoint.pt" in r["files"] and any(f.startswith("trainer_step") for f in r["files"]), r["files"]
        assert [x["step"] for x in r["lines"]] == [1]
        assert untimed(r["lines"][0]) == untimed(res["lines"][1]), rank
        bad = {n: bit_report(r["params"][n], w) for n, w in res["params"].items()
               if bit_report(r["params"][n], w)["differing"]}
        assert not bad, f"rank {rank}: the resumed run's masters differ: {bad}"


def test_unclaimed_and_indivisible_trainer_ep_are_refused_on_every_rank(world):
    for key, kind, needle in (("refuse/unclaimed_ep", "TopologyRefused: ", f"ep={WS} is not in the proven domain [1]"),
                              ("refuse/ep_divides", "ConfigError: ", f"trainer_ep={WS + 1} does not divide the world")):
        msgs = [res[key] for res in world]
        assert msgs[0].startswith(kind) and needle in msgs[0] and "\n" not in msgs[0], msgs[0]
        assert msgs == [msgs[0]] * WS


@pytest.mark.parametrize("change, needle", [
    (dict(trainer_ep=2), "trainer_ep=2 deals the trainer's experts over 2 ranks, and this run is one process"),
    (dict(trainer_ep=2, family="dense", model="dense_tiny", composition="isoexec"),
     "trainer_ep=2: the trainer under expert parallelism is built for the mla_moe and hybrid_moe families"),
    (dict(trainer_ep=0), "trainer_ep"),
    (dict(trainer_ep="2"), "trainer_ep"),
])
def test_trainer_ep_refused_from_the_configuration_in_one_line(tmp_path, change, needle):
    with pytest.raises(ConfigError) as exc:
        RLRun(RLConfig.from_dict(dict(rew.EP_CFG, **change)), tmp_path / "run", log=lambda s: None)
    assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    assert not (tmp_path / "run").exists()
