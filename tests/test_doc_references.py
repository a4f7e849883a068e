"""Every document that code or docs name exists in the project: all-capital names such as
``GATES.md``, paths under ``docs/``, and the targets of markdown links. (Lower-case names such as
``step_time.md`` are the workflow's generated tables, not documents.)"""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CAPS = re.compile(r"(?<![\w/.-])(?:[\w.-]+/)*[A-Z][A-Z0-9_]*\.md\b")
DOCS = re.compile(r"(?<![\w/.-])(?:\.\./)*docs/[\w./-]+\.md\b")
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")


def _tracked_sources():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    # this file names missing documents on purpose (its checker test)
    return [ROOT / p for p in out if p.endswith((".py", ".md", ".smk", ".yaml", ".yml", ".sh"))
            and not p.startswith("paper_figures/") and p != "tests/test_doc_references.py" and (ROOT / p).is_file()]


def _missing(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    refs = CAPS.findall(text) + DOCS.findall(text)
    if path.suffix == ".md":
        refs += LINK.findall(text)
    bad = []
    for ref in refs:
        if ref.startswith(("http://", "https://")):
            continue
        if not any(c.is_file() for c in (ROOT / ref, path.parent / ref, ROOT / "docs" / ref)):
            bad.append(ref)
    return bad


def test_every_named_document_exists():
    problems = {str(p.relative_to(ROOT)): refs for p in _tracked_sources() if (refs := _missing(p))}
    assert not problems, f"references to documents the project does not have: {problems}"


def test_the_checker_finds_missing_documents(tmp_path):
    f = tmp_path / "x.md"
    f.write_text("See GATES.md, docs/nothing.md, [c](contract.md) and README.md; step_time.md is output.\n")
    assert _missing(f) == ["GATES.md", "docs/nothing.md"]
    (tmp_path / "other.md").write_text("x")
    f.write_text("[o](other.md) [m](missing.md)\n")
    assert _missing(f) == ["missing.md"]
