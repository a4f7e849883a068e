"""A 2-rank FSDP2 run checkpointed with torch.distributed.checkpoint after its first train call,
torn down, and resumed in a new world gives the uninterrupted run's parameters and statistics bit
for bit at the second call, for the tiny dense and hybrid models (gloo, CPU). fsdp_workers.py:
plan "save" runs, per family, config B for two train calls without saving and with a save after
the first; plan "resume" starts fresh trainers from other initial weights, loads, and makes the
second call."""

from __future__ import annotations

import sys
import time

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import fsdp_workers as fw  # noqa: E402
from dist_workers import bit_report  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

FAMILIES = ("dense", "hybrid")
DP = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the saving world's rank results, the resumed world's), two separate spawns."""
    path = str(tmp_path_factory.mktemp("fsdp_ckpt"))
    times = {}
    out = []
    for plan in ("save", "resume"):
        job = fw.make_job(plan, families=FAMILIES, path=path)
        t0 = time.monotonic()
        ranks = fw.run_world(DP, tmp_path_factory.mktemp(f"fsdp_{plan}"), job)
        times[plan] = round(time.monotonic() - t0, 1)
        errors = [r["__error__"] for r in ranks if "__error__" in r]
        assert not errors, f"{plan}: a rank failed:\n{errors[0]}"
        out.append(ranks)
    print(f"\nseconds per world: {times}")
    return out


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
