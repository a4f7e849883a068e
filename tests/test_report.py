"""isoexec.report: the records the workflow writes and the tables it renders, on small fixtures."""

from __future__ import annotations

import csv
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from isoexec import report

ENV = {"device": "cpu (x86_64, 2 threads)", "arch": "cpu", "torch": "2.13.0", "triton": "absent",
       "transformers": "5.17.0", "python": "3.11.7", "commit": "abc123", "date": "2026-01-01T00:00:00Z"}


def artifact(aid: str, *, gate="batch_invariance", region=("lm_head",), impl="gemm_fixed_k", dtype="float32",
             verdict="pass", expect="invariant", differing=0, compared=64, max_ulp=0, of=None, env=ENV) -> dict:
    g = {"family": gate, "region": list(region), "impl": {"id": impl, "version": "1", "arch": "cpu"},
         "constants": {}, "shapes": {}, "dtype": dtype, "seed": 0, "hazards": []}
    if of:
        g["of"] = of
    return {"id": aid, "gate": g, "expect": expect, "verdict": verdict,
            "counts": {"compared": compared, "differing": differing, "max_abs_diff": "0.0", "max_ulp": max_ulp,
                       "first_index": None, "comparisons": 1},
            "correctness": {"rel_err": "0.0", "tolerance": "0.01"}, "hazards_exercised": {}, "env": env}


def write_json(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))
    return path


def gate_record(status="failed", returncode=1, error="", skipped=()) -> dict:
    return {"family": "dense", "composition": "isoexec", "arch": "cpu", "seed": 7, "model": "dense_tiny",
            "returncode": returncode, "status": status, "error": error, "skipped": list(skipped), "summary": None}


@pytest.fixture
def gates_run(tmp_path):
    d = tmp_path / "gates" / "dense"
    write_json(d / f"{'a' * 64}.json", artifact("a" * 64))
    write_json(d / f"{'b' * 64}.json", artifact("b" * 64, region=("attn_norm",), impl="rmsnorm_fixed", dtype="bfloat16",
                                                 gate="hazards"))
    write_json(d / f"{'c' * 64}.json", artifact("c" * 64, gate="negative_control", impl="torch_linear", of="batch_invariance",
                                                 expect="variant", differing=40, max_ulp=3))
    write_json(d / f"{'d' * 64}.json", artifact("d" * 64, region=("down_proj",), verdict="fail", differing=5,
                                                 compared=128, max_ulp=2))
    skipped = [{"gate": "case_parity", "region": "attn_core", "impl": "attention_fixed_walk",
                "reason": "no attention case_parity gate yet"}]
    rec = write_json(tmp_path / "gate_runs" / "dense.json", gate_record(skipped=skipped))
    return rec, d


def table_rows(md: str, first_cell: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in md.splitlines()
            if ln.startswith(f"| {first_cell} |")]


# ------------------------------------------------------------------------------------ gates table
def test_gates_table_has_one_row_per_artifact_and_counts_verdicts(gates_run, tmp_path):
    md, csv_path = tmp_path / "out" / "gates.md", tmp_path / "out" / "gates.csv"
    counts = report.write_gates_report([gates_run], md, csv_path, "unit")
    assert counts == {"pass": 3, "fail": 1}
    text = md.read_text()
    rows = [r for r in table_rows(text, "dense") if r[-1].startswith("`")]
    assert len(rows) == 4
    by_id = {r[-1].strip("`"): r for r in rows}
    assert by_id["a" * 12] == ["dense", "batch_invariance", "lm_head", "gemm_fixed_k v1 (cpu)", "float32", "invariant",
                               "0 / 64", "0", "pass", f"`{'a' * 12}`"]
    assert by_id["d" * 12][6:9] == ["5 / 128", "2", "fail"]
    neg = by_id["c" * 12]
    assert neg[1] == "negative_control (of batch_invariance)" and neg[5] == "variant" and neg[8] == "pass"
    assert "**4 gates: 3 pass, 1 fail**" in text
    assert "Measured on: cpu (x86_64, 2 threads) · arch cpu · torch 2.13.0" in text and "commit abc123" in text
    assert "seed 7" in text
    # the runs table: model, 4 gates, 3 pass, 1 fail, 1 not run
    assert ["dense", "dense_tiny", "4", "3", "1", "1", "finished, some gate failed (exit 1)"] in table_rows(text, "dense")
    missing = text.split("## Missing, failing or inconclusive", 1)[1]
    assert "case_parity gate for attn_core (attention_fixed_walk) not run: no attention case_parity gate yet" in missing
    assert "batch_invariance gate for down_proj (gemm_fixed_k v1 (cpu), float32) FAILED: 5 of 128" in missing


