"""The plan's parameter count is the number of parameters of the repo's own model: built from every
model config in configs/models/ (the tiny ones on the CPU, the full-size ones on the meta device,
which allocates nothing) and summed, never a hard-coded figure."""

import pytest
import torch

from isoexec.compose import load_model_config
from isoexec.model import build_model
from isoexec.model_config import FAMILY_CONFIGS
from isoexec.paths import configs_dir
from isoexec.plan.params import count_parameters

MODELS = sorted(p.stem for p in (configs_dir() / "models").glob("*.yaml"))


def _config_and_model(name):
    data = load_model_config(name)
    device = "cpu" if name.endswith("_tiny") else "meta"
    model = build_model(data["family"], data["hf_config"], device=device)
    return FAMILY_CONFIGS[data["family"]].from_hf(data["hf_config"]), model


@pytest.mark.parametrize("name", MODELS)
def test_the_count_is_the_built_models_number_of_parameters(name):
    cfg, model = _config_and_model(name)
    count = count_parameters(cfg)
    assert count.total == sum(p.numel() for p in model.parameters())
    assert count.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert count.embed == model.embed.numel()
    assert count.lm_head == (0 if model.lm_head is None else model.lm_head.numel())


def test_every_family_is_among_the_models_counted():
    assert {load_model_config(n)["family"] for n in MODELS} == set(FAMILY_CONFIGS)
    assert any(n.endswith("_tiny") for n in MODELS)


def test_a_config_of_no_family_is_refused():
    with pytest.raises(TypeError, match="no parameter layout"):
        count_parameters(torch.nn.Linear(2, 2))
