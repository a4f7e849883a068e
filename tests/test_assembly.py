"""installed_model (isoexec/assembly.py): the one contract -> model -> install path."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

from isoexec.assembly import installed_model  # noqa: E402
from isoexec.bits import count_differing  # noqa: E402
from isoexec.compose import build_contract  # noqa: E402
from isoexec.model import ForwardBatch  # noqa: E402


def test_same_seed_same_weights_and_the_contract_is_bound():
    a = installed_model("dense", "isoexec", "cpu", "dense_tiny", seed=3)
    b = installed_model("dense", "isoexec", "cpu", "dense_tiny", seed=3)
    c = installed_model("dense", "isoexec", "cpu", "dense_tiny", seed=4)
    pa, pb, pc = (torch.cat([p.detach().reshape(-1) for p in x.model.parameters()]) for x in (a, b, c))
    assert count_differing(pa, pb) == 0 and count_differing(pa, pc) > 0
    ids = torch.tensor([1, 2, 3, 4])
    h = a.model.hidden_states(ids, ForwardBatch.packed([4], "trainer_score", "cpu"))
    assert h.shape == (4, a.hf_config["hidden_size"])


def test_a_given_contract_is_installed_as_is():
    contract = build_contract("dense", "native", "cpu", "dense_tiny")
    got = installed_model("dense", "isoexec", "cpu", "dense_tiny", contract=contract)
    assert got.contract is contract


def test_a_missing_checkpoint_is_refused(tmp_path):
    with pytest.raises(Exception, match="not found|No such|does not exist|missing"):
        installed_model("dense", "isoexec", "cpu", "dense_tiny", checkpoint=str(tmp_path / "none"))
