"""``shard_model`` on a torch whose FSDP2 lacks ``set_reduce_scatter_unused_params`` (torch 2.11,
the H200's): every family is sharded without it, the MoE families with their routed experts
included, since the models give every parameter a gradient in every backward (a pass of no token
included: isoexec/dist/fsdp/shard.py); where the switch exists it is switched on. The method is
removed for the test (the CPU torch has it); test_fsdp_moe.py trains the MoE models without it on
a world of two."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

from isoexec.assembly import installed_model  # noqa: E402
from isoexec.dist.fsdp.shard import shard_model  # noqa: E402
from isoexec.dist.mesh import dp_mesh  # noqa: E402
from isoexec.model.ep_moe import is_expert_weight  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

MODELS = [("dense", "dense_tiny"), ("mla_moe", "mla_moe_tiny"), ("hybrid_moe", "hybrid_moe_tiny")]


def _unused_switches(model) -> set:
    """Each FSDP2 unit's zeros-for-unused setting (FSDP2's private flag, None where it has none;
    torch 2.11 keeps a unit's parameters in one group, 2.13 in a list of them)."""
    out = set()
    for u in [*model.layers, model]:
        state = u._get_fsdp_state()
        for g in getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]:
            out.add(getattr(g, "reduce_scatter_unused_params", None))
    return out


@pytest.mark.parametrize("family,name", MODELS)
def test_without_the_unused_params_switch_every_family_shards_its_experts_included(group_of_one, monkeypatch,
                                                                                    family, name):
    has_switch = hasattr(FSDPModule, "set_reduce_scatter_unused_params")
    with_switch = shard_model(installed_model(family, "isoexec", "cpu", name, seed=0).model, dp_mesh())
    if has_switch:
        assert _unused_switches(with_switch) == {True}
        monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params")
    model = shard_model(installed_model(family, "isoexec", "cpu", name, seed=0).model, dp_mesh())
    assert isinstance(model, FSDPModule)
    assert _unused_switches(model) <= {False, None}
    experts = [p for n, p in model.named_parameters() if is_expert_weight(n)]
    assert bool(experts) == family.endswith("moe")
    assert all(hasattr(p, "full_tensor") for p in experts)   # sharded by FSDP2 (DTensors)
