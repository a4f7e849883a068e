"""A 2-rank FSDP2 run checkpointed with torch.distributed.checkpoint after its first train call,
torn down, and resumed in a new world gives the uninterrupted run's parameters and statistics bit
for bit at the second call, for the tiny dense and hybrid models (gloo, CPU). fsdp_workers.py:
plan "save" runs, per family, config B for two train calls without saving and with a save after
the first; plan "resume" starts fresh trainers from other initial weights, loads, and makes the
second call."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import fsdp_workers as fw  # noqa: E402
from dist_workers import bit_report  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

FAMILIES = tuple(f for f, _ in fw.CASES["save"])


@pytest.fixture(scope="module")
def runs(fsdp_checkpoint_worlds):
    """(the saving world's rank results, the resumed world's): conftest.py, the save in the world of
    2 that the other FSDP tests share, the resume in a second world started after it."""
    return fsdp_checkpoint_worlds


def _differing(got: dict, want: dict) -> int:
    assert got.keys() == want.keys()
    return sum(bit_report(got[n], want[n])["differing"] for n in want)


@pytest.mark.parametrize("family", FAMILIES)
def test_saving_does_not_change_the_run(runs, family):
    saved, _ = runs
    for rank, res in enumerate(saved):
        plain, saving = res[family]["plain"], res[family]["saving"]
        assert _differing(saving["params"], plain["params"]) == 0, f"{family} rank {rank}"
        assert saving["stats"] == plain["stats"], f"{family} rank {rank}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_resumed_run_equals_the_uninterrupted_run_bitwise(runs, family):
    saved, resumed = runs
    for rank, (a, b) in enumerate(zip(saved, resumed)):
        plain, got = a[family]["plain"], b[family]
        assert _differing(got["params"], plain["params"]) == 0, f"{family} rank {rank}"
        assert got["stats"] == plain["stats"][1:], f"{family} rank {rank}"
        assert got["step"] == plain["stats"][-1]["step"] == fw.CALLS * fw.N_SEQ // fw.MINI
        assert got["rl_updates"] == fw.CALLS * fw.N_SEQ // fw.MINI


def test_a_checkpoint_before_the_first_step_is_refused_on_every_rank(runs):
    saved, _ = runs
    for res in saved:
        msg = res["refuse/save_before_step"]
        assert msg.startswith("RuntimeError") and "no optimizer step" in msg, msg
