"""Gate artifacts: one JSON file per gate run, named by the SHA-256 of its canonical bytes.

An artifact records the gate family, the region, the impl {id, version, arch}, its constants,
shapes, seed, verdict and counts, and the environment. Contract discharges point at artifact
ids; ``verify_contract`` checks that each discharge has a passing artifact for the same region,
impl, version, arch and constants, and that every artifact still hashes to its own id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..contract import Discharge, Entry, ExecutionContract, canonical_json, parse_json_strict
from ..contract.digests import sha256_hex
from ..errors import ContractDecodeError, IsoExecError, NotAdmitted
from ..paths import atomic_write

PENDING = "pending"
REF_SEP = "+"


def artifact_id(body: dict) -> str:
    """Content hash of an artifact body (everything but ``id``)."""
    return sha256_hex(canonical_json({k: v for k, v in body.items() if k != "id"}))


def finalize(body: dict) -> dict:
    return {"id": artifact_id(body), **body}


def write_artifact(out_dir: str | Path, body: dict) -> tuple[str, Path]:
    art = finalize(body)
    path = atomic_write(Path(out_dir) / f"{art['id']}.json", json.dumps(art, sort_keys=True, indent=1) + "\n")
    return art["id"], path


def load_artifacts(gates_dir: str | Path) -> dict[str, dict]:
    """All artifacts under ``gates_dir`` by id; a file whose content does not hash to its id is an error."""
    d = Path(gates_dir)
    if not d.is_dir():
        raise IsoExecError(f"gates directory {str(d)!r} not found; run `isoexec gates run --out {d}` first")
    out = {}
    for p in sorted(d.glob("*.json")):
        try:
            art = parse_json_strict(p.read_bytes(), what=f"gate artifact {p.name}")
        except ContractDecodeError:
            # Artifacts carry no floats except as strings; parse_json_strict refuses floats, so a
            # legitimately written artifact always parses. Anything else is corrupt.
            raise IsoExecError(f"gate artifact {str(p)!r} is not valid JSON") from None
        if not isinstance(art, dict) or "id" not in art:
            raise IsoExecError(f"gate artifact {str(p)!r} has no id")
        if artifact_id(art) != art["id"]:
            raise IsoExecError(f"gate artifact {str(p)!r}: content does not hash to its id (edited or corrupt)")
        out[art["id"]] = art
    return out


def _key(region, impl: dict, constants: dict) -> str:
    return canonical_json({"region": sorted(region), "impl": impl, "constants": constants}).decode()


def entry_key(e: Entry) -> str:
    return _key(e.region, {"id": e.impl.id, "version": e.impl.version, "arch": e.impl.arch}, dict(e.constants))


def artifact_key(a: dict) -> str:
    g = a["gate"]
    return _key(g["region"], g["impl"], g["constants"])


@dataclass(frozen=True)
class DischargeCheck:
    entry: str
    ok: bool
    artifacts: tuple[str, ...]
    problem: str = ""


def passing_for(e: Entry, artifacts: dict[str, dict]) -> list[dict]:
    key = entry_key(e)
    return [a for a in artifacts.values()
            if a["gate"]["family"] != "negative_control" and artifact_key(a) == key]


def _required_families(e: Entry) -> tuple[str, ...]:
    from .families import gate_families_for

    return gate_families_for(e)


def check_entry(e: Entry, artifacts: dict[str, dict]) -> DischargeCheck:
    name = f"region {e.region_name} ({e.impl})"
    d = e.discharge
    if d is None:
        return DischargeCheck(name, e.half == "deployment", (), "" if e.half == "deployment" else "no discharge")
    if d.kind != "gate" and d.ref != PENDING and d.ref not in artifacts:
        # equivalence / neutrality proofs that point at documents are accepted as written
        return DischargeCheck(name, True, (), "")
    if d.ref == PENDING:
        cands = passing_for(e, artifacts)
        by_family: dict[str, dict] = {}
        for a in sorted(cands, key=lambda a: a["env"]["date"]):
            if a["verdict"] == "pass" or a["gate"]["family"] not in by_family:
                by_family[a["gate"]["family"]] = a
        missing = [f for f in _required_families(e) if f not in by_family]
        failing = [f for f, a in by_family.items() if a["verdict"] != "pass"]
        ids = tuple(sorted(a["id"] for a in by_family.values() if a["verdict"] == "pass"))
        if missing or failing:
            why = []
            if missing:
                why.append(f"no artifact for gate(s) {', '.join(missing)}")
            if failing:
                why.append(f"gate(s) {', '.join(failing)} failed")
            return DischargeCheck(name, False, ids, "; ".join(why))
        return DischargeCheck(name, True, ids)
    ids = tuple(d.ref.split(REF_SEP))
    problems = []
    key = entry_key(e)
    for i in ids:
        a = artifacts.get(i)
        if a is None:
            problems.append(f"artifact {i[:12]}… not found")
        elif a["verdict"] != "pass":
            problems.append(f"artifact {i[:12]}… did not pass")
        elif artifact_key(a) != key:
            g = a["gate"]
            problems.append(f"artifact {i[:12]}… is for {'+'.join(g['region'])} {g['impl']['id']} "
                            f"v{g['impl']['version']} ({g['impl']['arch']}) {g['constants']}, not this entry")
    fams = {artifacts[i]["gate"]["family"] for i in ids if i in artifacts}
    missing = [f for f in _required_families(e) if f not in fams]
    if missing:
        problems.append(f"no passing artifact for gate(s) {', '.join(missing)}")
    return DischargeCheck(name, not problems, ids, "; ".join(problems))


def verify_contract(c: ExecutionContract, gates_dir: str | Path) -> list[DischargeCheck]:
    arts = load_artifacts(gates_dir)
    return [check_entry(e, arts) for e in c.composition if e.discharge is not None or e.half == "function"]


def resolve_discharges(entries: list[Entry], gates_dir: str | Path) -> list[Entry]:
    """Replace ``pending`` gate discharges by the ids of the passing artifacts (refuse if none)."""
    arts = load_artifacts(gates_dir)
    out = []
    problems = []
    for e in entries:
        if e.discharge is not None and e.discharge.kind == "gate" and e.discharge.ref == PENDING:
            chk = check_entry(e, arts)
            if not chk.ok:
                problems.append(f"{chk.entry}: {chk.problem}")
                out.append(e)
                continue
            e = replace(e, discharge=Discharge("gate", REF_SEP.join(chk.artifacts)))
        out.append(e)
    if problems:
        raise NotAdmitted(f"cannot admit: {len(problems)} entr{'y' if len(problems) == 1 else 'ies'} without a "
                           f"passing gate in {str(gates_dir)!r}: " + "; ".join(problems))
    return out
