"""The engine under tensor parallelism serves the tokens and logprobs of one process: an ``Engine``
on each rank's ``TensorParallelDense`` shards at TP = 1 (no group), 2 and 4 (gloo, spawned), under
the ``isoexec_tp4`` contract, fp32 and bf16, with chunked prefill, preemption, decode lookahead,
greedy / top-p / top-k sampling, and a weight update from full weights between two runs. Compared
bitwise with the one-process engine on ``DenseModel``, and generate-then-verify against the
one-process trainer (TP = 1). Negative control: the same engine with the row-parallel sums
all-reduced."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import dist_workers as dw  # noqa: E402
import tp_engine_workers as ew  # noqa: E402
import tp_model_workers as tw  # noqa: E402
from isoexec.gates.engine_gates import verify_engine_logprobs  # noqa: E402
from isoexec.model import tp_dense  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

RUNS = ("first", "second")


@pytest.fixture(scope="module")
def single():
    """{dtype: results} of the one-process engine on DenseModel."""
    return {dt: ew.serve(*tw.model_and_contract(dtype), dtype) for dt, dtype in tw.DTYPES.items()}


@pytest.fixture(scope="module")
def worlds(tp_engine_worlds):
    """{tp: [rank results]}: TP = 1 in this process (no group); TP = 2 (both pairs) and 4."""
    return {1: [ew.cases(None)], **tp_engine_worlds}


def _differences(want, got) -> list[str]:
    bad = []
    for x, y in zip(want, got, strict=True):
        if (x.ids, x.finish_reason) != (y.ids, y.finish_reason):
            bad.append(f"request {x.request_id}: tokens {y.ids} ({y.finish_reason}), one process {x.ids}")
        elif (rep := dw.bit_report(y.logprobs, x.logprobs))["differing"]:
            bad.append(f"request {x.request_id}: logprobs {rep}")
    return bad


def test_the_served_workload_chunks_preempts_and_looks_ahead(single):
    for res in single.values():
        assert res["preemptions"] > 0 and res["lookahead_steps"] > 0
        assert max(len(r.prompt) for r in res["first"]) > ew.ENGINE["chunk_align"]


@pytest.mark.parametrize("dt", list(tw.DTYPES))
def test_tp_engine_gives_the_one_process_engine_tokens_and_logprobs_bitwise(worlds, single, dt):
    bad = {}
    for tp, ranks in worlds.items():
        for rank, res in enumerate(ranks):
            for run in RUNS:
                if diff := _differences(single[dt][run], res[dt][run]):
                    bad[f"TP={tp} rank {rank} {run} run"] = diff[:3]
    assert not bad, bad
    # the weight update changed what is generated (the second run is not the first again)
    assert any(a.ids != b.ids for a, b in zip(single[dt]["first"], single[dt]["second"]))


@pytest.mark.parametrize("dt", list(tw.DTYPES))
def test_tp_engine_logprobs_equal_the_one_process_trainer_bitwise(worlds, dt):
    """Generate-then-verify: the TP = 1 trainer recomputes every token each TP engine served."""
    first, _ = tw.model_and_contract(tw.DTYPES[dt])
    second, _ = tw.model_and_contract(tw.DTYPES[dt])
    second.init_random(ew.NEW_WEIGHTS_SEED)
    for tp, ranks in worlds.items():
        for rank, res in enumerate(ranks):
            for run, trainer in (("first", first), ("second", second)):
                rep = verify_engine_logprobs(trainer, res[dt][run])
                assert rep.compared > 0 and rep.differing == 0, (tp, rank, run, rep)


def test_stock_all_reduce_tp_engine_differs(worlds, single):
    differing = 0
    for tp in (2, 4):
        for res in worlds[tp]:
            differing += len(_differences(single["fp32"]["first"], res["stock_all_reduce"]["first"]))
    assert differing > 0


def test_engine_cases_refuse_what_the_contract_does_not_declare():
    model, contract = tw.model_and_contract(torch.float32)
    tpm = tp_dense.TensorParallelDense(model, None)
    tpm.plans.pop("engine_decode")
    with pytest.raises(Exception, match="case 'engine_decode' is not served"):
        tpm._plan("engine_decode")
    with pytest.raises(Exception, match="engine cases only"):
        tpm.log_softmax_from_logits(torch.zeros(1, model.cfg.vocab_size), "trainer_score")


def test_shard_weights_cuts_full_weights_into_the_tp1_model_unchanged_and_passes_unknown_names():
    model, _ = tw.model_and_contract(torch.float32)
    tpm = tp_dense.TensorParallelDense(model, None)
    full = dict(model.named_parameters())
    cut = tpm.shard_weights({**full, "not_a_weight": torch.zeros(1)})
    own = dict(tpm.named_parameters())
    assert set(cut) == set(own) | {"not_a_weight"}
    for name, t in own.items():
        assert torch.equal(cut[name], t), name
