"""The code version the workflow's results depend on (docs/workflow.md, "Code version").

A SHA-256 over every ``*.py`` file of the ``isoexec`` and ``isoexec_kernels`` packages (the
checkout's ``isoexec/`` and ``isoexec_kernels/``; the copies Python imports, found without importing
them), each file named by its path inside its package. The Snakefile writes it to
``results/<run>/code_version.txt`` while it parses, *only when it differs* from what the file
holds, and every rule that runs package code takes that file as an input: an edit to the package
or the kernels gives the file a new modification time, so Snakemake reruns those jobs (by file
times, the trigger that needs no metadata), and nothing else changes the file.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Mapping

PACKAGES = ("isoexec", "isoexec_kernels")


def package_dirs(names=PACKAGES) -> dict[str, Path]:
    """The folder of each package, as Python would import it (no import happens)."""
    out = {}
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"package {name!r} is not installed (pip install -e . in the checkout)")
        out[name] = Path(list(spec.submodule_search_locations)[0])
    return out


def code_version(roots: Mapping[str, Path]) -> tuple[str, int]:
    """(SHA-256 hex, number of files) over ``<name>/<path>`` and the bytes of every ``*.py`` file
    under each root (``__pycache__`` left out), in sorted order."""
    files = sorted((f"{name}/{p.relative_to(root).as_posix()}", p)
                   for name, root in roots.items() for p in Path(root).rglob("*.py")
                   if "__pycache__" not in p.parts)
    h = hashlib.sha256()
    for rel, p in files:
        h.update(rel.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest(), len(files)


def version_text(roots: Mapping[str, Path]) -> str:
    digest, n = code_version(roots)
    return (f"sha256 {digest}\n"
            f"# over {n} *.py files of the packages {', '.join(sorted(roots))} as imported here\n")


def write_if_changed(path: str | Path, text: str) -> bool:
    """Write ``text`` to ``path`` unless it holds exactly that already (its time then stays);
    returns whether it wrote."""
    p = Path(path)
    try:
        if p.read_text() == text:
            return False
    except (OSError, UnicodeDecodeError):
        pass
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(text)
    tmp.replace(p)
    return True
