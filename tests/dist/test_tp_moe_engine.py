"""The engine on the MoE models under tensor parallelism serves the tokens and logprobs of one
process: an ``Engine`` on each rank's ``TensorParallelMoe`` shards of ``mla_moe_tp_tiny`` (MLA, a
dense-MLP layer, a MoE layer) and ``hybrid_moe_tp_tiny`` (Gated DeltaNet and gated attention, each
with a MoE layer) at TP = 1 (no group), 2 and 4 (gloo, spawned), under the ``isoexec_tp4``
contract, fp32 and bf16, with chunked prefill, preemption, decode lookahead, greedy / top-p / top-k
sampling and (fp32) a weight update from full weights. Against the one-process engine on the one-process
model (same tokens, 0 differing logprob bits through integer views) and, generate-then-verify,
against the one-process trainer's ``trainer_score``. The ranks' logs show decode steps of fewer rows
than ranks, in which a rank routes no row of its own yet enters every collective its group enters.
Negative control: the same engine at TP = 2 with the row-parallel sums all-reduced. Also the registry
(``TENSOR_PARALLEL``) rows of both families: the model class, and the memory plan's per-rank
parameter count."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import tp_model_workers as tw  # noqa: E402
import tp_moe_engine_workers as ew  # noqa: E402
import tp_moe_workers as mw  # noqa: E402
from isoexec.compose import load_model_config  # noqa: E402
from isoexec.gates.compare import compare_bits  # noqa: E402
from isoexec.gates.engine_gates import verify_engine_logprobs  # noqa: E402
from isoexec.model import FAMILY_MODELS, tp_moe  # noqa: E402
from isoexec.model.tensor_parallel import TENSOR_PARALLEL, rank_parameter_count, tensor_parallel  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

FAMILIES = list(ew.FAMILIES)
RUNS = ("first", "second")


@pytest.fixture(scope="module")
def single():
    """{family: {dtype: results}} of the one-process engine on the one-process model."""
    return {fam: {dt: ew.serve(*ew.model_and_contract(fam, dtype), fam, dtype, ew.UPDATE[dt])
                  for dt, dtype in tw.DTYPES.items()} for fam in FAMILIES}


@pytest.fixture(scope="module")
def worlds(tp_moe_engine_worlds):
    """{tp: [rank results]}: TP = 1 in this process (no group); TP = 2 (both pairs) and 4 from the
    world of 4 (conftest.py)."""
    return {1: [ew.cases(None)], **tp_moe_engine_worlds}


def _runs(dt: str) -> tuple[str, ...]:
    return RUNS if ew.UPDATE[dt] else RUNS[:1]


def _differences(want, got) -> list[str]:
    bad = []
    for x, y in zip(want, got, strict=True):
        if (x.ids, x.finish_reason) != (y.ids, y.finish_reason):
            bad.append(f"request {x.request_id}: tokens {y.ids} ({y.finish_reason}), one process {x.ids}")
        elif (rep := compare_bits(y.logprobs, x.logprobs)).differing:
            bad.append(f"request {x.request_id}: logprobs {rep}")
    return bad


@pytest.mark.parametrize("fam", FAMILIES)
def test_the_served_moe_workload_chunks_preempts_and_looks_ahead(single, fam):
    for res in single[fam].values():
        assert res["preemptions"] > 0 and res["lookahead_steps"] > 0
        assert max(len(r.prompt) for r in res["first"]) > ew.ENGINE["chunk_align"]


@pytest.mark.parametrize("dt", list(tw.DTYPES))
@pytest.mark.parametrize("fam", FAMILIES)
def test_moe_engine_at_tp2_and_tp4_equals_one_process_engine_bitwise(worlds, single, fam, dt):
    bad, tokens = {}, 0
    for tp, ranks in worlds.items():
        for rank, res in enumerate(ranks):
            for run in _runs(dt):
                got = res[f"{fam}/{dt}"][run]
                tokens += sum(len(r.ids) for r in got)
                if diff := _differences(single[fam][dt][run], got):
                    bad[f"TP={tp} rank {rank} {run} run"] = diff[:3]
    assert not bad, bad
    assert tokens > 0
    if ew.UPDATE[dt]:   # the weight update changed what is generated (the second run is not the first again)
        want = single[fam][dt]
        assert any(a.ids != b.ids for a, b in zip(want["first"], want["second"]))


@pytest.mark.parametrize("dt", list(tw.DTYPES))
@pytest.mark.parametrize("fam", FAMILIES)
def test_moe_engine_at_tp_logprobs_equal_the_one_process_trainer_bitwise(worlds, fam, dt):
    """Generate-then-verify: the one-process trainer (``trainer_score``, with the weights each run
    was served with) recomputes every token each TP engine served (runs that served the same bits
    are scored once)."""
    dtype = tw.DTYPES[dt]
    trainers = {"first": ew.model_and_contract(fam, dtype)[0],
                "second": ew.model_and_contract(fam, dtype, ew.NEW_WEIGHTS_SEED)[0]}
    verified = {}
    for tp, ranks in worlds.items():
        for rank, res in enumerate(ranks):
            for run in _runs(dt):
                key = (run, _served_bits(res[f"{fam}/{dt}"][run]))
                if key not in verified:
                    verified[key] = verify_engine_logprobs(trainers[run], res[f"{fam}/{dt}"][run])
                rep = verified[key]
                assert rep.compared > 0 and rep.differing == 0, (fam, dt, tp, rank, run, rep)


def _served_bits(results) -> tuple:
    """What a run served, as bytes: equal keys are the same tokens and the same logprob bits."""
    return tuple((tuple(r.prompt), tuple(r.ids), r.logprobs.contiguous().view(torch.int32).numpy().tobytes())
                 for r in results)


@pytest.mark.parametrize("fam", FAMILIES)
def test_moe_engine_decode_with_an_empty_row_slice_on_a_rank_enters_every_collective(worlds, fam):
    """Decode steps of fewer rows than ranks ran (the last requests decode alone at TP = 2, three
    at a time at TP = 4), in which some rank's slice of the MoE rows was empty; every rank of a
    group still ran the same MoE layers and entered the same collectives, as many times."""
    for tp in (2, 4):
        ranks = worlds[tp]
        for g0 in range(0, len(ranks), tp):   # each group of tp ranks (TP = 2: two pairs)
            for dt in tw.DTYPES:
                logs = [res[f"{fam}/{dt}/log"] for res in ranks[g0:g0 + tp]]
                steps = [[(case, T) for case, T, _ in lg["layers"]] for lg in logs]
                assert all(s == steps[0] for s in steps), (tp, g0, dt)
                counts = [lg["collectives"] for lg in logs]
                assert all(c == counts[0] for c in counts) and counts[0].get("all_to_all_single", 0) > 0, counts
                # each step's rows dealt out whole: the slices add up to T
                for i, (case, T) in enumerate(steps[0]):
                    assert sum(lg["layers"][i][2] for lg in logs) == T, (tp, g0, dt, i)
                empty = [(case, T) for lg in logs for case, T, own in lg["layers"] if own == 0]
                assert any(case == "engine_decode" and 0 < T < tp for case, T in empty), (tp, g0, dt, empty[:5])
                assert any(case == "engine_prefill" for case, _ in steps[0])


@pytest.mark.parametrize("fam", FAMILIES)
def test_moe_engine_ranks_cache_their_share_of_the_heads(worlds, single, fam):
    """MLA caches expanded per-head K/V (``num_kv_heads`` = ``num_heads`` rows of ``attn_width``),
    the hybrid model its kv heads; a rank of TP = t caches 1/t of them."""
    whole = single[fam]["fp32"]["kv_heads"]
    for tp, ranks in worlds.items():
        assert [res[f"{fam}/fp32"]["kv_heads"] for res in ranks] == [whole // tp] * len(ranks)


def test_moe_stock_all_reduce_tp_engine_differs(worlds, single):
    differing = {fam: sum(len(_differences(single[fam]["fp32"]["first"], res[f"{fam}/stock_all_reduce"]["first"]))
                          for res in worlds[2]) for fam in FAMILIES}
    print(f"\nstock all_reduce TP = 2 engine, requests differing from one process (over the ranks): {differing}")
    assert any(differing.values()), differing


# ------------------------------------------------------------------------------------------ registry
DIMS = {"mla_moe": ("mla_moe_tp_tiny", "mla_moe_glm47_flash_dims"),
        "hybrid_moe": ("hybrid_moe_tp_tiny", "hybrid_moe_qwen3p5_35b_a3b_dims")}


@pytest.mark.parametrize("fam", FAMILIES)
def test_the_registry_cuts_the_moe_families_with_their_tensor_parallel_models(fam):
    model, _ = mw.model_and_contract(fam, torch.float32)
    want = {"mla_moe": (tp_moe.TensorParallelMlaMoe, tp_moe.cut_parameter_mla_moe),
            "hybrid_moe": (tp_moe.TensorParallelHybridMoe, tp_moe.cut_parameter_hybrid_moe)}[fam]
    assert TENSOR_PARALLEL[fam] == want
    assert type(tensor_parallel(model)) is want[0]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("fam", FAMILIES)
def test_moe_rank_parameter_counts_sum_to_at_least_the_full_model(fam, tp):
    """The memory plan's per-rank count (``rank_parameter_count``, on ``meta``): over the ranks at
    least the whole model (replicated parts counted on every rank), every rank below it (the
    experts, heads and vocabulary are cut), and the routed experts counted exactly once."""
    for name in DIMS[fam]:
        data = load_model_config(name)
        model_cls, cfg_cls = FAMILY_MODELS[fam]
        model = model_cls(cfg_cls.from_hf(data["hf_config"]), device="meta")
        full = sum(p.numel() for p in model.parameters())
        counts = [rank_parameter_count(model, tp, r) for r in range(tp)]
        assert sum(counts) >= full and max(counts) < full, (name, tp, counts, full)
        cut = TENSOR_PARALLEL[fam][1]
        experts = [sum(cut(model.cfg, tp, r, n, p).numel() for n, p in model.named_parameters()
                       if n.rsplit(".", 1)[-1] in ("experts_gate_up", "experts_down")) for r in range(tp)]
        assert sum(experts) == sum(p.numel() for n, p in model.named_parameters()
                                   if n.rsplit(".", 1)[-1] in ("experts_gate_up", "experts_down")), name
