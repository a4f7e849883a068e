"""Run-time enforcement of a contract: binding, recording, refusing.

``bind(entry, case)`` takes the callable the registry declares for the entry's impl (the kernel
folder's ``IMPLS``), checks that it is still the object its module exports under its name (a
monkey-patched kernel is refused), pins the contract's constants on it, and records what was bound
(module and qualified name, impl, constants). ``check_bindings`` refuses any record that differs
from the contract (a different callable or impl, other constants).
``check_topology`` compares runtime facts (TP/EP/SP/PP/DP/CP sizes, arch) with the contract's
topology claims and refuses an unproven size before any compute; the model adds what its own shape
refuses (a tp that does not divide its kv heads), so one error names every problem.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch.distributed as dist

from . import registry
from .contract import Entry, ExecutionContract
from .contract.validate import tp_leaf_problems
from .envinfo import runtime_arch
from .errors import BindingRefused, CompositionError, TopologyRefused


@dataclass(frozen=True)
class BoundRecord:
    region: tuple[str, ...]
    case: str
    module: str
    qualname: str
    impl_id: str
    impl_version: str
    impl_arch: str
    constants: Mapping[str, Any]

    def as_dict(self) -> dict:
        return {"region": list(self.region), "case": self.case, "module": self.module, "qualname": self.qualname,
                "impl": {"id": self.impl_id, "version": self.impl_version, "arch": self.impl_arch},
                "constants": dict(self.constants)}


@dataclass(frozen=True)
class Bound:
    fn: Callable
    record: BoundRecord

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _exported(module_name: str, qualname: str) -> Any:
    """The object module ``module_name`` holds under ``qualname`` now (None if it holds none)."""
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _origin(fn: Any) -> tuple[str, str]:
    base = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(base, "__module__", "?"), getattr(base, "__qualname__", getattr(base, "__name__", "?"))


def bind(entry: Entry, case: str) -> Bound:
    """Bind one (region, case) entry to its callable with the contract's constants pinned."""
    where = f"region {entry.region_name}, case {case}"
    if case not in entry.cases:
        raise BindingRefused(f"{where}: the contract entry does not cover this case")
    try:
        spec = registry.impl_by_ref(entry.impl.id, entry.impl.version, entry.impl.arch)
    except CompositionError as exc:
        raise BindingRefused(f"{where}: {exc}") from None
    try:
        fn = registry.entry_for(spec, case)
    except CompositionError as exc:
        raise BindingRefused(f"{where}: {exc}") from None
    module_name, qual = _origin(fn)
    live = _exported(module_name, qual)
    if live is not fn:
        found = "nothing" if live is None else ".".join(_origin(live))
        raise BindingRefused(f"{where}: impl {spec.id} declares {module_name}.{qual}, but that name now holds "
                             f"{found} (patched?)")
    kwargs = {}
    for name, value in entry.constants.items():
        const = spec.constants.get(name)
        if const is None:
            raise BindingRefused(f"{where}: impl {spec.id} declares no constant {name!r}")
        if const.arg is not None:
            kwargs[const.arg] = value
        elif const.has_fixed and (const.fixed != value or type(const.fixed) is not type(value)):
            raise BindingRefused(f"{where}: contract pins {name}={value!r} but {spec.id} runs with "
                                 f"{name}={const.fixed!r}")
    bound_fn = functools.partial(fn, **kwargs) if kwargs else fn
    rec = BoundRecord(entry.region, case, module_name, qual, spec.id, spec.version, entry.impl.arch,
                      dict(entry.constants))
    return Bound(bound_fn, rec)


@dataclass
class ExecutionPlan:
    """Every logical op of one case bound to its callable."""

    contract: ExecutionContract
    case: str
    by_op: dict[str, Bound] = field(default_factory=dict)

    @classmethod
    def build(cls, contract: ExecutionContract, case: str) -> "ExecutionPlan":
        if case not in contract.case_ids:
            raise BindingRefused(f"case {case!r} is not declared by the contract ({', '.join(contract.case_ids)})")
        plan = cls(contract, case)
        for e in contract.entries_for(case):
            if e.half != "function":
                continue
            b = bind(e, case)
            for op in e.region:
                plan.by_op[op] = b
        check_bindings(contract, plan.records())
        return plan

    def __getitem__(self, op: str) -> Bound:
        try:
            return self.by_op[op]
        except KeyError:
            raise BindingRefused(f"op {op!r} has no region in case {self.case!r} of this contract") from None

    def records(self) -> list[BoundRecord]:
        seen, out = set(), []
        for b in self.by_op.values():
            if id(b) not in seen:
                seen.add(id(b))
                out.append(b.record)
        return out


def check_bindings(contract: ExecutionContract, records: list[BoundRecord]) -> None:
    """Refuse if what was bound differs from the contract in any (region, case)."""
    problems = []
    for r in records:
        e = next((x for x in contract.composition if tuple(sorted(x.region)) == tuple(sorted(r.region))
                  and r.case in x.cases), None)
        where = f"region {'+'.join(r.region)}, case {r.case}"
        if e is None:
            problems.append(f"{where}: bound but not in the contract")
            continue
        spec = registry.impl_by_ref(e.impl.id, e.impl.version, e.impl.arch)
        module_name, qual = _origin(registry.entry_for(spec, r.case))
        if (r.impl_id, r.impl_version, r.impl_arch) != (e.impl.id, e.impl.version, e.impl.arch):
            problems.append(f"{where}: bound impl {r.impl_id} v{r.impl_version} ({r.impl_arch}) vs contract {e.impl}")
        if (r.module, r.qualname) != (module_name, qual):
            problems.append(f"{where}: bound {r.module}.{r.qualname}, contract impl {e.impl.id} is "
                            f"{module_name}.{qual}")
        if dict(r.constants) != dict(e.constants):
            problems.append(f"{where}: bound constants {dict(r.constants)} vs contract {dict(e.constants)}")
    if problems:
        raise BindingRefused("binding differs from the contract: " + "; ".join(problems))


# ------------------------------------------------------------------------------------ topology
@dataclass(frozen=True)
class RuntimeFacts:
    arch: str
    tp: int = 1
    ep: int = 1
    sp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1

    @classmethod
    def detect(cls) -> "RuntimeFacts":
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return cls(arch=runtime_arch(), dp=world)


def check_topology(contract: ExecutionContract, facts: RuntimeFacts, model_problems: Iterable[str] = ()) -> None:
    """Refuse, before any forward, a runtime size or arch the contract does not prove.
    ``model_problems``: what the model's own shape refuses at these sizes (``DenseModel.tp_problems``),
    reported in the same error."""
    problems = []
    arches = {e.impl.arch for e in contract.composition}
    if facts.arch not in arches:
        problems.append(f"runtime arch {facts.arch!r} but the contract's impls are for {', '.join(sorted(arches))}")
    claims = {t.axis: t for t in contract.claims.topology}
    for axis in ("tp", "ep", "sp", "pp", "dp", "cp"):
        size = getattr(facts, axis)
        claim = claims.get(axis)
        if claim is None:
            if size != 1:
                problems.append(f"{axis}={size} but the contract makes no {axis} claim (only size 1 is implied)")
        elif size not in claim.domain:
            problems.append(f"{axis}={size} is not in the proven domain {sorted(claim.domain)} ({claim.kind}, proof "
                            f"{claim.proof})")
    problems += tp_leaf_problems(contract, [facts.tp])
    problems += list(model_problems)
    if problems:
        raise TopologyRefused("topology refused: " + "; ".join(problems))
