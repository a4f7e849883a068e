"""Build an execution contract from a composition YAML, the registry and a model family.

A composition (``configs/compositions/<name>.yaml``) says, for every region, which implementation
runs it with which pinned constants, and how each entry is discharged. Building refuses: an
unknown region (logical op), impl, constant or value; an op kind the impl does not implement; a
model op left uncovered (or covered twice) in some case; a case the impl cannot serve (trainer_fwd
needs ``grad``); and a function-half entry without discharge in a contract claiming tolerance 0.

Gate discharges are written ``{kind: gate, ref: pending}`` until gate artifacts exist; building
with a ``resolve`` step (the CLI's ``--gates DIR`` passes ``gates.artifacts.resolve_discharges``)
replaces each by the ids of the passing artifacts for that exact region, impl, version, arch and
constants (the admitted contract).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

from . import registry
from .contract import (
    STANDARD_CASES,
    TOPOLOGY_KINDS,
    Bounds,
    Case,
    Claims,
    Discharge,
    Entry,
    ExecutionContract,
    Identities,
    ImplRef,
    ModelSpec,
    StateClaim,
    TopologyClaim,
    ToleranceClaim,
    check,
    frozen_mapping,
    with_identities,
)
from .errors import CompositionError, ConfigError
from .model_config import FAMILY_CONFIGS
from .paths import resolve_config
from .yamlio import check_schema, load_yaml

PENDING = "pending"

STANDARD_CASE_DEFS = {
    "trainer_fwd": dict(role="trainer", grad=True, state="fresh", shape="variable"),
    "trainer_score": dict(role="trainer", grad=False, state="fresh", shape="variable"),
    "engine_prefill": dict(role="engine", grad=False, state="resumable", shape="variable"),
    "engine_decode": dict(role="engine", grad=False, state="continued", shape="static"),
}

_NAME = {"type": "string", "minLength": 1}
_CONST = {"type": ["integer", "string", "boolean"]}
COMPOSITION_SCHEMA: dict = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "entries"],
    "properties": {
        "name": _NAME,
        "description": {"type": "string"},
        "cases": {"type": "array", "minItems": 1, "items": {"oneOf": [_NAME, {
            "type": "object", "additionalProperties": False, "required": ["id", "role", "grad", "state", "shape"],
            "properties": {"id": _NAME, "role": {"enum": ["trainer", "engine"]}, "grad": {"type": "boolean"},
                           "state": {"enum": ["fresh", "continued", "resumable"]},
                           "shape": {"enum": ["static", "variable"]}}}]}},
        "claims": {
            "type": "object", "additionalProperties": False,
            "properties": {
                "topology": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False, "required": ["axis", "kind", "domain", "proof"],
                    "properties": {"axis": {"enum": ["tp", "ep", "sp", "pp", "dp", "cp"]},
                                   "kind": {"enum": list(TOPOLOGY_KINDS)},
                                   "domain": {"type": "array", "minItems": 1, "items": {"type": "integer",
                                                                                      "minimum": 1}},
                                   "proof": _NAME}}},
                "state": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False, "required": ["id", "invalidated_by"],
                    "properties": {"id": _NAME, "invalidated_by": {"type": "array", "minItems": 1,
                                                                   "items": _NAME}}}},
                "tolerances": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False, "required": ["cases", "bounds"],
                    "properties": {"cases": {"type": "array", "minItems": 2, "maxItems": 2, "items": _NAME},
                                   "bounds": {"type": "object", "additionalProperties": False,
                                              "required": ["mean_abs", "max_abs"],
                                              "properties": {"mean_abs": {"type": "string"},
                                                             "max_abs": {"type": "string"}}}}}},
            },
        },
        "entries": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False, "required": ["region", "impl"],
            "properties": {
                "region": {"type": "array", "minItems": 1, "items": _NAME},
                "impl": _NAME,
                "cases": {"type": "array", "minItems": 1, "items": _NAME},
                "families": {"type": "array", "minItems": 1, "items": _NAME},
                "archs": {"type": "array", "minItems": 1, "items": _NAME},
                "constants": {"type": "object", "additionalProperties": _CONST},
                "discharge": {"oneOf": [{"type": "null"}, {"const": "gate"}, {
                    "type": "object", "additionalProperties": False, "required": ["kind", "ref"],
                    "properties": {"kind": {"enum": ["gate", "equivalence_proof", "neutrality_proof"]},
                                   "ref": _NAME}}]},
            }}},
    },
}


def load_composition(name_or_path: str) -> tuple[str, dict]:
    path = resolve_config("compositions", name_or_path)
    data = load_yaml(path, "composition")
    check_schema(data, COMPOSITION_SCHEMA, f"composition {str(path)!r}")
    return str(path), data


# ------------------------------------------------------------------------------------ model config
def config_digest(hf_config: dict) -> str:
    """SHA-256 of the canonical JSON of the model's configuration (keys sorted)."""
    text = json.dumps(hf_config, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


MODEL_SCHEMA: dict = {
    "type": "object", "additionalProperties": False, "required": ["family", "hf_config"],
    "properties": {"family": {"enum": list(registry.FAMILIES)}, "description": {"type": "string"},
                   "architectures": {"type": "array", "items": _NAME},
                   "hf_config": {"type": "object", "required": ["model_type"]}},
}


def load_model_config(name_or_path: str) -> dict:
    path = resolve_config("models", name_or_path)
    data = load_yaml(path, "model config")
    check_schema(data, MODEL_SCHEMA, f"model config {str(path)!r}")
    fam = registry.family(data["family"])
    if data["hf_config"]["model_type"] not in fam.model_types:
        raise ConfigError(f"model config {str(path)!r}: model_type {data['hf_config']['model_type']!r} is not a "
                          f"{fam.id} model type ({', '.join(fam.model_types)})")
    # the whole transformers config is checked here, before any gate, run or benchmark starts
    if fam.id in FAMILY_CONFIGS:
        try:
            FAMILY_CONFIGS[fam.id].from_hf(data["hf_config"])
        except ConfigError as exc:
            raise ConfigError(f"model config {str(path)!r}: {exc}") from None
    return data


def model_ops(family: str, hf_config: dict) -> tuple[str, ...]:
    """The logical ops a model of ``family`` with this transformers config runs: the family's ops
    less the optional group(s) the config has none of (a qwen2 dense model has no q/k norm)."""
    cls = FAMILY_CONFIGS.get(family)
    absent = getattr(cls.from_hf(hf_config), "absent_ops", ()) if cls is not None else ()
    return registry.model_ops(family, absent)


def _default_architecture(fam: registry.FamilySpec, model_type: str) -> tuple[str]:
    """The transformers class of ``model_type`` (``architectures[i]`` is that of ``model_types[i]``),
    for a model YAML that names none."""
    return (fam.architectures[fam.model_types.index(model_type)],)


def default_model_name(family: str) -> str:
    return f"{family}_tiny"


# ------------------------------------------------------------------------------------------- build
def _cases(spec: dict) -> tuple[Case, ...]:
    out = []
    for c in spec.get("cases") or list(STANDARD_CASES):
        if isinstance(c, str):
            if c not in STANDARD_CASE_DEFS:
                raise CompositionError(f"case {c!r} is not a standard case ({', '.join(STANDARD_CASES)}); "
                                       "declare it in full (id, role, grad, state, shape)")
            out.append(Case(id=c, **STANDARD_CASE_DEFS[c]))
        else:
            out.append(Case(**c))
    return tuple(out)


def _claims(spec: dict) -> Claims:
    c = spec.get("claims") or {}
    return Claims(
        topology=tuple(TopologyClaim(t["axis"], t["kind"], tuple(t["domain"]), t["proof"])
                       for t in c.get("topology", [])),
        state=tuple(StateClaim(s["id"], tuple(s["invalidated_by"])) for s in c.get("state", [])),
        tolerances=tuple(ToleranceClaim(tuple(t["cases"]), Bounds(**t["bounds"])) for t in c.get("tolerances", [])),
    )


def _entry_applies(raw: dict, fam: registry.FamilySpec, arch: str) -> bool:
    if "archs" in raw and arch not in raw["archs"]:
        return False
    if "families" in raw:
        for f in raw["families"]:
            registry.family(f)
        return fam.id in raw["families"]
    ops = raw["region"]
    if all(registry.op(o).kind == "deployment" for o in ops):
        return True
    inside = [o for o in ops if o in fam.ops]
    if inside and len(inside) != len(ops):
        outside = [o for o in ops if o not in fam.ops]
        raise CompositionError(f"region {'+'.join(ops)} mixes {fam.id} ops with region op(s) "
                               f"{', '.join(repr(o) for o in outside)} that the {fam.id} family does not have")
    return bool(inside)


def build_entries(spec: dict, fam: registry.FamilySpec, arch: str, case_ids: tuple[str, ...],
                  where: str) -> list[Entry]:
    entries = []
    for i, raw in enumerate(spec["entries"]):
        p = f"{where}: entries[{i}]"
        for o in raw["region"]:
            registry.op(o)  # unknown op -> refusal naming it
        if not _entry_applies(raw, fam, arch):
            continue
        region = tuple(sorted(raw["region"]))
        impl = registry.impl(raw["impl"], arch)
        for o in region:
            kind = registry.OPS[o].kind
            if kind != impl.kind:
                raise CompositionError(f"{p}: impl {impl.id!r} implements {impl.kind!r} ops, but region op {o!r} "
                                       f"is a {kind!r} op")
            if o not in fam.ops and kind != "deployment":
                raise CompositionError(f"{p}: op {o!r} is not an op of the {fam.id} family")
        if len(region) > 1 and not impl.fusable:
            raise CompositionError(f"{p}: impl {impl.id!r} cannot fuse several ops into one region "
                                   f"({'+'.join(region)})")
        cases = tuple(sorted(raw.get("cases") or case_ids))
        for c in cases:
            if c not in case_ids:
                raise CompositionError(f"{p}: unknown case {c!r} (declared: {', '.join(case_ids)})")
            if impl.half == "function":
                registry.entry_for(impl, c)
        if "trainer_fwd" in cases and "grad" not in impl.capabilities and impl.half == "function":
            raise CompositionError(f"{p}: impl {impl.id!r} has no backward (capability 'grad') but runs in "
                                   "trainer_fwd")
        constants = impl.default_constants()
        for name, value in (raw.get("constants") or {}).items():
            if name not in impl.constants:
                declared = ", ".join(impl.constants) or "none"
                raise CompositionError(f"{p}: impl {impl.id!r} declares no constant {name!r} (declares: {declared})")
            if not impl.constants[name].admits(value):
                allowed = ", ".join(map(repr, impl.constants[name].allowed))
                raise CompositionError(f"{p}: constant {name}={value!r} is not allowed for impl {impl.id!r} "
                                       f"(allowed: {allowed})")
            constants[name] = value
        d = raw.get("discharge")
        if d == "gate":
            discharge = Discharge("gate", PENDING)
        elif isinstance(d, dict):
            discharge = Discharge(d["kind"], d["ref"])
        else:
            discharge = None
        entries.append(Entry(region=region, cases=cases, impl=ImplRef(impl.id, impl.version, arch),
                             constants=frozen_mapping(constants), discharge=discharge, half=impl.half))
    return entries


def check_coverage(entries: list[Entry], fam: registry.FamilySpec, case_ids: tuple[str, ...], where: str) -> None:
    problems = []
    for case in case_ids:
        for o in fam.ops:
            n = sum(1 for e in entries if case in e.cases and o in e.region)
            if n == 0:
                problems.append(f"model op {o!r} has no region in case {case!r}")
            elif n > 1:
                problems.append(f"model op {o!r} is in {n} regions in case {case!r}")
    if problems:
        raise CompositionError(f"{where}: the composition does not cover the {fam.id} family: "
                               + "; ".join(problems[:8]) + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""))


