"""The synchronous DAPO run on two gloo ranks with ONE engine sharded over both (``engine_tp: 2``,
isoexec/rl/distributed.py) against the same run in one process with a whole engine: two steps of
``dense_tp_tiny``, of ``hybrid_tp_tiny`` and of ``mla_moe_tp_tiny`` under ``isoexec_tp4``, each
from one warm-up checkpoint (rl_workers.py). The three sharded runs go one after the other in one
spawned world (each in its own folder): its ranks start once instead of once per family.

- every generation round gives the same tokens and bitwise the same engine logprobs, every metric
  but the timings (and the gradient norm, within 1e-6 relative) is equal, and the live check finds
  0 differing tokens on both ranks at every step;
- both ranks serve every prompt (one engine group), each caching its half of the kv heads;
- an engine_tp that does not divide the world, or that a single process cannot hold, is refused
  with one line before any collective; both MoE families' configs accept engine_tp 2.
"""

from __future__ import annotations

import os
import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import rl_workers as rw  # noqa: E402
from isoexec.errors import ConfigError  # noqa: E402
from isoexec.rl.loop import RLConfig, RLRun, warm_up  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

WS = 2


#: the same for the mla_moe family (mla_moe_tp_tiny: MLA, a dense-MLP layer, then a MoE layer of 8
#: experts; the engine caches its heads' expanded K/V and deals the experts and the MoE rows over
#: the engine group, tp_moe.py)
TP_MLA_MOE_CFG = dict(rw.TP_CFG, family="mla_moe", model="mla_moe_tp_tiny")
TP_MLA_MOE_WARM = dict(rw.TP_WARM, family="mla_moe", model="mla_moe_tp_tiny")
CONFIGS = {"dense": (rw.TP_CFG, rw.TP_WARM), "hybrid": (rw.TP_HYBRID_CFG, rw.TP_HYBRID_WARM),
           "mla_moe": (TP_MLA_MOE_CFG, TP_MLA_MOE_WARM)}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Each family's run configuration, started from a warm-up checkpoint made here once."""
    out = {}
    for family, (cfg, warm) in sorted(CONFIGS.items()):
        folder = tmp_path_factory.mktemp(f"warm_tp_{family}")
        warm_up(RLConfig.from_dict(warm), folder, log=lambda s: None)
        os.remove(folder / "warmup.json")
        out[family] = {"cfg": dict(cfg, checkpoint=str(folder)), "engine_tp": WS}
    return out


@pytest.fixture(scope="module")
def worlds(jobs, tmp_path_factory):
    """Every family's sharded run, one after the other in ONE spawned world of two ranks (the ranks
    start once, not once per family): {family: [rank results]}."""
    ranks = rw.run_world(WS, tmp_path_factory.mktemp("dist_tp"), {"runs": jobs})
    errors = [r["__error__"] for r in ranks if "__error__" in r]
    assert not errors, f"a rank failed:\n{errors[0]}"
    return {family: [r[family] for r in ranks] for family in jobs}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def job(jobs, family):
    return jobs[family]


@pytest.fixture(scope="module")
def single(job, tmp_path_factory):
    run = rw.RecordingRun(RLConfig.from_dict(job["cfg"]), tmp_path_factory.mktemp("single_tp"), log=lambda s: None)
    return {"lines": run.run(), "rollouts": run.rollouts, "kv_heads": run.engine.runner.kv.k[0].shape[2]}


@pytest.fixture(scope="module")
def world(worlds, family):
    return worlds[family]


def test_the_sharded_engine_serves_every_prompt_on_both_ranks_with_half_the_kv_heads(world, single):
    assert world[0]["engine_prompts"] == world[1]["engine_prompts"] > 0
    assert [r["engine_kv_heads"] for r in world] == [single["kv_heads"] // WS] * WS


def test_rollouts_and_metrics_equal_the_single_process_run_with_a_whole_engine(world, single):
    want = single["rollouts"]
    assert any(x.get("train_updates", 0) for x in single["lines"]), "nothing trained: the weight sync is not exercised"
    for rank, res in enumerate(world):
        rw.same_rollouts(res["rollouts"], want, rank)
        for x in res["lines"]:
            assert x["live_check_differing_per_rank"] == [0] * WS and x["bitwise_equal_frac"] == 1.0
        rw.same_metrics(res["lines"], single["lines"], WS)


def test_an_engine_tp_the_world_cannot_hold_is_refused_with_one_line(world, tmp_path):
    msgs = [r["refuse/engine_tp"] for r in world]
    assert msgs == [msgs[0]] * WS and "\n" not in msgs[0]
    assert "engine_tp=3 does not divide the world of 2 ranks" in msgs[0], msgs[0]
    msgs = [r["refuse/engine_tp_unclaimed"] for r in world]
    assert msgs == [msgs[0]] * WS and msgs[0].startswith("TopologyRefused: ") and "\n" not in msgs[0], msgs[0]
    with pytest.raises(ConfigError, match="engine_tp=2 shards the engine over 2 ranks, and this run is one process"):
        RLRun(RLConfig.from_dict(dict(rw.TP_CFG, engine_tp=2)), tmp_path, log=lambda s: None)
    for family in ("mla_moe", "hybrid_moe"):   # every family has a tensor-parallel engine now
        assert RLConfig.from_dict(dict(rw.TP_CFG, family=family, model=f"{family}_tp_tiny", engine_tp=2)).engine_tp == 2


def test_a_moe_engine_tp_with_cuda_graphs_is_refused_from_the_config():
    """The MoE engine under TP runs eager (its expert exchange sizes are read on the host): asking for
    CUDA graphs with it is one ConfigError line from the config, before any warm-up or engine."""
    for family in ("mla_moe", "hybrid_moe"):
        with pytest.raises(ConfigError, match="engine.cuda_graphs: false or engine_tp: 1"):
            RLConfig.from_dict(dict(rw.TP_CFG, family=family, model=f"{family}_tp_tiny", engine_tp=2,
                                    engine={"cuda_graphs": True}))
        assert RLConfig.from_dict(dict(rw.TP_CFG, family=family, model=f"{family}_tp_tiny", engine_tp=1,
                                       engine={"cuda_graphs": True})).engine_tp == 1
