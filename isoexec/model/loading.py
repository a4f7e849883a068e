"""Loading transformers-format checkpoints into the unified model.

Reads ``model.safetensors`` or a sharded set described by ``model.safetensors.index.json``,
maps Hugging Face parameter names onto the fused layout of the unified model, and refuses with
a clear error: a missing file or shard, a missing tensor, a shape mismatch, or tensors the model
does not know.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open
from safetensors.torch import save as safetensors_bytes

from ..errors import IsoExecError
from ..paths import atomic_write
from ..model_config import DenseConfig, HybridConfig, HybridMoeConfig, MlaMoeConfig


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
    for shard in _shards(Path(path)):
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{shard}: not a readable safetensors file ({exc})") from None


def dense_name_map(cfg: DenseConfig) -> dict[str, tuple[str, int, int]]:
    """HF name (``Qwen3ForCausalLM`` / ``Qwen2ForCausalLM``) -> (unified parameter name, first row, row
    count) in the fused layout. A qwen2 model has the q/k/v biases and no q/k norm weights."""
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
            pre + "self_attn.o_proj.weight": (to + "o_weight", 0, cfg.hidden_size),
            pre + "post_attention_layernorm.weight": (to + "mlp_norm", 0, cfg.hidden_size),
            pre + "mlp.gate_proj.weight": (to + "gate_up_weight", 0, inter),
            pre + "mlp.up_proj.weight": (to + "gate_up_weight", inter, inter),
            pre + "mlp.down_proj.weight": (to + "down_weight", 0, cfg.hidden_size),
        })
        if cfg.qk_norm:
            m.update({pre + "self_attn.q_norm.weight": (to + "q_norm", 0, cfg.head_dim),
                      pre + "self_attn.k_norm.weight": (to + "k_norm", 0, cfg.head_dim)})
        if cfg.qkv_bias:
            m.update({pre + "self_attn.q_proj.bias": (to + "qkv_bias", 0, q),
                      pre + "self_attn.k_proj.bias": (to + "qkv_bias", q, kv),
                      pre + "self_attn.v_proj.bias": (to + "qkv_bias", q + kv, kv)})
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


_MTP_LAYER = re.compile(r"^model\.mtp_layers\.\d+\.")


def _dense_ignore(cfg: DenseConfig) -> Callable[[str], bool]:
    # Tied checkpoints often still carry lm_head.weight (a copy of the embedding). MiMo checkpoints
    # (a qwen2 model) carry multi-token-prediction layers as model.mtp_layers.{j}.*: scoring and
    # generation use the next-token head only, so those are skipped (no other unknown name is).
    return lambda n: (cfg.tie_word_embeddings and n == "lm_head.weight" or n.endswith("rotary_emb.inv_freq")
                      or _MTP_LAYER.match(n) is not None)


def load_dense_checkpoint(model, path: str | Path) -> None:
    load_named_tensors(model, iter_safetensors(path), dense_name_map(model.cfg), str(path),
                       ignore=_dense_ignore(model.cfg))


def load_from_hf_model(model, hf_model) -> None:
    """Copy the weights of an in-memory transformers model (tests, conversions)."""
    if isinstance(model.cfg, HybridMoeConfig):
        return load_hybrid_moe_from_hf_model(model, hf_model)
    if isinstance(model.cfg, HybridConfig):
        return load_hybrid_from_hf_model(model, hf_model)
    if isinstance(model.cfg, MlaMoeConfig):
        return load_mla_moe_from_hf_model(model, hf_model)
    state = {k: v for k, v in hf_model.state_dict().items()}
    load_named_tensors(model, state, dense_name_map(model.cfg), type(hf_model).__name__,
                       ignore=_dense_ignore(model.cfg))


@torch.no_grad()
def to_hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's weights under the names of its transformers model (Qwen3 or Qwen2 for a dense
    model, Qwen3.5 for a hybrid one, ...)."""
    if isinstance(model.cfg, HybridMoeConfig):
        return _map_to_hf(model, hybrid_moe_name_map(model.cfg))
    if isinstance(model.cfg, HybridConfig):
        return _hybrid_to_hf(model)
    if isinstance(model.cfg, MlaMoeConfig):
        return _mla_moe_to_hf(model)
    params = dict(model.named_parameters())
    out = {}
    for name, (target, start, rows) in dense_name_map(model.cfg).items():
        p = params[target]
        out[name] = p[start:start + rows].clone()
    if model.cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def save_checkpoint(model, hf_config: dict, folder: str | Path) -> str:
    """Write ``model`` as a transformers checkpoint folder that :func:`load_checkpoint` reads back bit
    for bit (every family; tests/rl/test_shared_warmup.py): ``config.json`` (``hf_config``) and
    ``model.safetensors`` (:func:`to_hf_state_dict`, in the model's dtype; a tied ``lm_head`` is left
    out, safetensors stores no shared tensors). Each file is written to a temp file and renamed; the
    bytes depend only on the weights. Returns the SHA-256 of ``model.safetensors``."""
    tensors = to_hf_state_dict(model)
    if model.cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    blob = safetensors_bytes({k: v.detach().to("cpu").contiguous() for k, v in sorted(tensors.items())},
                             metadata={"format": "pt"})
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "config.json", json.dumps(hf_config, indent=1, sort_keys=True) + "\n")
    atomic_write(out / "model.safetensors", blob)
    return hashlib.sha256(blob).hexdigest()


