"""The FSDP2 trainer against the single-process Trainer, at dp = 1, 2 and 4 on gloo (CPU), for the
tiny dense and hybrid models (and the dense one in bf16): the forward is bitwise (scoring and the
training forward), and a step with one micro-batch per rank and mini-batch is bitwise the
single-process step whose micro-batches are the ranks' shares (fsdp_workers.py builds both sides
from the same seeds); the refusals come on
every rank before any collective. One world per dp runs every case, beside the other files' cases
(worlds.py); bits compared through integer views."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import fsdp_workers as fw  # noqa: E402
from dist_workers import bit_report  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

KEYS = [f"{f}/{d}" for f, d in fw.CASES["trainer"]]


@pytest.fixture(scope="module")
def job(fsdp_job):
    return fsdp_job


@pytest.fixture(scope="module")
def worlds(fsdp_trainer_worlds):
    """{dp: [rank results]} for dp = 1, 2, 4 (conftest.py: one world per size for the folder)."""
    return fsdp_trainer_worlds


def _differing(got: dict, want: dict) -> int:
    assert got.keys() == want.keys()
    return sum(bit_report(got[n], want[n])["differing"] for n in want)


def _assert_stats_equal(got: list[dict], want: list[dict], what: str) -> None:
    """Every statistic equal, except the gradient norm: the sharded norm adds the same squares in
    another order (isoexec/dist/fsdp/grad_norm.py), so at dp > 1 it may differ in its last bits."""
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), what
        for k in w:
            if k.startswith("grad_norm"):
                assert g[k] == pytest.approx(w[k], rel=1e-6), f"{what}: {k} {g[k]} vs {w[k]}"
            else:
                assert g[k] == w[k], f"{what}: {k} {g[k]} vs {w[k]}"


@pytest.mark.parametrize("key", KEYS)
def test_scoring_under_fsdp_equals_the_single_process_trainer_bitwise(worlds, job, key):
    """trainer_score: every rank scores its share and receives every sequence's logprobs."""
    family, dt = key.split("/")
    seqs, pls = fw.score_batch()
    want = fw.Trainer(fw.build_model(job, family, fw.DTYPES[dt]), fw.config("A")).score(seqs, pls)
    for ws, ranks in worlds.items():
        for rank, res in enumerate(ranks):
            got = res[key]["score"]
            assert len(got) == len(want)
            bad = {i: bit_report(g, w) for i, (g, w) in enumerate(zip(got, want)) if bit_report(g, w)["differing"]}
            assert not bad, f"{key} dp={ws} rank {rank}: differing sequences {bad}"


@pytest.mark.parametrize("key", KEYS)
def test_training_forward_under_fsdp_equals_the_single_process_forward_bitwise(worlds, job, key):
    """trainer_fwd (with a graph), each rank's contiguous share of a step's sequences."""
    family, dt = key.split("/")
    model = fw.build_model(job, family, fw.DTYPES[dt])
    for ws, ranks in worlds.items():
        for rank, res in enumerate(ranks):
            share = res[key]["share"]
            assert share == list(range(rank * fw.N_SEQ // ws, (rank + 1) * fw.N_SEQ // ws))
            packed = fw.PackedSequences.from_lists([fw.train_batch(0).sequences[i] for i in share])
            want = fw.score_logprobs(model, packed, grad=True).detach()
            assert bit_report(res[key]["fwd"], want)["differing"] == 0, f"{key} dp={ws} rank {rank}"


@pytest.mark.parametrize("key", KEYS)
def test_a_step_equals_the_single_process_step_with_the_ranks_shares_as_micro_batches(worlds, job, key):
    """One train call (two mini-batches, two AdamW updates, the second off-policy) without
    clipping: each rank's gradient is the single process's gradient of the same micro-batch, and
    the rank-order reduce-scatter adds them as the single process accumulates micro-batches, so
    the fp32 masters and the statistics other than the gradient norm are the same bits (bf16
    included: its gradients reach fp32 before any sum on both sides)."""
    family, dt = key.split("/")
    for ws, ranks in worlds.items():
        budget = fw.SEQ_LEN * fw.MINI // ws            # one micro-batch = one rank's share of a mini-batch
        want, want_stats = fw.single_run(job, family, fw.config("A", micro_batch_tokens=budget), fw.DTYPES[dt])
        for rank, res in enumerate(ranks):
            assert _differing(res[key]["A"]["params"], want) == 0, f"{key} dp={ws} rank {rank}"
            _assert_stats_equal(res[key]["A"]["stats"], want_stats, f"{key} dp={ws} rank {rank}")


def test_a_rank_whose_whole_share_is_rejected_still_steps_with_the_others(worlds, job):
    """k1 rejection drops the last rank's whole share of each mini-batch: that rank runs one
    masked micro-batch (zero gradient) to take part in the collectives, and the step equals the
    single process's, which drops the same sequences. At dp = 1 the whole batch is rejected and
    both skip every update."""
    for ws, ranks in worlds.items():
        budget = fw.SEQ_LEN * fw.MINI // ws
        want, want_stats = fw.single_run(job, "dense", fw.config("R", micro_batch_tokens=budget),
                                         batch_of=lambda tr: fw.rejection_batch(tr, ws))
        assert want_stats[0]["rs_rejected_frac"] == 1 / ws
        for rank, res in enumerate(ranks):
            assert _differing(res["dense/fp32"]["R"]["params"], want) == 0, f"dp={ws} rank {rank}"
            _assert_stats_equal(res["dense/fp32"]["R"]["stats"], want_stats, f"dp={ws} rank {rank}")


def test_an_sft_step_equals_the_single_process_sft_step_with_the_ranks_shares_as_micro_batches(worlds, job):
    seqs, pls = fw.train_batch(0).sequences, fw.train_batch(0).prompt_lens
    for ws, ranks in worlds.items():
        t = fw.Trainer(fw.build_model(job, "dense"), fw.config("A", micro_batch_tokens=fw.SEQ_LEN * fw.N_SEQ // ws))
        want_stats = t.sft_step(seqs, pls)
        want = dict(zip(t.optimizer.names, t.optimizer.masters))
        for rank, res in enumerate(ranks):
            got = res["dense/fp32"]["S"]
            assert _differing(got["params"], want) == 0, f"dp={ws} rank {rank}"
            assert {k: v for k, v in got["stats"].items() if k != "grad_norm"} == \
                   {k: v for k, v in want_stats.items() if k != "grad_norm"}
            assert got["stats"]["grad_norm"] == pytest.approx(want_stats["grad_norm"], rel=1e-6)


def test_sizes_that_do_not_divide_are_refused_on_every_rank_before_any_collective(worlds):
    for ws, ranks in worlds.items():
        for rank, res in enumerate(ranks):
            msg = res["refuse/mesh"]
            assert msg.startswith("ValueError") and f"({ws + 1},)" in msg and f"{ws} process" in msg, msg
            if ws == 1:
                continue
            msg = res["refuse/score"]
            assert msg.startswith("ValueError") and f"{ws + 1} sequence(s) over dp={ws}" in msg, msg
            msg = res["refuse/train"]
            assert msg.startswith("ValueError") and f"mini_batch_size {fw.MINI - 1}" in msg and f"dp={ws}" in msg, msg
            # and the group is not stuck: the next collective call works
            after, before = res["after_refusals"], ranks[0]["dense/fp32"]["score"]
            assert all(bit_report(a, b)["differing"] == 0 for a, b in zip(after, before))
