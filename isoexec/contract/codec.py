"""Canonical bytes and strict decoding of execution contracts.

Canonical bytes: UTF-8 JSON, keys sorted, separators ``,`` and ``:``, no floats. Lists that are
sets (the cases of an entry, the ops of a region, the entries, the cases, every claim list, a
topology domain, a tolerance's case pair) are sorted by their own canonical bytes, so two
contracts that differ only in the order someone wrote things encode identically.

Decoding is strict and names the JSON path of the first problem it meets: unknown or missing
fields, a wrong type, a raw float, NaN/Infinity, duplicate keys, a wrong schema_version.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from ..errors import ContractDecodeError
from .schema import (
    DISCHARGE_KINDS,
    HALVES,
    ROLES,
    SCHEMA_VERSION,
    SHAPES,
    STATES,
    TOPOLOGY_AXES,
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
    ToleranceClaim,
    TopologyClaim,
    frozen_mapping,
)

FLOAT_BITS_RE = re.compile(r"^(f16|bf16|f32|f64):0x[0-9a-f]+$")
_BITS_WIDTH = {"f16": 4, "bf16": 4, "f32": 8, "f64": 16}


def canonical_json(obj: Any) -> bytes:
    """Canonical bytes of a JSON-able object (keys sorted, compact separators, UTF-8)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


def _sorted_set(items: list) -> list:
    return sorted(items, key=canonical_json)


# ----------------------------------------------------------------------------- to plain objects


def model_obj(m: ModelSpec) -> dict:
    return {"family": m.family, "architectures": sorted(m.architectures), "config_digest": m.config_digest}


def case_obj(c: Case) -> dict:
    return {"id": c.id, "role": c.role, "grad": c.grad, "state": c.state, "shape": c.shape}


def impl_obj(i: ImplRef) -> dict:
    return {"id": i.id, "version": i.version, "arch": i.arch}


def discharge_obj(d: Discharge | None):
    return None if d is None else {"kind": d.kind, "ref": d.ref}


def entry_obj(e: Entry) -> dict:
    return {
        "region": sorted(e.region),
        "cases": sorted(e.cases),
        "impl": impl_obj(e.impl),
        "constants": dict(e.constants),
        "discharge": discharge_obj(e.discharge),
        "half": e.half,
    }


def topology_obj(t: TopologyClaim) -> dict:
    return {"axis": t.axis, "kind": t.kind, "domain": sorted(t.domain), "proof": t.proof}


def state_obj(s: StateClaim) -> dict:
    return {"id": s.id, "invalidated_by": sorted(s.invalidated_by)}


def tolerance_obj(t: ToleranceClaim) -> dict:
    return {"cases": sorted(t.cases), "bounds": {"mean_abs": t.bounds.mean_abs, "max_abs": t.bounds.max_abs}}


def claims_obj(c: Claims) -> dict:
    return {
        "topology": _sorted_set([topology_obj(t) for t in c.topology]),
        "state": _sorted_set([state_obj(s) for s in c.state]),
        "tolerances": _sorted_set([tolerance_obj(t) for t in c.tolerances]),
    }


def contract_obj(c: ExecutionContract) -> dict:
    return {
        "schema_version": c.schema_version,
        "model": model_obj(c.model),
        "cases": _sorted_set([case_obj(x) for x in c.cases]),
        "composition": _sorted_set([entry_obj(e) for e in c.composition]),
        "claims": claims_obj(c.claims),
        "identities": {
            "semantic": c.identities.semantic,
            "numerical_policy": c.identities.numerical_policy,
            "deployment": c.identities.deployment,
        },
    }


def encode(contract: ExecutionContract) -> bytes:
    """The contract's canonical bytes (what is exchanged in the handshake and written to disk)."""
    return canonical_json(contract_obj(contract))


# ----------------------------------------------------------------------------- strict decoding


def _reject_float(text: str):
    raise ValueError(f"raw JSON float {text!r} (write floats as bit patterns such as \"f32:0x3f800000\")")