def test_an_inconclusive_negative_control_is_listed_as_inconclusive_not_failed(gates_run, tmp_path):
    rec, d = gates_run
    write_json(d / f"{'f' * 64}.json", artifact("f" * 64, gate="negative_control", impl="torch_sdpa", of="batch_invariance",
                                                 expect="variant", verdict="inconclusive", region=("attn_core",)))
    md = tmp_path / "gates.md"
    counts = report.write_gates_report([(rec, d)], md, tmp_path / "gates.csv", "unit")
    assert counts["inconclusive"] == 1
    missing = md.read_text().split("## Missing, failing or inconclusive", 1)[1]
    line = next(ln for ln in missing.splitlines() if "attn_core" in ln and "torch_sdpa" in ln)
    assert "INCONCLUSIVE" in line and "FAILED" not in line
    assert "FAILED: 5 of 128" in missing  # a real failure is still called one


def test_gates_csv_carries_full_ids(gates_run, tmp_path):
    md, csv_path = tmp_path / "gates.md", tmp_path / "gates.csv"
    report.write_gates_report([gates_run], md, csv_path, "unit")
    rows = list(csv.DictReader(csv_path.open()))
    assert [r["id"] for r in rows].count("d" * 64) == 1 and len(rows) == 4
    assert set(rows[0]) == set(report.GATE_FIELDS)


def test_a_stopped_run_and_an_unreadable_artifact_are_reported(tmp_path):
    d = tmp_path / "gates" / "dense"
    write_json(d / f"{'e' * 64}.json", artifact("e" * 64))
    (d / "broken.json").write_text("{not json")
    rec = write_json(tmp_path / "gate_runs" / "dense.json",
                     gate_record(status="error", error="region act, case trainer_score: cannot import 'x'"))
    md = tmp_path / "gates.md"
    report.write_gates_report([(rec, d)], md, tmp_path / "gates.csv", "unit")
    text = md.read_text()
    assert "stopped after 1 artifact(s) (exit 1): region act, case trainer_score: cannot import 'x'" in text
    assert "the gate run stopped early" in text
    assert "`broken.json`" in text and "not a readable gate artifact" in text


def test_no_artifacts_at_all(tmp_path):
    rec = write_json(tmp_path / "gate_runs" / "dense.json", gate_record(status="error", error="boom"))
    md = tmp_path / "gates.md"
    counts = report.write_gates_report([(rec, tmp_path / "gates" / "dense")], md, tmp_path / "gates.csv", "unit")
    text = md.read_text()
    assert not counts and "No gate artifact was written." in text and "no environment was recorded" in text


def test_all_passing_says_nothing_is_missing(tmp_path):
    d = tmp_path / "gates" / "dense"
    write_json(d / f"{'a' * 64}.json", artifact("a" * 64))
    rec = write_json(tmp_path / "gate_runs" / "dense.json", gate_record(status="passed", returncode=0))
    md = tmp_path / "gates.md"
    report.write_gates_report([(rec, d)], md, tmp_path / "gates.csv", "unit")
    assert "Nothing: every gate ran and passed." in md.read_text()


