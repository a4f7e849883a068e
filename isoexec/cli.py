"""``isoexec`` command line.

    isoexec contract build --family dense --composition isoexec --arch cpu --out c.json [--gates DIR]
    isoexec contract show c.json [--json]
    isoexec contract verify c.json [--gates DIR] [--json]
    isoexec contract diff a.json b.json [--json]
    isoexec gates run --family dense --composition isoexec [--arch cpu] --out DIR [--seed N] [--json]
    isoexec run --config rl.yaml --out DIR [--checkpoint FOLDER]
    isoexec warmup --config rl.yaml --out FOLDER   (the shared warm-up, native composition: run --checkpoint FOLDER)
    isoexec plan --config workflow.yaml [--gpu-memory-gib G] [--markdown FILE]   (memory per GPU, before a run)

Exit codes: 0 success (verify: admitted; diff: numerical_policy agrees; gates: every gate passed;
plan: every run fits); 1 a check failed (not admitted, policies differ, a gate failed, a binding or
topology refusal, a run that does not fit in the GPU's memory);
2 bad input (usage, missing file, invalid JSON/YAML, unknown family/impl/region, invalid contract).
Errors print one line ``isoexec: error: ...`` on stderr; outputs are written atomically, so a
refused command never leaves a partial file.

Start-up: this module imports only what reads and checks contracts, gate artifacts and data
files; the modules that import torch (benchmarks, gate runners, the RL loop, the memory plan) are
imported inside the commands that run them. So ``--help``, ``contract show``, ``verify``, ``diff``
and ``data synthetic`` start without torch (``tests/cli/test_light_commands.py``); ``contract
build`` imports it through the registry's kernel callables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from . import registry
from .bench import BENCHES
from .compose import build_contract, required_ops
from .contract import check, decode, diff, encode, format_diff
from .contract.codec import entry_obj
from .errors import IsoExecError
from .gates.artifacts import PENDING, resolve_discharges, verify_contract
from .paths import atomic_write, check_output_path
from .rl.data import synthetic_arithmetic, write_parquet
from .yamlio import load_yaml

if TYPE_CHECKING:
    from .rl.loop import RLConfig

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _read_contract(path: str):
    p = Path(path)
    if not p.is_file():
        raise IsoExecError(f"contract file {path!r} not found")
    c = decode(p.read_bytes())
    try:
        registry.family(c.model.family)
        req = required_ops(c)
    except IsoExecError:
        req = None
    return check(c, req)


def _emit(args, obj, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(obj, indent=1, sort_keys=True))
    else:
        print(text)


# ------------------------------------------------------------------------------------ contract
def cmd_contract_build(args) -> int:
    resolve = None
    if args.gates:   # the admitted contract: discharges point at the passing gate artifacts
        resolve = partial(resolve_discharges, gates_dir=args.gates)
    c = build_contract(args.family, args.composition, args.arch, args.model, resolve)
    data = encode(c)
    atomic_write(args.out, data)
    ident = c.identities
    _emit(args, {"out": args.out, "entries": len(c.composition),
                 "identities": {"semantic": ident.semantic, "numerical_policy": ident.numerical_policy,
                                "deployment": ident.deployment}},
          f"wrote {args.out}: {c.model.family}/{args.composition} on {args.arch}, {len(c.composition)} entries, "
          f"numerical_policy {ident.numerical_policy[:16]}…")
    return EXIT_OK


def _summary(c) -> dict:
    return {"family": c.model.family, "config_digest": c.model.config_digest,
            "cases": [x.id for x in c.cases],
            "identities": {"semantic": c.identities.semantic, "numerical_policy": c.identities.numerical_policy,
                           "deployment": c.identities.deployment},
            "claims_zero_tolerance": c.claims.claims_zero_tolerance,
            "entries": [entry_obj(e) for e in sorted(c.composition, key=lambda e: e.region_name)]}


def cmd_contract_show(args) -> int:
    c = _read_contract(args.contract)
    s = _summary(c)
    lines = [f"contract {args.contract}", f"  family            {c.model.family} ({', '.join(c.model.architectures)})",
             f"  cases             {', '.join(s['cases'])}",
             f"  semantic          {c.identities.semantic}",
             f"  numerical_policy  {c.identities.numerical_policy}",
             f"  deployment        {c.identities.deployment}",
             f"  tolerance 0       {'claimed' if s['claims_zero_tolerance'] else 'not claimed'}",
             f"  entries ({len(c.composition)}):"]
    for e in sorted(c.composition, key=lambda e: e.region_name):
        consts = ", ".join(f"{k}={v}" for k, v in e.constants.items())
        dis = "-" if e.discharge is None else f"{e.discharge.kind}:{e.discharge.ref[:12]}"
        lines.append(f"    {e.region_name:<28} {str(e.impl):<32} {e.half:<10} {consts:<22} {dis}")
    _emit(args, s, "\n".join(lines))
    return EXIT_OK


def cmd_contract_verify(args) -> int:
    c = _read_contract(args.contract)
    needs = [e for e in c.composition if e.discharge is not None and e.discharge.kind == "gate"]
    if args.gates is None:
        checks = []
        ok = not needs
        msg = ("valid; no gate discharges to check" if ok else
               f"valid, but {len(needs)} gate discharge(s) cannot be checked without --gates DIR "
               f"({sum(e.discharge.ref == PENDING for e in needs)} pending)")
    else:
        checks = verify_contract(c, args.gates)
        if not c.claims.claims_zero_tolerance:
            checks = [x for x in checks if x.problem != "no discharge"]
        ok = all(x.ok for x in checks)
        bad = [x for x in checks if not x.ok]
        msg = (f"admitted: {len(checks)} entr{'y' if len(checks) == 1 else 'ies'} discharged by passing gates in "
               f"{args.gates}" if ok else
               f"NOT admitted: {len(bad)} of {len(checks)} entries lack a passing gate: "
               + "; ".join(f"{x.entry}: {x.problem}" for x in bad))
    _emit(args, {"admitted": ok, "contract": args.contract,
                 "numerical_policy": c.identities.numerical_policy,
                 "checks": [{"entry": x.entry, "ok": x.ok, "artifacts": list(x.artifacts), "problem": x.problem}
                            for x in checks]}, msg)
    return EXIT_OK if ok else EXIT_CHECK_FAILED


def cmd_contract_diff(args) -> int:
    a, b = _read_contract(args.a), _read_contract(args.b)
    diffs = diff(a, b)
    same = a.identities.numerical_policy == b.identities.numerical_policy
    verdict = ("numerical_policy agrees" if same else "numerical_policy DIFFERS "
               f"({a.identities.numerical_policy[:12]}… vs {b.identities.numerical_policy[:12]}…)")
    _emit(args, {"numerical_policy_agrees": same, "differences": [d.as_dict() for d in diffs]},
          f"{verdict}\n{format_diff(diffs, args.a, args.b)}")
    return EXIT_OK if same else EXIT_CHECK_FAILED


# ------------------------------------------------------------------------------------ gates
def cmd_gates_run(args) -> int:
    # the gate runners, and envinfo, import torch: local, so the other commands start without it
    from .envinfo import runtime_arch
    from .gates.runner import gate_names, run_gates

    only = None
    if args.only:
        only = frozenset(x.strip() for x in args.only.split(",") if x.strip())
        unknown = sorted(only - gate_names())
        if unknown or not only:
            raise IsoExecError(f"--only: unknown gate name(s) {', '.join(unknown) or '(none given)'}; known: "
                               f"{', '.join(sorted(gate_names()))}")
    arch = args.arch or ("sm90" if runtime_arch() == "sm90" else "cpu")
    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    # under torchrun every rank runs the gates (the topology gates need the whole group); rank 0
    # writes the artifacts and reports, the others only return their exit code
    lead = os.environ.get("RANK", "0") == "0"
    if not lead:
        log = lambda s: None  # noqa: E731
    skipped: list[dict] = []
    results = run_gates(args.family, args.composition, arch, args.out, seed=args.seed, model=args.model, log=log,
                        skipped=skipped, only=only)
    ok = bool(results) and all(r.ok for r in results)
    if args.json and lead:
        print(json.dumps({"passed": ok, "skipped": skipped, "gates": [{"id": r.id, "family": r.family, "region": r.region,
                                                   "impl": r.impl, "dtype": r.dtype, "verdict": r.verdict,
                                                   "expect": r.expect, "differing": r.differing,
                                                   "compared": r.compared} for r in results]}, indent=1))
    return EXIT_OK if ok else EXIT_CHECK_FAILED


# ------------------------------------------------------------------------------------ bench
def cmd_bench(args) -> int:
    from .bench import bench_function   # the benchmarks import torch (isoexec/bench/__init__.py)
    from .bench.common import default_device, write_result

    device = args.device or default_device()
    arch = "cpu" if device == "cpu" else "sm90"
    speaks = os.environ.get("RANK", "0") == "0"   # under torchrun (bench tp_dist) rank 0 speaks and writes
    if speaks:
        print(f"bench {args.name} on {device}{' (quick)' if args.quick else ''}: ours vs stock, same run")
    res = bench_function(args.name)(device, quick=args.quick)
    # a benchmark returns its rows, or (rows, extra fields of the result such as a profile)
    rows, extra = res if isinstance(res, tuple) else (res, None)
    if not speaks:
        return EXIT_OK
    path = write_result(args.name, rows, args.out, arch, extra)
    ratios = [r["speed_ratio"] for r in rows if r.get("speed_ratio")]
    print(f"wrote {path} ({len(rows)} rows; speed_ratio min {min(ratios):.3f}, max {max(ratios):.3f})")
    return EXIT_OK


# ------------------------------------------------------------------------------------ RL runs
def _load_mapping(path: str) -> dict:
    data = load_yaml(path, "rl config") if path else {}
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise IsoExecError(f"rl config {path!r} must be a mapping of keys to values")
    return data


def cmd_run(args) -> int:
    from .rl.loop import run_rl   # the RL loop imports torch (and the whole model stack)

    cfg = _rl_config(args, ("family", "composition", "model", "arch", "contract", "seed", "steps", "dataset",
                            "checkpoint"))
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    lines = run_rl(cfg, args.out, log=log)
    if lines and os.environ.get("RANK", "0") == "0":   # under torchrun rank 0 speaks for the run
        last = lines[-1]
        print(json.dumps({"steps_run": len(lines), "last_step": last["step"],
                          "logprob_abs_diff_max": max(x["logprob_abs_diff_max"] for x in lines),
                          "out": args.out}))
    return EXIT_OK


def _rl_config(args, keys) -> RLConfig:
    """The RL settings of ``--config`` with the command-line overrides ``keys``, checked."""
    from .rl.loop import RLConfig   # imports torch; only run and warmup read RL settings

    d = _load_mapping(args.config)
    if "rl" in d:   # a workflow-style file: the settings sit under `rl:`
        d = d["rl"]
        if not isinstance(d, dict):
            raise IsoExecError(f"rl config {args.config!r}: `rl` must be a mapping of RL settings, got {d!r}")
    d = dict(d)
    for key in keys:
        v = getattr(args, key)
        if v is not None:
            d[key] = v
    return RLConfig.from_dict(d)   # every value checked here: a refused config leaves no output folder


def cmd_warmup(args) -> int:
    from .rl.loop import warm_up   # imports torch

    cfg = _rl_config(args, ("family", "model", "arch", "seed", "dataset"))
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    rec = warm_up(cfg, args.out, log=log)
    nll = rec["nll"] or [None]
    print(json.dumps({"out": args.out, "composition": rec["composition"], "weights_sha256": rec["weights_sha256"],
                      "sft_steps": rec["settings"]["warmup_sft_steps"], "nll_first": nll[0], "nll_last": nll[-1],
                      "seconds": rec["seconds"]}))
    return EXIT_OK


def cmd_data_synthetic(args) -> int:
    params = {"n": args.n}
    if args.params:
        try:
            params.update(json.loads(args.params))
        except ValueError as exc:
            raise IsoExecError(f"--params is not JSON: {exc}") from None
    try:
        rows = synthetic_arithmetic(seed=args.seed, **params)
    except (TypeError, ValueError) as exc:
        raise IsoExecError(f"synthetic data: {exc}") from None
    write_parquet(rows, args.out)
    print(f"wrote {args.out}: {len(rows)} synthetic arithmetic problems (DAPO-Math-17k schema)")
    return EXIT_OK


# ------------------------------------------------------------------------------------ memory plan
def cmd_plan(args) -> int:
    # the plan sizes the engine's pools with its own allocators on the meta device: it imports torch
    from .plan import memory_plan, render_markdown, render_text

    if args.markdown:
        check_output_path(args.markdown)
    plan = memory_plan(args.config, args.gpu_memory_gib)
    print(render_text(plan), end="")
    if args.markdown:
        command = f"isoexec plan --config {args.config}" + (
            f" --gpu-memory-gib {args.gpu_memory_gib:g}" if args.gpu_memory_gib is not None else "")
        atomic_write(args.markdown, render_markdown(plan, command))
        print(f"wrote {args.markdown}")
    return EXIT_OK if plan.fits else EXIT_CHECK_FAILED


# ------------------------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="isoexec", description="Bitwise-identical trainer/engine logprobs: contracts, "
                                "gates and benchmarks.", epilog="exit codes: 0 ok, 1 check failed, 2 bad input",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{contract,gates,bench,run,warmup,plan,data}")

    pc = sub.add_parser("contract", help="build, show, verify and diff execution contracts")
    cs = pc.add_subparsers(dest="action", required=True, metavar="{build,show,verify,diff}")

    b = cs.add_parser("build", help="build a contract from a composition, the registry and a model family")
    b.add_argument("--family", required=True, choices=list(registry.FAMILIES))
    b.add_argument("--composition", required=True, help="name in configs/compositions/ or a YAML path")
    b.add_argument("--arch", required=True, choices=list(registry.ARCHES))
    b.add_argument("--model", help="model config name in configs/models/ or a YAML path (default <family>_tiny)")
    b.add_argument("--gates", help="resolve gate discharges from the passing artifacts in this folder")
    b.add_argument("--out", required=True, help="where to write the canonical contract JSON")
    b.add_argument("--json", action="store_true", help="print a JSON summary")
    b.set_defaults(func=cmd_contract_build)

    s = cs.add_parser("show", help="print a contract's digests and entries")
    s.add_argument("contract")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_contract_show)

    v = cs.add_parser("verify", help="validate a contract and check every discharge against gate artifacts")
    v.add_argument("contract")
    v.add_argument("--gates", help="folder of gate artifacts (results/<run>/gates)")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_contract_verify)

    d = cs.add_parser("diff", help="differences between two contracts (exit 0 iff numerical_policy agrees)")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_contract_diff)

    pg = sub.add_parser("gates", help="run bitwise admission gates")
    gs = pg.add_subparsers(dest="action", required=True, metavar="{run}")
    r = gs.add_parser("run", help="run the gates of a family and composition, write JSON artifacts")
    r.add_argument("--family", required=True, choices=list(registry.FAMILIES))
    r.add_argument("--composition", required=True)
    r.add_argument("--arch", choices=list(registry.ARCHES), help="default: sm90 on a Hopper GPU, else cpu")
    r.add_argument("--model", help="model config (default <family>_tiny)")
    r.add_argument("--out", required=True, help="folder for the artifacts")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--only", help="comma-separated gate names to run (e.g. backward_determinism,model_case_parity)")
    r.add_argument("--json", action="store_true", help="print a JSON summary (progress goes to stderr)")
    r.set_defaults(func=cmd_gates_run)

    pb = sub.add_parser("bench", help="microbenchmarks: ours vs the stock path in the same run (JSON result)")
    pb.add_argument("name", choices=list(BENCHES))
    pb.add_argument("--out", required=True, help="result JSON (results/<run>/bench/<name>.json)")
    pb.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    pb.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    pb.set_defaults(func=cmd_bench)

    pr = sub.add_parser("run", help="synchronous DAPO/GRPO run: engine rollouts, trainer updates, metrics.jsonl")
    pr.add_argument("--config", help="YAML with the RL settings (a top-level `rl:` mapping or the mapping itself)")
    pr.add_argument("--family", choices=list(registry.FAMILIES))
    pr.add_argument("--composition")
    pr.add_argument("--model")
    pr.add_argument("--arch", choices=list(registry.ARCHES))
    pr.add_argument("--contract", help="admitted contract JSON (default: build the draft)")
    pr.add_argument("--checkpoint", help="HF checkpoint folder, or the folder of `isoexec warmup` (default: random "
                    "init + a warm-up in the run, with its own composition)")
    pr.add_argument("--dataset", help="'synthetic' or a DAPO-schema parquet")
    pr.add_argument("--seed", type=int)
    pr.add_argument("--steps", type=int)
    pr.add_argument("--out", required=True, help="run folder (metrics.jsonl, checkpoint.pt); resumes if present")
    pr.set_defaults(func=cmd_run)

    pw = sub.add_parser("warmup", help="the supervised warm-up of a run's random model, once, with the native "
                        "composition: a checkpoint folder every arm starts from (run --checkpoint)")
    pw.add_argument("--config", help="YAML with the RL settings, as for `run` (composition and contract are not "
                    "read: the warm-up runs the native composition)")
    pw.add_argument("--family", choices=list(registry.FAMILIES))
    pw.add_argument("--model")
    pw.add_argument("--arch", choices=list(registry.ARCHES))
    pw.add_argument("--dataset", help="'synthetic' or a DAPO-schema parquet")
    pw.add_argument("--seed", type=int)
    pw.add_argument("--out", required=True, help="checkpoint folder (config.json, model.safetensors, warmup.json)")
    pw.set_defaults(func=cmd_warmup)

    pp = sub.add_parser("plan", help="memory per GPU of a workflow config's runs (exit 1 if one does not fit)")
    pp.add_argument("--config", required=True, help="workflow config YAML (configs/paper.yaml, configs/h200.yaml, ...)")
    pp.add_argument("--gpu-memory-gib", type=float,
                    help="memory of one GPU in GiB (default: the config's gpu_memory_gib, else 80, an H100 80 GB)")
    pp.add_argument("--markdown", help="also write the plan as markdown to this file")
    pp.set_defaults(func=cmd_plan)

    pd = sub.add_parser("data", help="datasets for RL runs")
    ds = pd.add_subparsers(dest="action", required=True, metavar="{synthetic}")
    sy = ds.add_parser("synthetic", help="write a synthetic arithmetic task in the DAPO-Math-17k schema")
    sy.add_argument("--n", type=int, default=512)
    sy.add_argument("--seed", type=int, default=0)
    sy.add_argument("--params", help='JSON of synthetic_arithmetic parameters, e.g. \'{"max_operand": 9}\'')
    sy.add_argument("--out", required=True)
    sy.set_defaults(func=cmd_data_synthetic)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "out", None):
            # gates, run and warmup write a folder; every other command writes one file
            check_output_path(args.out, folder=args.command in ("gates", "run", "warmup"))
        return args.func(args)
    except IsoExecError as exc:
        first, *rest = str(exc).split("\n")
        print(f"isoexec: error: {first}", file=sys.stderr)
        for line in rest:
            print(f"  {line}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("isoexec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
