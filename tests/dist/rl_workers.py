"""What each rank of the distributed RL run test (test_distributed_rl.py) runs.

``run_world(world_size, out_dir, job)`` starts ``world_size`` gloo processes; each joins the group
and builds ``RecordingRun`` (``RLRun`` that also keeps every generation round's rollouts) exactly
as ``isoexec run`` under torchrun would, and saves its results to ``out_dir/rank{rank}.pt``. The
test runs the same configuration in one process (``RecordingRun`` without a group) and compares.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from isoexec.errors import ConfigError, TopologyRefused  # noqa: E402
from isoexec.rl.loop import RLConfig, RLRun  # noqa: E402

#: two prompts of two samples per mini-batch: at dp = 2 each rank trains one sequence per update,
#: and micro_batch_tokens = 2 gives the single process one micro-batch per sequence, so the two
#: sum the same per-sequence gradients in the same order; no clipping (the sharded norm adds its
#: squares in another order, which only the clip would feed into the step)
CFG = dict(steps=2, prompts_per_step=4, samples_per_prompt=2, mini_batch_size=1, max_prompt_tokens=16,
           max_response_tokens=16, overlong_cache=4, prompt_style="compact", warmup_sft_steps=0,
           synthetic={"n": 40, "max_operand": 9, "min_terms": 2, "max_terms": 2, "ops": "+"},
           train={"lr": 1e-3, "grad_clip": None, "micro_batch_tokens": 2}, checkpoint_every=0)
#: the warm-up that makes the tiny random model answer some problems (so groups are mixed and the
#: advantages non-zero): its own, faster train settings
WARM = dict(CFG, warmup_sft_steps=120, warmup_batch_size=16, train={"lr": 1e-2})


class RecordingRun(RLRun):
    """``RLRun`` that keeps each generation round's rollouts (all ranks' results, as this rank
    sees them) and counts the prompts its own engine was given."""

    def __init__(self, *a, **kw):
        self.rollouts, self.engine_prompts = [], 0
        super().__init__(*a, **kw)
        generate = self.engine.generate

        def counting(prompts, *args, **kwargs):
            self.engine_prompts += len(prompts)
            return generate(prompts, *args, **kwargs)

        self.engine.generate = counting

    def _generate(self, problems, step, round_):
        results, owners = super()._generate(problems, step, round_)
        self.rollouts.append({"step": step, "round": round_, "prompts": [r.prompt for r in results],
                              "ids": [r.ids for r in results], "logprobs": [r.logprobs.clone() for r in results]})
        return results, owners


#: the metrics that are timings (not compared between runs)
TIMING = ("time_generation_s", "time_scoring_s", "time_training_s", "time_weight_sync_s", "time_step_s",
          "time_generation_per_1k_tokens_s")


def same_metrics(lines, want, world_size: int) -> None:
    """A distributed run's metrics lines against the one-process run's: equal but the timings, the
    world size and the per-rank live check, and the gradient norm within 1e-6 relative (the sharded
    norm adds the same squares in another order)."""
    import pytest

    assert len(lines) == len(want)
    for got, w in zip(lines, want):
        got, w = dict(got), dict(w)
        assert got.pop("world_size") == world_size and w.pop("world_size") == 1
        got.pop("live_check_differing_per_rank"), w.pop("live_check_differing_per_rank")
        assert got.keys() == w.keys()
        for k in w:
            if k in TIMING:
                continue
            if k.startswith("train_grad_norm"):
                assert got[k] == pytest.approx(w[k], rel=1e-6), k
            else:
                assert got[k] == w[k], (got["step"], k, got[k], w[k])


def same_rollouts(got, want, rank: int) -> None:
    """Every generation round of a rank (``RecordingRun.rollouts``) against the one-process run's:
    the same rounds, prompts and tokens, and bitwise the same engine logprobs."""
    from dist_workers import bit_report

    assert [(r["step"], r["round"]) for r in got] == [(r["step"], r["round"]) for r in want]
    for g, w in zip(got, want):
        assert g["prompts"] == w["prompts"] and g["ids"] == w["ids"], (rank, g["step"], g["round"])
        for a, b in zip(g["logprobs"], w["logprobs"]):
            assert bit_report(a, b)["differing"] == 0, (rank, g["step"], g["round"])


def _refusal(fn) -> str:
    try:
        fn()
    except (ConfigError, TopologyRefused) as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


def _plan(job, ws, rank, out_dir) -> dict:
    out = Path(out_dir)
    res = {"times": {"start": time.monotonic()}}
    # refusals, from the configuration and the folder alone: every rank, before any collective
    res["refuse/world"] = _refusal(lambda: RLRun(RLConfig.from_dict(dict(job["cfg"], prompts_per_step=3)),
                                                 out / "bad", log=lambda s: None))
    dist.barrier()    # the ranks are still paired up: no rank entered a collective the other skipped
    res["times"]["refusals"] = time.monotonic()
    run = RecordingRun(RLConfig.from_dict(job["cfg"]), out / "run", log=lambda s: None)
    res["times"]["built"] = time.monotonic()
    res["lines"] = run.run()
    res["times"]["ran"] = time.monotonic()
    res["rollouts"] = run.rollouts
    res["engine_prompts"] = run.engine_prompts
    res["params"] = run.trainer.full_parameters()
    res["engine_params"] = {n: p.detach().clone() for n, p in run.engine_model.named_parameters()}
    # checkpoint and resume: one step with a checkpoint, then a new run in that folder given two
    cfg = dict(job["cfg"], checkpoint_every=1)
    RecordingRun(RLConfig.from_dict(dict(cfg, steps=1)), out / "part", log=lambda s: None).run()
    rest = RecordingRun(RLConfig.from_dict(cfg), out / "part", log=lambda s: None)
    res["resumed"] = {"start_step": rest.step, "lines": rest.run(), "params": rest.trainer.full_parameters(),
                      "files": sorted(p.name for p in (out / "part").iterdir())}
    # a checkpoint written at another world size: a single-process run's (it has no world_size)
    other = out / "other"
    if rank == 0:
        other.mkdir()
        torch.save({"config": asdict(RLConfig.from_dict(cfg)), "step": 1, "trainer": {}, "stream": {}},
                   other / "checkpoint.pt")
    dist.barrier()
    res["refuse/resume_world"] = _refusal(lambda: RLRun(RLConfig.from_dict(cfg), other, log=lambda s: None))
    dist.barrier()    # refused before any collective: the ranks are still paired up
    return res


def _plan_run_only(job, ws, rank, out_dir) -> dict:
    """Just the run (a world of one rank: the sharded trainer's code path on one process)."""
    res = {"times": {"start": time.monotonic()}}
    run = RecordingRun(RLConfig.from_dict(job["cfg"]), Path(out_dir) / "run", log=lambda s: None)
    res["trainer_class"] = type(run.trainer).__name__
    res["lines"] = run.run()
    res["times"]["ran"] = time.monotonic()
    res["rollouts"] = run.rollouts
    res["params"] = run.trainer.full_parameters()
    res["engine_params"] = {n: p.detach().clone() for n, p in run.engine_model.named_parameters()}
    res["files"] = sorted(p.name for p in (Path(out_dir) / "run").iterdir())
    return res


#: the same run on the model and contract the engine can be sharded with (4 kv heads, 5 vocabulary
#: leaves, tp claimed 1/2/4): the engine at tp = 2 over the world of 2
TP_CFG = dict(CFG, model="dense_tp_tiny", composition="isoexec_tp4")
TP_WARM = dict(WARM, model="dense_tp_tiny", composition="isoexec_tp4")
#: the same for the hybrid family (Gated DeltaNet and gated attention layers, the engine's GDN
#: state cut by value head)
TP_HYBRID_CFG = dict(TP_CFG, family="hybrid", model="hybrid_tp_tiny")
TP_HYBRID_WARM = dict(TP_WARM, family="hybrid", model="hybrid_tp_tiny")
#: the run under the native composition for tensor parallelism (stock kernels, row-parallel sums
#: all-reduced, tp claimed variant): the native arm of a pair whose engines run at engine_tp; from
#: random weights with no warm-up and no dynamic sampling, so every group is kept and trained on
NATIVE_TP_CFG = dict(TP_CFG, composition="native_tp4", dynamic_sampling=False)


def _plan_engine_tp(job, ws, rank, out_dir) -> dict:
    """The run with one engine sharded over the whole world (``engine_tp`` = the world size)."""
    out = Path(out_dir)
    res = {"times": {"start": time.monotonic()}}
    res["refuse/engine_tp"] = _refusal(lambda: RLRun(RLConfig.from_dict(dict(job["cfg"], engine_tp=3)),
                                                     out / "bad", log=lambda s: None))
    # the isoexec contract claims tp 1 only: refused when the engine is cut, before the trainer's
    # first collective, on every rank
    res["refuse/engine_tp_unclaimed"] = _refusal(lambda: RLRun(
        RLConfig.from_dict(dict(job["cfg"], composition="isoexec", engine_tp=ws)), out / "bad2", log=lambda s: None))
    dist.barrier()    # refused before any collective: the ranks are still paired up
    run = RecordingRun(RLConfig.from_dict(dict(job["cfg"], engine_tp=ws)), out / "run", log=lambda s: None)
    res["times"]["built"] = time.monotonic()
    res["lines"] = run.run()
    res["times"]["ran"] = time.monotonic()
    res["rollouts"] = run.rollouts
    res["engine_prompts"] = run.engine_prompts
    res["engine_kv_heads"] = run.engine.runner.kv.k[0].shape[2]
    return res


def _plan_engine_tp_runs(job, ws, rank, out_dir) -> dict:
    """:func:`_plan_engine_tp` for each run of ``job["runs"]`` ({name: job}), one after the other in
    the same world, each in a folder of its own: one start-up of the ranks (torch, the package, the
    rendezvous: several seconds a rank) for all of them instead of one per run. ``{name: results}``."""
    res = {"times": {"start": time.monotonic()}}
    for name, sub in job["runs"].items():
        res[name] = _plan_engine_tp(sub, ws, rank, str(Path(out_dir) / name))
        res["times"][name] = time.monotonic()
    return res


def _any_plan(job: dict, world_size: int, rank: int, out_dir: str) -> dict:
    plan = (_plan_engine_tp_runs if "runs" in job else _plan_engine_tp if job.get("engine_tp")
            else _plan_run_only if job.get("run_only") else _plan)
    return plan(job, world_size, rank, out_dir)


def run_world(world_size: int, out_dir: Path, job: dict) -> list[dict]:
    """Every rank's results of one world of ``world_size`` gloo processes."""
    from dist_workers import spawn_plan_world

    return spawn_plan_world(_any_plan, world_size, out_dir, job)
