"""Run-time enforcement of a contract: binding, recording, refusing.

``bind(entry, case)`` imports the callable the registry declares for the entry's impl, pins the
contract's constants on it, and records what was ACTUALLY bound (module and qualified name of the
object found, impl, constants). ``check_bindings`` refuses any record that differs from the
contract (a monkey-patched kernel, a different impl, a constant the kernel would not take).
``check_topology`` compares runtime facts (TP/EP/SP/PP/DP/CP sizes, arch) with the contract's
topology claims and refuses an unproven size before any compute.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from . import registry
from .contract import Entry, ExecutionContract
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


def _import(target: str, where: str) -> Any:
    module_name, _, qual = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise BindingRefused(f"{where}: cannot import {module_name!r} for {target!r}: {exc}") from None
    for part in qual.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise BindingRefused(f"{where}: {module_name!r} has no {qual!r}") from None
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
    target = spec.entry_for(case)
    fn = _import(target, where)
    module_name, _, qual = target.partition(":")
    actual_module, actual_qual = _origin(fn)
    if (actual_module, actual_qual) != (module_name, qual):
        raise BindingRefused(f"{where}: impl {spec.id} declares {target} but {module_name}.{qual} is now "
                             f"{actual_module}.{actual_qual} (patched?)")
    kwargs = {}
    params = _kwarg_names(fn)
    module = importlib.import_module(module_name)
    for name, value in entry.constants.items():
        if name not in spec.constants:
            raise BindingRefused(f"{where}: impl {spec.id} declares no constant {name!r}")
        if name.lower() in params:
            kwargs[name.lower()] = value
        elif hasattr(module, name):
            live = getattr(module, name)
            if live != value or type(live) is not type(value):
                raise BindingRefused(f"{where}: contract pins {name}={value!r} but {module_name}.{name} is {live!r}")
        elif len(spec.constants[name].allowed) > 1:
            raise BindingRefused(f"{where}: {target} can neither take nor expose constant {name!r}")
    bound_fn = functools.partial(fn, **kwargs) if kwargs else fn
    rec = BoundRecord(entry.region, case, actual_module, actual_qual, spec.id, spec.version, entry.impl.arch,
                      dict(entry.constants))
    return Bound(bound_fn, rec)


def _kwarg_names(fn: Any) -> set[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return set()
    return {p.name for p in sig.parameters.values()
            if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}


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
        module_name, _, qual = spec.entry_for(r.case).partition(":")
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
        import torch.distributed as dist

        from .envinfo import runtime_arch

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return cls(arch=runtime_arch(), dp=world)


def check_topology(contract: ExecutionContract, facts: RuntimeFacts) -> None:
    """Refuse, before any forward, a runtime size or arch the contract does not prove."""
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
    if problems:
        raise TopologyRefused("topology refused: " + "; ".join(problems))
