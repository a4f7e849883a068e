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
  FSDP2 keeps its dtype and bits (the frozen bias whole, this rank's expert slice).
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
