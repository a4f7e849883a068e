"""Run every gate a contract needs and write one artifact per gate run.

``run_gates`` builds the (draft) contract of a family and composition on an arch, runs each
function-half entry's gate families on the model's own shapes, then the negative controls (the
same gate on the stock implementation where the stock kernel is known to be batch-variant), and
writes the artifacts to ``out_dir``. Progress goes to ``log`` one line per gate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from .. import registry
from ..assembly import installed_model
from ..compose import build_contract, default_model_name, load_model_config
from ..contract import Entry, ImplRef
from ..enforce import bind
from ..envinfo import env_info
from .artifacts import artifact_id, write_artifact
from .compare import merge
from .engine_gates import ENGINE_GATES, GPU_ONLY_GATES
from .engine_gates import sizes as engine_sizes
from .kernel_gates import GateOutcome, entry_with_impl
from .kinds import KINDS, NEGATIVE_CONTROLS, kernel_gate_names
from .model_gates import backward_determinism, model_batch_invariance, model_case_parity
from .topology_gates import (TOPOLOGY_GATES, claims_tp, gathered, group_info, process_group,
                             tp_engine_generate_verify, tp_trainer_logits, tp_trainer_logprobs)

BATCH_SIZES = {"cpu": (1, 2, 3, 5, 8, 16, 31, 64, 100, 128, 256),
               "sm90": (1, 2, 3, 5, 8, 16, 31, 64, 100, 128, 256, 512, 1024, 2048, 4096)}
DTYPES = {"cpu": (torch.float32, torch.bfloat16), "sm90": (torch.bfloat16,)}
DEVICE = {"cpu": "cpu", "sm90": "cuda"}
MODEL_FAMILIES = ("dense", "hybrid", "mla_moe", "hybrid_moe")
# Negative controls that may find the stock path invariant by chance without that being a defect
# of the gate: generate-then-verify compares a few hundred sampled tokens, and in bf16 on the CPU
# the stock engine's logits can round to the trainer's (measured: dense_tiny, 0 of 153). Like a
# kernel-level control they are then "inconclusive"; the whole-model case-parity control must fail.
# The full-vocabulary control compares whole rows, so any logit that differs shows (the token
# logprob hides a logit difference that moves neither the token's logit nor the rounded lse), but
# a row differs only if its logits do, and the CPU draw has few rows (26): measured in bf16, dense
# 5, mla_moe 6 and hybrid_moe 1 of 26 rows differ, so a draw with none is chance, not a defect.
INCONCLUSIVE_CONTROLS = frozenset({"engine_generate_verify", "engine_full_vocab", "tp_engine_generate_verify"})
# Whole-model gate sizes: CPU runs the fixed-order torch twins (slow), so sequences are short.
MODEL_GATE_SIZES = {"cpu": dict(batch_sizes=(1, 4, 17, 64), max_len=40),
                    "sm90": dict(batch_sizes=(1, 8, 64), max_len=128)}
BACKWARD_GATE_SIZES = {"cpu": dict(batch_sizes=(1, 6), max_len=32),
                       "sm90": dict(batch_sizes=(1, 8, 64), max_len=512)}


def _model_body(contract, composition: str, family: str, reports, info: dict, dtype, seed: int, arch: str,
                expect: str, of: str | None = None) -> dict:
    counts = merge(reports)
    # a gate that reports why its comparison would be vacuous (e.g. all-zero gradients) fails
    invariant = counts["differing"] == 0 and not info.get("sanity_failures")
    gate = {"family": family, "region": ["model"],
            "impl": {"id": f"composition:{composition}", "version": contract.identities.numerical_policy[:16],
                     "arch": arch},
            "constants": {}, "shapes": info, "dtype": str(dtype).replace("torch.", ""), "seed": seed, "hazards": [],
            "model": contract.model.config_digest[:16]}
    if of:
        gate["of"] = of
    verdict = "pass" if invariant == (expect == "invariant") else "fail"
    if expect == "variant" and invariant and of in INCONCLUSIVE_CONTROLS:
        verdict = "inconclusive"
    return {"gate": gate, "expect": expect, "verdict": verdict, "counts": counts,
            "correctness": {"rel_err": "n/a", "tolerance": "n/a"}, "hazards_exercised": {}, "env": env_info(arch)}


MODEL_GATE_NAMES = ("model_case_parity", "model_batch_invariance", "backward_determinism")


def gate_names() -> frozenset:
    """Every gate name ``--only`` accepts: kernel gate families, model and engine gates, and
    ``negative_control``."""
    return frozenset(kernel_gate_names() | set(MODEL_GATE_NAMES) | set(ENGINE_GATES) | set(TOPOLOGY_GATES)
                     | {"negative_control"})


def run_model_gates(family: str, composition: str, arch: str, out_dir, seed: int, model: str | None,
                    log: Callable[[str], None], only: frozenset | None = None) -> list[GateResult]:
    """Whole-model case parity and needle-in-batch, plus the native composition as negative control."""
    results = []
    runs = [(composition, "invariant", None)]
    if composition != "native" and arch in NEGATIVE_CONTROLS and (not only or "negative_control" in only):
        # the whole-model and the generate-then-verify pair must both fail under stock kernels;
        # the full-vocabulary gate too (stock kernels give the engine's logits other bits than the
        # trainer's, and whole rows show every logit that moved: on CPU it differed in every family
        # and dtype, also in bf16 where generate-then-verify's token logprobs did not)
        runs.append(("native", "variant", ("model_case_parity", "engine_generate_verify", "engine_full_vocab")))
    for comp, expect, of in runs:
        contract = build_contract(family, comp, arch, model)
        for dtype in DTYPES[arch]:
            m = installed_model(family, comp, arch, model, dtype=dtype, device=DEVICE[arch], seed=seed,
                                contract=contract).model
            t0 = time.time()
            gates = [("model_case_parity", lambda g: model_case_parity(m, g, **MODEL_GATE_SIZES[arch])),
                     ("model_batch_invariance", lambda g: model_batch_invariance(m, g, **MODEL_GATE_SIZES[arch])),
                     ("backward_determinism", lambda g: backward_determinism(m, g, **BACKWARD_GATE_SIZES[arch]))]
            for gname, gfn in ENGINE_GATES.items():
                if gname not in GPU_ONLY_GATES or arch != "cpu":
                    gates.append((gname, lambda g, gfn=gfn, gname=gname:
                                  gfn(m, contract, g, **engine_sizes(gname, arch))))
            if expect == "variant":
                gates = [(name, fn) for name, fn in gates if name in of]
            elif only:
                gates = [(name, fn) for name, fn in gates if name in only]
            for name, fn in gates:
                gen = torch.Generator().manual_seed(seed + 1)
                reports, info = fn(gen)
                fam_name = "negative_control" if expect == "variant" else name
                body = _model_body(contract, comp, fam_name, reports, info, dtype, seed, arch, expect,
                                   name if expect == "variant" else None)
                gid, path = write_artifact(out_dir, body)
                c = body["counts"]
                r = GateResult(gid, path, fam_name, "model", f"composition:{comp}",
                               str(dtype).replace("torch.", ""), body["verdict"], expect, c["differing"],
                               c["compared"])
                results.append(r)
                log(r.line() + f"  ({time.time() - t0:.1f}s)")
    return results


def run_topology_gates(family: str, composition: str, arch: str, out_dir, seed: int, model: str | None,
                       log: Callable[[str], None], only: frozenset | None = None) -> list[GateResult]:
    """The tensor-parallel model and engine against one process (topology_gates.py), at the size
    of the process group this runs in (a group of one when not under torchrun), plus the stock
    all-reduce as negative control. Every rank runs them; rank 0 writes the artifacts and logs."""
    results = []
    with process_group(arch):
        rank = dist.get_rank()
        contract = build_contract(family, composition, arch, model)
        where = group_info(arch)
        for dtype in DTYPES[arch]:
            m = installed_model(family, composition, arch, model, dtype=dtype, device=DEVICE[arch], seed=seed,
                                contract=contract).model
            gates = [(name, "invariant", None) for name in TOPOLOGY_GATES if not only or name in only]
            if not only or only & {"negative_control", "tp_engine_generate_verify"}:
                # the engine gate's control comes with it (a stock run that must differ)
                gates.append(("negative_control", "variant", "tp_engine_generate_verify"))
            for name, expect, of in gates:
                t0 = time.time()
                gen = torch.Generator().manual_seed(seed + 1)
                if name == "tp_trainer_logits":
                    reports, info = tp_trainer_logits(m, contract, gen, arch)
                elif name == "tp_trainer_logprobs":
                    reports, info = tp_trainer_logprobs(m, contract, gen, arch)
                else:
                    reports, info = tp_engine_generate_verify(m, contract, gen, arch, stock_all_reduce=of is not None)
                body = _model_body(contract, composition, name, gathered(reports), {**info, **where}, dtype, seed,
                                   arch, expect, of)
                # every rank holds every rank's counts, so every rank returns the same verdicts
                gid, path = write_artifact(out_dir, body) if rank == 0 else (artifact_id(body), None)
                c = body["counts"]
                r = GateResult(gid, path, name, "model", f"composition:{composition}",
                               str(dtype).replace("torch.", ""), body["verdict"], expect, c["differing"], c["compared"])
                results.append(r)
                if rank == 0:
                    log(r.line() + f"  (tp={where['tp']}, {where['backend']}, {time.time() - t0:.1f}s)")
    return results


@dataclass
class GateResult:
    id: str
    path: Path | None   # None on the ranks other than 0 of a topology gate (rank 0 writes)
    family: str
    region: str
    impl: str
    dtype: str
    verdict: str
    expect: str
    differing: int
    compared: int

    @property
    def ok(self) -> bool:
        return self.verdict in ("pass", "inconclusive")

    def line(self) -> str:
        tag = {"pass": "PASS", "inconclusive": "INCONCLUSIVE"}.get(self.verdict, "FAIL")
        return (f"{tag} {self.family:<17} {self.region:<28} {self.impl:<22} {self.dtype:<9} "
                f"differing {self.differing}/{self.compared}  [{self.id[:12]}]")


def _body(entry: Entry, family: str, outcome: GateOutcome, seed: int, arch: str, expect: str,
          of: str | None = None) -> dict:
    counts = merge(outcome.reports)
    gate = {"family": family, "region": sorted(entry.region),
            "impl": {"id": entry.impl.id, "version": entry.impl.version, "arch": entry.impl.arch},
            "constants": dict(entry.constants), "shapes": outcome.shapes, "dtype": outcome.dtype, "seed": seed,
            "hazards": list(outcome.hazards_required)}
    if of:
        gate["of"] = of
    return {
        "gate": gate,
        "expect": expect,
        "verdict": outcome.verdict(expect_invariant=(expect == "invariant")),
        "counts": counts,
        "correctness": {"rel_err": repr(outcome.rel_err), "tolerance": repr(outcome.tolerance)},
        "hazards_exercised": {k: (v if isinstance(v, (bool, int)) else str(v))
                              for k, v in outcome.hazards_exercised.items()},
        "env": env_info(arch),
    }


def _run_one(entry: Entry, family: str, cfg: dict, dtype, arch: str, seed: int, out_dir, expect="invariant",
             of=None) -> GateResult:
    kind = registry.OPS[entry.region[0]].kind
    spec = registry.impl_by_ref(entry.impl.id, entry.impl.version, entry.impl.arch)
    fn = bind(entry, entry.cases[0] if "trainer_score" not in entry.cases else "trainer_score")
    gen = torch.Generator().manual_seed(seed)
    extra = {}
    if KINDS[kind].across_cases:
        extra["binds"] = {c: bind(entry, c) for c in entry.cases}
    outcome = KINDS[kind].run(fn, entry.region, cfg, of or family, dtype, DEVICE[arch], gen, BATCH_SIZES[arch],
                                 spec.hazards, dict(entry.constants), **extra)
    body = _body(entry, family, outcome, seed, arch, expect, of)
    gid, path = write_artifact(out_dir, body)
    c = body["counts"]
    return GateResult(gid, path, family, entry.region_name, entry.impl.id, outcome.dtype.replace("torch.", ""),
                      body["verdict"], expect, c["differing"], c["compared"])


def run_gates(family: str, composition: str, arch: str, out_dir: str | Path, seed: int = 0,
              model: str | None = None, log: Callable[[str], None] = print,
              skipped: list[dict] | None = None, only: frozenset | None = None) -> list[GateResult]:
    """Run the gates; regions of a kind without gates (no row in ``kinds.KINDS``) are appended to
    ``skipped`` (if given).
    ``only``: run just these gate names (see :func:`gate_names`), e.g. to re-check one gate."""
    contract = build_contract(family, composition, arch, model)
    cfg = load_model_config(model or default_model_name(family))["hf_config"]
    results: list[GateResult] = []
    skipped = [] if skipped is None else skipped
    seen: set = set()
    torch.manual_seed(seed)
    t0 = time.time()
    for e in sorted(contract.composition, key=lambda e: e.region_name):
        if e.half != "function":
            continue
        kind = registry.OPS[e.region[0]].kind
        spec = registry.impl_by_ref(e.impl.id, e.impl.version, e.impl.arch)
        if kind not in KINDS:
            log(f"SKIP {'-':<17} {e.region_name:<28} {e.impl.id:<22} (no gate for {kind} regions yet)")
            skipped.append({"family": "-", "region": e.region_name, "impl": e.impl.id,
                            "reason": f"no gate for {kind} regions yet"})
            continue
        for fam in KINDS[kind].families:
            if only and fam not in only:
                continue
            if fam == "hazards" and not spec.hazards:
                continue
            for dtype in DTYPES[arch]:
                key = (e.region_name, e.impl.id, fam, dtype)
                if key in seen:
                    continue
                seen.add(key)
                r = _run_one(e, fam, cfg, dtype, arch, seed, out_dir)
                results.append(r)
                log(r.line())
        # negative control: the stock kernel for this region must NOT be invariant here
        if (kind in NEGATIVE_CONTROLS.get(arch, ()) and not spec.native and kind in KINDS
                and (not only or "negative_control" in only)):
            native = registry.native_counterpart(kind, arch)
            if native is not None:
                ne = entry_with_impl(e, ImplRef(native.id, native.version, arch))
                for dtype in DTYPES[arch][:1]:
                    key = (e.region_name, native.id, "negative_control", dtype)
                    if key in seen:
                        continue
                    seen.add(key)
                    r = _run_one(ne, "negative_control", cfg, dtype, arch, seed, out_dir, expect="variant",
                                 of="batch_invariance")
                    results.append(r)
                    log(r.line())
    if family in MODEL_FAMILIES:
        results += run_model_gates(family, composition, arch, out_dir, seed, model, log, only)
    if family in MODEL_FAMILIES and claims_tp(contract) and (
            not only or only & {*TOPOLOGY_GATES, "negative_control"}):
        results += run_topology_gates(family, composition, arch, out_dir, seed, model, log, only)
    n_inc = sum(r.verdict == "inconclusive" for r in results)
    log(f"{sum(r.verdict == 'pass' for r in results)}/{len(results)} gates passed"
        + (f", {n_inc} negative control(s) inconclusive" if n_inc else "") + f"  in {time.time() - t0:.1f}s "
        f"({family}/{composition} on {arch}, seed {seed}) -> {out_dir}")
    return results
