"""The layer rule of docs/architecture.md: a module imports only the layers below its own (module level
and inside functions alike), isoexec_kernels/ imports nothing from isoexec, and no two modules import
each other (directly or around a cycle)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top. A module of layer i may import layers < i and its own package; two names on one
# row are side by side and never import each other. docs/architecture.md draws the same list.
LAYERS = (
    ("isoexec_kernels",),
    ("isoexec.errors", "isoexec.hf_config_store"),
    ("isoexec.bits", "isoexec.dist", "isoexec.envinfo", "isoexec.kernel_compiles", "isoexec.model_config",
     "isoexec.paths", "isoexec.yamlio"),
    ("isoexec.report",),
    ("isoexec.contract",),
    ("isoexec.registry",),
    ("isoexec.compose", "isoexec.enforce"),
    ("isoexec.model",),
    ("isoexec.assembly", "isoexec.engine", "isoexec.train"),
    ("isoexec.gates", "isoexec.dist.fsdp"),
    ("isoexec.debug",),
    ("isoexec.bench", "isoexec.rl"),
    ("isoexec.plan",),
    ("isoexec.cli",),
)
LEVEL = {name: i for i, row in enumerate(LAYERS) for name in row}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, path: Path) -> str:
    """The absolute dotted name of a (possibly relative) from-import in ``path``."""
    if not node.level:
        return node.module or ""
    pkg = list(path.relative_to(ROOT).with_suffix("").parts)
    base = pkg[:-node.level] if path.name != "__init__.py" else pkg[:len(pkg) - node.level]
    return ".".join(base + ([node.module] if node.module else []))


@functools.lru_cache(maxsize=None)
def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _absolute(node, path)
            out += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return out


def _layer(name: str) -> str | None:
    """The LAYERS entry ``name`` belongs to (None: not ours, or the bare ``isoexec`` package)."""
    while name:
        if name in LEVEL:
            return name
        name = name.rpartition(".")[0]
    return None


def _sources() -> list[Path]:
    return sorted((ROOT / "isoexec").rglob("*.py")) + sorted((ROOT / "isoexec_kernels").rglob("*.py"))


def test_every_module_has_a_layer():
    loose = [str(f.relative_to(ROOT)) for f in _sources()
             if _layer(_module(f)) is None and _module(f) != "isoexec"]
    assert not loose, f"add these to LAYERS (and to docs/architecture.md): {loose}"


@pytest.mark.parametrize("row", range(len(LAYERS)), ids=lambda i: "+".join(LAYERS[i]))
def test_a_layer_imports_only_the_layers_below_it(row):
    bad = []
    for f in _sources():
        me = _layer(_module(f))
        if me not in LAYERS[row]:
            continue
        for imp in _imports(f):
            other = _layer(imp)
            if other is not None and other != me and LEVEL[other] >= LEVEL[me]:
                bad.append((str(f.relative_to(ROOT)), imp))
    assert not bad, bad


def test_no_import_cycles():
    mods = {_module(f): f for f in _sources()}
    graph = {m: set() for m in mods}
    for m, f in mods.items():
        for imp in _imports(f):
            while imp and imp not in mods:
                imp = imp.rpartition(".")[0]
            if imp and imp != m and not m.startswith(imp + "."):   # a package's own __init__ is not an edge
                graph[m].add(imp)
    seen, on_path, cycles = set(), [], []

    def walk(m):
        if m in on_path:
            cycles.append(on_path[on_path.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        on_path.append(m)
        for n in sorted(graph[m]):
            walk(n)
        on_path.pop()

    for m in sorted(graph):
        walk(m)
    assert not cycles, cycles


def test_the_scan_sees_relative_and_function_level_imports():
    """The scan itself: a relative import inside a function resolves to its absolute module."""
    f = ROOT / "isoexec" / "compose.py"
    names = _imports(f)
    assert "isoexec.model_config.FAMILY_CONFIGS" in names and "isoexec.registry" in names
    assert _layer("isoexec.gates.kinds") == "isoexec.gates"
    assert _layer("isoexec_kernels.gdn_core.api") == "isoexec_kernels"
