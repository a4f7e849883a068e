"""The Triton compile counter (isoexec/kernel_compiles.py) counts through Triton's real
post-compile hook and keeps a hook that was installed before it."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402

from isoexec import kernel_compiles  # noqa: E402


@pytest.fixture
def fresh_counter(monkeypatch):
    monkeypatch.setattr(kernel_compiles, "_state", {"count": 0, "installed": False, "names": []})
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    return kernel_compiles


def test_each_post_compile_call_counts_once_and_an_earlier_hook_still_runs(fresh_counter):
    seen = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["key"])
    assert fresh_counter.count() == 0
    assert fresh_counter.install() and fresh_counter.install()   # idempotent: one counting hook
    for key in ("a", "b"):
        knobs.runtime.jit_post_compile_hook(key=key, repr="", fn=None, compile=None, is_manual_warmup=False,
                                            already_compiled=False)
    assert fresh_counter.count() == 2 and seen == ["a", "b"]
    assert fresh_counter.compiled_since(1) == ["b"]


def test_count_is_zero_before_install(fresh_counter):
    assert fresh_counter.count() == 0
