"""README gives exactly two set-up-and-run commands, and .ci/run runs the test one verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quick_start_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def test_readme_has_exactly_two_commands():
    cmds = _quick_start_commands()
    assert len(cmds) == 2
    main, tests = cmds
    assert main.rstrip().endswith("snakemake --cores all")
    assert "pytest" in tests and "snakemake --lint" in tests
    for c in cmds:
        assert "\n" not in c.strip() and "pip install" in c


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert _quick_start_commands()[1].strip() in ci.splitlines()
