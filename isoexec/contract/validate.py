"""Rule checks on a decoded contract. ``validate`` returns EVERY violation, not the first.

The rules (docs/contract.md): case ids are unique and entries only name declared cases; in every case
each logical op belongs to exactly one region (an op uncovered in some case is a violation, not a
default); a contract that claims a tolerance of 0 has a discharge on every function-half entry;
claims name known cases and axes; a tp claim above 1 of kind invariant comes with a pinned
K_LEAVES, divisible by every claimed size, on each row-parallel region, and one of kind variant
with none there (its sums are all_reduce); a variant claim above 1 and a tolerance of 0 exclude each
other; stored identities equal recomputed ones.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..errors import ContractInvalid
from .digests import compute_identities
from .schema import K_LEAVES, ROW_PARALLEL_OPS, SCHEMA_VERSION, STANDARD_CASES, ExecutionContract

# The role each standard case must have: a trainer_* case run by the engine would be a lie.
_STANDARD_ROLES = {"trainer_fwd": "trainer", "trainer_score": "trainer", "engine_prefill": "engine",
                   "engine_decode": "engine"}


@dataclass(frozen=True)
class Violation:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def validate(c: ExecutionContract, required_ops: frozenset[str] | None = None) -> list[Violation]:
    """All rule violations of ``c``. ``required_ops``: the model's logical ops, when known."""
    out: list[Violation] = []
    add = lambda path, msg: out.append(Violation(path, msg))  # noqa: E731

    if c.schema_version != SCHEMA_VERSION:
        add("$.schema_version", f"unsupported schema_version {c.schema_version!r}")

    case_ids = [x.id for x in c.cases]
    if not case_ids:
        add("$.cases", "a contract declares at least one case")
    seen: set[str] = set()
    for i, case in enumerate(c.cases):
        if case.id in seen:
            add(f"$.cases[{i}].id", f"duplicate case id {case.id!r}")
        seen.add(case.id)
        want = _STANDARD_ROLES.get(case.id)
        if want and case.role != want:
            add(f"$.cases[{i}].role", f"standard case {case.id!r} has role {want!r}, not {case.role!r}")
        if case.id == "trainer_fwd" and not case.grad:
            add(f"$.cases[{i}].grad", "trainer_fwd runs with autograd on (grad: true)")
        if case.id in STANDARD_CASES and case.id != "trainer_fwd" and case.grad:
            add(f"$.cases[{i}].grad", f"{case.id} runs without autograd (grad: false)")

    # Coverage: op -> case -> list of entry indices covering it.
    cover: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, e in enumerate(c.composition):
        p = f"$.composition[{i}]"
        if len(set(e.region)) != len(e.region):
            add(f"{p}.region", f"region {e.region_name!r} names an op twice")
        if len(set(e.cases)) != len(e.cases):
            add(f"{p}.cases", "an entry names a case twice")
        for case in e.cases:
            if case not in seen:
                add(f"{p}.cases", f"entry {e.region_name!r} names undeclared case {case!r}")
        if e.discharge is None and e.half == "function" and c.claims.claims_zero_tolerance:
            add(
                f"{p}.discharge",
                f"function-half entry {e.region_name!r} (impl {e.impl.id}) has no discharge, but the contract "
                "claims tolerance 0; run its gates (isoexec gates run) and build with --gates",
            )
        if e.half == "function":
            for op in e.region:
                for case in e.cases:
                    cover[op][case].append(i)
    for op in sorted(cover):
        for case in sorted(seen):
            hits = cover[op].get(case, [])
            if not hits:
                add("$.composition", f"logical op {op!r} has no region in case {case!r}")
            elif len(hits) > 1:
                add("$.composition", f"logical op {op!r} is in {len(hits)} regions in case {case!r} "
                    f"(entries {', '.join(str(h) for h in hits)}); each op belongs to exactly one region per case")
    if required_ops is not None:
        for op in sorted(set(required_ops) - set(cover)):
            add("$.composition", f"model op {op!r} ({c.model.family}) is covered by no region")
        for op in sorted(set(cover) - set(required_ops)):
            add("$.composition", f"op {op!r} is not an op of the {c.model.family} family")

    axes: set[str] = set()
    for i, t in enumerate(c.claims.topology):
        p = f"$.claims.topology[{i}]"
        if t.axis in axes:
            add(f"{p}.axis", f"axis {t.axis!r} is claimed twice")
        axes.add(t.axis)
        if not t.domain:
            add(f"{p}.domain", "a topology claim proves at least one size")
        if any(d < 1 for d in t.domain):
            add(f"{p}.domain", "sizes are positive integers")
        if len(set(t.domain)) != len(t.domain):
            add(f"{p}.domain", "a size is listed twice")
        if t.axis == "tp":
            for msg in tp_leaf_problems(c, t.domain):
                add(f"{p}.domain", msg)
        if t.kind == "variant" and any(d > 1 for d in t.domain) and c.claims.claims_zero_tolerance:
            # the trainer and the engine may run at different sizes of the axis (the RL run's trainer
            # at tp 1, its engine at engine_tp), whose bits the claim says differ
            add(f"{p}.kind", f"axis {t.axis!r} is claimed variant (its bits depend on its size) beside a "
                "tolerance of 0 between cases, which a trainer and an engine at different sizes cannot keep: "
                "claim it invariant, or claim no tolerance of 0")
    for i, s in enumerate(c.claims.state):
        if not s.invalidated_by:
            add(f"$.claims.state[{i}].invalidated_by", f"state {s.id!r} names no invalidating event")
    for i, t in enumerate(c.claims.tolerances):
        for case in t.cases:
            if case not in seen:
                add(f"$.claims.tolerances[{i}].cases", f"tolerance claim names undeclared case {case!r}")
        if t.cases[0] == t.cases[1]:
            add(f"$.claims.tolerances[{i}].cases", "a tolerance claim compares two different cases")
        for name in ("mean_abs", "max_abs"):
            if getattr(t.bounds, name).startswith("-"):
                add(f"$.claims.tolerances[{i}].bounds.{name}", "a bound is not negative")

    want = compute_identities(c)
    for name in ("semantic", "numerical_policy", "deployment"):
        stored, real = getattr(c.identities, name), getattr(want, name)
        if stored != real:
            add(f"$.identities.{name}", f"stored digest {stored[:12]}… does not match content ({real[:12]}…)")
    return out


