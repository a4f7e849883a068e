"""Bytes per parameter per GPU: FSDP2 divides the sharded states (fp32 masters, Adam moments, the
sharded gradient) by dp and keeps no whole copy (what it gathers is per model: the root and two
layers, ``FsdpUnits``; tests/dist/test_fsdp_per_layer.py measures it); the one-process layout is
what MasterAdamW really keeps."""

import pytest
import torch

from isoexec.model import FAMILY_MODELS, build_model
from isoexec.plan.params import count_parameters
from isoexec.plan.states import STATES, bytes_per_param, fsdp_units
from isoexec.train import MasterAdamW
from isoexec.compose import load_model_config
from isoexec.model_config import DenseConfig


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("dp", [2, 4, 8, 16])
def test_sharding_divides_the_sharded_states_by_dp(dtype, dp):
    two, n = bytes_per_param(dtype, 2), bytes_per_param(dtype, dp)
    assert n.master * dp == two.master * 2 == 4
    assert n.adam * dp == two.adam * 2 == 8
    assert n.grads * dp == two.grads * 2 == 4                    # the fp32 sharded gradient
    assert n.weights == two.weights == 0                         # no whole copy: the units are per model
    assert n.engine == two.engine                                # the engine's copy


def test_one_process_in_bf16_holds_22_bytes_per_parameter():
    pp = bytes_per_param("bfloat16", 1)
    assert pp.total == 22 and [getattr(pp, s) for s in STATES] == [2, 4, 8, 6, 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_one_process_layout_is_what_master_adamw_keeps(dtype):
    hf = load_model_config("dense_tiny")["hf_config"]
    model = build_model("dense", hf, dtype=dtype).init_random(0)
    n = count_parameters(DenseConfig.from_hf(hf)).trainable
    pp = bytes_per_param("bfloat16" if dtype == torch.bfloat16 else "float32", 1)
    opt = MasterAdamW(model, lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert sum(p.grad.nbytes for p in model.parameters()) + 4 * n == pp.grads * n   # p.grad + fp32 master grad
    opt.step()
    assert sum(p.nbytes for p in model.parameters()) == pp.weights * n
    assert sum(m.nbytes for m in opt.masters) == pp.master * n
    moments = [t for st in opt.opt.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")]
    assert sum(t.nbytes for t in moments) == pp.adam * n


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        bytes_per_param("float16", 1)
    with pytest.raises(ValueError):
        bytes_per_param("bfloat16", 0)


@pytest.mark.parametrize("family, name", [("dense", "dense_tiny"), ("hybrid", "hybrid_tiny"),
                                          ("mla_moe", "mla_moe_tiny"), ("hybrid_moe", "hybrid_moe_tiny")])
def test_the_fsdp_units_are_the_root_and_the_largest_layer_shard_model_would_make(family, name):
    """Counted on the meta device: the largest decoder layer, and the root (every other parameter)."""
    cls, cfg_cls = FAMILY_MODELS[family]
    cfg = cfg_cls.from_hf(load_model_config(name)["hf_config"])
    model = cls(cfg)
    units = fsdp_units(family, cfg)
    layers = [sum(p.numel() for p in L.parameters()) for L in model.layers]
    assert units.layer == max(layers)
    assert units.root + sum(layers) == sum(p.numel() for p in model.parameters()) == count_parameters(cfg).total
