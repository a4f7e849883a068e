"""What an op folder declares about its implementations, as data that ``isoexec.registry``
collects (this package imports nothing of isoexec; the registry imports this).

Every op folder's ``__init__.py`` ends with ``IMPLS``, a tuple of :class:`Impl`: the invariant
kernel (its fixed-order torch twin on the CPU, its Triton twin on CUDA, behind one public function)
and the stock twin. An :class:`Impl` names the callable that runs each case (the real function, not
a string), the constants a contract may pin and how each reaches the kernel, what the kernel can do
(``grad``: it has a backward; ``cuda_graph``; ``paged``: it reads a paged KV cache) and the hazards
its gates must exercise. Adding an op is adding a folder with such a tuple: nothing else lists it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

ARCHES = ("cpu", "sm90")
"""Where an implementation runs: the CPU (reference twins) and Hopper GPUs (Triton twins)."""

CASES = ("trainer_fwd", "trainer_score", "engine_prefill", "engine_decode")
"""The calls a model makes of a region: trainer forward with and without grad, engine prefill
and decode (the contract's standard cases)."""

_NOT_FIXED = object()


@dataclass(frozen=True)
class Constant:
    """A constant of an implementation that a contract pins: its ``default``, the values a
    contract may pin (``allowed``; the default alone when empty) and how the pinned value reaches
    the kernel: as the keyword argument ``arg``, or checked against ``fixed``, the value the kernel
    is built with (a contract pinning another value is refused when the kernel is bound). A
    constant with neither is a label the contract records (``ACC_DTYPE = "fp32"``): it may allow
    one value only. An ``optional`` constant is absent from a contract that does not pin it, and
    then the kernel runs as if it had no such constant (``default`` is what it computes then, where
    that is one value): so adding one to an impl leaves every existing contract's bytes alone."""

    default: int | str | bool
    allowed: tuple[int | str | bool, ...] = ()
    arg: str | None = None
    fixed: Any = _NOT_FIXED
    optional: bool = False

    def __post_init__(self):
        if not self.allowed:
            object.__setattr__(self, "allowed", (self.default,))
        if not self.admits(self.default):
            raise ValueError(f"constant default {self.default!r} is not among the allowed {self.allowed!r}")

    @property
    def has_fixed(self) -> bool:
        return self.fixed is not _NOT_FIXED

    def admits(self, value) -> bool:
        # bool is an int in Python; True must not stand in for 1.
        return any(type(value) is type(a) and value == a for a in self.allowed)


@dataclass(frozen=True)
class Impl:
    """One implementation of an op kind (``norm``, ``linear``, ``attention``...).

    ``fn`` is the callable of every case, or a mapping case -> callable for an op whose cases call
    different functions (attention, the Gated DeltaNet conv and core). ``version`` changes when the
    bits can change. ``native`` marks the stock twin (the negative-control side of a gate);
    ``fusable`` an implementation that may run several ops of its kind in one region (the q/k/v
    projections as one GEMM)."""

    id: str
    version: str
    kind: str
    fn: Callable | Mapping[str, Callable] | None
    constants: Mapping[str, Constant] = field(default_factory=dict)
    capabilities: frozenset[str] = frozenset({"grad", "cuda_graph"})
    hazards: tuple[str, ...] = ()
    fusable: bool = False
    native: bool = False
    archs: tuple[str, ...] = ARCHES
    half: str = "function"
    doc: str = ""

    def __post_init__(self):
        if isinstance(self.fn, Mapping):
            unknown = set(self.fn) - set(CASES) - {"*"}
            if unknown:
                raise ValueError(f"impl {self.id}: unknown case(s) {sorted(unknown)}")
        elif self.fn is not None:
            object.__setattr__(self, "fn", {"*": self.fn})
        elif self.half == "function":
            raise ValueError(f"impl {self.id}: a function-half implementation needs a callable")
        unknown = set(self.archs) - set(ARCHES)
        if unknown:
            raise ValueError(f"impl {self.id}: unknown arch(es) {sorted(unknown)}")
        for name, c in self.constants.items():
            if self.half == "function" and len(c.allowed) > 1 and c.arg is None and not c.has_fixed:
                raise ValueError(f"impl {self.id}: constant {name} allows several values, so it must reach the "
                                 "kernel (arg) or state the value the kernel runs with (fixed)")

    def callable_for(self, case: str) -> Callable | None:
        """The callable that runs ``case`` (None if this implementation does not serve it)."""
        fns = self.fn or {}
        return fns.get(case, fns.get("*"))

    def default_constants(self) -> dict:
        """The constants a contract lists when its entry pins none: every non-optional one."""
        return {k: v.default for k, v in self.constants.items() if not v.optional}


def per_case(trainer: Callable, prefill: Callable, decode: Callable) -> dict[str, Callable]:
    """``fn`` of an op whose cases call different functions: the trainer's (with and without grad),
    the engine prefill's and the engine decode's."""
    return {"trainer_fwd": trainer, "trainer_score": trainer, "engine_prefill": prefill, "engine_decode": decode}
