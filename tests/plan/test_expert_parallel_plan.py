"""The memory plan under the expert-parallel trainer (``rl.settings.trainer_ep``): each GPU holds its
slice of the routed experts whole (compute-dtype weights, fp32 masters, two fp32 moments, a
slice-sized p.grad beside the fp32 master gradient), every other parameter FSDP2-sharded over the
whole world, the FSDP2 units without the experts; trainer_ep 1 is the plan as it was; what the run
would refuse for trainer_ep the plan refuses in one line; and the slice's bytes are what
``ExpertParallelAdamW`` allocates on a gloo world of two ranks (expert_slice_workers.py)."""

from dataclasses import replace

import pytest
import torch.distributed as dist
import yaml

import expert_slice_workers as workers
from isoexec.cli import main
from isoexec.compose import build_contract, load_model_config
from isoexec.errors import ConfigError, TopologyRefused
from isoexec.model import FAMILY_MODELS
from isoexec.model.ep_moe import is_expert_weight
from isoexec.model_config import FAMILY_CONFIGS, HybridMoeConfig, MlaMoeConfig
from isoexec.plan.expert_slices import expert_slices
from isoexec.plan.params import count_parameters
from isoexec.plan.rows import GIB, plan_row
from isoexec.plan.states import DTYPE_BYTES, FROZEN_BYTES, STATES, bytes_per_param, fsdp_units
from isoexec.plan.workflow_config import RunShape, check_trainer_ep_topology, read_workflow_config

PAPER_MOE = [("mla_moe", "mla_moe_glm47_flash"), ("hybrid_moe", "hybrid_moe_qwen3p5_35b_a3b")]
TINY_MOE = [("mla_moe", "mla_moe_tiny"), ("hybrid_moe", "hybrid_moe_tiny")]


def _cfg(family, name):
    return FAMILY_CONFIGS[family].from_hf(load_model_config(name)["hf_config"])


def _shape(family, name, cfg=None, **kw):
    base = dict(family=family, model=name, cfg=cfg or _cfg(family, name), arms=("isoexec_ep4",), dtype="bfloat16",
                dp=8, engine_tp=1, num_pages=100, page_size=16, num_state_slots=0, gdn_chunk=64, max_num_seqs=8,
                max_num_batched_tokens=256, micro_batch_budget=512, longest_sequence=40)
    base.update(kw)
    return RunShape(**base)


def _routed_expert_elements(cfg) -> int:
    """Every MoE layer's experts_gate_up [E, 2I, H] and experts_down [E, H, I], from the config alone."""
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    if isinstance(cfg, MlaMoeConfig):
        return len(cfg.sparse_layers) * cfg.n_routed_experts * 3 * inter * h
    assert isinstance(cfg, HybridMoeConfig)
    return cfg.num_layers * cfg.num_experts * 3 * inter * h


