"""The registry: the logical ops, the model families, and the implementations the kernels declare.

- A logical op (``OPS``) is one step of a model's arithmetic (``q_proj``, ``attn_core``...). Its
  ``kind`` says which implementations may run it.
- A family (``FAMILIES``) lists the logical ops its model executes; a contract for that family
  must place every one of them in exactly one region per case.
- An implementation (``IMPLS``) is a kernel (or a stock torch op) for one op kind, with a version,
  the callable it binds per case, the constants that can be pinned and their allowed values,
  capabilities (``grad``, ``cuda_graph``, ``paged``) and the hazards its gates exercise. Each op
  folder of ``isoexec_kernels`` declares its own in ``IMPLS`` (``isoexec_kernels/impl.py``); this
  module collects every folder's, and adds the deployment settings (``paged_kv``), which are not
  kernels.

Nothing here runs arithmetic; ``isoexec.enforce`` binds the callables and ``isoexec.compose``
turns a composition YAML plus this table into a contract.

``OPS`` and ``FAMILIES`` are plain data; ``IMPLS`` holds the kernels' real callables, so the op
folders (and torch) are imported the first time ``IMPLS`` or a function that reads it (``impl``,
``native_counterpart``) is used, not when this module is: checking a contract's ops against its
family (``isoexec contract show``/``verify``/``diff``) then starts without torch.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

import isoexec_kernels
from isoexec_kernels.impl import ARCHES
from isoexec_kernels.impl import Constant as ConstantSpec
from isoexec_kernels.impl import Impl as ImplSpec

from .errors import CompositionError

__all__ = ["ARCHES", "OPS", "FAMILIES", "IMPLS", "OpSpec", "FamilySpec", "ImplSpec", "ConstantSpec", "family", "op",
           "model_ops", "impl", "impl_by_ref", "entry_for", "native_counterpart"]


@dataclass(frozen=True)
class OpSpec:
    id: str
    kind: str
    doc: str


@dataclass(frozen=True)
class FamilySpec:
    """``architectures[i]``: the transformers class of ``model_types[i]``. ``ops``: every logical op
    a model of the family may run. ``optional_ops``: groups of them that a model of the family may
    lack, each as a whole (the dense family's q/k norm, absent from a qwen2 model); the model config
    says which (``model_config``: a config's ``absent_ops``)."""

    id: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    ops: tuple[str, ...]
    optional_ops: tuple[tuple[str, ...], ...] = ()


def _ops(*rows: tuple[str, str, str]) -> Mapping[str, OpSpec]:
    return MappingProxyType({r[0]: OpSpec(*r) for r in rows})


# ----------------------------------------------------------------------------------------- ops
OPS: Mapping[str, OpSpec] = _ops(
    ("embed", "embed", "token embedding lookup"),
    ("attn_norm", "norm", "RMSNorm before the token mixer"),
    ("mlp_norm", "norm", "RMSNorm before the channel mixer"),
    ("final_norm", "norm", "RMSNorm before the lm_head"),
    ("q_norm", "norm", "per-head RMSNorm of queries"),
    ("k_norm", "norm", "per-head RMSNorm of keys"),
    ("q_proj", "linear", "query projection"),
    ("k_proj", "linear", "key projection"),
    ("v_proj", "linear", "value projection"),
    ("o_proj", "linear", "attention output projection"),
    ("q_a_proj", "linear", "MLA query down-projection"),
    ("q_a_norm", "norm", "MLA query latent RMSNorm"),
    ("q_b_proj", "linear", "MLA query up-projection"),
    ("kv_a_proj", "linear", "MLA joint KV down-projection (with rope key)"),
    ("kv_a_norm", "norm", "MLA KV latent RMSNorm"),
    ("kv_b_proj", "linear", "MLA KV up-projection"),
    ("rope", "rope", "rotary position embedding of q and k"),
    ("attn_core", "attention", "softmax(QK^T)V over the causal context"),
    ("attn_gate", "gate", "sigmoid output gate of gated attention: attn * sigmoid(gate)"),
    ("gate_proj", "linear", "MLP gate projection"),
    ("up_proj", "linear", "MLP up projection"),
    ("act", "activation", "SiLU(gate) * up"),
    ("down_proj", "linear", "MLP down projection"),
    ("router", "router", "MoE router logits and top-k selection"),
    ("dispatch", "dispatch", "MoE token permutation to experts"),
    ("experts", "experts", "MoE expert MLPs (grouped GEMM + activation)"),
    ("combine", "combine", "MoE weighted un-permutation, summed in a fixed order"),
    ("shared_gate_proj", "linear", "shared expert gate projection"),
    ("shared_up_proj", "linear", "shared expert up projection"),
    ("shared_act", "activation", "shared expert SiLU(gate) * up"),
    ("shared_down_proj", "linear", "shared expert down projection"),
    ("gdn_in_proj", "linear", "Gated DeltaNet input projection (q, k, v, z)"),
    ("gdn_ba_proj", "linear", "Gated DeltaNet beta/alpha projection"),
    ("gdn_conv", "gdn_conv", "Gated DeltaNet short causal convolution"),
    ("gdn_prep", "gdn_prep", "q/k L2 norm, gating g and beta"),
    ("gdn_core", "gdn_core", "gated delta rule recurrence (CPR or chunked)"),
    ("gdn_out_norm", "gated_norm", "gated output RMSNorm: rmsnorm(o) * w * silu(z)"),
    ("gdn_out_proj", "linear", "Gated DeltaNet output projection"),
    ("lm_head", "linear", "vocabulary projection"),
    ("logprob", "logprob", "fp32 log-softmax over the vocabulary and target gather"),
    ("tp_allreduce", "collective", "tensor-parallel sum of partial outputs"),
    # deployment settings: cannot change bits (where proved neutral)
    ("kv_pages", "deployment", "paged KV cache geometry and memory sizing"),
    ("cuda_graph", "deployment", "CUDA graph capture of decode steps"),
    ("weight_sync", "deployment", "trainer-to-engine weight transport"),
)

_ATTN = ("attn_norm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "rope", "attn_core", "o_proj")
_MLP = ("mlp_norm", "gate_proj", "up_proj", "act", "down_proj")
_MOE = ("router", "dispatch", "experts", "combine", "shared_gate_proj", "shared_up_proj", "shared_act",
        "shared_down_proj")
_GDN = ("gdn_in_proj", "gdn_ba_proj", "gdn_conv", "gdn_prep", "gdn_core", "gdn_out_norm", "gdn_out_proj")
_ENDS = ("embed", "final_norm", "lm_head", "logprob")

FAMILIES: Mapping[str, FamilySpec] = MappingProxyType({
    "dense": FamilySpec("dense", ("qwen3", "qwen2"), ("Qwen3ForCausalLM", "Qwen2ForCausalLM"), _ENDS + _ATTN + _MLP,
                        optional_ops=(("q_norm", "k_norm"),)),
    "mla_moe": FamilySpec(
        "mla_moe", ("glm4_moe_lite", "deepseek_v3"), ("Glm4MoeLiteForCausalLM", "DeepseekV3ForCausalLM"),
        _ENDS + ("attn_norm", "q_a_proj", "q_a_norm", "q_b_proj", "kv_a_proj", "kv_a_norm", "kv_b_proj", "rope",
                 "attn_core", "o_proj") + _MLP + _MOE),
    "hybrid": FamilySpec("hybrid", ("qwen3_5_text",), ("Qwen3_5ForCausalLM",),
                         _ENDS + _ATTN + ("attn_gate",) + _GDN + _MLP),
    "hybrid_moe": FamilySpec("hybrid_moe", ("qwen3_5_moe_text",), ("Qwen3_5MoeForCausalLM",),
                             _ENDS + _ATTN + ("attn_gate",) + _GDN + ("mlp_norm",) + _MOE),
})


# ---------------------------------------------------------------------------------- implementations
def _kernel_impls() -> tuple[ImplSpec, ...]:
    """Every op folder's ``IMPLS``, folders in name order: a new folder is found without being
    listed anywhere."""
    found: list[ImplSpec] = []
    for info in pkgutil.iter_modules(isoexec_kernels.__path__):
        if info.ispkg:
            found += getattr(importlib.import_module(f"isoexec_kernels.{info.name}"), "IMPLS", ())
    return tuple(found)


# Deployment settings: they change memory layout or scheduling, never a kernel, so they are not
# bound to a callable (the engine reads them from the contract).
DEPLOYMENT_IMPLS: tuple[ImplSpec, ...] = (
    ImplSpec("paged_kv", "1", "deployment", None,
             constants={"PAGE_SIZE": ConstantSpec(16, (16, 32, 64, 128, 256))}, capabilities=frozenset(),
             half="deployment", doc="page geometry changes memory layout only; attention walks absolute positions"),
)


def _check_table(impls: tuple[ImplSpec, ...]) -> None:
    kinds = {o.kind for o in OPS.values()}
    seen: set = set()
    for i in impls:
        if i.kind not in kinds:
            raise CompositionError(f"impl {i.id!r} implements kind {i.kind!r}, which no op in OPS has")
        for a in i.archs:
            if (i.id, a) in seen:
                raise CompositionError(f"impl {i.id!r} is declared twice for arch {a!r}")
            seen.add((i.id, a))


@functools.cache
def _impls() -> tuple[ImplSpec, ...]:
    """``IMPLS``, collected and checked once, on first use (importing the op folders imports torch)."""
    impls = _kernel_impls() + DEPLOYMENT_IMPLS
    _check_table(impls)
    return impls


@functools.cache
def _by_key() -> dict[tuple[str, str], ImplSpec]:
    return {(i.id, a): i for i in _impls() for a in i.archs}


def __getattr__(name: str):
    # ``registry.IMPLS``: the module attribute, computed when first read (PEP 562)
    if name == "IMPLS":
        return _impls()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def family(name: str) -> FamilySpec:
    try:
        return FAMILIES[name]
    except KeyError:
        raise CompositionError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None


def model_ops(name: str, absent=()) -> tuple[str, ...]:
    """The logical ops a model of family ``name`` runs when it lacks the ops ``absent``, which must
    be whole groups of the family's ``optional_ops``."""
    fam = family(name)
    absent = set(absent)
    groups = [set(g) for g in fam.optional_ops if set(g) & absent]
    whole = set().union(*groups) if groups else set()
    if absent != whole:
        known = "; ".join("+".join(g) for g in fam.optional_ops) or "none"
        raise CompositionError(f"a {fam.id} model cannot lack op(s) {', '.join(sorted(absent))}: only whole "
                               f"optional groups may be absent (the family's: {known})")
    return tuple(o for o in fam.ops if o not in absent)


def op(name: str) -> OpSpec:
    try:
        return OPS[name]
    except KeyError:
        raise CompositionError(f"unknown region/logical op {name!r}; known ops are listed in isoexec.registry.OPS")


def impl(impl_id: str, arch: str) -> ImplSpec:
    if arch not in ARCHES:
        raise CompositionError(f"unknown arch {arch!r}; known: {', '.join(ARCHES)}")
    spec = _by_key().get((impl_id, arch))
    if spec is None:
        if any(i.id == impl_id for i in _impls()):
            raise CompositionError(f"impl {impl_id!r} has no variant for arch {arch!r}")
        raise CompositionError(f"unknown impl {impl_id!r}; known: {', '.join(sorted({i.id for i in _impls()}))}")
    return spec


def impl_by_ref(impl_id: str, version: str, arch: str) -> ImplSpec:
    spec = impl(impl_id, arch)
    if spec.version != version:
        raise CompositionError(f"impl {impl_id!r} on {arch} is version {spec.version!r} in this isoexec, "
                               f"the contract says {version!r}")
    return spec


def entry_for(spec: ImplSpec, case: str) -> Callable:
    """The callable ``spec`` runs for ``case`` (refused if it serves no such case)."""
    fn = spec.callable_for(case)
    if fn is None:
        raise CompositionError(f"impl {spec.id!r} has no callable for case {case!r}")
    return fn


def native_counterpart(kind: str, arch: str) -> ImplSpec | None:
    """The stock implementation of an op kind (the negative-control side of a gate)."""
    for i in _impls():
        if i.native and i.kind == kind and arch in i.archs:
            return i
    return None