def build_contract(family: str, composition: str, arch: str, model: str | None = None,
                   resolve: Callable[[list[Entry]], list[Entry]] | None = None) -> ExecutionContract:
    """The contract for ``family`` under ``composition`` on ``arch`` (validated; raises on refusal).
    ``resolve`` maps the entries before the contract is sealed: the CLI passes the gate layer's
    ``resolve_discharges`` for a gates folder (this module sits below the gates and never imports
    them)."""
    fam = registry.family(family)
    if arch not in registry.ARCHES:
        raise CompositionError(f"unknown arch {arch!r}; known: {', '.join(registry.ARCHES)}")
    where, spec = load_composition(composition)
    model_cfg = load_model_config(model or default_model_name(family))
    if model_cfg["family"] != family:
        raise ConfigError(f"model config is a {model_cfg['family']} model, not {family}")
    # the ops this model runs: an op the model lacks (q/k norm of a qwen2 model) gets no region, so
    # the entries for it are skipped and the contract's semantic identity records its absence
    fam = replace(fam, ops=model_ops(fam.id, model_cfg["hf_config"]))
    cases = _cases(spec)
    case_ids = tuple(c.id for c in cases)
    entries = build_entries(spec, fam, arch, case_ids, where)
    check_coverage(entries, fam, case_ids, where)
    if resolve is not None:
        entries = resolve(entries)
    contract = ExecutionContract(
        schema_version="1",
        model=ModelSpec(family=fam.id,
                        architectures=tuple(sorted(model_cfg.get("architectures") or _default_architecture(
                            fam, model_cfg["hf_config"]["model_type"]))),
                        config_digest=config_digest(model_cfg["hf_config"])),
        cases=cases,
        composition=tuple(entries),
        claims=_claims(spec),
        identities=Identities("0" * 64, "0" * 64, "0" * 64),
    )
    return check(with_identities(contract), frozenset(fam.ops))


def required_ops(c: ExecutionContract) -> frozenset[str]:
    """The function ops a valid contract of ``c``'s family must cover: the family's ops less each
    optional group (``registry.FamilySpec.optional_ops``) the contract covers no op of. Whether the
    model has such a group is the model config's to say; ``model.install`` refuses a contract whose
    ops differ from the model's. A group covered in part stays required, so its other ops are
    reported missing."""
    fam = registry.family(c.model.family)
    covered = {o for e in c.composition if e.half == "function" for o in e.region}
    absent = [o for g in fam.optional_ops if not set(g) & covered for o in g]
    return frozenset(registry.model_ops(fam.id, absent))



__all__ = ["build_contract", "load_composition", "load_model_config", "config_digest", "model_ops", "required_ops",
           "PENDING"]
