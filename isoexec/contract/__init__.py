"""The execution contract: schema, canonical bytes, digests, validation, diff and handshake."""

from .codec import canonical_json, decode, encode, parse_json_strict
from .diff import Difference, diff, format_diff, policy_differences
from .digests import compute_identities, with_identities
from .handshake import HandshakeResult, handshake, offer, receive
from .schema import (
    K_LEAVES,
    ROW_PARALLEL_OPS,
    SCHEMA_VERSION,
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
    frozen_mapping,
)
from .validate import Violation, check, validate

__all__ = [name for name in dir() if not name.startswith("_")]
