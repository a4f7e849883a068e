"""The MoE kernel gates (isoexec/gates/moe_gates.py) have teeth: the declared hazards occur in their
inputs (top-k and group ties, an expert with every token and experts with none, skewed loads), the
invariant regions pass, and regions that break ties, order or rounding by the batch fail."""

import pytest
import torch

from isoexec.compose import load_model_config
from isoexec.gates.kinds import KINDS
from isoexec.gates.moe_gates import gate_combine, gate_dispatch, gate_experts, gate_router, moe_dims
from isoexec_kernels.moe import (Dispatch, Routing, moe_combine, moe_dispatch, moe_dispatch_native, moe_experts,
                                 moe_route)

CFG = load_model_config("mla_moe_tiny")["hf_config"]
SIZES = (1, 3, 17)


def _gen():
    return torch.Generator().manual_seed(0)


def test_moe_kinds_are_registered_with_their_gate_families():
    assert KINDS["router"].families == ("batch_invariance", "hazards") and KINDS["router"].run is gate_router
    assert KINDS["experts"].families == ("batch_invariance", "hazards") and KINDS["experts"].run is gate_experts
    assert "batch_invariance" in KINDS["dispatch"].families and "batch_invariance" in KINDS["combine"].families


def test_dims_follow_the_config():
    d = moe_dims(CFG)
    assert (d["E"], d["k"], d["spec"].kind, d["spec"].n_group, d["shared"]) == (8, 2, "sigmoid_group_topk", 2, 32)


def test_router_hazards_make_ties_and_the_invariant_router_passes():
    out = gate_router(moe_route, ("router",), CFG, "hazards", torch.float32, "cpu", _gen(), SIZES, ("topk_tie",), {})
    assert out.hazards_exercised["topk_tie"] > 0 and out.hazards_exercised["group_tie"] > 0
    assert out.verdict() == "pass"


def test_a_router_whose_tie_break_follows_the_batch_fails():
    def flaky(x, w, spec, bias=None, gate=None):
        r = moe_route(x, w, spec, bias, gate)
        if x.shape[0] > 1:   # inside a batch, a tie goes to the higher expert: the kind of drift topk allows
            sel = torch.sort(moe_route(x, w.flip(0), spec, None if bias is None else bias.flip(0)).ids, -1).values
            r.ids = torch.sort(w.shape[0] - 1 - sel, -1).values
        return r

    out = gate_router(flaky, ("router",), CFG, "hazards", torch.float32, "cpu", _gen(), SIZES, ("topk_tie",), {})
    assert out.verdict() == "fail"


def test_canonical_dispatch_passes_and_a_slot_major_order_fails():
    assert gate_dispatch(moe_dispatch, ("dispatch",), CFG, "batch_invariance", torch.float32, "cpu", _gen(),
                         SIZES, (), {}).verdict() == "pass"
    # the stock grouped_mm dispatch (a stable sort of the pairs by expert) lands on the same order:
    # integers only, so it passes too
    assert gate_dispatch(moe_dispatch_native, ("dispatch",), CFG, "batch_invariance", torch.float32, "cpu", _gen(),
                         (17, 64), (), {}).verdict() == "pass"

    def slot_major(ids, num_experts):
        # transformers' eager loop order: inside an expert, slot-major, then token
        T, k = ids.shape
        e_idx, slot, tok = torch.where(torch.nn.functional.one_hot(ids, num_experts).permute(2, 1, 0) > 0)
        offsets = torch.zeros(num_experts + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(torch.bincount(e_idx, minlength=num_experts), 0)
        row_of_pair = torch.empty(T * k, dtype=torch.long)
        row_of_pair[tok * k + slot] = torch.arange(T * k)
        return Dispatch(token=tok, offsets=offsets, row_of_pair=row_of_pair, num_tokens=T, top_k=k)

    # inside an expert, tokens that chose it in slot 1 come after those that chose it in slot 0
    stock = gate_dispatch(slot_major, ("dispatch",), CFG, "batch_invariance", torch.float32, "cpu", _gen(),
                          (17, 64), (), {})
    assert stock.verdict() == "fail" and stock.rel_err == 0.0   # a consistent dispatch, in another order


def test_expert_hazards_occur_and_a_load_dependent_expert_fails():
    out = gate_experts(moe_experts, ("experts",), CFG, "hazards", torch.float32, "cpu", _gen(), SIZES,
                       ("expert_zero_load", "expert_full_load", "skewed_load"), {})
    ex = out.hazards_exercised
    assert ex["expert_zero_load"] > 0 and ex["expert_full_load"] > 0 and ex["skewed_load"] > 0
    assert out.verdict() == "pass"

    def load_dependent(x, disp, gate_up, down):   # e.g. a tile choice keyed on the expert's row count
        rows = moe_experts(x, disp, gate_up, down)
        return rows * (1 + 1e-3 * (disp.counts.max() > 1))

    bad = gate_experts(load_dependent, ("experts",), CFG, "hazards", torch.float32, "cpu", _gen(), SIZES,
                       ("expert_zero_load", "expert_full_load", "skewed_load"), {})
    assert bad.verdict() == "fail"


def test_combine_passes_and_a_batch_dependent_sum_fails():
    assert gate_combine(moe_combine, ("combine",), CFG, "batch_invariance", torch.bfloat16, "cpu", _gen(), SIZES,
                        (), {}).verdict() == "pass"

    def arrival_order(rows, disp, routing: Routing, shared=None, out_dtype=None):
        # rounds to the output dtype after each add; inside a batch the shared expert arrives first
        out = torch.zeros(disp.num_tokens, rows.shape[-1], dtype=out_dtype)
        if disp.num_tokens > 1:
            out = out + shared
        pair = torch.empty_like(disp.row_of_pair)
        pair[disp.row_of_pair] = torch.arange(pair.numel())
        w = routing.weights.reshape(-1)[pair]
        for r in range(rows.shape[0]):
            out[disp.token[r]] += (w[r] * rows[r].float()).to(out_dtype)
        return out if disp.num_tokens > 1 else out + shared

    bad = gate_combine(arrival_order, ("combine",), CFG, "batch_invariance", torch.bfloat16, "cpu", _gen(), SIZES,
                       (), {})
    assert bad.verdict() == "fail"


@pytest.mark.parametrize("kind", ["router", "experts"])
def test_a_hazard_gate_without_its_hazards_is_vacuous(kind):
    fn = {"router": gate_router, "experts": gate_experts}[kind]
    impl = {"router": moe_route, "experts": moe_experts}[kind]
    out = fn(impl, (kind,), CFG, "batch_invariance", torch.float32, "cpu", _gen(), SIZES, (), {})
    out.hazards_required = {"router": ("topk_tie",), "experts": ("expert_full_load",)}[kind]
    assert out.verdict() == "fail"     # random inputs: no declared hazard was recorded
