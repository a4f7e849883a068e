"""The synchronous DAPO run under the native composition for tensor parallelism (``native_tp4``) on
two gloo ranks with one engine sharded over both (``engine_tp: 2``), as ``isoexec run`` under
torchrun runs the native arm of a pair whose engines are at TP = 2: two steps of ``dense_tp_tiny``
from random weights (rl_workers.NATIVE_TP_CFG).

The run completes on both ranks: every step generates, scores, trains and syncs the weights into
the sharded engine. Both ranks serve every prompt, each caching half the kv heads, and they draw the
same tokens with the same logprob bits (the all-reduced sums are one sum on every rank, so the two
halves of the engine step in lock step). The native contract claims no tolerance, so there is no
live check; the engine's logprobs are close to the trainer's, not equal. The refusals of the
isoexec_tp4 test hold here too (an engine_tp the world cannot hold, a contract whose tp claim is 1
only). The mla_moe family (``mla_moe_tp_tiny``) runs the same way: its MoE layers deal their rows
over the engine group and run native.yaml's stock MoE regions there.
"""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import dist_workers as dw  # noqa: E402
import rl_workers as rw  # noqa: E402
from isoexec.compose import load_model_config  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

WS = 2
MLA_MOE_CFG = dict(rw.NATIVE_TP_CFG, family="mla_moe", model="mla_moe_tp_tiny")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    ranks = rw.run_world(WS, tmp_path_factory.mktemp("dist_native_tp"), {"cfg": rw.NATIVE_TP_CFG, "engine_tp": WS})
    errors = [r["__error__"] for r in ranks if "__error__" in r]
    assert not errors, f"a rank failed:\n{errors[0]}"
    return ranks


def test_the_native_run_with_a_sharded_engine_completes_on_both_ranks(world):
    for res in world:
        assert [x["step"] for x in res["lines"]] == list(range(rw.NATIVE_TP_CFG["steps"]))
        assert all(x["trained"] and x["responses_trained"] > 0 and x["time_weight_sync_s"] >= 0 for x in res["lines"])
        # no tolerance claimed, so no live check: trainer and engine need not agree bit for bit (the
        # counts of differing tokens are still reported per rank), only closely
        assert all(len(x["live_check_differing_per_rank"]) == WS for x in res["lines"])
        assert all(x["logprob_abs_diff_max"] < 1e-3 for x in res["lines"])
    assert world[0]["engine_prompts"] == world[1]["engine_prompts"] > 0
    kv_heads = load_model_config(rw.NATIVE_TP_CFG["model"])["hf_config"]["num_key_value_heads"]
    assert [r["engine_kv_heads"] for r in world] == [kv_heads // WS] * WS


def test_both_halves_of_the_engine_serve_the_same_tokens_and_logprob_bits(world):
    a, b = (r["rollouts"] for r in world)
    assert [(r["step"], r["round"]) for r in a] == [(r["step"], r["round"]) for r in b] and a
    for x, y in zip(a, b):
        assert x["prompts"] == y["prompts"] and x["ids"] == y["ids"]
        for p, q in zip(x["logprobs"], y["logprobs"]):
            assert dw.bit_report(p, q)["differing"] == 0


def test_the_isoexec_tp4_refusals_hold_for_the_native_run(world):
    for key, text in (("refuse/engine_tp", "engine_tp=3 does not divide the world of 2 ranks"),
                      ("refuse/engine_tp_unclaimed", "TopologyRefused: ")):
        msgs = [r[key] for r in world]
        assert msgs == [msgs[0]] * WS and "\n" not in msgs[0] and text in msgs[0], msgs[0]


def test_the_mla_moe_native_run_with_a_sharded_engine_completes_and_both_ranks_agree(tmp_path):
    world = rw.run_world(WS, tmp_path, {"cfg": MLA_MOE_CFG, "engine_tp": WS})
    errors = [r["__error__"] for r in world if "__error__" in r]
    assert not errors, f"a rank failed:\n{errors[0]}"
    for res in world:
        assert [x["step"] for x in res["lines"]] == list(range(MLA_MOE_CFG["steps"]))
        assert all(x["trained"] and x["logprob_abs_diff_max"] < 1e-3 for x in res["lines"])
    a, b = (r["rollouts"] for r in world)
    assert a and [x["ids"] for x in a] == [y["ids"] for y in b]
    for x, y in zip(a, b):
        for p, q in zip(x["logprobs"], y["logprobs"]):
            assert dw.bit_report(p, q)["differing"] == 0
