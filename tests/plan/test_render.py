"""The text and the markdown of a plan carry the same cells, and the copy of the configs/paper.yaml
plan in docs/scale_out.md ("Memory plan") is what the command writes today."""

import re
from pathlib import Path

import pytest

from isoexec.plan import memory_plan, render_markdown, render_text

ROOT = Path(__file__).resolve().parents[2]
BEGIN = "<!-- isoexec plan --config configs/paper.yaml: begin -->\n"
END = "<!-- isoexec plan --config configs/paper.yaml: end -->"


@pytest.fixture(scope="module")
def paper():
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)                      # paths are shown relative to the working directory
        plan = memory_plan("configs/paper.yaml")
        return plan, render_text(plan), render_markdown(plan, "isoexec plan --config configs/paper.yaml")


def test_the_docs_hold_the_current_plan_of_the_paper_config(paper):
    _, _, md = paper
    doc = (ROOT / "docs" / "scale_out.md").read_text()
    assert doc.split(BEGIN, 1)[1].split(END, 1)[0] == md, \
        "re-run `isoexec plan --config configs/paper.yaml --markdown FILE` and paste FILE into docs/scale_out.md"


def test_text_and_markdown_have_the_same_rows(paper):
    plan, text, md = paper
    for r in plan.rows:
        verdict = r.verdict()
        assert re.search(rf"^{r.shape.family}\s.*{re.escape(verdict)}$", text, re.M)
        assert f"| {r.shape.family} | {', '.join(r.shape.arms)} |" in md and f"| {verdict} |" in md
