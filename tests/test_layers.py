"""The layer rule of docs/architecture.md, for the layers that have no exceptions: a module imports
only layers below it (module level and inside functions), and isoexec_kernels/ imports nothing from isoexec."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# module (or package folder) -> isoexec modules it must never import
FORBIDDEN = {
    "isoexec/contract": ("isoexec.registry", "isoexec.compose", "isoexec.model", "isoexec.gates", "isoexec.engine",
                         "isoexec.train", "isoexec.rl", "isoexec.bench", "isoexec.cli", "isoexec_kernels"),
    "isoexec/registry.py": ("isoexec.compose", "isoexec.model", "isoexec.gates", "isoexec.engine", "isoexec.train",
                            "isoexec.rl", "isoexec.bench", "isoexec.cli"),
    "isoexec/model_config.py": ("isoexec.compose", "isoexec.model", "isoexec.gates", "isoexec.engine",
                                "isoexec.train", "isoexec.rl", "isoexec.bench", "isoexec.cli", "isoexec_kernels"),
    "isoexec/compose.py": ("isoexec.model", "isoexec.gates", "isoexec.engine", "isoexec.train", "isoexec.rl",
                           "isoexec.bench", "isoexec.cli"),
    "isoexec_kernels": ("isoexec",),
}


def _absolute(node: ast.ImportFrom, path: Path) -> str:
    """The absolute dotted name of a (possibly relative) from-import in ``path``."""
    if not node.level:
        return node.module or ""
    pkg = list(path.relative_to(ROOT).with_suffix("").parts)
    base = pkg[:-node.level] if path.name != "__init__.py" else pkg[:len(pkg) - node.level]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _absolute(node, path)
            out += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return out


@pytest.mark.parametrize("where", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_above_it(where):
    target = ROOT / where
    files = sorted(target.rglob("*.py")) if target.is_dir() else [target]
    bad = [(str(f.relative_to(ROOT)), imp) for f in files for imp in _imports(f)
           if any(imp == x or imp.startswith(x + ".") for x in FORBIDDEN[where])]
    assert not bad, bad


def test_the_scan_sees_relative_and_function_level_imports():
    """The scan itself: a relative import inside a function resolves to its absolute module."""
    f = ROOT / "isoexec" / "compose.py"
    names = _imports(f)
    assert "isoexec.model_config.FAMILY_CONFIGS" in names and "isoexec.registry" in names
