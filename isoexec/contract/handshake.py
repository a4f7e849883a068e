"""The contract handshake between trainer and engine.

Each side sends its FULL canonical contract (not a bare hash). The receiver decodes it strictly,
validates it, and compares ``numerical_policy``: on a mismatch it refuses with a diff naming each
differing (region, case); a ``deployment`` mismatch is logged and allowed. A diagnostic override
exists only as an explicit argument, and the result records that it was used so the run's
metadata can say so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..errors import ContractMismatch
from .codec import decode, encode
from .diff import Difference, diff, format_diff
from .schema import ExecutionContract
from .validate import check

log = logging.getLogger("isoexec.handshake")


@dataclass(frozen=True)
class HandshakeResult:
    accepted: bool
    numerical_policy: str
    deployment_differences: tuple[Difference, ...] = ()
    overridden: bool = False
    policy_differences: tuple[Difference, ...] = field(default=())

    def metadata(self) -> dict:
        """What a run records about its handshake (the override is never silent)."""
        return {
            "accepted": self.accepted,
            "numerical_policy": self.numerical_policy,
            "deployment_differences": [d.as_dict() for d in self.deployment_differences],
            "policy_override": self.overridden,
            "policy_differences": [d.as_dict() for d in self.policy_differences],
        }


def offer(contract: ExecutionContract) -> bytes:
    """What a side sends: its full contract in canonical bytes."""
    return encode(contract)


def receive(local: ExecutionContract, remote_bytes: bytes, *, local_name: str = "local",
            remote_name: str = "remote", allow_policy_mismatch: bool = False) -> HandshakeResult:
    """Accept or refuse the peer's contract. Raises ContractMismatch on a policy difference."""
    remote = check(decode(remote_bytes))
    check(local)
    diffs = diff(local, remote)
    policy = tuple(d for d in diffs if d.identity == "numerical_policy")
    deployment = tuple(d for d in diffs if d.identity == "deployment")
    same_policy = local.identities.numerical_policy == remote.identities.numerical_policy
    if not same_policy:
        text = format_diff(list(policy) or diffs, local_name, remote_name)
        if not allow_policy_mismatch:
            raise ContractMismatch(
                f"handshake refused: numerical_policy {local.identities.numerical_policy[:12]}… ({local_name}) vs "
                f"{remote.identities.numerical_policy[:12]}… ({remote_name})\n{text}",
                differences=policy,
            )
        log.warning("handshake: numerical_policy differs and the diagnostic override is ON; "
                    "results of this run are not bitwise-checked\n%s", text)
    if deployment:
        log.info("handshake: deployment-only differences (allowed):\n%s", format_diff(list(deployment), local_name,
                                                                                      remote_name))
    return HandshakeResult(
        accepted=True,
        numerical_policy=local.identities.numerical_policy,
        deployment_differences=deployment,
        overridden=not same_policy,
        policy_differences=policy,
    )


def handshake(a: ExecutionContract, b: ExecutionContract, **kw) -> HandshakeResult:
    """Both directions in one process (colocated trainer and engine): each side checks the other."""
    receive(b, offer(a), local_name="engine", remote_name="trainer", **kw)
    return receive(a, offer(b), local_name="trainer", remote_name="engine", **kw)
