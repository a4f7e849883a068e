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
    # the main job runs before pytest: tests/workflow/test_default_run.py checks its outputs (and
    # makes the run itself only when pytest runs alone)
    steps = [s.strip() for s in tests.split("&&")]
    assert steps.index("snakemake --cores all") < steps.index("python3 -m pytest -q -n auto --dist loadfile"), steps
    for c in cmds:
        assert "\n" not in c.strip() and "pip install" in c


def test_readme_commands_install_into_a_virtual_environment():
    """A distribution's own Python refuses `pip install` outside a venv (PEP 668): each command
    creates .venv/ unless it has one (an existing venv is reused as it is) and activates it before
    anything is installed or run."""
    for c in _quick_start_commands():
        steps = [s.strip() for s in c.strip().split("&&")]
        assert steps[:2] == ["{ [ -f .venv/bin/activate ] || python3 -m venv .venv; }", ". .venv/bin/activate"], steps
        assert steps[2].startswith("python3 -m pip install"), steps
    section = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "python3-venv" in section  # what Debian/Ubuntu need when `python3 -m venv` fails


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert _quick_start_commands()[1].strip() in ci.splitlines()
