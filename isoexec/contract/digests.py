"""The three identities of a contract, with exactly the inclusion rules of docs/contract.md.

- ``semantic``: model, the sorted union of logical ops, and the cases' (id, shape). Re-fusing ops
  into different regions leaves it unchanged.
- ``numerical_policy``: schema_version, case ids, the function-half entries (region, cases, impl,
  constants, discharge) and the topology claims. Both sides of a handshake must share it.
- ``deployment``: deployment-half entries, state claims and tolerance claims.

Each is the SHA-256 of the canonical bytes of a small object; every set-like list is sorted by
its canonical bytes first, so the order in which entries, cases or claims were written never
rotates a digest.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from .codec import canonical_json, entry_obj, model_obj, state_obj, tolerance_obj, topology_obj
from .schema import ExecutionContract, Identities


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sorted_set(items: list) -> list:
    return sorted(items, key=canonical_json)


def _policy_entry(e) -> dict:
    obj = entry_obj(e)
    return {k: obj[k] for k in ("region", "cases", "impl", "constants", "discharge")}


def semantic_digest(c: ExecutionContract) -> str:
    ops = sorted({op for e in c.composition for op in e.region})
    cases = _sorted_set([{"id": x.id, "shape": x.shape} for x in c.cases])
    return sha256_hex(canonical_json({"model": model_obj(c.model), "ops": ops, "cases": cases}))


def numerical_policy_digest(c: ExecutionContract) -> str:
    entries = _sorted_set([_policy_entry(e) for e in c.composition if e.half == "function"])
    return sha256_hex(
        canonical_json(
            {
                "schema_version": c.schema_version,
                "case_ids": sorted(x.id for x in c.cases),
                "entries": entries,
                "topology": _sorted_set([topology_obj(t) for t in c.claims.topology]),
            }
        )
    )


def deployment_digest(c: ExecutionContract) -> str:
    entries = _sorted_set([entry_obj(e) for e in c.composition if e.half == "deployment"])
    return sha256_hex(
        canonical_json(
            {
                "entries": entries,
                "state": _sorted_set([state_obj(s) for s in c.claims.state]),
                "tolerances": _sorted_set([tolerance_obj(t) for t in c.claims.tolerances]),
            }
        )
    )


def compute_identities(c: ExecutionContract) -> Identities:
    return Identities(
        semantic=semantic_digest(c), numerical_policy=numerical_policy_digest(c), deployment=deployment_digest(c)
    )


def with_identities(c: ExecutionContract) -> ExecutionContract:
    """A copy of ``c`` whose stored identities are recomputed from its content."""
    return replace(c, identities=compute_identities(c))