# ------------------------------------------------------------------------------------------ hybrid
_HF_PREFIX = "model.language_model."   # Qwen3.5 multimodal checkpoints keep the text model here


def hybrid_name_map(cfg: HybridConfig) -> dict[str, tuple[str, int, int]]:
    """transformers ``Qwen3_5ForCausalLM`` name -> (unified parameter, first row, row count)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    m: dict[str, tuple[str, int, int]] = {"model.embed_tokens.weight": ("embed", 0, cfg.vocab_size),
                                          "model.norm.weight": ("final_norm", 0, h)}
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = ("lm_head", 0, cfg.vocab_size)
    for i, kind in enumerate(cfg.layer_types):
        pre, to = f"model.layers.{i}.", f"layers.{i}."
        m.update({
            pre + "input_layernorm.weight": (to + "attn_norm", 0, h),
            pre + "post_attention_layernorm.weight": (to + "mlp_norm", 0, h),
            pre + "mlp.gate_proj.weight": (to + "gate_up_weight", 0, inter),
            pre + "mlp.up_proj.weight": (to + "gate_up_weight", inter, inter),
            pre + "mlp.down_proj.weight": (to + "down_weight", 0, h),
        })
        if kind == "full_attention":
            q2, kv, a = 2 * cfg.q_size, cfg.kv_size, pre + "self_attn."
            m.update({
                a + "q_proj.weight": (to + "qkv_weight", 0, q2),
                a + "k_proj.weight": (to + "qkv_weight", q2, kv),
                a + "v_proj.weight": (to + "qkv_weight", q2 + kv, kv),
                a + "q_norm.weight": (to + "q_norm", 0, cfg.head_dim),
                a + "k_norm.weight": (to + "k_norm", 0, cfg.head_dim),
                a + "o_proj.weight": (to + "o_weight", 0, h),
            })
        else:
            c, v, hv, g = cfg.conv_dim, cfg.value_dim, cfg.linear_num_value_heads, pre + "linear_attn."
            m.update({
                g + "in_proj_qkv.weight": (to + "in_proj_weight", 0, c),
                g + "in_proj_z.weight": (to + "in_proj_weight", c, v),
                g + "in_proj_b.weight": (to + "in_proj_weight", c + v, hv),
                g + "in_proj_a.weight": (to + "in_proj_weight", c + v + hv, hv),
                g + "conv1d.weight": (to + "conv_weight", 0, c),
                g + "A_log": (to + "A_log", 0, hv),
                g + "dt_bias": (to + "dt_bias", 0, hv),
                g + "norm.weight": (to + "out_norm", 0, cfg.linear_value_head_dim),
                g + "out_proj.weight": (to + "out_weight", 0, h),
            })
    return m


def _hybrid_tensors(items) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers names and layouts -> the unified model's: the multimodal checkpoints' text prefix
    is dropped and conv1d weights [C, 1, W] become [C, W]."""
    for name, t in items:
        if name.startswith(_HF_PREFIX):
            name = "model." + name[len(_HF_PREFIX):]
        if name.endswith("linear_attn.conv1d.weight") and t.dim() == 3 and t.shape[1] == 1:
            t = t[:, 0]
        yield name, t


def _hybrid_ignore(cfg: HybridConfig) -> Callable[[str], bool]:
    # Tied checkpoints may still carry lm_head.weight; multimodal ones carry the vision tower and the
    # multi-token-prediction head, which the text model does not use.
    return lambda n: ((cfg.tie_word_embeddings and n == "lm_head.weight") or n.endswith("rotary_emb.inv_freq")
                      or n.startswith(("model.visual.", "mtp.")))


def load_checkpoint(model, path: str | Path) -> None:
    """Load a transformers safetensors checkpoint into a unified model of any family."""
    if isinstance(model.cfg, HybridMoeConfig):
        return load_hybrid_moe_checkpoint(model, path)
    if isinstance(model.cfg, HybridConfig):
        return load_hybrid_checkpoint(model, path)
    if isinstance(model.cfg, MlaMoeConfig):
        return load_mla_moe_checkpoint(model, path)
    return load_dense_checkpoint(model, path)


