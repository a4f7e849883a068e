"""Contract -> model -> install, in one place.

Every entry point that needs a runnable model (the RL run, the gates, the benchmarks) goes
through :func:`installed_model`: it reads the model config, builds (or takes) the contract, builds
the unified model, gives it weights (random from a seed, or a checkpoint, or none when another
model's weights are copied in later) and installs the contract, which binds every region.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .compose import build_contract, load_model_config, default_model_name
from .model import build_model, load_checkpoint


@dataclass
class Installed:
    model: Any
    contract: Any
    hf_config: dict


def installed_model(family: str, composition: str, arch: str, model: Optional[str] = None, *,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    seed: Optional[int] = 0, checkpoint: Optional[str] = None,
                    contract=None) -> Installed:
    """A model of ``family`` (config ``model``, the family's default if None) with the contract of
    ``composition`` on ``arch`` installed. Weights: ``checkpoint`` if given, else random from
    ``seed``, else (``seed=None``) left uninitialised for a weight copy. ``contract`` overrides
    the built one (an admitted contract read from a file, say)."""
    name = model or default_model_name(family)
    hf_config = load_model_config(name)["hf_config"]
    if contract is None:
        contract = build_contract(family, composition, arch, name)
    m = build_model(family, hf_config, dtype=dtype, device=device)
    if checkpoint:
        load_checkpoint(m, checkpoint)
    elif seed is not None:
        m.init_random(seed)
    m.install(contract)
    return Installed(m, contract, hf_config)
