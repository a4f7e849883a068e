"""The synchronous DAPO run on two gloo ranks (isoexec/rl/distributed.py) against the same run in
one process, two steps of the tiny dense model from one warm-up checkpoint (rl_workers.py):

- the IsoExec live check finds 0 differing tokens on both ranks' engines at every step;
- every generation round gives the same tokens and bitwise the same engine logprobs, and every
  metric but the timings (and the gradient norm, within 1e-6 relative) is equal;
- the trained fp32 masters are BITWISE the single process's: the configuration makes the single
  process's micro-batches the ranks' shares (one sequence each, no clipping), so both add the
  same per-sequence gradients in the same order; each rank's engine holds them after the sync;
- a run checkpointed after one step (sharded trainer) and resumed in a new run is bitwise the
  uninterrupted run (metrics but timings, fp32 masters);
- a world size that does not divide the groups, and a checkpoint written at another world size,
  are refused on every rank with one line, before any collective.
"""

from __future__ import annotations

import os
import sys
import time

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import rl_workers as rw  # noqa: E402
from dist_workers import bit_report  # noqa: E402
from isoexec.rl.loop import RLConfig, warm_up  # noqa: E402
from isoexec.rl.metrics import read_metrics  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

WS = 2
TIMING = rw.TIMING


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The run configuration, started from a warm-up checkpoint made here once. The warm-up's
    record is removed: it would tie the run's train settings to the warm-up's (a plain
    checkpoint folder is what a run from a Hugging Face model reads)."""
    folder = tmp_path_factory.mktemp("warm")
    warm_up(RLConfig.from_dict(rw.WARM), folder, log=lambda s: None)
    os.remove(folder / "warmup.json")
    return {"cfg": dict(rw.CFG, checkpoint=str(folder))}


@pytest.fixture(scope="module")
def single(job, tmp_path_factory):
    run = rw.RecordingRun(RLConfig.from_dict(job["cfg"]), tmp_path_factory.mktemp("single"), log=lambda s: None)

    def masters():
        return {n: m.clone() for n, m in zip(run.trainer.optimizer.names, run.trainer.optimizer.masters)}

    start = masters()
    lines = run.run()
    return {"lines": lines, "rollouts": run.rollouts, "params": masters(), "start": start}


@pytest.fixture(scope="module")
def world(job, tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    t0 = time.monotonic()
    ranks = rw.run_world(WS, out, job)
    print(f"\nworld of {WS}: {time.monotonic() - t0:.1f} s; seconds since each rank's start: "
          f"{[r.get('times') for r in ranks]}")
    errors = [r["__error__"] for r in ranks if "__error__" in r]
    assert not errors, f"a rank failed:\n{errors[0]}"
    return {"ranks": ranks, "out": out}


@pytest.fixture(scope="module")
def world_of_one(job, tmp_path_factory):
    out = tmp_path_factory.mktemp("dist1")
    ranks = rw.run_world(1, out, dict(job, run_only=True))
    errors = [r["__error__"] for r in ranks if "__error__" in r]
    assert not errors, f"the rank failed:\n{errors[0]}"
    return ranks[0]


def test_a_world_of_one_rank_takes_the_sharded_path_and_equals_the_single_process_run(world_of_one, single):
    """In a process group of one rank (``torchrun --nproc_per_node=1``, the H200's NCCL path) the
    run takes the distributed code path, FSDP2 trainer and collectives included, and gives the
    single process's metrics and bitwise its fp32 masters."""
    res = world_of_one
    assert res["trainer_class"] == "FSDPTrainer"
    rw.same_rollouts(res["rollouts"], single["rollouts"], 0)
    rw.same_metrics(res["lines"], single["lines"], 1)
    bad = {n: bit_report(res["params"][n], w)["differing"] for n, w in single["params"].items()
           if bit_report(res["params"][n], w)["differing"]}
    assert not bad, f"fp32 masters differ: {bad}"
    assert all(bit_report(p, res["params"][n])["differing"] == 0 for n, p in res["engine_params"].items())


def test_live_check_is_zero_on_every_rank_at_every_step(world):
    for rank, res in enumerate(world["ranks"]):
        assert [x["step"] for x in res["lines"]] == [0, 1]
        assert res["engine_prompts"] > 0, f"rank {rank}'s engine generated nothing: the check covers no engine"
        for x in res["lines"]:
            assert x["world_size"] == WS
            assert x["live_check_differing_per_rank"] == [0] * WS, (rank, x["step"])
            assert x["bitwise_equal_frac"] == 1.0 and x["logprob_abs_diff_max"] == 0.0
            assert x["tokens"] > 0
    # rank 0 alone writes the metrics, the lines every rank computed
    assert read_metrics(world["out"] / "run" / "metrics.jsonl") == world["ranks"][0]["lines"]
    untimed = lambda lines: [{k: v for k, v in x.items() if k not in TIMING} for x in lines]  # noqa: E731
    assert untimed(world["ranks"][1]["lines"]) == untimed(world["ranks"][0]["lines"])


def test_rollouts_and_metrics_equal_the_single_process_run(world, single):
    want = single["rollouts"]
    assert len(want) > 2, "no refill round: the uneven deal of a round is not exercised"
    for rank, res in enumerate(world["ranks"]):
        rw.same_rollouts(res["rollouts"], want, rank)
    assert any(x.get("train_updates", 0) for x in single["lines"]), "nothing trained: the comparison is empty"
    rw.same_metrics(world["ranks"][0]["lines"], single["lines"], WS)


def test_trained_weights_are_bitwise_the_single_process_run(world, single):
    for rank, res in enumerate(world["ranks"]):
        assert res["params"].keys() == single["params"].keys()
        bad = {n: bit_report(res["params"][n], w) for n, w in single["params"].items()
               if bit_report(res["params"][n], w)["differing"]}
        assert not bad, f"rank {rank}: fp32 masters differ: {bad}"
        # the weight sync: each rank's engine holds the trainer's parameters (fp32 run: the masters)
        bad = {n: bit_report(p, res["params"][n]) for n, p in res["engine_params"].items()
               if bit_report(p, res["params"][n])["differing"]}
        assert not bad, f"rank {rank}: engine weights differ from the trainer's: {bad}"
    moved = sum(bit_report(single["start"][n], w)["differing"] for n, w in single["params"].items())
    assert moved > 0, "the steps left the weights where they started: the comparison is empty"


def test_checkpointed_and_resumed_run_equals_the_uninterrupted_one(world):
    """One step with a sharded checkpoint, then a new run in that folder resumes at step 1: its
    step-1 metrics (but timings) and its final fp32 masters are bitwise the uninterrupted run's."""
    untimed = lambda x: {k: v for k, v in x.items() if k not in TIMING}  # noqa: E731
    for rank, res in enumerate(world["ranks"]):
        r = res["resumed"]
        assert r["start_step"] == 1, rank
        assert "checkpoint.pt" in r["files"] and any(f.startswith("trainer_step") for f in r["files"]), r["files"]
        assert [x["step"] for x in r["lines"]] == [1]
        assert untimed(r["lines"][0]) == untimed(res["lines"][1]), rank
        bad = {n: bit_report(r["params"][n], w) for n, w in res["params"].items()
               if bit_report(r["params"][n], w)["differing"]}
        assert not bad, f"rank {rank}: the resumed run's masters differ: {bad}"
    metrics = read_metrics(world["out"] / "part" / "metrics.jsonl")
    assert [x["step"] for x in metrics] == [0, 1]


def test_bad_world_size_and_resume_are_refused_on_every_rank(world):
    for key, needle in (("refuse/world", "a world of 2 ranks must divide prompts_per_step=3"),
                        ("refuse/resume_world", "was written by a run on 1 rank(s) and this run has 2")):
        msgs = [res[key] for res in world["ranks"]]
        assert msgs[0].startswith("ConfigError: ") and needle in msgs[0], msgs[0]
        assert "\n" not in msgs[0]
        assert msgs == [msgs[0]] * WS