# ------------------------------------------------------------------------------------ contracts table
def contract_fixture(tmp_path: Path, composition: str, *, zero: bool, admitted: bool, problems=(), built=True,
                     gate_status="passed") -> dict:
    d = tmp_path / "contracts" / "dense"
    ident = {"semantic": "1" * 64, "numerical_policy": (composition[0] * 64 if composition[0] in "abcdef" else "2" * 64),
             "deployment": "3" * 64}
    show = write_json(d / f"{composition}.show.json",
                      {"family": "dense", "identities": ident, "claims_zero_tolerance": zero,
                       "entries": [{"region": ["e"]}] * 16})
    checks = [{"entry": f"region r{i}", "ok": True, "artifacts": ["x"], "problem": ""} for i in range(3)]
    checks += [{"entry": e, "ok": False, "artifacts": [], "problem": p} for e, p in problems]
    verify = write_json(d / f"{composition}.verify.json",
                        {"contract": str(d / f"{composition}.json"), "returncode": 0 if admitted else 1,
                         "admitted": admitted, "result": {"admitted": admitted, "checks": checks}})
    admission = write_json(d / f"{composition}.admission.json", {"built_with_gates": built})
    gate_run = write_json(tmp_path / "gate_runs" / "dense.json",
                          gate_record(status=gate_status, error="cannot import 'k'" if gate_status == "error" else ""))
    return {"family": "dense", "composition": composition, "show": show, "verify": verify, "admission": admission,
            "gate_run": gate_run}


def test_contracts_table_admitted_not_admitted_and_na(tmp_path):
    items = [
        contract_fixture(tmp_path / "x", "isoexec", zero=True, admitted=True),
        contract_fixture(tmp_path / "y", "isoexec", zero=True, admitted=False, built=False, gate_status="error",
                         problems=[("region act (silu_mul_fp32 v1 (cpu))", "no artifact for gate(s) batch_invariance")]),
        contract_fixture(tmp_path / "z", "native", zero=False, admitted=True),
    ]
    md, csv_path = tmp_path / "contracts.md", tmp_path / "contracts.csv"
    counts = report.write_contracts_report(items, md, csv_path, "unit", "cpu")
    assert counts == {"admitted": 1, "not admitted": 1, "n.a.": 1}
    text = md.read_text()
    assert "**3 contracts: 1 admitted, 1 not admitted, 1 n.a.**" in text
    rows = table_rows(text, "dense")
    status_rows = [r for r in rows if len(r) == 6]
    assert status_rows[0][:5] == ["dense", "isoexec", "16", "claimed", "admitted"]
    assert status_rows[0][5] == "3 entries discharged by passing gates"
    assert status_rows[1][:5] == ["dense", "isoexec", "16", "claimed", "not admitted"]
    assert status_rows[1][5].startswith("1 of 4 entries lack a passing gate; the draft (pending discharges) was kept")
    assert "the gate run stopped early: cannot import 'k'" in status_rows[1][5]
    assert status_rows[2][:5] == ["dense", "native", "16", "not claimed", "n.a."]
    digest_rows = [r for r in rows if len(r) == 5]
    assert digest_rows[0] == ["dense", "isoexec", f"`{'1' * 64}`", f"`{'2' * 64}`", f"`{'3' * 64}`"]
    details = text.split("## Entries without a passing gate", 1)[1]
    assert "dense / isoexec: region act (silu_mul_fp32 v1 (cpu)): no artifact for gate(s) batch_invariance" in details
    rows_csv = list(csv.DictReader(csv_path.open()))
    assert [r["admission"] for r in rows_csv] == ["admitted", "not admitted", "n.a."]
    assert rows_csv[0]["semantic"] == "1" * 64 and rows_csv[0]["entries"] == "16"


