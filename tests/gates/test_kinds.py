"""``kinds.KINDS`` names each op kind's gate runner as ``"<module>.<function>"`` (``contract verify``
reads a kind's gate families without importing the gate modules, which import torch): every name
must resolve to a function of isoexec.gates, and every kind with gates to a runner."""

import inspect

from isoexec import registry
from isoexec.gates.kinds import KINDS


def test_every_kind_names_a_gate_runner_that_exists():
    for kind, k in KINDS.items():
        assert inspect.isfunction(k.run) and k.run.__module__.startswith("isoexec.gates."), kind
        assert k.families and kind in {o.kind for o in registry.OPS.values()}, kind
