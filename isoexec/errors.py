"""Error types shared by the package.

Every refusal the contract machinery makes is an :class:`IsoExecError` subclass whose message
names the offending thing (a JSON path, a region and case, an impl id) and says what to do.
The CLI turns them into one clear line and a documented exit code.
"""

from __future__ import annotations


class IsoExecError(Exception):
    """Base class: bad input or a refused check. ``exit_code`` is what the CLI returns."""

    exit_code = 2


class ContractDecodeError(IsoExecError):
    """The bytes are not a well-formed contract; ``path`` is the JSON path of the problem."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}")


class ContractInvalid(IsoExecError):
    """A decoded contract breaks one or more rules; every violation is listed."""

    def __init__(self, violations):
        self.violations = list(violations)
        lines = "; ".join(str(v) for v in self.violations)
        super().__init__(f"contract invalid ({len(self.violations)} violation(s)): {lines}")


class CompositionError(IsoExecError):
    """A composition YAML cannot be turned into a contract (unknown region, impl, constant...)."""


class ConfigError(IsoExecError):
    """A configuration file (model config, workflow config) is malformed."""


class ContractMismatch(IsoExecError):
    """Handshake refusal: the two sides' numerical policies differ."""

    exit_code = 1

    def __init__(self, message: str, differences=()):
        self.differences = list(differences)
        super().__init__(message)


class BindingRefused(IsoExecError):
    """What was actually bound at run time differs from the contract."""

    exit_code = 1


class TopologyRefused(IsoExecError):
    """A runtime topology fact (TP size, arch...) is not proven by the contract's claims."""

    exit_code = 1


class NotAdmitted(IsoExecError):
    """A contract cannot be admitted: some discharge has no passing gate artifact."""

    exit_code = 1
