"""Test modules are imported by basename (no __init__.py in tests/, pytest's rootdir imports): two
files with the same name in different folders break collection of the second one."""

from collections import Counter
from fnmatch import fnmatch
from pathlib import Path


def test_no_two_test_modules_share_a_basename():
    files = sorted(Path(__file__).parent.rglob("test_*.py"))
    dup = {name: n for name, n in Counter(f.name for f in files).items() if n > 1}
    assert len(files) > 50 and not dup, f"test files sharing a basename: {dup}"


def test_no_test_folder_is_left_out_by_norecursedirs(pytestconfig):
    """A folder whose name matches a norecursedirs pattern is not collected by a plain `pytest`,
    though its tests pass when named (pytest's default list has "dist": tests/dist once ran nowhere)."""
    here = Path(__file__).parent
    patterns = pytestconfig.getini("norecursedirs")
    folders = {f.parent.relative_to(here) for f in here.rglob("test_*.py")}
    left_out = sorted(str(d) for d in folders if any(fnmatch(part, p) for part in d.parts for p in patterns))
    assert len(folders) > 10 and not left_out, f"test folders pytest does not collect: {left_out}"
