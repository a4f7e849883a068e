"""How many Triton kernels this process has compiled so far.

A Triton kernel is compiled the first time it is launched with a new combination of compile-time
constants and argument specialisations (an integer argument equal to 1 or divisible by 16, say),
which takes from tens of milliseconds (found in the on-disk cache) to a second or more. The
invariant GEMM picks its tile by the M bucket, so a training step whose packed length falls in a
bucket not seen before pays for new compiles inside its timing. The RL loop records the count per
step (``kernels_compiled`` in metrics.jsonl) and warms the buckets up front
(``isoexec.train.precompile``), so a step that still compiled is visible in the metrics.

Counting uses Triton's post-compile hook; a hook already installed keeps being called. The hook's
description of each compile (kernel name, launch options, argument types and specialisations) is
kept too, so a step that compiled can say what it compiled (:func:`compiled_since`).
"""

from __future__ import annotations

_state = {"count": 0, "installed": False, "names": []}


def install() -> bool:
    """Start counting (idempotent). False when Triton is not importable (nothing to count)."""
    if _state["installed"]:
        return True
    try:
        from triton import knobs
    except ImportError:
        return False
    previous = knobs.runtime.jit_post_compile_hook

    def counting_hook(*args, **kwargs):
        _state["count"] += 1
        _state.setdefault("names", []).append(str(kwargs.get("repr") or kwargs.get("key") or "?"))
        if previous is not None:
            return previous(*args, **kwargs)
        return None

    knobs.runtime.jit_post_compile_hook = counting_hook
    _state["installed"] = True
    return True


def count() -> int:
    """Kernels compiled in this process since :func:`install` (0 before it)."""
    return _state["count"]


def compiled_since(start: int) -> list[str]:
    """Descriptions of the kernels compiled after the count was ``start``."""
    return list(_state.get("names", [])[start:])
