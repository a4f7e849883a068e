"""The main job itself: `snakemake --cores all` on the embedded CPU default, in the checkout.

The README's test command runs the main job before pytest, so here the run is already complete and
this test costs a no-op rerun and a report (seconds); run on its own, the test runs the main job
first (about 6.5 minutes on 2 cores, for the four model families). Either way the assertions are
about the very outputs a user gets (`results/cpu/`, `paper_figures/cpu/`), made under the settings
of `configs/config.yaml`, and no second end-to-end run of a shortened config repeats that work.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
# one module, so one xdist worker (`--dist loadfile`): two `snakemake` runs in the checkout at once
# would lock each other out
pytestmark = pytest.mark.slow

CONFIG = yaml.safe_load((REPO / "configs/config.yaml").read_text())
RES = REPO / CONFIG["results_dir"] / CONFIG["run_name"]
FIG = REPO / CONFIG["figures_dir"] / CONFIG["run_name"]
# the embedded default runs the four model families
FAMILIES = ["dense", "hybrid", "mla_moe", "hybrid_moe"]


def snakemake(*args: str, timeout: int = 3600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def main_job():
    """The main job, brought up to date (a no-op when the README's test command ran it already)."""
    r = snakemake("--cores", "all")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_after_the_main_job_nothing_is_left_to_do(main_job):
    again = snakemake("--cores", "all", "-n")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, again.stdout[-2000:]


def md_families(text: str, header: str) -> list[str]:
    """The first column of the markdown table whose header line is ``header``, one entry per row."""
    lines = text.splitlines()
    start = lines.index(header) + 2   # past the header and the |---| line
    rows = []
    for ln in lines[start:]:
        if not ln.startswith("| "):
            break
        rows.append(ln.strip("|").split("|")[0].strip())
    return rows


def test_the_default_runs_the_four_families_and_every_table_shows_them(main_job):
    assert CONFIG["families"] == FAMILIES
    assert sorted(CONFIG["models"]) == sorted(FAMILIES)
    with open(FIG / "gates.csv", newline="") as f:
        assert {row["family"] for row in csv.DictReader(f)} == set(FAMILIES)
    gates_md = (FIG / "gates.md").read_text()
    assert md_families(gates_md, "| family | model | gates | pass | fail | not run | gate run |") == FAMILIES
    assert set(md_families(gates_md, "| family | gate | region | impl | dtype | expect | differing / compared | "
                                     "max ULP | verdict | artifact |")) == set(FAMILIES)
    contracts_md = (FIG / "contracts.md").read_text()
    assert sorted(md_families(contracts_md, "| family | composition | entries | tolerance 0 | admission | reason |")) \
        == sorted(f for f in FAMILIES for _ in CONFIG["compositions"])
    lp = (FIG / "logprob_diff.md").read_text()
    header = next(ln for ln in lp.splitlines() if ln.startswith("| family | native mean |"))
    assert sorted(md_families(lp, header)) == sorted(FAMILIES)
    st = (FIG / "step_time.md").read_text()
    assert set(md_families(st, "| family | stage | native s | IsoExec s | overhead |")) == set(FAMILIES)
    for family in FAMILIES:
        assert f"| {family} | full step |" in st, family
    with open(FIG / "runs.csv", newline="") as f:
        assert sorted((r["family"], r["composition"]) for r in csv.DictReader(f)) == sorted(
            (fam, c) for fam in FAMILIES for c in CONFIG["compositions"])


def test_every_family_has_gate_rows_and_an_admitted_isoexec_contract(main_job):
    gates_md = (FIG / "gates.md").read_text()
    contracts_md = (FIG / "contracts.md").read_text()
    assert "Measured on: cpu" in gates_md and "torch " in gates_md
    csv_lines = (FIG / "gates.csv").read_text().splitlines()
    assert csv_lines[0].startswith("family,gate,region")
    n_total = 0
    for family in CONFIG["families"]:
        record = json.loads((RES / "gate_runs" / f"{family}.json").read_text())
        assert record["status"] == "passed", (family, record.get("error"))
        n = len(list((RES / "gates" / family).glob("*.json")))
        rows = [ln for ln in gates_md.splitlines() if ln.startswith(f"| {family} |") and "`" in ln]
        assert n > 0 and len(rows) == n, family
        n_total += n
        assert re.search(rf"\| {family} \| isoexec \| \d+ \| claimed \| admitted \|", contracts_md), family
        assert re.search(rf"\| {family} \| native \| \d+ \| not claimed \| n\.a\. \|", contracts_md), family
    assert len(csv_lines) == n_total + 1
    # gdn_core: the hybrid families; router, dispatch, experts, combine: the MoE families
    for region in ("lm_head", "attn_norm", "embed", "gdn_core", "router", "dispatch", "experts", "combine"):
        assert f"| {region} |" in gates_md, region
    # 3 digests per contract (model config, composition, canonical bytes)
    n_contracts = len(CONFIG["families"]) * len(CONFIG["compositions"])
    assert len(re.findall(r"`[0-9a-f]{64}`", contracts_md)) == 3 * n_contracts


def test_benchmarks_and_their_tables(main_job):
    # the default config leaves the benchmarks to the workflow schema's default list
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    names = CONFIG.get("benchmarks", {}).get("names") or schema["properties"]["benchmarks"]["properties"]["names"]["default"]
    assert sorted(p.stem for p in (RES / "bench").glob("*.json")) == sorted(names)
    cpr = (FIG / "cpr.md").read_text()
    assert all(f"| {stage} |" in cpr for stage in ("trainer fwd+bwd", "rollout prefill", "decode"))
    assert (FIG / "kernels.md").stat().st_size > 500


def test_rl_runs_isoexec_exactly_zero_native_not(main_job):
    steps = CONFIG["rl"]["settings"]["steps"]
    runs = sorted((RES / "runs").glob("*/*/seed0"))
    assert len(runs) == len(CONFIG["families"]) * len(CONFIG["compositions"])
    for run in runs:
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == list(range(steps)), run
        assert any(x.get("train_updates", 0) for x in lines), run
        log = (RES / "logs/runs" / f"{run.parts[-3]}_{run.parts[-2]}_seed0.log").read_text()
        assert "starting from the shared warm-up" in log, run   # the default warms up before RL, once per family
    for family in CONFIG["families"]:   # one warm-up (native composition), both arms start from its weights
        record = json.loads((RES / "warmup" / family / "seed0" / "warmup.json").read_text())
        assert record["composition"] == "native"
        assert "warm-up SFT" in (RES / "logs/warmup" / f"{family}_seed0.log").read_text()
        starts = [json.loads((RES / "runs" / family / c / "seed0" / "run.json").read_text())["started_from"]
                  for c in CONFIG["compositions"]]
        assert all(x["weights"] == "shared warm-up" and x["sha256"] == record["weights_sha256"] for x in starts), starts
    lp = (FIG / "logprob_diff.md").read_text()
    for family in CONFIG["families"]:
        row = next(ln for ln in lp.splitlines() if ln.startswith(f"| {family} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[5] == "0" and cells[7] == "0" and cells[8] == "1", row      # IsoExec mean, max, equal
        assert cells[3] not in ("0", "–"), row                                   # native max
        assert f"| {family} | full step |" in (FIG / "step_time.md").read_text()
    for name in ("logprob_diff.png", "step_time.png"):
        assert (FIG / name).stat().st_size > 500


def test_the_html_report_renders(main_job, tmp_path):
    html = tmp_path / "report.html"
    rep = snakemake("--cores", "all", "--report", str(html))
    assert rep.returncode == 0, rep.stderr[-3000:]
    assert html.stat().st_size > 10_000