@pytest.mark.parametrize("family, name", PAPER_MOE)
def test_at_trainer_ep_equal_to_the_world_each_gpu_holds_an_ep_th_of_the_expert_masters(family, name):
    cfg = _cfg(family, name)
    one = plan_row(_shape(family, name, cfg), 80 * GIB)
    ep8 = plan_row(_shape(family, name, cfg, trainer_ep=8), 80 * GIB)
    total = _routed_expert_elements(cfg)
    x = ep8.experts
    assert x.total == total and x.slice * 8 == total and set(x.experts_per_rank) == {x.experts // 8}
    assert x.state_bytes("bfloat16") == {"weights": 2 * total // 8, "master": 4 * total // 8,
                                         "adam": 8 * total // 8, "grads": 6 * total // 8}
    # masters and moments: the slice at ep = dp is what FSDP2's dp-th of the experts was, to the byte
    assert ep8.states["master"] == one.states["master"] and ep8.states["adam"] == one.states["adam"]
    # but the slice is held in bf16 whole (FSDP2 held no whole copy), and its bf16 p.grad beside the fp32 one
    units = fsdp_units(family, cfg, trainer_ep=8)
    assert ep8.states["weights"] == 2 * total // 8 + units.gathered_bytes("bfloat16") + count_parameters(cfg).frozen * 4
    assert ep8.states["engine"] == one.states["engine"]          # the engine is whole either way


@pytest.mark.parametrize("family, name", TINY_MOE + PAPER_MOE)
def test_the_fsdp_units_leave_out_what_the_ep_trainer_keeps_out_of_fsdp2(family, name):
    """Under EP the gathered layer is the largest layer less its routed experts and frozen bias (the
    trainer's ``ignored``), the root unchanged; the gathered figure drops by twice that share in bf16."""
    cfg = _cfg(family, name)
    model = FAMILY_MODELS[family][0](cfg, device="meta")
    kept = [sum(p.numel() for n, p in L.named_parameters() if p.requires_grad and not is_expert_weight(n))
            for L in model.layers]
    whole, ep = fsdp_units(family, cfg), fsdp_units(family, cfg, trainer_ep=2)
    assert ep.layer == max(kept) < whole.layer and ep.root == whole.root
    assert whole.gathered_bytes("bfloat16") - ep.gathered_bytes("bfloat16") == 2 * 2 * (whole.layer - ep.layer)
    if family == "hybrid_moe":      # every layer is an MoE layer: the expert share of each is the same
        per_layer = _routed_expert_elements(cfg) // cfg.num_layers
        assert whole.layer - ep.layer == per_layer
    one = plan_row(_shape(family, name, cfg), 80 * GIB)
    two = plan_row(_shape(family, name, cfg, trainer_ep=2), 80 * GIB)
    assert one.units == whole and two.units == ep


@pytest.mark.parametrize("family, name", TINY_MOE + PAPER_MOE + [("dense", "dense_tiny"), ("hybrid", "hybrid_tiny")])
@pytest.mark.parametrize("dp", [1, 2, 8])
def test_trainer_ep_1_is_the_plan_as_it_was(family, name, dp):
    """No expert slice, and every state what FSDP2 (or one process) over dp holds, as before."""
    cfg = _cfg(family, name)
    row = plan_row(_shape(family, name, cfg, dp=dp), 80 * GIB)
    params, pp, b = count_parameters(cfg), bytes_per_param("bfloat16", dp), DTYPE_BYTES["bfloat16"]
    want = {s: int(params.trainable * getattr(pp, s)) for s in STATES}
    want["weights"] += params.frozen * FROZEN_BYTES
    want["engine"] += params.frozen * FROZEN_BYTES
    if dp > 1:
        units = fsdp_units(family, cfg)
        want["weights"] += b * (units.root + 2 * units.layer)
        want["grads"] += max(b * units.root + 8 * units.layer, 8 * units.root)
    assert row.experts is None and row.expert_per_param is None and row.states == want


def test_an_uneven_deal_counts_the_largest_rank_and_the_replica_sum_in_flight():
    """7 experts over 2 ranks are 3 and 4: the plan counts the 4; with two replicas (a world of 4)
    one expert weight's column sum is in flight (2 x 4 bytes per element per replica)."""
    cfg = workers.model_config()
    x = expert_slices("hybrid_moe", cfg, 2, 2)
    assert x.experts_per_rank == (3, 4) and x.slice == x.per_rank[1] == 4 * x.per_rank[0] // 3
    per_weight = 4 * 2 * cfg.moe_intermediate_size * cfg.hidden_size       # the 4 experts' experts_gate_up
    assert x.largest_weight == per_weight and x.replicas == 1
    assert x.grads_in_flight_bytes("bfloat16") == 4 * per_weight           # accumulate_grads' fp32 copy
    assert x.grads_in_flight_bytes("float32") == 0
    assert expert_slices("hybrid_moe", cfg, 2, 4).grads_in_flight_bytes("bfloat16") == 2 * 8 * per_weight


# ------------------------------------------------------------------------------------ refusals
def _wf(tmp_path, family, model, gpus, trainer_ep, name="wf.yaml"):
    d = {"run_name": "t", "arch": "cpu", "families": [family], "models": {family: model}, "gpus": gpus,
         "rl": {"settings": {"prompts_per_step": 4, "samples_per_prompt": 2, "mini_batch_size": 2,
                             "max_prompt_tokens": 24, "max_response_tokens": 16, "overlong_cache": 4,
                             "trainer_ep": trainer_ep}}}
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d))
    return str(p)


