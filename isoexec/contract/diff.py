"""Structured differences between two contracts.

``diff(a, b)`` lists every differing (region, case) and claim, each tagged with the identity it
moves (semantic, numerical_policy or deployment). The handshake shows the numerical_policy ones
when it refuses; ``isoexec contract diff`` prints them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .codec import discharge_obj
from .schema import Entry, ExecutionContract


@dataclass(frozen=True)
class Difference:
    identity: str          # which identity this difference rotates: semantic | numerical_policy | deployment | none
    where: str             # "region q_proj+k_proj, case engine_decode", "claim topology tp", "model"
    field: str             # "impl.version", "constants.BLOCK_K", "present"
    a: Any
    b: Any

    def __str__(self) -> str:
        return f"{self.where}: {self.field} {_show(self.a)} vs {_show(self.b)}"

    def as_dict(self) -> dict:
        return {"identity": self.identity, "where": self.where, "field": self.field, "a": self.a, "b": self.b}


def _show(v: Any) -> str:
    if v is None:
        return "(absent)"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _by_region_case(c: ExecutionContract) -> dict[tuple[str, str], Entry]:
    out = {}
    for e in c.composition:
        for case in e.cases:
            out[("+".join(sorted(e.region)), case)] = e
    return out


def _entry_fields(e: Entry) -> dict[str, Any]:
    fields = {
        "impl.id": e.impl.id,
        "impl.version": e.impl.version,
        "impl.arch": e.impl.arch,
        "half": e.half,
        "discharge": None if e.discharge is None else f"{e.discharge.kind}:{e.discharge.ref}",
    }
    for k, v in e.constants.items():
        fields[f"constants.{k}"] = v
    return fields


def diff(a: ExecutionContract, b: ExecutionContract) -> list[Difference]:
    out: list[Difference] = []
    if a.schema_version != b.schema_version:
        out.append(Difference("numerical_policy", "contract", "schema_version", a.schema_version, b.schema_version))
    for name in ("family", "config_digest"):
        if getattr(a.model, name) != getattr(b.model, name):
            out.append(Difference("semantic", "model", name, getattr(a.model, name), getattr(b.model, name)))
    if sorted(a.model.architectures) != sorted(b.model.architectures):
        out.append(Difference("semantic", "model", "architectures", ",".join(sorted(a.model.architectures)),
                              ",".join(sorted(b.model.architectures))))

    ca, cb = {c.id: c for c in a.cases}, {c.id: c for c in b.cases}
    for cid in sorted(set(ca) | set(cb)):
        x, y = ca.get(cid), cb.get(cid)
        if x is None or y is None:
            out.append(Difference("numerical_policy", f"case {cid}", "present", x is not None, y is not None))
            continue
        for name in ("role", "grad", "state", "shape"):
            if getattr(x, name) != getattr(y, name):
                ident = "semantic" if name == "shape" else "none"
                out.append(Difference(ident, f"case {cid}", name, getattr(x, name), getattr(y, name)))

    ea, eb = _by_region_case(a), _by_region_case(b)
    for key in sorted(set(ea) | set(eb)):
        region, case = key
        where = f"region {region}, case {case}"
        x, y = ea.get(key), eb.get(key)
        half = (x or y).half
        ident = "numerical_policy" if half == "function" else "deployment"
        if x is None or y is None:
            out.append(Difference(ident, where, "present", str(x.impl) if x else None, str(y.impl) if y else None))
            continue
        fx, fy = _entry_fields(x), _entry_fields(y)
        if x.half != y.half:
            ident = "numerical_policy"
        for name in sorted(set(fx) | set(fy)):
            if fx.get(name) != fy.get(name):
                out.append(Difference(ident, where, name, fx.get(name), fy.get(name)))

    ta, tb = {t.axis: t for t in a.claims.topology}, {t.axis: t for t in b.claims.topology}
    for axis in sorted(set(ta) | set(tb)):
        x, y = ta.get(axis), tb.get(axis)
        where = f"claim topology {axis}"
        if x is None or y is None:
            out.append(Difference("numerical_policy", where, "present", x is not None, y is not None))
            continue
        for name in ("kind", "domain", "proof"):
            vx, vy = getattr(x, name), getattr(y, name)
            if name == "domain":
                vx, vy = sorted(vx), sorted(vy)
            if vx != vy:
                out.append(Difference("numerical_policy", where, name, vx, vy))

    sa, sb = {s.id: sorted(s.invalidated_by) for s in a.claims.state}, {s.id: sorted(s.invalidated_by) for s in b.claims.state}
    for sid in sorted(set(sa) | set(sb)):
        if sa.get(sid) != sb.get(sid):
            out.append(Difference("deployment", f"claim state {sid}", "invalidated_by", sa.get(sid), sb.get(sid)))

    def tol_key(t):
        return "/".join(sorted(t.cases))

    oa = {tol_key(t): (t.bounds.mean_abs, t.bounds.max_abs) for t in a.claims.tolerances}
    ob = {tol_key(t): (t.bounds.mean_abs, t.bounds.max_abs) for t in b.claims.tolerances}
    for k in sorted(set(oa) | set(ob)):
        if oa.get(k) != ob.get(k):
            fmt = lambda v: None if v is None else f"mean_abs {v[0]}, max_abs {v[1]}"  # noqa: E731
            out.append(Difference("deployment", f"claim tolerance {k}", "bounds", fmt(oa.get(k)), fmt(ob.get(k))))
    return out


def policy_differences(a: ExecutionContract, b: ExecutionContract) -> list[Difference]:
    return [d for d in diff(a, b) if d.identity == "numerical_policy"]


def format_diff(diffs: list[Difference], label_a: str = "a", label_b: str = "b") -> str:
    if not diffs:
        return "no differences"
    lines = [f"{len(diffs)} difference(s) ({label_a} vs {label_b}):"]
    lines += [f"  [{d.identity}] {d}" for d in diffs]
    return "\n".join(lines)


__all__ = ["Difference", "diff", "policy_differences", "format_diff", "discharge_obj"]
