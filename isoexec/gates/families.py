"""Which gate families each kernel kind must pass, and where its stock kernel is a negative control.

Plain data, without torch: ``contract verify`` reads it (through ``artifacts``) to know which
passing artifacts an entry needs, and so starts without importing torch. The gate runners live in
``kernel_gates`` and ``gdn_gates``, which re-export these tables."""

from __future__ import annotations

from ..contract import Entry

KERNEL_GATE_FAMILIES = {
    "linear": ("batch_invariance", "hazards"),
    "norm": ("batch_invariance", "hazards"),
    "embed": ("batch_invariance",),
    "activation": ("batch_invariance",),
    "rope": ("batch_invariance",),
    "logprob": ("batch_invariance", "hazards"),
    "attention": ("batch_invariance", "case_parity"),
}
# the Gated DeltaNet kinds (gdn_gates runs them)
GDN_GATE_FAMILIES = {"gdn_core": ("batch_invariance", "case_parity"), "gdn_conv": ("batch_invariance", "case_parity"),
                     "gdn_prep": ("batch_invariance",), "gated_norm": ("batch_invariance",),
                     "gate": ("batch_invariance",)}
GATE_FAMILIES = {**KERNEL_GATE_FAMILIES, **GDN_GATE_FAMILIES}

# Kinds whose stock kernel is known to be batch-variant on an arch (measured; docs/gpu_notes.md): the
# negative control must fail to be invariant there.
NEGATIVE_CONTROLS = {"cpu": ("linear",), "sm90": ("linear", "attention")}


def gate_families_for(entry: Entry) -> tuple[str, ...]:
    from .. import registry

    return GATE_FAMILIES.get(registry.OPS[entry.region[0]].kind, ())