# ------------------------------------------------------------------------------------ recording
def test_error_line_and_skip_parsing():
    err = "PASS something\nSKIP case_parity       attn_core      attention_fixed_walk   (no attention case_parity gate yet)\n" \
          "isoexec: error: region act, case trainer_score: cannot import 'x'\n  hint line\n"
    assert report.error_line(err) == "region act, case trainer_score: cannot import 'x'"
    assert report.skipped_gates(err) == [{"gate": "case_parity", "region": "attn_core", "impl": "attention_fixed_walk",
                                          "reason": "no attention case_parity gate yet"}]
    tb = "Traceback (most recent call last):\n  File x\nModuleNotFoundError: No module named 'isoexec_kernels.foo'\n"
    assert report.error_line(tb) == "ModuleNotFoundError: No module named 'isoexec_kernels.foo'"
    assert report.error_line("") == ""


def test_parse_stdout_json_tolerates_stray_lines():
    assert report.parse_stdout_json('{"a": 1}') == {"a": 1}
    assert report.parse_stdout_json('warning: x\n{\n "a": 2\n}\n') == {"a": 2}
    assert report.parse_stdout_json("") is None and report.parse_stdout_json("nope") is None


FAKE = """\
#!{python}
import json, os, sys
mode = os.environ["FAKE_MODE"]
args = sys.argv[1:]
if args[:2] == ["gates", "run"]:
    out = args[args.index("--out") + 1]
    print("SKIP case_parity attn_core attention_fixed_walk (no gate yet)", file=sys.stderr)
    if mode == "bad":
        print("isoexec: error: unknown family 'x'", file=sys.stderr); sys.exit(2)
    if mode == "stop":
        print("isoexec: error: cannot import 'isoexec_kernels.nope'", file=sys.stderr); sys.exit(1)
    gates = [dict(id="a" * 64, verdict="pass" if mode == "pass" else "fail")]
    print(json.dumps(dict(passed=mode == "pass", gates=gates))); sys.exit(0 if mode == "pass" else 1)
if args[:2] == ["contract", "verify"]:
    if mode == "crash":
        print("Traceback (most recent call last):\\nValueError: boom", file=sys.stderr); sys.exit(1)
    ok = mode == "pass"
    print(json.dumps(dict(admitted=ok, checks=[], contract=args[2]))); sys.exit(0 if ok else 1)
if args[:2] == ["contract", "build"]:
    out = args[args.index("--out") + 1]
    open(out, "w").write("built" + (" with gates" if "--gates" in args else "")); sys.exit(0)
sys.exit(3)
"""


