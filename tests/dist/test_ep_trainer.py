"""The expert-parallel trainer (``isoexec.dist.fsdp.ExpertParallelTrainer``) on a world of two gloo
ranks (ep_trainer_workers.py): the tiny GLM-style MoE model (8 experts, 4 per rank at ep = 2) and
the Qwen3.5-MoE-style one cut to 7 experts (3 and 4 per rank), under ``isoexec_ep4``:

- a train call (two AdamW updates, clipped) is bitwise the same run to run, at ep = 2 and at ep = 1
  (both ranks hold every expert and add their gradients over the ``ep_replica`` column), fp32 and
  bf16, and every rank ends with the same weights;
- it agrees with the single-process ``Trainer`` within a stated tolerance (fp32), and in bf16 it is
  no further from the fp32 one-process step than the bf16 one-process step is;
- scoring is bitwise the single-process ``Trainer``'s, with ranks that pack different numbers of
  micro-batches kept in lockstep by empty passes;
- activation checkpointing (the MoE exchanges recomputed in the backward) leaves the same weights;
- a checkpoint written after the first of two train calls and loaded into a fresh trainer gives
  the uninterrupted run bitwise;
- an ep the contract does not claim, an ep that does not divide the world and a family without
  experts are refused on every rank before any collective, in one line;
- on a torch whose FSDP2 lacks ``set_reduce_scatter_unused_params`` (torch 2.11) the trainer shards
  an MoE model and steps as with it: FSDP2 manages no expert weight (a process group of one, in this
  process; ``shard_model`` shards the experts of the plain FSDP2 trainer too, test_fsdp_moe.py).
"""

from __future__ import annotations

import sys
import time

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ep_trainer_workers as ew  # noqa: E402
from dist_workers import bit_report  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

WS = 2
# The tolerance of the fp32 expert-parallel step against one process (the reasoning of
# test_fsdp_determinism.py's UPDATE_REL_L2): the same fp32 gradient terms in another association
# (an expert's weight gradient sums both ranks' rows in one backward, one process sums each
# micro-batch's rows and then adds micro-batches; the replicated parameters' as under FSDP2; the
# clip norm's squares in another order), so each gradient element moves by a few ulps, and AdamW
# turns that into up to lr per update where a gradient is all cancellation. Bound: the relative L2
# difference of the parameter updates, and every element within the hard Adam bound of 2 lr per
# update. Measured on this CPU: relative L2 1.4e-6 (glm, ep 1 and 2) to 4.8e-6 (qwen7, ep 2), the
# largest fp32 difference 0.79e-6 to 1.9e-6 (lr 1e-3, two updates).
UPDATE_REL_L2 = 1e-4
UPDATES = len(ew.LENGTHS) // ew.MINI
GRAD_NORM_REL = 1e-6


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return ew.make_job(str(tmp_path_factory.mktemp("ep_ckpt")))


@pytest.fixture(scope="module")
def world(job, tmp_path_factory):
    out = tmp_path_factory.mktemp("ep_trainer")
    t0 = time.monotonic()
    ranks = ew.run_world(WS, out, job)
    errors = [r["__error__"] for r in ranks if "__error__" in r]
    assert not errors, f"a rank failed:\n{errors[0]}"
    print(f"\nworld of {WS}: {time.monotonic() - t0:.1f} s; seconds since each rank's start: "
          f"{[r['times'] for r in ranks]}")
    return ranks


@pytest.fixture(scope="module")
def single(job):
    """{(model, dtype): (fp32 masters, statistics, initial weights)} of the one-process run."""
    return {(name, dt): ew.single_run(job, name, ew.DTYPES[dt]) for name, dt in {(n, d) for n, d, _ in ew.RUNS}}


def _differing(got: dict, want: dict) -> int:
    assert got.keys() == want.keys()
    return sum(bit_report(got[n], want[n])["differing"] for n in want)


def _update_diff(got: dict, want: dict, init: dict) -> tuple[float, float]:
    """(relative L2 difference of the parameter updates, largest absolute fp32 difference)."""
    dg = torch.cat([(got[n] - init[n]).double().reshape(-1) for n in want])
    dw = torch.cat([(want[n] - init[n]).double().reshape(-1) for n in want])
    return float((dg - dw).norm() / dw.norm()), max(float((got[n] - want[n]).abs().max()) for n in want)


