"""``shard_model`` converts a bf16 model to its fp32 masters one FSDP2 unit at a time, each just
before its ``fully_shard`` (isoexec/dist/fsdp/shard.py), so that building the trainer never holds
the whole model in fp32 on a rank: checked on a gloo world of two ranks (fsdp_build_workers.py),
through both trainers that shard (``FSDPTrainer`` on the dense and hybrid tiny models,
``ExpertParallelTrainer`` at ep 2 on the GLM-style tiny model, whose expert slices and fp32
router bias stay out of FSDP2), with a spy that records the model's parameters at every
``fully_shard`` call and then calls the real one:

- at every call, the fp32 parameters that are not yet DTensor shards are exactly the unit being
  sharded, never more bytes than the largest unit: converting the whole model first (the order
  before) holds every unit in fp32 at the first call and fails this;
- the units are sharded in order: the layers, then the root;
- the bits are those of the old order: every rank's local shard is bitwise the fp32 conversion of
  its dim-0 chunk of the whole bf16 parameter (``torch.chunk``, FSDP2's cut), and what stays out of
  FSDP2 keeps its dtype and bits (the frozen bias whole, this rank's expert slice);
- the memory plan's build figures (isoexec/plan/rows.py) are what the ranks held, to the byte.
"""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import fsdp_build_workers as bw  # noqa: E402
from dist_workers import bit_report, spawn_plan_world  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    ranks = spawn_plan_world(bw.plan, bw.WORLD, tmp_path_factory.mktemp("fsdp_build"), {})
    for rank, res in enumerate(ranks):
        assert "__error__" not in res, f"rank {rank} failed:\n{res['__error__']}"
    return ranks


@pytest.mark.parametrize("name", list(bw.CASES))
def test_at_most_one_unit_is_whole_in_fp32_at_any_fully_shard(world, name):
    for rank, res in enumerate(world):
        r = res[name]
        calls, units = r["calls"], r["unit_bytes"]
        n_layers = len(units) - 1
        assert [c["unit"] for c in calls] == [*range(n_layers), "root"], f"{name} rank {rank}: unit order"
        largest = max(units)
        for c in calls:
            what = f"{name} rank {rank}, fully_shard of unit {c['unit']}"
            # the only fp32 parameters not yet sharded are the unit's own, converted just now
            assert c["fp32_whole"] == c["unit_fp32"], what
            assert c["fp32_whole"] <= largest, f"{what}: {c['fp32_whole']} fp32 bytes whole, largest unit {largest}"
            i = n_layers if c["unit"] == "root" else c["unit"]
            assert c["unit_fp32"] == units[i], what
            # the units after it are still in bf16 (2 bytes an element), those before it are shards
            assert c["compute"] == sum(units[i + 1:]) // 2, what
        # the first call alone would see the whole model in fp32 under the old order
        assert calls[0]["fp32_whole"] < sum(units)


@pytest.mark.parametrize("name", list(bw.CASES))
def test_the_shards_are_the_fp32_chunks_of_the_whole_bf16_parameters_bitwise(world, name):
    for rank, res in enumerate(world):
        r = res[name]
        assert r["shards"], name
        for n, (got, want) in r["shards"].items():
            assert got.dtype == torch.float32 and got.shape == want.shape, (name, rank, n, got.shape, want.shape)
            assert bit_report(got, want)["differing"] == 0, (name, rank, n)
        # the parameters left out of FSDP2 keep their dtype and bits
        assert sorted(r["kept"]) == r["left_out"], name
        for n, (got, want) in r["kept"].items():
            assert got.dtype == want.dtype and bit_report(got, want)["differing"] == 0, (name, rank, n)
    # the two ranks' shards of each parameter are its two chunks: together, the whole parameter
    for n in world[0][name]["shards"]:
        both = torch.cat([world[r][name]["shards"][n][0] for r in range(bw.WORLD)])
        assert both.numel() == sum(world[r][name]["shards"][n][1].numel() for r in range(bw.WORLD))


def _plan_row(family: str, model: str, ep: int, engine_tp: int = 1):
    from isoexec.compose import load_model_config
    from isoexec.model_config import FAMILY_CONFIGS
    from isoexec.plan.rows import GIB, plan_row
    from isoexec.plan.workflow_config import RunShape

    cfg = FAMILY_CONFIGS[family].from_hf(load_model_config(model)["hf_config"])
    shape = RunShape(family=family, model=model, cfg=cfg, arms=("x",), dtype="bfloat16", dp=bw.WORLD,
                     engine_tp=engine_tp, num_pages=8, page_size=16, num_state_slots=0, gdn_chunk=0, max_num_seqs=2,
                     max_num_batched_tokens=64, micro_batch_budget=64, longest_sequence=32, trainer_ep=ep)
    return plan_row(shape, 80 * GIB)


@pytest.mark.parametrize("name", list(bw.CASES))
def test_the_plans_build_peak_is_what_sharding_the_trainer_holds(world, name):
    """The memory plan's build figures (isoexec/plan/rows.py, ``build_bytes``) against the
    parameters the ranks held: the trainer's phase is the largest, over the fully_shard calls, of
    the units still in bf16 + the unit whole in fp32 + the shards so far and the unit's own, beside
    what stays out of FSDP2 (and, under the EP trainer, the whole model the caller holds); the
    engine's phase starts from what the built trainer holds (its shards, what stays out, the expert
    slices' fp32 masters), to which the plan adds the engine's whole bf16 model."""
    from isoexec.assembly import installed_model

    family, model, ep = world[0][name]["case"]
    row = _plan_row(family, model, ep)
    measured, built = [], []
    for res in world:
        r = res[name]
        beside = r["left_out_bytes"] + r["caller_bytes"]
        measured.append(max(c["compute"] + c["fp32_whole"] + c["shards"] + c["unit_shards"] for c in r["calls"]) + beside)
        built.append(r["built_bytes"])
    assert row.build_trainer == max(measured), (name, row.build_trainer, measured)
    engine = sum(p.nbytes for p in installed_model(family, bw.CASES[name][2], "cpu", model, dtype=torch.bfloat16,
                                                   seed=None).model.parameters())
    assert row.build_engine == max(built) + engine, (name, row.build_engine, built, engine)
