"""The registry: ONE declarative table of logical ops, model families and implementations.

- A logical op (``OPS``) is one step of a model's arithmetic (``q_proj``, ``attn_core``...). Its
  ``kind`` says which implementations may run it.
- A family (``FAMILIES``) lists the logical ops its model executes; a contract for that family
  must place every one of them in exactly one region per case.
- An implementation (``IMPLS``) is a kernel (or a stock torch op) for one op kind on one arch, with
  a version, the callable it binds per case, the constants that can be pinned and their allowed
  values, capabilities (``grad``, ``cuda_graph``, ``paged``) and the hazards its gates exercise.

Nothing here runs arithmetic; ``isoexec.enforce`` imports the callables and ``isoexec.compose``
turns a composition YAML plus this table into a contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from .errors import CompositionError

ARCHES = ("cpu", "sm90")


@dataclass(frozen=True)
class OpSpec:
    id: str
    kind: str
    doc: str


@dataclass(frozen=True)
class FamilySpec:
    id: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    ops: tuple[str, ...]


@dataclass(frozen=True)
class ConstantSpec:
    default: int | str | bool
    allowed: tuple[int | str | bool, ...]

    def admits(self, value) -> bool:
        # bool is an int in Python; True must not stand in for 1.
        return any(type(value) is type(a) and value == a for a in self.allowed)


@dataclass(frozen=True)
class ImplSpec:
    id: str
    version: str
    kind: str
    archs: tuple[str, ...]
    entry: Mapping[str, str]                 # case id (or "*") -> "module:qualified.name"
    constants: Mapping[str, ConstantSpec] = field(default_factory=dict)
    capabilities: frozenset[str] = frozenset()
    hazards: tuple[str, ...] = ()
    half: str = "function"
    fusable: bool = False                     # may cover several ops of its kind in one region
    native: bool = False                      # stock library path (negative-control side)
    doc: str = ""

    def entry_for(self, case: str) -> str:
        if case in self.entry:
            return self.entry[case]
        if "*" in self.entry:
            return self.entry["*"]
        raise CompositionError(f"impl {self.id!r} has no callable for case {case!r}")

    def default_constants(self) -> dict:
        return {k: v.default for k, v in self.constants.items()}


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
    "dense": FamilySpec("dense", ("qwen3",), ("Qwen3ForCausalLM",), _ENDS + _ATTN + _MLP),
    "mla_moe": FamilySpec(
        "mla_moe", ("glm4_moe_lite", "deepseek_v3"), ("Glm4MoeLiteForCausalLM", "DeepseekV3ForCausalLM"),
        _ENDS + ("attn_norm", "q_a_proj", "q_a_norm", "q_b_proj", "kv_a_proj", "kv_a_norm", "kv_b_proj", "rope",
                 "attn_core", "o_proj") + _MLP + _MOE),
    "hybrid": FamilySpec("hybrid", ("qwen3_5_text",), ("Qwen3_5ForCausalLM",),
                         _ENDS + _ATTN + ("attn_gate",) + _GDN + _MLP),
    "hybrid_moe": FamilySpec("hybrid_moe", ("qwen3_5_moe_text",), ("Qwen3_5MoeForCausalLM",),
                             _ENDS + _ATTN + ("attn_gate",) + _GDN + ("mlp_norm",) + _MOE),
})


def _c(default, *allowed) -> ConstantSpec:
    return ConstantSpec(default, tuple(allowed) or (default,))


_K = "isoexec_kernels"

# ---------------------------------------------------------------------------------- implementations
IMPLS: tuple[ImplSpec, ...] = (
    # ---- IsoExec: batch-invariant kernels (Triton on sm90, fixed-order torch reference on cpu)
    ImplSpec("embed_gather", "1", "embed", ARCHES, {"*": f"{_K}.embedding.api:embedding"},
             capabilities=frozenset({"grad", "cuda_graph"}),
             doc="row gather: no arithmetic, invariant by construction"),
    ImplSpec("rmsnorm_fixed", "1", "norm", ARCHES, {"*": f"{_K}.rmsnorm.api:rms_norm"},
             constants={"ACC_DTYPE": _c("fp32")},
             capabilities=frozenset({"grad", "cuda_graph"}), hazards=("signed_zero", "subnormal", "noncontiguous"),
             doc="fp32 statistics, one fixed reduction order over the hidden dim"),
    ImplSpec("gemm_fixed_k", "1", "linear", ARCHES, {"*": f"{_K}.gemm.api:linear"},
             constants={"BLOCK_K": _c(64, 32, 64, 128), "ACC_DTYPE": _c("fp32")},
             capabilities=frozenset({"grad", "cuda_graph"}), fusable=True,
             hazards=("signed_zero", "subnormal", "k_not_tile_multiple", "noncontiguous"),
             doc="fixed BLOCK_K, sequential K-block accumulation in fp32 keyed on (N, K) only; no split-K"),
    ImplSpec("rope_fp32", "1", "rope", ARCHES, {"*": f"{_K}.rope.api:apply_rope"},
             capabilities=frozenset({"grad", "cuda_graph"}),
             doc="fp32 phases from absolute positions, neox rotate-half"),
    ImplSpec("attention_fixed_walk", "1", "attention", ARCHES,
             {"trainer_fwd": f"{_K}.attention.api:varlen_attention", "trainer_score": f"{_K}.attention.api:varlen_attention",
              "engine_prefill": f"{_K}.attention.api:paged_prefill_attention",
              "engine_decode": f"{_K}.attention.api:paged_decode_attention"},
             constants={"BLOCK_N": _c(64)},
             capabilities=frozenset({"grad", "cuda_graph", "paged"}), hazards=("len_not_tile_multiple",),
             doc="KV blocks of BLOCK_N at absolute positions walked in order with an fp32 online softmax"),
    ImplSpec("silu_mul_fp32", "1", "activation", ARCHES, {"*": f"{_K}.activation.api:silu_and_mul"},
             capabilities=frozenset({"grad", "cuda_graph"}), doc="elementwise: SiLU in fp32 then multiply"),
    ImplSpec("logprob_fixed", "1", "logprob", ARCHES, {"*": f"{_K}.logprob.api:token_logprobs"},
             constants={"BLOCK_V": _c(4096, 1024, 2048, 4096)},
             capabilities=frozenset({"grad", "cuda_graph"}), hazards=("v_not_tile_multiple", "ties"),
             doc="fp32 online max/sum-exp over fixed vocabulary blocks in order"),
    # ---- IsoExec, hybrid family (Qwen3.5: Gated DeltaNet + gated attention)
    ImplSpec("conv_fixed_taps", "1", "gdn_conv", ARCHES,
             {"trainer_fwd": f"{_K}.gdn_conv.api:causal_conv1d_varlen",
              "trainer_score": f"{_K}.gdn_conv.api:causal_conv1d_varlen",
              "engine_prefill": f"{_K}.gdn_conv.api:causal_conv1d_engine",
              "engine_decode": f"{_K}.gdn_conv.api:causal_conv1d_decode"},
             capabilities=frozenset({"grad", "cuda_graph"}),
             doc="depthwise causal conv: fp32 taps summed in increasing tap order, then SiLU; the engine "
                 "continues each sequence from its slot's conv window"),
    ImplSpec("gdn_prep_fp32", "1", "gdn_prep", ARCHES, {"*": f"{_K}.gdn_prep.api:gdn_prep"},
             capabilities=frozenset({"grad", "cuda_graph"}),
             doc="fp32 q/k L2 norm with a fixed-order row sum, q scaled by Dk**-0.5; g and beta in fp32"),
    ImplSpec("gdn_cpr", "1", "gdn_core", ARCHES,
             {"trainer_fwd": f"{_K}.gdn_core.api:gdn_cpr_varlen", "trainer_score": f"{_K}.gdn_core.api:gdn_cpr_varlen",
              "engine_prefill": f"{_K}.gdn_core.api:gdn_cpr_engine",
              "engine_decode": f"{_K}.gdn_core.api:gdn_cpr_decode"},
             constants={"CHUNK": _c(64)},
             capabilities=frozenset({"grad", "cuda_graph"}),
             doc="gated delta rule in chunks of CHUNK tokens at absolute positions; the engine keeps the "
                 "partial chunk in its state slot so every split gives the trainer's bits"),
    ImplSpec("gated_rmsnorm_fixed", "1", "gated_norm", ARCHES, {"*": f"{_K}.gated_rmsnorm.api:gated_rms_norm"},
             constants={"ACC_DTYPE": _c("fp32")},
             capabilities=frozenset({"grad", "cuda_graph"}),
             doc="fp32 statistics in one fixed order over the head dim, then weight and SiLU(gate)"),
    ImplSpec("sigmoid_gate_fp32", "1", "gate", ARCHES, {"*": f"{_K}.sigmoid_gate.api:sigmoid_gate"},
             capabilities=frozenset({"grad", "cuda_graph"}), doc="elementwise: x * sigmoid(gate) in fp32"),
    # ---- native: stock torch / cuBLAS / SDPA / torch.log_softmax (the comparison baseline)
    ImplSpec("torch_embedding", "torch", "embed", ARCHES, {"*": f"{_K}.embedding.native:embedding_native"},
             capabilities=frozenset({"grad", "cuda_graph"}), native=True),
    ImplSpec("torch_rmsnorm", "torch", "norm", ARCHES, {"*": f"{_K}.rmsnorm.native:rms_norm_native"},
             capabilities=frozenset({"grad", "cuda_graph"}), native=True),
    ImplSpec("torch_linear", "torch", "linear", ARCHES, {"*": f"{_K}.gemm.native:linear_native"},
             capabilities=frozenset({"grad", "cuda_graph"}), fusable=True, native=True,
             doc="torch.nn.functional.linear: cuBLAS / CPU BLAS, batch-variant"),
    ImplSpec("torch_rope", "torch", "rope", ARCHES, {"*": f"{_K}.rope.native:apply_rope_native"},
             capabilities=frozenset({"grad", "cuda_graph"}), native=True),
    ImplSpec("torch_sdpa", "torch", "attention", ARCHES,
             {"trainer_fwd": f"{_K}.attention.native:attention_native_varlen",
              "trainer_score": f"{_K}.attention.native:attention_native_varlen",
              "engine_prefill": f"{_K}.attention.native:attention_native_paged_prefill",
              "engine_decode": f"{_K}.attention.native:attention_native_paged_decode"},
             capabilities=frozenset({"grad", "cuda_graph", "paged"}), native=True),
    ImplSpec("torch_silu_mul", "torch", "activation", ARCHES, {"*": f"{_K}.activation.native:silu_and_mul_native"},
             capabilities=frozenset({"grad", "cuda_graph"}), native=True),
    ImplSpec("torch_log_softmax", "torch", "logprob", ARCHES, {"*": f"{_K}.logprob.native:token_logprobs_native"},
             capabilities=frozenset({"grad", "cuda_graph"}), native=True),
    ImplSpec("torch_conv1d", "torch", "gdn_conv", ARCHES,
             {"trainer_fwd": f"{_K}.gdn_conv.native:conv1d_native_varlen",
              "trainer_score": f"{_K}.gdn_conv.native:conv1d_native_varlen",
              "engine_prefill": f"{_K}.gdn_conv.native:conv1d_native_engine",
              "engine_decode": f"{_K}.gdn_conv.native:conv1d_native_decode"},
             capabilities=frozenset({"grad", "cuda_graph"}), native=True, doc="F.conv1d per sequence + F.silu"),
    ImplSpec("torch_gdn_prep", "torch", "gdn_prep", ARCHES, {"*": f"{_K}.gdn_prep.native:gdn_prep_native"},
             capabilities=frozenset({"grad", "cuda_graph"}), native=True),
    ImplSpec("gdn_chunk_native", "1", "gdn_core", ARCHES,
             {"trainer_fwd": f"{_K}.gdn_core.native:gdn_chunk_varlen",
              "trainer_score": f"{_K}.gdn_core.native:gdn_chunk_varlen",
              "engine_prefill": f"{_K}.gdn_core.native:gdn_chunk_engine",
              "engine_decode": f"{_K}.gdn_core.native:gdn_recurrent_decode"},
             constants={"CHUNK": _c(64)},
             capabilities=frozenset({"grad", "cuda_graph"}), native=True,
             doc="stock-style chunked gated delta rule (trainer, prefill) and token recurrence (decode)"),
    ImplSpec("torch_gated_rmsnorm", "torch", "gated_norm", ARCHES, {"*": f"{_K}.gated_rmsnorm.native:gated_rms_norm_native"},
             capabilities=frozenset({"grad", "cuda_graph"}), native=True),
    ImplSpec("torch_sigmoid_gate", "torch", "gate", ARCHES, {"*": f"{_K}.sigmoid_gate.native:sigmoid_gate_native"},
             capabilities=frozenset({"grad", "cuda_graph"}), native=True),
    # ---- deployment settings
    ImplSpec("paged_kv", "1", "deployment", ARCHES, {"*": "isoexec.engine.block_manager:BlockManager"},
             constants={"PAGE_SIZE": _c(16, 16, 32, 64, 128, 256)}, half="deployment",
             doc="page geometry changes memory layout only; attention walks absolute positions"),
)

_BY_KEY = {(i.id, a): i for i in IMPLS for a in i.archs}


def family(name: str) -> FamilySpec:
    try:
        return FAMILIES[name]
    except KeyError:
        raise CompositionError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None


def op(name: str) -> OpSpec:
    try:
        return OPS[name]
    except KeyError:
        raise CompositionError(f"unknown region/logical op {name!r}; known ops are listed in isoexec.registry.OPS")


def impl(impl_id: str, arch: str) -> ImplSpec:
    if arch not in ARCHES:
        raise CompositionError(f"unknown arch {arch!r}; known: {', '.join(ARCHES)}")
    spec = _BY_KEY.get((impl_id, arch))
    if spec is None:
        if any(i.id == impl_id for i in IMPLS):
            raise CompositionError(f"impl {impl_id!r} has no variant for arch {arch!r}")
        raise CompositionError(f"unknown impl {impl_id!r}; known: {', '.join(sorted({i.id for i in IMPLS}))}")
    return spec


def impl_by_ref(impl_id: str, version: str, arch: str) -> ImplSpec:
    spec = impl(impl_id, arch)
    if spec.version != version:
        raise CompositionError(f"impl {impl_id!r} on {arch} is version {spec.version!r} in this isoexec, "
                               f"the contract says {version!r}")
    return spec


def native_counterpart(kind: str, arch: str) -> ImplSpec | None:
    """The stock implementation of an op kind (the negative-control side of a gate)."""
    for i in IMPLS:
        if i.native and i.kind == kind and arch in i.archs:
            return i
    return None
