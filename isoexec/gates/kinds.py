"""Which gates each op kind gets and the function that runs them: one table, ``KINDS``.

A kind's gate families are what ``gates run`` produces for every region of that kind and what
``contract verify`` requires of the region's discharge. A kind gated across cases (attention and
the stateful Gated DeltaNet regions) has its runner given every case's bound callable
(``binds``). A new op kind gets its row here and a runner in ``kernel_gates`` (row-wise regions)
or ``gdn_gates`` (sequence regions); a kind without a row has no gate and cannot be discharged.

A row names its runner as ``"<module of isoexec.gates>.<function>"``, imported when the gate runs:
the gate modules import torch, and ``contract verify`` (through ``gate_families_for``) reads only
the families, so it starts without torch. ``tests/gates/test_kinds.py`` resolves every row's runner.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .. import registry
from ..contract import Entry

if TYPE_CHECKING:
    from .kernel_gates import GateOutcome


@dataclass(frozen=True)
class KindGates:
    families: tuple[str, ...]
    runner: str   # "kernel_gates.gate_linear": the function of isoexec.gates that runs them
    across_cases: bool = False   # bind every case of the entry and pass them as ``binds``

    @property
    def run(self) -> Callable[..., GateOutcome]:
        module, _, name = self.runner.rpartition(".")
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)


_ROW = ("batch_invariance",)
_ROW_HAZARDS = ("batch_invariance", "hazards")
_CASES = ("batch_invariance", "case_parity")

KINDS: dict[str, KindGates] = {
    "linear": KindGates(_ROW_HAZARDS, "kernel_gates.gate_linear"),
    "norm": KindGates(_ROW_HAZARDS, "kernel_gates.gate_norm"),
    "embed": KindGates(_ROW, "kernel_gates.gate_embed"),
    "activation": KindGates(_ROW, "kernel_gates.gate_activation"),
    "rope": KindGates(_ROW, "kernel_gates.gate_rope"),
    "logprob": KindGates(_ROW_HAZARDS, "kernel_gates.gate_logprob"),
    "attention": KindGates(_CASES, "kernel_gates.gate_attention", across_cases=True),
    "gdn_core": KindGates(_CASES, "gdn_gates.gate_gdn_core", across_cases=True),
    "gdn_conv": KindGates(_CASES, "gdn_gates.gate_gdn_conv", across_cases=True),
    "gdn_prep": KindGates(_ROW, "gdn_gates.gate_gdn_prep"),
    "gated_norm": KindGates(_ROW, "gdn_gates.gate_gated_norm"),
    "gate": KindGates(_ROW, "gdn_gates.gate_sigmoid_gate"),
    "router": KindGates(_ROW_HAZARDS, "moe_gates.gate_router"),
    "dispatch": KindGates(_ROW, "moe_gates.gate_dispatch"),
    "experts": KindGates(_ROW_HAZARDS, "moe_gates.gate_experts"),
    "combine": KindGates(_ROW, "moe_gates.gate_combine"),
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