@pytest.mark.parametrize("run", [f"{n}/{d}/ep{e}" for n, d, e in ew.RUNS])
def test_the_ep_step_is_bitwise_deterministic_run_to_run_and_the_same_on_every_rank(world, run):
    for rank, res in enumerate(world):
        a, b = res[run]["run"], res[run]["again"]
        assert _differing(a["params"], b["params"]) == 0, f"{run} rank {rank}"
        assert a["stats"] == b["stats"], f"{run} rank {rank}"
        assert _differing(a["params"], world[0][run]["run"]["params"]) == 0, f"{run}: ranks disagree"
        assert a["stats"] == world[0][run]["run"]["stats"], f"{run}: ranks disagree"


@pytest.mark.parametrize("run", [f"{n}/{d}/ep{e}" for n, d, e in ew.RUNS if d == "fp32"])
def test_the_ep_step_matches_one_process_within_the_stated_tolerance(world, single, job, run):
    """fp32: the whole fp32 masters (``full_parameters``: the expert slices gathered over the ep
    group, frozen parameters included) against the single-process ``Trainer``'s after one train
    call."""
    name, dt, _ = run.split("/")
    want, want_stats, init = single[(name, dt)]
    got = world[0][run]["run"]["params"]
    model = dict(ew.build_model(job, name).named_parameters())
    assert got.keys() == model.keys()
    rel, worst = _update_diff(got, want, init)
    lr = ew.CONFIG["lr"]
    print(f"\n{run}: update relative L2 {rel:.2e}, largest fp32 difference {worst:.2e} "
          f"({worst / lr:.2e} lr), differing {_differing({n: got[n] for n in want}, want)} of "
          f"{sum(w.numel() for w in want.values())}")
    assert rel <= UPDATE_REL_L2, (run, rel)
    assert worst <= 2 * lr * UPDATES, (run, worst)
    frozen = set(got) - set(want)   # GLM's router correction bias: never trained, whole on every rank
    assert frozen == {n for n, p in model.items() if not p.requires_grad}
    assert all(bit_report(got[n], model[n])["differing"] == 0 for n in frozen)
    for g, w in zip(world[0][run]["run"]["stats"], want_stats):
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=GRAD_NORM_REL)
        assert g["clip_frac"] == w["clip_frac"] and g["tokens"] == w["tokens"] and g["updates"] == w["updates"]
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5, abs=1e-7)
        assert g["grad_norm"] > ew.CONFIG["grad_clip"]   # the clip engaged: the norm fed the step


def test_the_bf16_ep_step_is_no_further_from_fp32_than_the_one_process_bf16_step(world, single):
    """bf16 gradients are rounded at every op, so the association shows far more than in fp32;
    against the fp32 one-process update the EP run is 0.0924 away (relative L2 of the updates) and
    the one-process bf16 run 0.0921: bound 1.1 times the latter."""
    want32, _, init = single[("glm", "fp32")]
    want16 = single[("glm", "bf16")][0]
    got = world[0]["glm/bf16/ep2"]["run"]["params"]
    ep_err, _ = _update_diff(got, want32, init)
    one_err, _ = _update_diff(want16, want32, init)
    print(f"\nbf16 update vs the fp32 one-process update: ep 2 {ep_err:.4f}, one process {one_err:.4f}")
    assert ep_err <= 1.1 * one_err, (ep_err, one_err)


@pytest.mark.parametrize("name", list(ew.MODELS))
def test_scoring_under_ep_equals_one_process_bitwise_with_each_rank_its_experts(world, job, name):
    seqs, pls = ew.score_batch()
    want = ew.Trainer(ew.build_model(job, name), ew.config()).score(seqs, pls)
    run = f"{name}/fp32/ep{WS}"
    experts = {"glm": [(0, 4), (4, 8)], "qwen7": [(0, 3), (3, 7)]}[name]
    for rank, res in enumerate(world):
        got = res[run]["score"]
        assert len(got) == len(want)
        assert sum(bit_report(g, w)["differing"] for g, w in zip(got, want)) == 0, f"{run} rank {rank}"
        assert res[run]["expert_range"] == experts[rank]
        e0, e1 = experts[rank]
        assert set(res[run]["expert_rows"]) == {e1 - e0}


