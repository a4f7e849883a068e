"""The plan's KV pool and recurrent-state pool are the bytes the engine allocates for the same
settings (dense: KV pages only; hybrid: KV pages for its attention layers and GDN state slots)."""

import pytest
import torch

from isoexec.assembly import installed_model
from isoexec.engine import Engine, EngineConfig
from isoexec.model.hybrid import contract_gdn_chunk, contract_gdn_chunk_form
from isoexec.plan.engine_pools import kv_bytes_per_page, kv_pool_bytes, recurrent_state_bytes


def _engine_bytes(engine):
    r = engine.runner
    kv = sum(t.nbytes for t in r.kv.k + r.kv.v)
    state = 0
    if r.recurrent:
        # every tensor the slots hold, counted here without GDNState.nbytes (which the plan uses)
        state = sum(t.nbytes for s in r.gdn_states for t in (getattr(s, f) for f in s.__dataclass_fields__)
                    if t is not None)
        state += sum(c.nbytes for c in r.conv_states)
    return kv, state


@pytest.mark.parametrize("family", ["dense", "hybrid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pools_are_what_the_engine_allocates(family, dtype):
    inst = installed_model(family, "isoexec", "cpu", f"{family}_tiny", dtype=dtype, seed=None)
    ecfg = EngineConfig(max_num_seqs=6, num_pages=40, page_size=16)
    engine = Engine(inst.model, inst.contract, ecfg)
    kv, state = _engine_bytes(engine)
    name = "float32" if dtype == torch.float32 else "bfloat16"
    cfg = inst.model.cfg
    assert kv == kv_pool_bytes(cfg, 40, 16, name) == 40 * kv_bytes_per_page(cfg, 16, name)
    slots = engine.config.num_state_slots
    assert state == recurrent_state_bytes(cfg, slots, contract_gdn_chunk(inst.contract), name,
                                          chunk_form=contract_gdn_chunk_form(inst.contract))
    assert (state > 0) == (family == "hybrid")
