"""The unified model: one definition for trainer and engine, arithmetic bound from a contract."""

import torch

from ..errors import ConfigError
from .batch import ForwardBatch, KVCache
from ..model_config import DenseConfig, HybridConfig, HybridMoeConfig, MlaMoeConfig, hf_config_from_dict
from .dense import DenseModel
from .hybrid import HybridModel
from .mla_moe import MlaMoeModel
from .hybrid_moe import HybridMoeModel
from .loading import (CheckpointError, load_checkpoint, load_dense_checkpoint, load_from_hf_model,
                      load_hybrid_checkpoint, save_checkpoint)

FAMILY_MODELS = {"dense": (DenseModel, DenseConfig), "hybrid": (HybridModel, HybridConfig),
                 "mla_moe": (MlaMoeModel, MlaMoeConfig), "hybrid_moe": (HybridMoeModel, HybridMoeConfig)}


def build_model(family: str, hf_config: dict, dtype=None, device="cpu"):
    """An uninitialised model of ``family`` from a transformers config dict."""

    if family not in FAMILY_MODELS:
        raise ConfigError(f"the unified model has no {family!r} family yet (have: {', '.join(FAMILY_MODELS)})")
    model_cls, cfg_cls = FAMILY_MODELS[family]
    return model_cls(cfg_cls.from_hf(hf_config), dtype=dtype or torch.float32, device=device)


__all__ = ["DenseConfig", "DenseModel", "HybridConfig", "HybridModel", "MlaMoeConfig", "MlaMoeModel", "HybridMoeConfig",
           "HybridMoeModel", "ForwardBatch", "KVCache", "CheckpointError",
           "build_model", "hf_config_from_dict", "load_checkpoint", "load_dense_checkpoint", "load_hybrid_checkpoint",
           "load_from_hf_model", "save_checkpoint"]
