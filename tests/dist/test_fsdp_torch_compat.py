"""``shard_model`` on a torch whose FSDP2 lacks ``set_reduce_scatter_unused_params`` (torch 2.11,
the H200's): the dense family, whose every parameter gets a gradient on every rank, is sharded
without it; an MoE family, where a rank may route no token to an expert, is refused with one
clear error. The method is removed for the test (the CPU torch has it)."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

from isoexec.assembly import installed_model  # noqa: E402
from isoexec.dist.fsdp.shard import shard_model  # noqa: E402
from isoexec.dist.mesh import dp_mesh  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def test_without_the_unused_params_switch_dense_shards_and_moe_is_refused(group_of_one, monkeypatch):
    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params")
    mesh = dp_mesh()
    dense = installed_model("dense", "isoexec", "cpu", "dense_tiny", seed=0).model
    assert isinstance(shard_model(dense, mesh), FSDPModule)
    moe = installed_model("mla_moe", "isoexec", "cpu", "mla_moe_tiny", seed=0).model
    with pytest.raises(ValueError, match="set_reduce_scatter_unused_params"):
        shard_model(moe, mesh)
