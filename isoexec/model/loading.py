"""Loading transformers-format checkpoints into the unified model.

Reads ``model.safetensors`` or a sharded set described by ``model.safetensors.index.json``,
maps Hugging Face parameter names onto the fused layout of the unified model, and refuses with
a clear error: a missing file or shard, a missing tensor, a shape mismatch, or tensors the model
does not know.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from ..errors import IsoExecError
from .config import DenseConfig


class CheckpointError(IsoExecError):
    """A checkpoint is missing, incomplete or does not fit the model."""


def _shards(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} not found")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise CheckpointError(f"checkpoint {str(path)!r}: shard file(s) missing: {', '.join(missing)}")
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"checkpoint {str(path)!r} has neither model.safetensors nor model.safetensors.index.json")


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    for shard in _shards(Path(path)):
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{shard}: not a readable safetensors file ({exc})") from None


def dense_name_map(cfg: DenseConfig) -> dict[str, tuple[str, int, int]]:
    """HF name -> (unified parameter name, first row, row count) in the fused layout."""
    m: dict[str, tuple[str, int, int]] = {"model.embed_tokens.weight": ("embed", 0, cfg.vocab_size),
                                          "model.norm.weight": ("final_norm", 0, cfg.hidden_size)}
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = ("lm_head", 0, cfg.vocab_size)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    for i in range(cfg.num_layers):
        pre, to = f"model.layers.{i}.", f"layers.{i}."
        m.update({
            pre + "input_layernorm.weight": (to + "attn_norm", 0, cfg.hidden_size),
            pre + "self_attn.q_proj.weight": (to + "qkv_weight", 0, q),
            pre + "self_attn.k_proj.weight": (to + "qkv_weight", q, kv),
            pre + "self_attn.v_proj.weight": (to + "qkv_weight", q + kv, kv),
            pre + "self_attn.q_norm.weight": (to + "q_norm", 0, cfg.head_dim),
            pre + "self_attn.k_norm.weight": (to + "k_norm", 0, cfg.head_dim),
            pre + "self_attn.o_proj.weight": (to + "o_weight", 0, cfg.hidden_size),
            pre + "post_attention_layernorm.weight": (to + "mlp_norm", 0, cfg.hidden_size),
            pre + "mlp.gate_proj.weight": (to + "gate_up_weight", 0, inter),
            pre + "mlp.up_proj.weight": (to + "gate_up_weight", inter, inter),
            pre + "mlp.down_proj.weight": (to + "down_weight", 0, cfg.hidden_size),
        })
    return m


@torch.no_grad()
def load_named_tensors(model, tensors: Iterator[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                       name_map: dict[str, tuple[str, int, int]], source: str, strict: bool = True,
                       ignore: Callable[[str], bool] = lambda n: False) -> None:
    params = dict(model.named_parameters())
    seen: set[str] = set()
    unexpected: list[str] = []
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    for name, t in items:
        if name not in name_map:
            if not ignore(name):
                unexpected.append(name)
            continue
        target, start, rows = name_map[name]
        p = params[target]
        dest = p if (start == 0 and rows == p.shape[0]) else p[start:start + rows]
        if tuple(t.shape) != tuple(dest.shape):
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, the model expects "
                                  f"{tuple(dest.shape)} (is the config right?)")
        dest.copy_(t.to(dtype=p.dtype, device=p.device))
        seen.add(name)
    missing = sorted(set(name_map) - seen)
    if missing:
        raise CheckpointError(f"{source}: {len(missing)} tensor(s) missing, first {missing[0]!r}")
    if unexpected and strict:
        raise CheckpointError(f"{source}: {len(unexpected)} tensor(s) the model does not know, first "
                              f"{unexpected[0]!r}")


def _tied_extra(cfg: DenseConfig) -> Callable[[str], bool]:
    # Tied checkpoints often still carry lm_head.weight (a copy of the embedding).
    return lambda n: cfg.tie_word_embeddings and n == "lm_head.weight" or n.endswith("rotary_emb.inv_freq")


def load_dense_checkpoint(model, path: str | Path) -> None:
    load_named_tensors(model, iter_safetensors(path), dense_name_map(model.cfg), str(path),
                       ignore=_tied_extra(model.cfg))


def load_from_hf_model(model, hf_model) -> None:
    """Copy the weights of an in-memory transformers model (tests, conversions)."""
    state = {k: v for k, v in hf_model.state_dict().items()}
    load_named_tensors(model, state, dense_name_map(model.cfg), type(hf_model).__name__,
                       ignore=_tied_extra(model.cfg))


@torch.no_grad()
def to_hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's weights under transformers' Qwen3 names (for the transformers reference)."""
    params = dict(model.named_parameters())
    out = {}
    for name, (target, start, rows) in dense_name_map(model.cfg).items():
        p = params[target]
        out[name] = p[start:start + rows].clone()
    if model.cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