def tp_leaf_problems(c: ExecutionContract, sizes) -> list[str]:
    """Why ``c`` cannot serve the tensor-parallel ``sizes``, from its row-parallel regions (o_proj,
    down_proj, gdn_out_proj: ``ROW_PARALLEL_OPS``), whose ``K_LEAVES`` says how the ranks' partials
    are summed. Under a tp claim of kind ``variant`` they are summed by ``all_reduce``, so no such
    region pins ``K_LEAVES`` (a pin would promise a fixed leaf order that the claim disowns).
    Otherwise each must pin its K leaf count L and every size above 1 must divide it, so that each
    rank holds L/tp whole leaves and every size adds the same L partials in one order."""
    out = []
    big = sorted(s for s in set(sizes) if s > 1)
    if not big:
        return out
    claim = c.topology_claim("tp")
    variant = claim is not None and claim.kind == "variant"
    for e in c.composition:
        rows = [o for o in e.region if o in ROW_PARALLEL_OPS]
        if not rows or e.half != "function":
            continue
        leaves = e.constants.get(K_LEAVES)
        if variant:
            if leaves is not None:
                out.append(f"tp={', '.join(map(str, big))}: the tp claim is variant (row-parallel partials summed by "
                           f"all_reduce), but row-parallel region {e.region_name!r} pins {K_LEAVES}={leaves!r}, a "
                           "fixed leaf order: drop the pin, or claim tp invariant")
            continue
        if leaves is None:
            sizes_text = ", ".join(map(str, big))
            out.append(f"tp={sizes_text}: row-parallel region {e.region_name!r} (impl {e.impl.id}) pins no "
                       f"{K_LEAVES}: the K leaves of its cross-rank sum must be a contract constant")
            continue
        bad = [s for s in big if not isinstance(leaves, int) or isinstance(leaves, bool) or leaves % s]
        if bad:
            sizes_text = ", ".join(map(str, bad))
            out.append(f"tp={sizes_text}: row-parallel region {e.region_name!r} pins {K_LEAVES}={leaves!r}, which "
                       "tp does not divide (each rank holds L/tp whole K leaves)")
    return out


def check(c: ExecutionContract, required_ops: frozenset[str] | None = None) -> ExecutionContract:
    """Raise ContractInvalid listing every violation; return ``c`` when it is valid."""
    violations = validate(c, required_ops)
    if violations:
        raise ContractInvalid(violations)
    return c