def _reject_constant(text: str):
    raise ValueError(f"{text} is not allowed in a contract")


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def parse_json_strict(data: bytes | str, what: str = "contract") -> Any:
    """json.loads that refuses floats, NaN/Infinity and duplicate keys, naming the problem."""
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ContractDecodeError("$", f"{what} is not UTF-8: {exc}") from None
    try:
        return json.loads(
            data, parse_float=_reject_float, parse_constant=_reject_constant, object_pairs_hook=_no_duplicates
        )
    except ValueError as exc:  # JSONDecodeError is a ValueError; so are our hooks' refusals
        raise ContractDecodeError("$", f"{what} is not valid strict JSON: {exc}") from None
    except RecursionError:
        raise ContractDecodeError("$", f"{what} is nested too deeply") from None


class _Reader:
    """Walks a parsed JSON value with a path, raising ContractDecodeError on the first problem."""

    def __init__(self, value: Any, path: str):
        self.value = value
        self.path = path

    def fail(self, message: str):
        raise ContractDecodeError(self.path, message)

    def obj(self, fields: tuple[str, ...]) -> dict[str, "_Reader"]:
        if not isinstance(self.value, dict):
            self.fail(f"expected an object, got {_type_name(self.value)}")
        unknown = sorted(set(self.value) - set(fields))
        if unknown:
            raise ContractDecodeError(f"{self.path}.{unknown[0]}", "unknown field")
        missing = [f for f in fields if f not in self.value]
        if missing:
            raise ContractDecodeError(f"{self.path}.{missing[0]}", "missing field")
        return {f: _Reader(self.value[f], f"{self.path}.{f}") for f in fields}

    def list(self) -> list["_Reader"]:
        if not isinstance(self.value, list):
            self.fail(f"expected a list, got {_type_name(self.value)}")
        return [_Reader(v, f"{self.path}[{i}]") for i, v in enumerate(self.value)]

    def str(self, choices: tuple[str, ...] | None = None, nonempty: bool = True) -> str:
        if not isinstance(self.value, str):
            self.fail(f"expected a string, got {_type_name(self.value)}")
        if nonempty and not self.value:
            self.fail("expected a non-empty string")
        if choices is not None and self.value not in choices:
            self.fail(f"{self.value!r} is not one of {', '.join(choices)}")
        return self.value

    def bool(self) -> bool:
        if not isinstance(self.value, bool):
            self.fail(f"expected true or false, got {_type_name(self.value)}")
        return self.value

    def int(self) -> int:
        if isinstance(self.value, bool) or not isinstance(self.value, int):
            self.fail(f"expected an integer, got {_type_name(self.value)}")
        return self.value

    def hexdigest(self) -> str:
        s = self.str()
        if not re.fullmatch(r"[0-9a-f]{64}", s):
            self.fail("expected a lowercase hex SHA-256 (64 characters)")
        return s

    def decimal(self) -> str:
        s = self.str()
        if not re.fullmatch(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?", s):
            self.fail(f"{s!r} is not a decimal string such as \"0\" or \"1e-6\"")
        return s

    def constant(self):
        v = self.value
        if isinstance(v, (bool, int)):
            return v
        if isinstance(v, str):
            prefix = v.split(":", 1)[0]
            if prefix in _BITS_WIDTH and not FLOAT_BITS_RE.fullmatch(v):
                self.fail(f"{v!r} looks like a float bit pattern but is malformed (e.g. \"f32:0x3f800000\")")
            if prefix in _BITS_WIDTH and len(v.split("0x", 1)[1]) != _BITS_WIDTH[prefix]:
                self.fail(f"{v!r}: a {prefix} bit pattern has exactly {_BITS_WIDTH[prefix]} hex digits")
            return v
        self.fail(f"a constant must be an integer, string or boolean, got {_type_name(v)}")


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a float"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _read_list(r: _Reader, item: Callable[[_Reader], Any]) -> tuple:
    return tuple(item(x) for x in r.list())


def _read_model(r: _Reader) -> ModelSpec:
    f = r.obj(("family", "architectures", "config_digest"))
    return ModelSpec(
        family=f["family"].str(),
        architectures=_read_list(f["architectures"], lambda x: x.str()),
        config_digest=f["config_digest"].hexdigest(),
    )


def _read_case(r: _Reader) -> Case:
    f = r.obj(("id", "role", "grad", "state", "shape"))
    return Case(
        id=f["id"].str(),
        role=f["role"].str(ROLES),
        grad=f["grad"].bool(),
        state=f["state"].str(STATES),
        shape=f["shape"].str(SHAPES),
    )


def _read_entry(r: _Reader) -> Entry:
    f = r.obj(("region", "cases", "impl", "constants", "discharge", "half"))
    impl = f["impl"].obj(("id", "version", "arch"))
    consts = f["constants"]
    if not isinstance(consts.value, dict):
        consts.fail(f"expected an object, got {_type_name(consts.value)}")
    constants = {}
    for name, value in consts.value.items():
        constants[name] = _Reader(value, f"{consts.path}.{name}").constant()
    discharge = None
    if f["discharge"].value is not None:
        d = f["discharge"].obj(("kind", "ref"))
        discharge = Discharge(kind=d["kind"].str(DISCHARGE_KINDS), ref=d["ref"].str())
    region = _read_list(f["region"], lambda x: x.str())
    if not region:
        f["region"].fail("a region names at least one logical op")
    cases = _read_list(f["cases"], lambda x: x.str())
    if not cases:
        f["cases"].fail("an entry applies to at least one case")
    return Entry(
        region=region,
        cases=cases,
        impl=ImplRef(id=impl["id"].str(), version=impl["version"].str(), arch=impl["arch"].str()),
        constants=frozen_mapping(constants),
        discharge=discharge,
        half=f["half"].str(HALVES),
    )


def _read_topology(r: _Reader) -> TopologyClaim:
    f = r.obj(("axis", "kind", "domain", "proof"))
    domain = _read_list(f["domain"], lambda x: x.int())
    return TopologyClaim(
        axis=f["axis"].str(TOPOLOGY_AXES), kind=f["kind"].str(TOPOLOGY_KINDS), domain=domain, proof=f["proof"].str()
    )


def _read_state(r: _Reader) -> StateClaim:
    f = r.obj(("id", "invalidated_by"))
    return StateClaim(id=f["id"].str(), invalidated_by=_read_list(f["invalidated_by"], lambda x: x.str()))


def _read_tolerance(r: _Reader) -> ToleranceClaim:
    f = r.obj(("cases", "bounds"))
    cases = _read_list(f["cases"], lambda x: x.str())
    if len(cases) != 2:
        f["cases"].fail(f"a tolerance claim compares exactly two cases, got {len(cases)}")
    b = f["bounds"].obj(("mean_abs", "max_abs"))
    return ToleranceClaim(cases=cases, bounds=Bounds(mean_abs=b["mean_abs"].decimal(), max_abs=b["max_abs"].decimal()))


def decode(data: bytes | str) -> ExecutionContract:
    """Strictly decode contract bytes. Raises ContractDecodeError naming the JSON path."""
    root = _Reader(parse_json_strict(data), "$")
    if isinstance(root.value, dict) and "schema_version" in root.value:
        sv = root.value["schema_version"]
        if sv != SCHEMA_VERSION:
            raise ContractDecodeError(
                "$.schema_version", f"unsupported schema_version {sv!r}; this isoexec reads {SCHEMA_VERSION!r}"
            )
    f = root.obj(("schema_version", "model", "cases", "composition", "claims", "identities"))
    claims = f["claims"].obj(("topology", "state", "tolerances"))
    ident = f["identities"].obj(("semantic", "numerical_policy", "deployment"))
    return ExecutionContract(
        schema_version=f["schema_version"].str(),
        model=_read_model(f["model"]),
        cases=_read_list(f["cases"], _read_case),
        composition=_read_list(f["composition"], _read_entry),
        claims=Claims(
            topology=_read_list(claims["topology"], _read_topology),
            state=_read_list(claims["state"], _read_state),
            tolerances=_read_list(claims["tolerances"], _read_tolerance),
        ),
        identities=Identities(
            semantic=ident["semantic"].hexdigest(),
            numerical_policy=ident["numerical_policy"].hexdigest(),
            deployment=ident["deployment"].hexdigest(),
        ),
    )