@pytest.fixture
def fake_cli(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "isoexec"
    exe.write_text(FAKE.format(python=sys.executable))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")

    def set_mode(mode):
        monkeypatch.setenv("FAKE_MODE", mode)
    return set_mode


def _run_gates(tmp_path):
    return report.run_gates(family="dense", composition="configs/compositions/isoexec.yaml", model="dense_tiny",
                            arch="cpu", seed=5, out_dir=tmp_path / "g", record=tmp_path / "rec.json",
                            log=tmp_path / "gates.log", threads=2)


@pytest.mark.parametrize("mode,status,rc", [("pass", "passed", 0), ("fail", "failed", 1), ("stop", "error", 1)])
def test_run_gates_records_the_outcome(fake_cli, tmp_path, mode, status, rc):
    fake_cli(mode)
    rec = _run_gates(tmp_path)
    assert rec == json.loads((tmp_path / "rec.json").read_text())
    assert rec["status"] == status and rec["returncode"] == rc and rec["seed"] == 5
    assert rec["composition"] == "isoexec" and rec["command"][:3] == ["isoexec", "gates", "run"]
    assert rec["skipped"][0]["region"] == "attn_core"
    assert (rec["error"] == "cannot import 'isoexec_kernels.nope'") == (mode == "stop")
    assert (tmp_path / "g").is_dir()
    log = (tmp_path / "gates.log").read_text()
    assert log.startswith("$ isoexec gates run --family dense") and f"# exit {rc}" in log


def test_run_gates_bad_input_raises(fake_cli, tmp_path):
    fake_cli("bad")
    with pytest.raises(report.CommandFailed, match=r"exited 2 \(bad input\): unknown family 'x'"):
        _run_gates(tmp_path)
    assert not (tmp_path / "rec.json").exists()


def _admit(tmp_path):
    draft = tmp_path / "c.draft.json"
    draft.write_text("draft bytes")
    return report.admit_contract(family="dense", composition="isoexec", build_args=["contract", "build", "--family",
                                 "dense"], draft=draft, gates_dir=tmp_path, out=tmp_path / "c.json",
                                 record=tmp_path / "c.admission.json", log=tmp_path / "admit.log")


def test_admit_builds_with_gates_when_admitted(fake_cli, tmp_path):
    fake_cli("pass")
    rec = _admit(tmp_path)
    assert rec["built_with_gates"] is True and rec["draft_verdict"]["admitted"] is True
    assert (tmp_path / "c.json").read_text() == "built with gates"


def test_admit_keeps_the_draft_when_not_admitted(fake_cli, tmp_path):
    fake_cli("fail")
    rec = _admit(tmp_path)
    assert rec["built_with_gates"] is False
    assert (tmp_path / "c.json").read_text() == "draft bytes"
    assert json.loads((tmp_path / "c.admission.json").read_text()) == rec


def test_verify_records_not_admitted_and_raises_on_a_crash(fake_cli, tmp_path):
    fake_cli("fail")
    rec = report.verify_contract(contract=tmp_path / "c.json", gates_dir=tmp_path, record=tmp_path / "v.json",
                                 log=tmp_path / "v.log")
    assert rec["admitted"] is False and rec["returncode"] == 1 and rec["result"]["admitted"] is False
    fake_cli("crash")
    with pytest.raises(report.CommandFailed, match="without a verdict: ValueError: boom"):
        report.verify_contract(contract=tmp_path / "c.json", gates_dir=tmp_path, record=tmp_path / "v2.json",
                               log=tmp_path / "v2.log")


def test_run_cli_writes_stdout_to_a_file_only_on_success(fake_cli, tmp_path):
    fake_cli("pass")
    with open(tmp_path / "log", "w") as lf:
        report.run_cli(["contract", "verify", "c.json", "--json"], lf, stdout=tmp_path / "out.json")
    assert json.loads((tmp_path / "out.json").read_text())["admitted"] is True
    with open(tmp_path / "log", "w") as lf, pytest.raises(report.CommandFailed, match="exited 3"):
        report.run_cli(["nothing"], lf, stdout=tmp_path / "never.json")
    assert not (tmp_path / "never.json").exists()


def test_run_cli_streams_the_command_output_into_the_log(tmp_path, monkeypatch):
    """The log shows what the command printed while it still runs (a long RL run or gate run is
    followed live, and a job killed mid-way keeps its output)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "isoexec"
    flag = tmp_path / "go"
    exe.write_text(f"#!{sys.executable}\nimport os, sys, time\nprint('first line', file=sys.stderr, flush=True)\n"
                   f"while not os.path.exists({str(flag)!r}):\n    time.sleep(0.05)\n"
                   "print('{\"done\": true}')\nprint('isoexec: error: it went wrong', file=sys.stderr)\nsys.exit(1)\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    log = tmp_path / "job.log"
    result = {}

    def run():
        with open(log, "a") as lf:
            result["proc"] = report.run_cli(["gates", "run"], lf, accept=(0, 1))
    t = threading.Thread(target=run)
    t.start()
    deadline = time.time() + 30
    while "first line" not in (log.read_text() if log.exists() else "") and time.time() < deadline:
        time.sleep(0.05)
    assert "first line" in log.read_text() and t.is_alive()   # in the log while the command runs
    flag.write_text("")
    t.join(30)
    proc = result["proc"]
    assert proc.returncode == 1 and json.loads(proc.stdout) == {"done": True}
    assert report.error_line(proc.stderr) == "it went wrong"
    text = log.read_text()
    assert text.startswith("$ isoexec gates run\nfirst line\n") and "# exit 1 after" in text
