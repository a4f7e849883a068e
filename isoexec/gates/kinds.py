"""Which gates each op kind gets and the function that runs them: one table, ``KINDS``.

A kind's gate families are what ``gates run`` produces for every region of that kind and what
``contract verify`` requires of the region's discharge. A kind gated across cases (attention and
the stateful Gated DeltaNet regions) has its runner given every case's bound callable
(``binds``). A new op kind gets its row here and a runner in ``kernel_gates`` (row-wise regions)
or ``gdn_gates`` (sequence regions); a kind without a row has no gate and cannot be discharged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .. import registry
from ..contract import Entry
from .moe_gates import gate_combine, gate_dispatch, gate_experts, gate_router
from .gdn_gates import gate_gated_norm, gate_gdn_conv, gate_gdn_core, gate_gdn_prep, gate_sigmoid_gate
from .kernel_gates import (
    GateOutcome,
    gate_activation,
    gate_attention,
    gate_embed,
    gate_linear,
    gate_logprob,
    gate_norm,
    gate_rope,
)


@dataclass(frozen=True)
class KindGates:
    families: tuple[str, ...]
    run: Callable[..., GateOutcome]
    across_cases: bool = False   # bind every case of the entry and pass them as ``binds``


_ROW = ("batch_invariance",)
_ROW_HAZARDS = ("batch_invariance", "hazards")
_CASES = ("batch_invariance", "case_parity")

KINDS: dict[str, KindGates] = {
    "linear": KindGates(_ROW_HAZARDS, gate_linear),
    "norm": KindGates(_ROW_HAZARDS, gate_norm),
    "embed": KindGates(_ROW, gate_embed),
    "activation": KindGates(_ROW, gate_activation),
    "rope": KindGates(_ROW, gate_rope),
    "logprob": KindGates(_ROW_HAZARDS, gate_logprob),
    "attention": KindGates(_CASES, gate_attention, across_cases=True),
    "gdn_core": KindGates(_CASES, gate_gdn_core, across_cases=True),
    "gdn_conv": KindGates(_CASES, gate_gdn_conv, across_cases=True),
    "gdn_prep": KindGates(_ROW, gate_gdn_prep),
    "gated_norm": KindGates(_ROW, gate_gated_norm),
    "gate": KindGates(_ROW, gate_sigmoid_gate),
    "router": KindGates(_ROW_HAZARDS, gate_router),
    "dispatch": KindGates(_ROW, gate_dispatch),
    "experts": KindGates(_ROW_HAZARDS, gate_experts),
    "combine": KindGates(_ROW, gate_combine),
}

# Kinds whose stock kernel is known to be batch-variant on an arch (measured; docs/gpu_notes.md): the
# negative control must fail to be invariant there.
NEGATIVE_CONTROLS = {"cpu": ("linear",), "sm90": ("linear", "attention")}


def gate_families_for(entry: Entry) -> tuple[str, ...]:
    """The gate families an entry's discharge needs (by the kind of its region's ops)."""
    k = KINDS.get(registry.OPS[entry.region[0]].kind)
    return k.families if k else ()


def kernel_gate_names() -> frozenset[str]:
    return frozenset(f for k in KINDS.values() for f in k.families)
