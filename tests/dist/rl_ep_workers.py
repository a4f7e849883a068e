"""What each rank of the expert-parallel RL run test (test_distributed_rl_ep.py) runs.

``run_world(world_size, out_dir, job)`` starts ``world_size`` gloo processes; each joins the group
and runs ``RecordingRun`` (rl_workers.py: ``RLRun`` keeping every generation round's rollouts) on
the tiny GLM-style MoE model (``mla_moe_tiny``) under ``isoexec_ep4`` with ``trainer_ep`` = the
world size, as ``isoexec run`` under torchrun would, and saves its results to
``out_dir/rank{rank}.pt``. The test runs the same configuration (``trainer_ep: 1``) in one process.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.modules.setdefault("fla", None)

import torch.distributed as dist  # noqa: E402

from rl_workers import CFG, WARM, RecordingRun, _refusal  # noqa: E402
from isoexec.rl.loop import RLConfig, RLRun  # noqa: E402

#: rl_workers' configuration on the MoE model with ep claimed 1, 2, 4
EP_CFG = dict(CFG, family="mla_moe", model="mla_moe_tiny", composition="isoexec_ep4")
#: its warm-up, shorter than rl_workers' (60 SFT steps leave groups mixed: each step keeps 2 of 4 after
#: refill rounds)
EP_WARM = dict(WARM, family="mla_moe", model="mla_moe_tiny", composition="isoexec_ep4", warmup_sft_steps=60)


def _plan(job, ws, rank, out_dir) -> dict:
    out = Path(out_dir)
    res = {"times": {"start": time.monotonic()}}
    # refusals, from the configuration and the contract alone: every rank, before any collective
    res["refuse/unclaimed_ep"] = _refusal(lambda: RLRun(
        RLConfig.from_dict(dict(job["cfg"], composition="isoexec", trainer_ep=ws)), out / "bad", log=lambda s: None))
    res["refuse/ep_divides"] = _refusal(lambda: RLRun(RLConfig.from_dict(dict(job["cfg"], trainer_ep=ws + 1)),
                                                      out / "bad2", log=lambda s: None))
    dist.barrier()    # the ranks are still paired up: no rank entered a collective the other skipped
    cfg = dict(job["cfg"], trainer_ep=ws)
    run = RecordingRun(RLConfig.from_dict(cfg), out / "run", log=lambda s: None)
    res["trainer_class"] = type(run.trainer).__name__
    res["expert_rows"] = [L.experts_gate_up.shape[0] for L in run.trainer.model.layers if hasattr(L, "experts_gate_up")]
    res["times"]["built"] = time.monotonic()
    res["lines"] = run.run()
    res["times"]["ran"] = time.monotonic()
    res["rollouts"] = run.rollouts
    res["engine_prompts"] = run.engine_prompts
    res["params"] = run.trainer.full_parameters()
    res["engine_params"] = {n: p.detach().clone() for n, p in run.engine_model.named_parameters()}
    # checkpoint and resume: one step with a checkpoint, then a new run in that folder given two
    cfg = dict(cfg, checkpoint_every=1)
    RecordingRun(RLConfig.from_dict(dict(cfg, steps=1)), out / "part", log=lambda s: None).run()
    rest = RecordingRun(RLConfig.from_dict(cfg), out / "part", log=lambda s: None)
    res["resumed"] = {"start_step": rest.step, "lines": rest.run(), "params": rest.trainer.full_parameters(),
                      "files": sorted(p.name for p in (out / "part").iterdir())}
    res["times"]["resumed"] = time.monotonic()
    return res


def run_world(world_size: int, out_dir: Path, job: dict) -> list[dict]:
    """Every rank's results of one world of ``world_size`` gloo processes."""
    from dist_workers import spawn_plan_world

    return spawn_plan_world(_plan, world_size, out_dir, job)