@pytest.mark.parametrize("family, model, gpus, ep, why", [
    ("dense", "dense_tiny", 2, 2, "trainer_ep=2: the trainer under expert parallelism is built for the mla_moe and "
                                  "hybrid_moe families, not dense"),
    ("mla_moe", "mla_moe_tiny", 2, 4, "trainer_ep=4 does not divide the world of 2 ranks"),
    ("mla_moe", "mla_moe_tiny", 1, 2, "trainer_ep=2 deals the trainer's experts over 2 ranks, and this run is one "
                                      "process"),
    # the workflow's compositions (isoexec, native) pin ep to 1: the trainer would refuse any ep > 1
    ("hybrid_moe", "hybrid_moe_tiny", 2, 2, "topology refused: ep=2 is not in the proven domain [1]"),
])
def test_a_trainer_ep_the_run_would_refuse_is_refused_in_one_line(tmp_path, capsys, family, model, gpus, ep, why):
    path = _wf(tmp_path, family, model, gpus, ep)
    with pytest.raises(ConfigError, match=f"rl settings of {family} arm isoexec: ") as exc:
        read_workflow_config(path)
    assert why in str(exc.value) and "\n" not in str(exc.value)
    assert main(["plan", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("isoexec: error: ") and why in err and "Traceback" not in err


def test_the_ep_trainers_own_topology_check_admits_the_claimed_ep_and_refuses_the_rest():
    """``isoexec_ep4`` claims ep 1, 2, 4: admitted at 2 and 4, refused at 8 by the claim and at 4 on
    three experts (a rank would own none), with the trainer's own TopologyRefused line."""
    contract = build_contract("mla_moe", "isoexec_ep4", "cpu", "mla_moe_tiny")
    cfg = _cfg("mla_moe", "mla_moe_tiny")
    for ep in (2, 4):
        check_trainer_ep_topology("mla_moe", cfg, contract, "cpu", ep)
    with pytest.raises(TopologyRefused, match="ep=8 is not in the proven domain"):
        check_trainer_ep_topology("mla_moe", cfg, contract, "cpu", 8)
    hf = dict(load_model_config("hybrid_moe_tiny")["hf_config"], num_experts=3)
    with pytest.raises(TopologyRefused, match="ep=4 is more than the 3 routed expert"):
        check_trainer_ep_topology("hybrid_moe", HybridMoeConfig.from_hf(hf),
                                  build_contract("hybrid_moe", "isoexec_ep4", "cpu", "hybrid_moe_tiny"), "cpu", 4)


# ------------------------------------------------------------------- against the trainer's tensors
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    ranks = workers.run_world(tmp_path_factory.mktemp("ep_plan"), workers.make_job())
    for r in ranks:
        assert "__error__" not in r, r.get("__error__")
    return ranks


def test_the_plans_expert_slice_is_what_expert_parallel_adamw_allocates(world):
    """Per rank (3 and 4 of 7 experts, bf16): the slice's weights, fp32 masters, AdamW moments and the
    p.grad + master gradient at the end of a backward, to the byte; no gradient larger than the slice;
    the row counts the larger rank."""
    cfg = workers.model_config()
    x = expert_slices("hybrid_moe", cfg, workers.EP, workers.WORLD)
    for r in world:
        q = r["rank"] % workers.EP
        assert r["expert_range"][1] - r["expert_range"][0] == x.experts_per_rank[q]
        slice_bytes = {s: x.per_rank[q] * v for s, v in {"weights": 2, "master": 4, "adam": 8, "grads": 6}.items()}
        assert {s: r[s] for s in slice_bytes} == slice_bytes, r
        assert not r["grad_larger_than_slice"]
    row = plan_row(_shape("hybrid_moe", "hybrid_moe_tiny", cfg, dp=workers.WORLD, trainer_ep=workers.EP), 80 * GIB)
    assert row.experts.state_bytes("bfloat16") == {s: max(r[s] for r in world) for s in ("weights", "master", "adam",
                                                                                           "grads")}


def test_the_plans_fsdp2_side_is_what_the_ep_trainer_shards(world):
    """FSDP2 manages every trainable parameter but the experts, over both ranks (the plan's non-expert
    count, sharded by dp), and each layer unit holds the plan's elements without the experts."""
    cfg = workers.model_config()
    x = expert_slices("hybrid_moe", cfg, workers.EP, workers.WORLD)
    assert sum(r["fsdp_local"] for r in world) == count_parameters(cfg).trainable - x.total
    units = fsdp_units("hybrid_moe", cfg, trainer_ep=workers.EP)
    assert all(max(r["fsdp_layer"]) == units.layer for r in world)


def test_the_rendered_plan_shows_trainer_ep_where_a_row_has_one(tmp_path):
    """A `trainer EP` column, a bytes-per-parameter table of the experts and a line per EP row; a plan
    without one keeps its table as it was (no column)."""
    from isoexec.plan.memory import MemoryPlan
    from isoexec.plan.render import render_markdown, render_text

    wf = read_workflow_config(_wf(tmp_path, "mla_moe", "mla_moe_tiny", 2, 1))
    (shape,) = wf.shapes
    plain = MemoryPlan(wf, [plan_row(shape, 80 * GIB)], 80.0, "test")
    assert "trainer EP" not in render_text(plain) and "trainer_ep" not in render_markdown(plain, "x")
    rows = [plan_row(shape, 80 * GIB), plan_row(replace(shape, trainer_ep=2), 80 * GIB)]
    plan = MemoryPlan(replace(wf, shapes=[r.shape for r in rows]), rows, 80.0, "test")
    text, md = render_text(plan), render_markdown(plan, "x")
    experts = rows[1].experts.experts
    for out in (text, md):
        assert "trainer EP" in out and "routed experts, trainer_ep = 2 of 2 GPUs" in out
        assert f"trainer_ep 2: 1 ep group of 2 GPUs, each GPU {experts // 2} of the {experts} routed experts" in out
        assert "largest layer without its routed experts" in out and "ExpertParallelTrainer" in out
    # dp, engine TP, trainer EP of each row
    assert "| mla_moe | isoexec, native | " in md and " | 2 | 1 | 1 | " in md and " | 2 | 1 | 2 | " in md