def load_hybrid_checkpoint(model, path: str | Path) -> None:
    """Load a Qwen3.5 (text or multimodal) safetensors checkpoint into a :class:`HybridModel`."""
    load_named_tensors(model, _hybrid_tensors(iter_safetensors(path)), hybrid_name_map(model.cfg), str(path),
                       ignore=_hybrid_ignore(model.cfg))


def load_hybrid_from_hf_model(model, hf_model) -> None:
    """Copy the weights of an in-memory transformers ``Qwen3_5ForCausalLM``."""
    load_named_tensors(model, _hybrid_tensors(hf_model.state_dict().items()), hybrid_name_map(model.cfg),
                       type(hf_model).__name__, ignore=_hybrid_ignore(model.cfg))


def _hybrid_to_hf(model) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    out = {}
    for name, (target, start, rows) in hybrid_name_map(model.cfg).items():
        t = params[target][start:start + rows].detach().clone()
        out[name] = t[:, None, :] if name.endswith("conv1d.weight") else t
    if model.cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# ------------------------------------------------------------------------------------------ mla_moe
def mla_moe_name_map(cfg: MlaMoeConfig) -> dict[str, tuple[str, int, int]]:
    """transformers ``Glm4MoeLiteForCausalLM`` / ``DeepseekV3ForCausalLM`` name (in-memory layout:
    stacked experts) -> (unified parameter, first row, row count)."""
    h = cfg.hidden_size
    m: dict[str, tuple[str, int, int]] = {"model.embed_tokens.weight": ("embed", 0, cfg.vocab_size),
                                          "model.norm.weight": ("final_norm", 0, h)}
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = ("lm_head", 0, cfg.vocab_size)
    qr, kvr, rd, nh = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_heads
    for i, kind in enumerate(cfg.mlp_layer_types):
        pre, to, a = f"model.layers.{i}.", f"layers.{i}.", f"model.layers.{i}.self_attn."
        m.update({
            pre + "input_layernorm.weight": (to + "attn_norm", 0, h),
            pre + "post_attention_layernorm.weight": (to + "mlp_norm", 0, h),
            a + "q_a_proj.weight": (to + "qkv_a_weight", 0, qr),
            a + "kv_a_proj_with_mqa.weight": (to + "qkv_a_weight", qr, kvr + rd),
            a + "q_a_layernorm.weight": (to + "q_a_norm", 0, qr),
            a + "q_b_proj.weight": (to + "q_b_weight", 0, nh * cfg.qk_head_dim),
            a + "kv_a_layernorm.weight": (to + "kv_a_norm", 0, kvr),
            a + "kv_b_proj.weight": (to + "kv_b_weight", 0, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
            a + "o_proj.weight": (to + "o_weight", 0, h),
        })
        mlp = pre + "mlp."
        if kind == "dense":
            inter = cfg.intermediate_size
            m.update({mlp + "gate_proj.weight": (to + "gate_up_weight", 0, inter),
                      mlp + "up_proj.weight": (to + "gate_up_weight", inter, inter),
                      mlp + "down_proj.weight": (to + "down_weight", 0, h)})
            continue
        E = cfg.n_routed_experts
        m.update({mlp + "gate.weight": (to + "router_weight", 0, E),
                  mlp + "gate.e_score_correction_bias": (to + "correction_bias", 0, E),
                  mlp + "experts.gate_up_proj": (to + "experts_gate_up", 0, E),
                  mlp + "experts.down_proj": (to + "experts_down", 0, E)})
        si = cfg.shared_intermediate_size
        if si:
            s = mlp + "shared_experts."
            m.update({s + "gate_proj.weight": (to + "shared_gate_up", 0, si),
                      s + "up_proj.weight": (to + "shared_gate_up", si, si),
                      s + "down_proj.weight": (to + "shared_down", 0, h)})
    return m


def _mla_moe_tensors(items, cfg: MlaMoeConfig, source: str) -> Iterator[tuple[str, torch.Tensor]]:
    return _stack_experts(items, cfg.n_routed_experts, source)


def _stack_experts(items, E: int, source: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint names and layouts -> the in-memory transformers layout: per-expert tensors
    ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (how checkpoints store them) are stacked into
    ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I] once a layer's
    experts are all read."""

    pat = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in items:
        hit = pat.match(name)
        if not hit:
            yield name, t
            continue
        base, e, part = hit.group(1), int(hit.group(2)), hit.group(3)
        if e >= E:
            raise CheckpointError(f"{source}: tensor {name!r} names expert {e}, the config has {E}")
        got = pending.setdefault(base, {})
        got[(e, part)] = t
        if len(got) == 3 * E:
            yield base + ".gate_up_proj", torch.stack([torch.cat([got[(j, "gate_proj")], got[(j, "up_proj")]])
                                                       for j in range(E)])
            yield base + ".down_proj", torch.stack([got[(j, "down_proj")] for j in range(E)])
            del pending[base]
    for base, got in pending.items():
        raise CheckpointError(f"{source}: {base}: {len(got)} of {3 * E} per-expert tensors present")


def _mla_moe_ignore(cfg: MlaMoeConfig) -> Callable[[str], bool]:
    # Tied checkpoints may carry lm_head.weight; GLM-4.7-Flash and DeepSeek-V3 checkpoints carry the
    # multi-token-prediction layer(s) as model.layers.{num_hidden_layers + j}, which the model skips.
    def ignore(n: str) -> bool:
        if (cfg.tie_word_embeddings and n == "lm_head.weight") or n.endswith("rotary_emb.inv_freq"):
            return True
        parts = n.split(".")
        return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() \
            and int(parts[2]) >= cfg.num_layers
    return ignore


def load_mla_moe_checkpoint(model, path: str | Path) -> None:
    """Load a GLM-4.7-Flash / DeepSeek-V3 style safetensors checkpoint into an :class:`MlaMoeModel`."""
    load_named_tensors(model, _mla_moe_tensors(iter_safetensors(path), model.cfg, str(path)),
                       mla_moe_name_map(model.cfg), str(path), ignore=_mla_moe_ignore(model.cfg))


def load_mla_moe_from_hf_model(model, hf_model) -> None:
    """Copy the weights of an in-memory transformers ``Glm4MoeLiteForCausalLM`` / ``DeepseekV3ForCausalLM``."""
    src = type(hf_model).__name__
    load_named_tensors(model, _mla_moe_tensors(hf_model.state_dict().items(), model.cfg, src),
                       mla_moe_name_map(model.cfg), src, ignore=_mla_moe_ignore(model.cfg))


def _mla_moe_to_hf(model) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    out = {name: params[target][start:start + rows].detach().clone()
           for name, (target, start, rows) in mla_moe_name_map(model.cfg).items()}
    if model.cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# ------------------------------------------------------------------------------------------ hybrid_moe
def hybrid_moe_name_map(cfg: HybridMoeConfig) -> dict[str, tuple[str, int, int]]:
    """transformers ``Qwen3_5MoeForCausalLM`` name (stacked experts) -> (unified parameter, first row,
    row count): the hybrid family's names with each layer's dense MLP replaced by the MoE block."""
    m = {n: t for n, t in hybrid_name_map(cfg).items()
         if not (".mlp." in n and n.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")))}
    h, E, si = cfg.hidden_size, cfg.num_experts, cfg.shared_expert_intermediate_size
    for i in range(cfg.num_layers):
        mlp, to = f"model.layers.{i}.mlp.", f"layers.{i}."
        m.update({mlp + "gate.weight": (to + "router_weight", 0, E),
                  mlp + "experts.gate_up_proj": (to + "experts_gate_up", 0, E),
                  mlp + "experts.down_proj": (to + "experts_down", 0, E)})
        if si:
            s = mlp + "shared_expert."
            m.update({s + "gate_proj.weight": (to + "shared_gate_up", 0, si),
                      s + "up_proj.weight": (to + "shared_gate_up", si, si),
                      s + "down_proj.weight": (to + "shared_down", 0, h),
                      mlp + "shared_expert_gate.weight": (to + "shared_gate", 0, 1)})
    return m


def load_hybrid_moe_checkpoint(model, path: str | Path) -> None:
    """Load a Qwen3.5-MoE (text or multimodal) safetensors checkpoint into a :class:`HybridMoeModel`."""
    load_named_tensors(model, _stack_experts(_hybrid_tensors(iter_safetensors(path)), model.cfg.num_experts,
                                             str(path)),
                       hybrid_moe_name_map(model.cfg), str(path), ignore=_hybrid_ignore(model.cfg))


def load_hybrid_moe_from_hf_model(model, hf_model) -> None:
    """Copy the weights of an in-memory transformers ``Qwen3_5MoeForCausalLM``."""
    src = type(hf_model).__name__
    load_named_tensors(model, _stack_experts(_hybrid_tensors(hf_model.state_dict().items()), model.cfg.num_experts,
                                             src),
                       hybrid_moe_name_map(model.cfg), src, ignore=_hybrid_ignore(model.cfg))


def _map_to_hf(model, name_map) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    out = {}
    for name, (target, start, rows) in name_map.items():
        t = params[target][start:start + rows].detach().clone()
        out[name] = t[:, None, :] if name.endswith("conv1d.weight") else t
    if model.cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
