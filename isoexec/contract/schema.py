"""The execution contract as frozen dataclasses (schema_version "1", see docs/contract.md).

The objects are plain data: they do not know how they are encoded (``codec``), hashed
(``digests``) or checked (``validate``). Constants are held in a read-only mapping whose values
are ``int``, ``str`` or ``bool`` only; a float constant is written as a bit-pattern string such
as ``"f32:0x3f800000"`` so that no decimal rounding can ever enter a contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from types import MappingProxyType
from typing import Mapping, Optional, Union

SCHEMA_VERSION = "1"

STANDARD_CASES = ("trainer_fwd", "trainer_score", "engine_prefill", "engine_decode")
ROLES = ("trainer", "engine")
STATES = ("fresh", "continued", "resumable")
SHAPES = ("static", "variable")
HALVES = ("function", "deployment")
DISCHARGE_KINDS = ("gate", "equivalence_proof", "neutrality_proof")
TOPOLOGY_AXES = ("tp", "ep", "sp", "pp", "dp", "cp")
TOPOLOGY_KINDS = ("invariant", "pinned", "variant")
"""What a topology claim says about the sizes of its ``domain`` (docs/contract.md): ``invariant``,
every size computes the bits of size 1 (one process), so trainer and engine may run at different
sizes of it; ``pinned``, a run must be at a size of the domain and nothing is said across sizes (the
single-process compositions pin every axis to [1]); ``variant``, every size of the domain runs and
the bits depend on the size (a stock collective adds the ranks' partials in the backend's order),
so nothing is claimed across sizes and a tolerance of 0 cannot be claimed beside it (validate.py)."""

ROW_PARALLEL_OPS = ("o_proj", "down_proj", "gdn_out_proj")
"""The ops a tensor-parallel model runs row-parallel (K cut between ranks, the ranks' partial sums
added). Their ``K_LEAVES`` says how that sum is made: pinned (L, the K leaves of the sum, the same
at every tp), the leaves are gathered and added in one fixed order; not pinned, the ranks' partials
are summed by the backend's ``all_reduce``. So a contract claiming tp ``invariant`` above 1 must pin
it on their regions, divisible by every claimed size, and one claiming tp ``variant`` must not pin
it there (validate.py; docs/scale_out.md). The
dense family's o_proj and down_proj, and the hybrid family's Gated DeltaNet out_proj besides; the
MoE families' are the same ops (MLA's o_proj, mla_moe's dense down_proj, hybrid_moe's o_proj and
out_proj): their MoE layers add nothing across ranks (isoexec/model/tp_moe.py)."""
K_LEAVES = "K_LEAVES"

ConstantValue = Union[int, str, bool]


def frozen_mapping(items: Mapping[str, ConstantValue] | None = None) -> Mapping[str, ConstantValue]:
    """A read-only, key-sorted copy of ``items`` (constants must not change after build)."""
    items = dict(items or {})
    return MappingProxyType({k: items[k] for k in sorted(items)})


@dataclass(frozen=True)
class ModelSpec:
    family: str
    architectures: tuple[str, ...]
    config_digest: str


@dataclass(frozen=True)
class Case:
    id: str
    role: str
    grad: bool
    state: str
    shape: str


@dataclass(frozen=True)
class ImplRef:
    id: str
    version: str
    arch: str

    def __str__(self) -> str:
        return f"{self.id} v{self.version} ({self.arch})"


@dataclass(frozen=True)
class Discharge:
    kind: str
    ref: str


@dataclass(frozen=True)
class Entry:
    """One region of the model, run by one implementation in the listed cases."""

    region: tuple[str, ...]
    cases: tuple[str, ...]
    impl: ImplRef
    constants: Mapping[str, ConstantValue] = field(default_factory=frozen_mapping)
    discharge: Optional[Discharge] = None
    half: str = "function"

    @property
    def region_name(self) -> str:
        return "+".join(self.region)


@dataclass(frozen=True)
class TopologyClaim:
    axis: str
    kind: str
    domain: tuple[int, ...]
    proof: str


@dataclass(frozen=True)
class StateClaim:
    id: str
    invalidated_by: tuple[str, ...]


@dataclass(frozen=True)
class Bounds:
    mean_abs: str
    max_abs: str

    @property
    def is_zero(self) -> bool:
        return Decimal(self.mean_abs) == 0 and Decimal(self.max_abs) == 0


@dataclass(frozen=True)
class ToleranceClaim:
    cases: tuple[str, str]
    bounds: Bounds


@dataclass(frozen=True)
class Claims:
    topology: tuple[TopologyClaim, ...] = ()
    state: tuple[StateClaim, ...] = ()
    tolerances: tuple[ToleranceClaim, ...] = ()

    @property
    def claims_zero_tolerance(self) -> bool:
        return any(t.bounds.is_zero for t in self.tolerances)


@dataclass(frozen=True)
class Identities:
    semantic: str
    numerical_policy: str
    deployment: str


@dataclass(frozen=True)
class ExecutionContract:
    schema_version: str
    model: ModelSpec
    cases: tuple[Case, ...]
    composition: tuple[Entry, ...]
    claims: Claims
    identities: Identities

    @property
    def case_ids(self) -> tuple[str, ...]:
        return tuple(sorted(c.id for c in self.cases))

    def entries_for(self, case: str) -> tuple[Entry, ...]:
        return tuple(e for e in self.composition if case in e.cases)

    def topology_claim(self, axis: str) -> Optional[TopologyClaim]:
        """The claim about ``axis`` (None if the contract makes none)."""
        return next((t for t in self.claims.topology if t.axis == axis), None)

    def entry_for(self, op: str, case: str) -> Optional[Entry]:
        """The entry whose region holds logical ``op`` in ``case`` (None if uncovered)."""
        for e in self.composition:
            if op in e.region and case in e.cases:
                return e
        return None
