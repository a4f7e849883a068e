"""Test modules are imported by basename (no __init__.py in tests/, pytest's rootdir imports): two
files with the same name in different folders break collection of the second one."""

from collections import Counter
from pathlib import Path


def test_no_two_test_modules_share_a_basename():
    files = sorted(Path(__file__).parent.rglob("test_*.py"))
    dup = {name: n for name, n in Counter(f.name for f in files).items() if n > 1}
    assert len(files) > 50 and not dup, f"test files sharing a basename: {dup}"
