"""What the workflow records, and the tables it renders from results/.

Two halves, both used by the workflow's job scripts (workflow/scripts/*.py):

* **Recording** (``run_cli``, ``run_gates``, ``admit_contract``, ``verify_contract``): run the
  ``isoexec`` command line and write its outcome to a JSON record. The exit codes are the CLI's
  (0 ok, 1 a check failed, 2 bad input). An expected "check failed" (a gate that fails, a gate run
  stopped by a kernel that is not there yet, a contract that is not admitted) is *recorded*, so
  the workflow finishes and the tables say what is missing; bad input (exit 2) or anything else
  raises :class:`CommandFailed` and fails the rule. Each command's output is appended to the
  job's log as it comes (``run_cli``).
* **Rendering** (``write_gates_report``, ``write_contracts_report``): read those records, the gate
  artifacts and the contract summaries, and write markdown and CSV tables to paper_figures/.

Layout of one run (docs/architecture.md; paths are chosen by the workflow and passed in):

    results/<run>/contracts/<family>/<composition>.draft.json      contract build (pending discharges)
    results/<run>/contracts/<family>/<composition>.json            admitted build, or the draft if refused
    results/<run>/contracts/<family>/<composition>.admission.json  record: why admitted or not
    results/<run>/contracts/<family>/<composition>.show.json       `contract show --json`
    results/<run>/contracts/<family>/<composition>.verify.json     record of `contract verify --json`
    results/<run>/gates/<family>/<id>.json                         gate artifacts (docs/gates.md)
    results/<run>/gate_runs/<family>.json                          record of `gates run --json`

Nothing here imports torch: rendering runs wherever Snakemake runs.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import IO, Iterable, Mapping, Sequence

from .paths import atomic_write

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT = 0, 1, 2
ID_PREFIX = 12  # hex digits of an artifact id shown in tables (the full id is in the CSV)


class CommandFailed(RuntimeError):
    """An ``isoexec`` command ended in a way the workflow must not paper over."""


# =========================================================================== recording
def _isoexec_argv(args: Sequence) -> list[str]:
    exe = shutil.which("isoexec")
    base = [exe] if exe else [sys.executable, "-m", "isoexec.cli"]
    return base + [str(a) for a in args]


def error_line(stderr: str) -> str:
    """The one line that says why a command stopped: the CLI's ``isoexec: error:`` line, else the
    last line of a traceback or of the output."""
    lines = [ln.rstrip() for ln in stderr.splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("isoexec: error:")]
    if errs:
        return errs[-1][len("isoexec: error:"):].strip()
    return lines[-1].strip() if lines else ""


_SKIP = re.compile(r"^SKIP\s+(?P<gate>\S+)\s+(?P<region>\S+)\s+(?P<impl>\S+)\s+\((?P<reason>.*)\)\s*$")


def skipped_gates(stderr: str) -> list[dict]:
    """Gates a run announced it could not run (``SKIP <gate> <region> <impl> (<reason>)``)."""
    out = []
    for ln in stderr.splitlines():
        if not ln.startswith("SKIP"):
            continue
        m = _SKIP.match(ln.strip())
        out.append(m.groupdict() if m else {"gate": "?", "region": "?", "impl": "?", "reason": " ".join(ln.split()[1:])})
    return out


def parse_stdout_json(stdout: str):
    """The JSON document a ``--json`` command printed, or None if it printed none."""
    text = stdout.strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    start = text.find("\n{")  # tolerate stray lines printed before the document
    if start >= 0:
        try:
            return json.loads(text[start + 1:])
        except json.JSONDecodeError:
            return None
    return None


def run_cli(args: Sequence, log: IO[str], *, accept: Iterable[int] = (EXIT_OK,), stdout: str | Path | None = None,
            env: Mapping[str, str] | None = None, launcher: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run ``isoexec *args``; its stderr goes to ``log`` line by line as it comes (a long job shows
    its progress live, and a job killed mid-way keeps what it printed), its stdout is collected and
    then appended to ``log`` (or written to the file ``stdout``, only on success).

    An exit code outside ``accept`` raises :class:`CommandFailed` naming the command, the code and
    the error line. ``launcher``, when given, is the command that stands for ``isoexec`` (e.g.
    ``torchrun --standalone --nproc_per_node=8 -m isoexec.cli``)."""
    argv = [*map(str, launcher), *map(str, args)] if launcher else _isoexec_argv(args)
    shown = shlex.join(argv if launcher else ["isoexec", *map(str, args)])
    log.write(f"$ {shown}\n")
    log.flush()
    t0 = time.time()
    err: list[str] = []
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1,
                                env=None if env is None else dict(env))
        try:
            for line in proc.stderr:
                log.write(line)
                log.flush()
                err.append(line)
            rc = proc.wait()
        finally:
            if proc.poll() is None:   # interrupted while reading: do not leave the command running
                proc.kill()
                proc.wait()
        out.seek(0)
        out_text = out.read()
    stderr = "".join(err)
    if stdout is None:
        log.write(out_text)
    log.write(f"# exit {rc} after {time.time() - t0:.1f}s\n")
    log.flush()
    if rc not in tuple(accept):
        why = error_line(stderr) or "no error message"
        kind = " (bad input)" if rc == EXIT_BAD_INPUT else ""
        raise CommandFailed(f"`{shown}` exited {rc}{kind}: {why}")
    if stdout is not None:
        atomic_write(stdout, out_text)
    return subprocess.CompletedProcess(argv, rc, out_text, stderr)


