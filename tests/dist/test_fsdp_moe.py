"""The FSDP2 trainer on the MoE models with their routed experts sharded, on a torch whose FSDP2
lacks ``set_reduce_scatter_unused_params`` (torch 2.11, the GPU machine's): the switch is removed
from ``FSDPModule`` while the model is sharded (fsdp_moe_workers.py; the CPU torch has it), and
the world of two gloo ranks trains a step in which the ranks route to different experts and rank 1
runs an empty pass (no token). FSDP2 then reduce-scatters only the parameters with a gradient; the
models give every parameter one in every backward (idle experts: zero slices of the stacked
weights' gradients; a pass of no token: ``isoexec_kernels.moe.reference.no_rows``), so:

- at every unit's post-backward, on both ranks, every parameter has a gradient (the same lists:
  before the models' zeros for a pass of no token, gloo aborted this run with "Received data size
  doesn't match expected size");
- the weights after the step are bitwise those of the same run with the switch (FSDP2's zeros for
  a parameter without a gradient), fp32 and bf16, mla_moe and hybrid_moe;
- and bitwise those of the single-process ``Trainer`` whose micro-batches are the ranks' in the
  order the sharded run adds them (fsdp_workers.py's comparison, with an empty pass added);
- with activation checkpointing the same weights again (the recompute runs the same regions);
- all of the above under the native composition too (``glm_native``, ``qwen_native``, fp32): the
  stock regions, rank 1's empty training and scoring passes included (before
  ``isoexec_kernels._empty.no_token`` the world failed at the first: the stock attention raised on
  a batch of no sequence)."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import fsdp_moe_workers as mw  # noqa: E402
from dist_workers import bit_report  # noqa: E402
from isoexec.model.ep_moe import is_expert_weight  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

PLAIN = [r for r in mw.RUNS if not r[3]]
PAIRS = sorted({(n, d) for n, d, _, _ in PLAIN})


@pytest.fixture(scope="module")
def world(fsdp_moe_worlds):
    return fsdp_moe_worlds


@pytest.fixture(scope="module")
def job():
    return mw.make_job()


def _differing(got: dict, want: dict) -> int:
    return sum(bit_report(got[n], want[n])["differing"] for n in want)


def _passes(res: dict) -> list[list[set[int]]]:
    """Each training pass's experts that received rows, per MoE layer."""
    rows, L = res["rows"], res["moe_layers"]
    return [[{e for e, c in enumerate(cs) if c} for cs in rows[i:i + L]] for i in range(0, len(rows), L)]


@pytest.mark.parametrize("run", [mw.run_key(*r) for r in mw.RUNS])
def test_every_unit_reduce_scatters_every_parameter_on_every_rank(world, run):
    """What each rank's FSDP2 units hand their reduce-scatter: every parameter that requires a
    gradient, the stacked experts included, in every pass (rank 1's empty one too), with the switch
    off where it was removed."""
    switch = "/switch" in run
    units = [res[run]["units"] for res in world]
    assert len(units[0]) == len(units[1]) > 0
    for rank, res in enumerate(world):
        r = res[run]
        assert r["has_switch"] is switch and {u["switch"] for u in r["units"]} == {switch}, (run, rank)
        assert r["empty_passes"] == [[0, 0], [1, 1]][rank], (run, rank)   # [training, scoring]
        missing = [(u["unit"], u["missing"]) for u in r["units"] if u["missing"]]
        assert not missing, f"{run} rank {rank}: parameters without a gradient {missing}"
        assert any(is_expert_weight(n) for u in r["units"] for n in u["params"])
    assert [(u["unit"], u["params"]) for u in units[0]] == [(u["unit"], u["params"]) for u in units[1]]


@pytest.mark.parametrize("run", [mw.run_key(*r) for r in PLAIN])
def test_the_ranks_route_to_different_experts_and_rank_1_runs_a_pass_of_no_token(world, run):
    p0, p1 = (_passes(res[run]) for res in world)
    assert len(p0) == len(p1) == 2
    assert all(not s for s in p1[1]), "rank 1's second pass is its empty one"
    assert all(s for s in p0[0] + p0[1] + p1[0])
    assert any(a != b for a, b in zip(p0[0], p1[0])), "the ranks' first passes route to the same experts"
    idle = [s for s in p0[0] + p0[1] + p1[0] if len(s) < 8]
    assert idle, "no MoE layer of a pass of tokens left an expert idle"


@pytest.mark.parametrize("name,dt", PAIRS)
def test_the_step_without_the_switch_is_the_step_with_it_bitwise(world, name, dt):
    for rank, res in enumerate(world):
        a, b = res[f"{name}/{dt}/no_switch"], res[f"{name}/{dt}/switch"]
        assert _differing(a["params"], b["params"]) == 0, (name, dt, rank)
        assert a["stats"] == b["stats"], (name, dt, rank)
        assert _differing(a["params"], world[0][f"{name}/{dt}/no_switch"]["params"]) == 0, "the ranks disagree"


@pytest.mark.parametrize("name,dt", PAIRS)
def test_the_step_equals_the_single_process_step_with_the_ranks_micro_batches_bitwise(world, job, name, dt):
    """The single process trains the same sequences in ``SINGLE_ORDER``, which it packs into the
    micro-batches [0], [2, 3], [1]: it accumulates (g0 + g23) + g1, the sharded run's rank-order
    sum of the first passes plus the second pass's (rank 1's empty pass adds zeros). Frozen
    parameters (GLM's correction bias) are not trained and stay the initial bits; the expert
    weights moved."""
    want = mw.single_run(job, name, mw.DTYPES[dt])
    init = dict(mw.build_model(job, name, mw.DTYPES[dt]).named_parameters())
    for switch in ("switch", "no_switch"):
        got = world[0][f"{name}/{dt}/{switch}"]["params"]
        assert _differing(got, want) == 0, (name, dt, switch)
        for n in set(got) - set(want):
            assert not init[n].requires_grad and bit_report(got[n], init[n].detach())["differing"] == 0, n
    moved = [n for n in want if is_expert_weight(n) and bit_report(want[n], init[n].detach().float())["differing"]]
    assert moved and len(moved) == sum(is_expert_weight(n) for n in want)


def test_activation_checkpointing_without_the_switch_leaves_the_same_weights(world):
    for rank, res in enumerate(world):
        got, want = res["qwen/fp32/no_switch/checkpointed"], res["qwen/fp32/no_switch"]
        assert _differing(got["params"], want["params"]) == 0, rank
        assert got["stats"] == want["stats"], rank
