"""The plan counts building the models (isoexec/plan/rows.py, ``build_bytes``) beside the steady
state, and the verdict takes the larger of the two:

- one process: the trainer's model, the engine's and the fp32 masters, within the steady state, so
  a one-process row's verdict is what it was;
- under FSDP2 (dp > 1): the trainer sharded one unit at a time in the order ``shard_model`` takes
  them (``FsdpUnits.order``), then the engine's model whole beside the trainer's shards, plus the
  tensor-parallel engine's shards at engine_tp > 1 (the figures against what the ranks hold:
  tests/dist/test_fsdp_build_order.py);
- a row whose build does not fit the GPU does not fit, even where its steady state does, and the
  command exits 1.
"""

import re
from dataclasses import replace

import pytest
import yaml

from isoexec.cli import main
from isoexec.compose import load_model_config
from isoexec.model import FAMILY_MODELS
from isoexec.model_config import FAMILY_CONFIGS
from isoexec.plan.params import count_parameters
from isoexec.plan.rows import GIB, plan_row
from isoexec.plan.states import fsdp_units
from isoexec.plan.workflow_config import RunShape


def _cfg(family, name):
    return FAMILY_CONFIGS[family].from_hf(load_model_config(name)["hf_config"])


def _shape(cfg, **kw):
    base = dict(family="dense", model="dense_tiny", cfg=cfg, arms=("isoexec",), dtype="bfloat16", dp=1, engine_tp=1,
                num_pages=16, page_size=16, num_state_slots=0, gdn_chunk=0, max_num_seqs=2,
                max_num_batched_tokens=64, micro_batch_budget=64, longest_sequence=40, activation_checkpointing=True)
    base.update(kw)
    return RunShape(**base)


@pytest.mark.parametrize("family, name", [("dense", "dense_tiny"), ("hybrid", "hybrid_tiny"),
                                          ("mla_moe", "mla_moe_tiny"), ("hybrid_moe", "hybrid_moe_tiny")])
def test_the_units_order_is_what_shard_model_shards_in_turn(family, name):
    """Per unit, the parameters the trainer hands FSDP2 (never the frozen ones): the layers in order,
    then the root; with trainer_ep > 1 without the routed experts."""
    from isoexec.model.ep_moe import is_expert_weight

    cfg = _cfg(family, name)
    model = FAMILY_MODELS[family][0](cfg, device="meta")
    units = fsdp_units(family, cfg)
    trainable = lambda named, ep=1: sum(p.numel() for n, p in named  # noqa: E731
                                        if p.requires_grad and (ep == 1 or not is_expert_weight(n)))
    in_layers = {id(p) for p in model.layers.parameters()}
    root = [(n, p) for n, p in model.named_parameters() if id(p) not in in_layers]
    assert units.order == (*(trainable(L.named_parameters()) for L in model.layers), trainable(root))
    assert sum(units.order) == count_parameters(cfg).trainable
    if family.endswith("moe"):
        ep_units = fsdp_units(family, cfg, trainer_ep=2)
        assert ep_units.order == (*(trainable(L.named_parameters(), 2) for L in model.layers), trainable(root, 2))


def test_one_process_builds_within_its_steady_state():
    cfg = _cfg("dense", "dense_tiny")
    row = plan_row(_shape(cfg), 80 * GIB)
    assert row.build == row.states["weights"] + row.states["master"] + row.states["engine"] < row.total
    assert row.peak == row.total and row.verdict() == f"fits, {(row.capacity - row.total) / GIB:,.1f} GiB free"


def test_the_sharded_build_at_a_small_config():
    """dense_tiny in bf16 over dp = 2: the trainer's phase walks the units (those after the one
    being sharded in bf16, it whole in fp32, the fp32 shards so far with its own), the engine's phase
    is the trainer's shards and the engine's whole bf16 model; at engine_tp 2 the engine's shards
    are added to the engine's phase, and nothing else moves."""
    cfg = _cfg("dense", "dense_tiny")
    row = plan_row(_shape(cfg, dp=2), 80 * GIB)
    order, p = row.units.order, count_parameters(cfg)
    assert p.frozen == 0 and sum(order) == p.trainable
    walk = [2 * sum(order[k + 1:]) + 4 * order[k] + 4 * sum(order[:k + 1]) // 2 for k in range(len(order))]
    assert row.build_trainer == max(walk)
    # the first unit's call is the largest here: everything else is still bf16, and no fp32
    # whole copy of the model (4 bytes a parameter) is ever counted
    assert row.build_trainer == walk[0] < 4 * p.trainable
    assert row.build_engine == 4 * p.trainable // 2 + 2 * p.trainable
    assert row.build == max(row.build_trainer, row.build_engine) and row.peak == max(row.total, row.build)

    cfg = _cfg("dense", "dense_tp_tiny")
    whole, cut = plan_row(_shape(cfg, dp=2), 80 * GIB), plan_row(_shape(cfg, dp=2, engine_tp=2), 80 * GIB)
    assert cut.build_engine - whole.build_engine == cut.states["engine"] < whole.states["engine"]
    assert cut.build_trainer == whole.build_trainer


def test_a_build_over_the_gpu_does_not_fit_where_the_steady_state_does():
    cfg = _cfg("dense", "dense_qwen3_8b")
    # 64 GPUs, the engine cut in two, small pools and micro-batches: the steady state is below the build
    row = plan_row(_shape(cfg, model="dense_qwen3_8b", dp=64, engine_tp=2), 80 * GIB)
    assert row.total < row.build == row.build_engine
    between = replace(row, capacity=(row.total + row.build) // 2)
    assert between.total <= between.capacity < between.build and not between.fits
    v = between.verdict()
    assert v.startswith("does not fit: building the models is over by ") and "the steady state fits" in v
    assert row.fits and row.verdict().startswith("fits, ")
    # a steady state over the GPU with a build over it too: fewer KV pages would not do
    small = replace(row, capacity=row.build - 1, kv_pool=row.kv_pool + 2 * row.build)
    assert small.total > small.build and "engine.num_pages" not in small.verdict()
    assert "building the models is over too" in small.verdict()


def test_the_command_exits_1_when_only_the_build_is_over(tmp_path, capsys):
    settings = {"prompts_per_step": 64, "samples_per_prompt": 2, "mini_batch_size": 32, "max_prompt_tokens": 24,
                "max_response_tokens": 16, "overlong_cache": 4, "engine_tp": 2, "engine": {"num_pages": 16},
                "train": {"activation_checkpointing": True, "micro_batch_tokens": 64}}
    cfg = {"run_name": "t", "arch": "sm90", "gpus": 8, "nodes": 8, "families": ["dense"],
           "models": {"dense": "dense_qwen3_8b"},
           "rl": {"arms": {"iso": {"composition": "isoexec_tp4"}}, "settings": settings}}
    path = tmp_path / "wf.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["plan", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "build peak" in out and "Peak = every state held at once" in out and "build: sharding the trainer" in out
    lines = out.splitlines()
    head = next(line for line in lines if line.startswith("family ") and "build peak" in line)
    cells = dict(zip(re.split(r"\s{2,}", head), re.split(r"\s{2,}", [x for x in lines if x.startswith("dense ")][-1])))
    total, build = float(cells["total"]), float(cells["build peak"])
    assert total < build and cells["verdict"].endswith("GiB free at the build's peak")
    gib = f"{(total + build) / 2:.2f}"
    assert main(["plan", "--config", str(path), "--gpu-memory-gib", gib]) == 1
    assert "does not fit: building the models is over by " in capsys.readouterr().out