def _write_json(path: str | Path, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def _config_name(name_or_path) -> str:
    """``isoexec`` for ``configs/compositions/isoexec.yaml``; a plain name stays as it is."""
    p = Path(str(name_or_path))
    return p.stem if p.suffix in (".yaml", ".yml") else str(name_or_path)


def run_gates(*, family: str, composition: str, model: str, arch: str, seed: int, out_dir: str | Path,
              record: str | Path, log: str | Path, threads: int | None = None,
              env: Mapping[str, str] | None = None) -> dict:
    """``isoexec gates run`` into ``out_dir``; writes and returns the run record.

    ``status`` is ``passed`` (exit 0), ``failed`` (exit 1, the run finished and some gate failed),
    ``no gates`` (exit 1, nothing to run) or ``error`` (exit 1 without a summary: the run stopped,
    e.g. a kernel module that does not exist yet; ``error`` says why). Exit 2 raises. ``env`` is the
    command's environment (default: this process's; the workflow passes one with the job's GPUs)."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if env is None else env)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    args = ["gates", "run", "--family", family, "--composition", composition, "--model", model, "--arch", arch,
            "--seed", seed, "--out", out_dir, "--json"]
    with open(log, "a") as lf:
        proc = run_cli(args, lf, accept=(EXIT_OK, EXIT_CHECK_FAILED), env=env)
    summary = parse_stdout_json(proc.stdout)
    if summary is None:
        status = "passed" if proc.returncode == EXIT_OK else "error"
    elif proc.returncode == EXIT_OK:
        status = "passed"
    else:
        status = "failed" if summary.get("gates") else "no gates"
    rec = {"family": family, "composition": _config_name(composition), "model": _config_name(model), "arch": arch, "seed": int(seed),
           "artifacts_dir": str(out_dir), "command": ["isoexec", *map(str, args)], "returncode": proc.returncode,
           "status": status, "error": error_line(proc.stderr) if status == "error" else "",
           "skipped": skipped_gates(proc.stderr), "summary": summary}
    _write_json(record, rec)
    return rec


def _verify(contract, gates_dir, log: IO[str]) -> tuple[int, dict]:
    proc = run_cli(["contract", "verify", contract, "--gates", gates_dir, "--json"], log,
                   accept=(EXIT_OK, EXIT_CHECK_FAILED))
    result = parse_stdout_json(proc.stdout)
    if not isinstance(result, dict) or "admitted" not in result:
        raise CommandFailed(f"`isoexec contract verify {contract}` exited {proc.returncode} without a verdict: "
                            f"{error_line(proc.stderr) or 'no output'}")
    return proc.returncode, result


def admit_contract(*, family: str, composition: str, build_args: Sequence, draft: str | Path,
                   gates_dir: str | Path, out: str | Path, record: str | Path, log: str | Path) -> dict:
    """Build the admitted contract when the gates allow it, else keep the draft; record which.

    First ``contract verify`` checks the draft against the artifacts (exit 0/1 = admitted or not).
    If admitted, ``contract build <build_args> --gates DIR`` writes the contract whose discharges
    name the passing artifacts (a failure there is a real error and raises). If not, the draft is
    copied to ``out`` unchanged (pending discharges), so the next steps still have a contract to
    show and verify, and the record lists the entries that lack a passing gate."""
    with open(log, "a") as lf:
        rc, verdict = _verify(draft, gates_dir, lf)
        built = rc == EXIT_OK
        if built:
            run_cli([*build_args, "--gates", gates_dir, "--out", out], lf)
        else:
            atomic_write(out, Path(draft).read_bytes())
            lf.write(f"# not admitted: kept the draft as {out}\n")
    rec = {"family": family, "composition": composition, "draft": str(draft), "contract": str(out),
           "gates_dir": str(gates_dir), "built_with_gates": built, "draft_verdict": verdict}
    _write_json(record, rec)
    return rec


def verify_contract(*, contract: str | Path, gates_dir: str | Path, record: str | Path, log: str | Path) -> dict:
    """Record ``contract verify --json`` (exit 0 admitted, 1 not admitted; anything else raises)."""
    with open(log, "a") as lf:
        rc, result = _verify(contract, gates_dir, lf)
    rec = {"contract": str(contract), "gates_dir": str(gates_dir), "returncode": rc,
           "admitted": bool(result["admitted"]), "result": result}
    _write_json(record, rec)
    return rec


# =========================================================================== reading
def _load(path: str | Path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_artifacts(artifacts_dir: str | Path) -> tuple[list[dict], list[str]]:
    """Gate artifacts in a folder, and the names of files that are not readable artifacts."""
    arts, bad = [], []
    d = Path(artifacts_dir)
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            a = _load(p)
        except (OSError, ValueError):
            bad.append(p.name)
            continue
        if isinstance(a, dict) and isinstance(a.get("gate"), dict) and "verdict" in a:
            arts.append(a)
        else:
            bad.append(p.name)
    return arts, bad


def _impl_text(impl: Mapping) -> str:
    return f"{impl.get('id', '?')} v{impl.get('version', '?')} ({impl.get('arch', '?')})"


def gate_row(model_family: str, art: Mapping) -> dict:
    """One table row for one artifact (the fields of the CSV, in order)."""
    g, c = art.get("gate", {}), art.get("counts", {})
    gate = g.get("family", "?")
    if g.get("of"):
        gate = f"{gate} (of {g['of']})"
    return {"family": model_family, "gate": gate, "region": "+".join(g.get("region", [])),
            "impl": _impl_text(g.get("impl", {})), "dtype": str(g.get("dtype", "?")).replace("torch.", ""),
            "expect": art.get("expect", "invariant"), "differing": c.get("differing", ""),
            "compared": c.get("compared", ""), "max_abs_diff": c.get("max_abs_diff", ""),
            "max_ulp": c.get("max_ulp", ""), "verdict": art.get("verdict", "?"), "id": art.get("id", "")}


_ENV_KEYS = ("device", "arch", "torch", "triton", "transformers", "python", "commit")


def env_text(env: Mapping) -> str:
    parts = [str(env.get("device", "?"))]
    parts += [f"{k} {env[k]}" for k in _ENV_KEYS[1:] if k in env]
    return " · ".join(parts)


def _md_cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _md_table(header: Sequence[str], rows: Iterable[Sequence]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_md_cell(v) for v in r) + " |" for r in rows]
    return out


def _csv_text(fields: Sequence[str], rows: Iterable[Mapping]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(fields), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: r.get(k, "") for k in fields})
    return buf.getvalue()


# =========================================================================== gates table
GATE_FIELDS = ("family", "gate", "region", "impl", "dtype", "expect", "differing", "compared", "max_abs_diff",
               "max_ulp", "verdict", "id")


def collect_gates(runs: Iterable[tuple[str | Path, str | Path]]) -> list[dict]:
    """Per model family: its gate-run record, its artifacts (as rows) and unreadable files.
    ``runs`` pairs each family's record (results/<run>/gate_runs/<family>.json) with its
    artifact folder (results/<run>/gates/<family>/)."""
    out = []
    for record_path, artifacts_dir in runs:
        rec = _load(record_path)
        arts, bad = load_artifacts(artifacts_dir)
        fam = rec.get("family") or Path(artifacts_dir).name
        rows = sorted((gate_row(fam, a) for a in arts),
                      key=lambda r: (r["region"], r["gate"], r["impl"], r["dtype"], r["id"]))
        envs = Counter(env_text(a.get("env", {})) for a in arts)
        out.append({"family": fam, "record": rec, "rows": rows, "unreadable": bad, "envs": envs,
                    "artifacts_dir": str(artifacts_dir)})
    return out


def verdict_counts(rows: Iterable[Mapping]) -> Counter:
    return Counter(r["verdict"] for r in rows)


def _run_status_text(rec: Mapping, n_rows: int) -> str:
    status = rec.get("status", "?")
    rc = rec.get("returncode", "?")
    if status == "passed":
        return f"finished, every gate passed (exit {rc})"
    if status == "failed":
        return f"finished, some gate failed (exit {rc})"
    if status == "no gates":
        return f"finished without running any gate (exit {rc})"
    if status == "error":
        return f"stopped after {n_rows} artifact(s) (exit {rc}): {rec.get('error') or 'no error message'}"
    return f"{status} (exit {rc})"


def render_gates_md(fams: Sequence[Mapping], run_name: str) -> str:
    all_rows = [r for f in fams for r in f["rows"]]
    counts = verdict_counts(all_rows)
    first = fams[0]["record"] if fams else {}
    lines = [f"# Bitwise gates: run `{run_name}`", "",
             f"Composition `{first.get('composition', '?')}` on arch `{first.get('arch', '?')}`, "
             f"seed {first.get('seed', '?')}. One row per gate artifact "
             f"(`<results>/{run_name}/gates/<family>/<id>.json`, docs/gates.md). A gate passes with 0 differing "
             "elements; a negative control (expect `variant`) passes when the stock kernel *does* differ.", "",
             f"**{len(all_rows)} gates: {counts.get('pass', 0)} pass, {counts.get('fail', 0)} fail**"
             + "".join(f", {n} {v}" for v, n in sorted(counts.items()) if v not in ("pass", "fail")) + ".", ""]
    envs: Counter = Counter()
    for f in fams:
        envs.update(f["envs"])
    if envs:
        lines.append("Measured on: " + "; ".join(
            e + (f" ({n} artifacts)" if len(envs) > 1 else "") for e, n in sorted(envs.items())) + ".")
    else:
        lines.append("Measured on: no artifact was written, so no environment was recorded.")
    lines.append("")

    lines += ["## Runs", ""]
    summary = []
    for f in fams:
        c = verdict_counts(f["rows"])
        rec = f["record"]
        summary.append((f["family"], rec.get("model", "?"), len(f["rows"]), c.get("pass", 0), c.get("fail", 0),
                        len(rec.get("skipped", [])), _run_status_text(rec, len(f["rows"]))))
    lines += _md_table(("family", "model", "gates", "pass", "fail", "not run", "gate run"), summary)
    lines.append("")

    lines += ["## Gates", ""]
    if all_rows:
        lines += _md_table(("family", "gate", "region", "impl", "dtype", "expect", "differing / compared",
                            "max ULP", "verdict", "artifact"),
                           ((r["family"], r["gate"], r["region"], r["impl"], r["dtype"], r["expect"],
                             f"{r['differing']} / {r['compared']}", r["max_ulp"], r["verdict"],
                             f"`{str(r['id'])[:ID_PREFIX]}`") for f in fams for r in f["rows"]))
    else:
        lines.append("No gate artifact was written.")
    lines.append("")

    missing = []
    for f in fams:
        rec = f["record"]
        if rec.get("status") == "error":
            missing.append(f"- {f['family']}: the gate run stopped early: {rec.get('error') or 'no error message'} "
                           "(gates after this point did not run; see the rule's log)")
        for s in rec.get("skipped", []):
            missing.append(f"- {f['family']}: {s['gate']} gate for {s['region']} ({s['impl']}) not run: {s['reason']}")
        for r in f["rows"]:
            if r["verdict"] == "inconclusive":
                # a negative control whose stock kernel happened to be invariant here proves nothing,
                # but it is no failure of ours
                missing.append(f"- {f['family']}: {r['gate']} gate for {r['region']} ({r['impl']}, {r['dtype']}) "
                               f"INCONCLUSIVE: the stock kernel gave the same bits here ({r['differing']} of "
                               f"{r['compared']} differ; artifact `{str(r['id'])[:ID_PREFIX]}`)")
            elif r["verdict"] != "pass":
                missing.append(f"- {f['family']}: {r['gate']} gate for {r['region']} ({r['impl']}, {r['dtype']}) "
                               f"FAILED: {r['differing']} of {r['compared']} elements differ "
                               f"(artifact `{str(r['id'])[:ID_PREFIX]}`)")
        for name in f["unreadable"]:
            missing.append(f"- {f['family']}: `{name}` in {f['artifacts_dir']} is not a readable gate artifact")
    lines += ["## Missing, failing or inconclusive", ""]
    lines += missing or ["Nothing: every gate ran and passed."]
    lines.append("")
    return "\n".join(lines)


def _log_line(log: str | Path | None, text: str) -> None:
    if log is not None:
        atomic_write(log, text + "\n")


def write_gates_report(runs: Iterable[tuple[str | Path, str | Path]], md_path: str | Path, csv_path: str | Path,
                       run_name: str, log: str | Path | None = None) -> Counter:
    """Render gates.md and gates.csv; returns the verdict counts."""
    fams = collect_gates(runs)
    rows = [r for f in fams for r in f["rows"]]
    atomic_write(md_path, render_gates_md(fams, run_name))
    atomic_write(csv_path, _csv_text(GATE_FIELDS, rows))
    counts = verdict_counts(rows)
    _log_line(log, f"wrote {md_path} and {csv_path}: {len(rows)} gates, "
                   + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
    return counts


# =========================================================================== contracts table
CONTRACT_FIELDS = ("family", "composition", "entries", "tolerance_zero", "admission", "reason", "semantic",
                   "numerical_policy", "deployment", "contract")


def contract_row(item: Mapping) -> dict:
    """One row for one family x composition. ``item`` holds ``family``, ``composition`` and the
    paths ``show``, ``verify``, ``admission`` and optionally ``gate_run`` (records above)."""
    show = _load(item["show"])
    verify = _load(item["verify"])
    admission = _load(item["admission"]) if item.get("admission") else {}
    gate_run = _load(item["gate_run"]) if item.get("gate_run") else {}
    ident = show.get("identities", {})
    zero = bool(show.get("claims_zero_tolerance"))
    checks = (verify.get("result") or {}).get("checks", [])
    bad = [c for c in checks if not c.get("ok")]
    problems = [f"{c.get('entry', '?')}: {c.get('problem') or 'no passing gate'}" for c in bad]
    if not zero:
        admission_text = "n.a."
        reason = "claims no tolerance 0, so no entry needs a gate discharge (baseline composition)"
    elif verify.get("admitted"):
        admission_text = "admitted"
        reason = f"{len(checks)} entries discharged by passing gates"
    else:
        admission_text = "not admitted"
        reason = f"{len(bad)} of {len(checks)} entries lack a passing gate"
        if admission and not admission.get("built_with_gates", True):
            reason += "; the draft (pending discharges) was kept"
        if gate_run.get("status") == "error":
            reason += f"; the gate run stopped early: {gate_run.get('error') or 'no error message'}"
    return {"family": item["family"], "composition": item["composition"], "entries": len(show.get("entries", [])),
            "tolerance_zero": "claimed" if zero else "not claimed", "admission": admission_text, "reason": reason,
            "semantic": ident.get("semantic", ""), "numerical_policy": ident.get("numerical_policy", ""),
            "deployment": ident.get("deployment", ""), "contract": verify.get("contract", ""),
            "problems": problems}


def render_contracts_md(rows: Sequence[Mapping], run_name: str, arch: str | None = None) -> str:
    counts = Counter(r["admission"] for r in rows)
    lines = [f"# Execution contracts: run `{run_name}`", "",
             (f"Arch `{arch}`. " if arch else "")
             + "One row per family x composition: the contract built from `configs/compositions/<composition>.yaml` "
             f"and admitted against the gate artifacts in `<results>/{run_name}/gates/<family>/` (docs/contract.md). "
             "When admission is refused the draft, with its discharges still pending, is kept.", "",
             f"**{len(rows)} contracts: {counts.get('admitted', 0)} admitted, {counts.get('not admitted', 0)} "
             f"not admitted, {counts.get('n.a.', 0)} n.a.**", ""]
    lines += _md_table(("family", "composition", "entries", "tolerance 0", "admission", "reason"),
                       ((r["family"], r["composition"], r["entries"], r["tolerance_zero"], r["admission"], r["reason"])
                        for r in rows))
    lines += ["", "## Digests", "",
              "`numerical_policy` is the identity trainer and engine must share (docs/contract.md).", ""]
    lines += _md_table(("family", "composition", "semantic", "numerical_policy", "deployment"),
                       ((r["family"], r["composition"], f"`{r['semantic']}`", f"`{r['numerical_policy']}`",
                         f"`{r['deployment']}`") for r in rows))
    lines += ["", "## Entries without a passing gate", ""]
    details = [f"- {r['family']} / {r['composition']}: {p}" for r in rows if r["admission"] == "not admitted"
               for p in r["problems"]]
    lines += details or ["None."]
    lines.append("")
    return "\n".join(lines)


def write_contracts_report(items: Iterable[Mapping], md_path: str | Path, csv_path: str | Path, run_name: str,
                           arch: str | None = None, log: str | Path | None = None) -> Counter:
    """Render contracts.md and contracts.csv; returns the admission counts."""
    rows = [contract_row(it) for it in items]
    atomic_write(md_path, render_contracts_md(rows, run_name, arch))
    atomic_write(csv_path, _csv_text(CONTRACT_FIELDS, rows))
    counts = Counter(r["admission"] for r in rows)
    _log_line(log, f"wrote {md_path} and {csv_path}: {len(rows)} contracts, "
                   + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
    return counts