def test_ranks_that_pack_fewer_micro_batches_run_empty_passes_in_lockstep(world):
    """The batches are made so that at dp = 2 rank 0 packs more micro-batches than rank 1: rank 1
    runs one empty training pass per train call and one empty scoring pass in ``score``; rank 0
    none. At ep = 1 too: each layer's all-gather and reduce-scatter are collectives of every rank
    (the layers are gathered per pass, isoexec/dist/fsdp/shard.py), so every rank runs as many
    passes as the busiest, whatever the ep groups."""
    for run in (f"{n}/{d}/ep{WS}" for n, d, e in ew.RUNS if e == WS):
        assert [res[run]["run"]["empty_passes"] for res in world] == [[0, 0], [1, 0]], run
        assert [res[run]["score_empty_passes"] for res in world] == [0, 1], run
    assert [res["glm/fp32/ep1"]["run"]["empty_passes"] for res in world] == [[0, 0], [1, 0]]


def test_activation_checkpointing_under_ep_leaves_the_same_weights(world):
    """A checkpointed layer's recompute in the backward runs its MoE exchanges again, on every rank
    of the group in the same order: the weights after the call are bitwise those without."""
    for rank, res in enumerate(world):
        got, want = res["glm/fp32/ep2"]["checkpointed"], res["glm/fp32/ep2"]["run"]
        assert _differing(got["params"], want["params"]) == 0, rank
        assert got["stats"] == want["stats"], rank


def test_a_resumed_ep_trainer_equals_the_uninterrupted_one_bitwise(world):
    """Sharded checkpoint after the first of two train calls (the replicated shards by
    ``get_state_dict``, the expert slices' masters and AdamW state under keys of their own), loaded
    into a fresh trainer built from other initial weights: the second call's statistics, the step
    counters and the weights are the uninterrupted run's."""
    for rank, res in enumerate(world):
        plain, r = res["plain"], res["resumed"]
        assert _differing(res["saving"]["params"], plain["params"]) == 0, rank
        assert r["stats"] == plain["stats"][1:], rank
        assert _differing(r["params"], plain["params"]) == 0, rank
        assert r["step"] == r["rl_updates"] == ew.CALLS * UPDATES


def test_unclaimed_ep_ep_not_dividing_the_world_and_no_experts_are_refused_on_every_rank(world):
    want = {"refuse/unclaimed_ep": ("TopologyRefused: ", f"ep={WS} is not in the proven domain [1]"),
            "refuse/ep_divides": ("ValueError: ", f"ep={WS + 1} does not divide the world of {WS}"),
            "refuse/dense": ("BindingRefused: ", "the dense family has no routed experts")}
    for key, (kind, needle) in want.items():
        msgs = [res[key] for res in world]
        assert msgs[0].startswith(kind) and needle in msgs[0] and "\n" not in msgs[0], msgs[0]
        assert msgs == [msgs[0]] * WS


def test_without_the_unused_params_switch_the_ep_trainer_shards_an_moe_model_and_steps_the_same(
        group_of_one, job, monkeypatch):
    """torch 2.11's FSDP2 lacks ``set_reduce_scatter_unused_params``: the expert-parallel trainer,
    whose experts FSDP2 does not manage, shards the MoE model and steps without it to the weights
    it reaches with it (one process, ep = 1)."""
    from torch.distributed.fsdp import FSDPModule

    from isoexec.dist.fsdp import ExpertParallelTrainer

    def one_call():
        t = ExpertParallelTrainer(ew.build_model(job, "glm"), ew.config(), 1)
        assert hasattr(t.model, "set_reduce_scatter_unused_params") == hasattr(FSDPModule,
                                                                               "set_reduce_scatter_unused_params")
        ew.train_calls(t)
        return t.full_parameters()

    with_switch = one_call()
    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params")
    assert _differing(one_call(), with_switch) == 0
