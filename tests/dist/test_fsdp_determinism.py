"""The FSDP2 trainer's step is bitwise deterministic run to run at dp = 1, 2 and 4 (gloo, CPU), and
within a stated fp32 tolerance of the single-process Trainer's step on the same global batch, for
the tiny dense and hybrid models. Run B (fsdp_workers.py): one train call of two mini-batches (two
AdamW updates, clipped, the second off-policy), twice per world; run C: the same with one sequence
per micro-batch, so that each rank runs several micro-batches per mini-batch, each reduce-scattered
and its reduced shard added into the shards' gradient (dense model, fp32 and bf16; not at dp = 4,
where each rank's share of a mini-batch is one sequence and run C is run B)."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import fsdp_workers as fw  # noqa: E402
from dist_workers import bit_report  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

FAMILIES = tuple(f for f, _ in fw.CASES["determinism"])
# The tolerance of the sharded step against one process. Both sides add the same per-token fp32
# gradient terms, in another association: one process sums a mini-batch's tokens inside each
# weight-gradient reduction, dp ranks sum their own tokens and the reduce-scatter adds the dp
# partial sums; the clip norm's squares are added in another order too (grad_norm.py). Each
# gradient element therefore moves by a few fp32 ulps of the magnitudes summed, the gradient norm
# and clip coefficient by a few ulps. AdamW divides each element's step by that element's own
# gradient scale, so its update moves by about lr times the element's relative gradient change:
# tiny where the gradient is large against its rounding, up to lr per update where it is all
# cancellation (a rounding-level gradient can change sign). So the bound is on the whole update
# (relative L2 of the difference of the parameter changes), with the per-element change kept under
# the hard Adam bound of 2 lr per update. Run C adds the micro-batches' reduced gradients (the sum
# over micro-batches of rank-order sums, isoexec/dist/fsdp/trainer.py), a third association. Measured
# on this CPU (dp = 2 and 4, both families, runs B and C): relative L2 0.96e-6 to 1.42e-6, the
# largest element 2.7e-4 lr to 4.7e-4 lr, about a fifth to a quarter of the elements differ; the
# gradient norms agree to a few 1e-8 relative.
UPDATE_REL_L2 = 1e-4
UPDATES = fw.N_SEQ // fw.MINI      # AdamW updates in a run
GRAD_NORM_REL = 1e-6


@pytest.fixture(scope="module")
def job(fsdp_job):
    return fsdp_job


@pytest.fixture(scope="module")
def worlds(fsdp_determinism_worlds):
    """{dp: [rank results]} for dp = 1, 2, 4 (conftest.py: one world per size for the folder)."""
    return fsdp_determinism_worlds


@pytest.fixture(scope="module")
def single(job):
    """The single-process run B and the initial weights, per family."""
    out = {}
    for family in FAMILIES:
        params, stats = fw.single_run(job, family, fw.config("B"))
        init = {n: p.detach().clone() for n, p in fw.build_model(job, family).named_parameters()}
        out[family] = (params, stats, init)
    return out


def _differing(got: dict, want: dict) -> int:
    assert got.keys() == want.keys()
    return sum(bit_report(got[n], want[n])["differing"] for n in want)


@pytest.mark.parametrize("key, run", [("dense/fp32", "B"), ("hybrid/fp32", "B"), ("dense/fp32", "C"),
                                      ("dense/bf16", "C")])
def test_the_sharded_step_is_bitwise_deterministic_run_to_run(worlds, key, run):
    family = f"{key} run {run}"
    for ws, ranks in worlds.items():
        if run not in ranks[0].get(key, {}):
            continue
        for rank, res in enumerate(ranks):
            a, b = res[key][run], res[key][run + "_again"]
            assert _differing(a["params"], b["params"]) == 0, f"{family} dp={ws} rank {rank}"
            assert a["stats"] == b["stats"], f"{family} dp={ws} rank {rank}"
            assert _differing(a["params"], ranks[0][key][run]["params"]) == 0, "ranks disagree"
            assert a["stats"] == ranks[0][key][run]["stats"], "ranks disagree"


@pytest.mark.parametrize("family, run", [("dense", "B"), ("hybrid", "B"), ("dense", "C")])
def test_the_sharded_step_matches_one_process_within_the_stated_tolerance(worlds, single, family, run):
    """Against one process packing each mini-batch into one micro-batch (run B's packing). Run C
    packs one sequence per micro-batch instead, so even at dp = 1 it adds the gradients in another
    order than this reference."""
    want, want_stats, init = single[family]
    lr = fw.CONFIGS["B"]["lr"]
    report = {}
    for ws, ranks in worlds.items():
        if run not in ranks[0][f"{family}/fp32"]:
            continue
        got = ranks[0][f"{family}/fp32"][run]
        if ws == 1 and run == "B":   # one micro-batch per mini-batch, one shard per norm: the same arithmetic
            assert _differing(got["params"], want) == 0
            assert got["stats"] == want_stats
            continue
        dg = torch.cat([(got["params"][n] - init[n]).double().reshape(-1) for n in want])
        dw = torch.cat([(want[n] - init[n]).double().reshape(-1) for n in want])
        rel = float((dg - dw).norm() / dw.norm())
        worst = float((dg - dw).abs().max())
        report[ws] = {"update_rel_l2": f"{rel:.2e}", "max_abs_over_lr": f"{worst / lr:.2e}",
                      "differing": f"{_differing(got['params'], want)} of {dw.numel()}"}
        assert rel <= UPDATE_REL_L2, f"{family} dp={ws}: {report[ws]}"
        assert worst <= 2 * lr * UPDATES, f"{family} dp={ws}: {report[ws]}"
        for g, w in zip(got["stats"], want_stats):
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=GRAD_NORM_REL)
            assert g["clip_frac"] == w["clip_frac"] and g["tokens"] == w["tokens"] and g["updates"] == w["updates"]
            assert g["loss"] == pytest.approx(w["loss"], rel=1e-5, abs=1e-7)
    print(f"\n{family} run {run}: the sharded step against one process: {report}")


@pytest.mark.parametrize("dt", ["fp32", "bf16"])
def test_at_dp_1_adding_each_micro_batch_s_reduced_gradient_is_the_single_process_sum(worlds, job, dt):
    """dp = 1, run C: each micro-batch's backward "reduce-scatters" (at dp = 1 a copy of its fp32
    gradient, bf16 cast to fp32) and FSDP2 adds it into the shard's gradient in order, as
    MasterAdamW accumulates the micro-batches on the masters: the same bits."""
    want, want_stats = fw.single_run(job, "dense", fw.config("C"), fw.DTYPES[dt])
    got = worlds[1][0][f"dense/{dt}"]["C"]
    assert _differing(got["params"], want) == 0
    assert got["stats"] == want_stats
