"""The MoE layer cut into the contract's regions (isoexec_kernels/moe/regions.py and the stock
regions of native.py): run in sequence, the regions give the whole-layer twins' bits; the stock
dispatch keeps transformers' order, which is not the canonical one; the router computes the
Qwen-style shared-expert gate."""

import pytest
import torch
import torch.nn.functional as F

from isoexec_kernels.moe import (MoEWeights, RouterSpec, dispatch, moe_combine, moe_combine_native, moe_dispatch,
                                 moe_dispatch_native, moe_experts, moe_experts_native, moe_forward_native,
                                 moe_forward_reference, moe_route, moe_route_native)

KINDS = {"softmax_topk": dict(top_k=2, norm_topk_prob=True),
         "sigmoid_group_topk": dict(top_k=3, norm_topk_prob=True, n_group=4, topk_group=2, routed_scaling_factor=2.5)}


def _bits(t):
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def _weights(kind, E=8, H=32, inter=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(s, generator=g) * 0.2).to(dtype)  # noqa: E731
    return MoEWeights(router=r(E, H), gate_up=r(E, 2 * inter, H), down=r(E, H, inter),
                      correction_bias=(0.05 * torch.randn(E, generator=g)) if kind != "softmax_topk" else None,
                      shared_gate_up=r(2 * inter, H), shared_down=r(H, inter),
                      shared_gate=r(1, H) if kind == "softmax_topk" else None)


def _shared(x, w, linear, act):
    """The shared expert as the stock layer runs it: gate and up as two products."""
    inter = w.shared_gate_up.shape[0] // 2
    return linear(act(linear(x, w.shared_gate_up[:inter]), linear(x, w.shared_gate_up[inter:])), w.shared_down)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_invariant_regions_in_sequence_equal_the_reference_layer(kind, dtype):
    from isoexec_kernels.activation import silu_and_mul
    from isoexec_kernels.gemm import linear

    w = _weights(kind, dtype=dtype)
    x = torch.randn(29, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    spec = RouterSpec(kind=kind, **KINDS[kind])
    r = moe_route(x, w.router, spec, w.correction_bias, w.shared_gate)
    d = moe_dispatch(r.ids, 8)
    out = moe_combine(moe_experts(x, d, w.gate_up, w.down), d, r, _shared(x, w, linear, silu_and_mul), out_dtype=dtype)
    ref = moe_forward_reference(x, w, kind=kind, **KINDS[kind])
    assert torch.equal(_bits(out), _bits(ref))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_stock_regions_in_sequence_equal_the_stock_layer(kind):
    w = _weights(kind)
    x = torch.randn(29, 32, generator=torch.Generator().manual_seed(2))
    spec = RouterSpec(kind=kind, **KINDS[kind])
    r = moe_route_native(x, w.router, spec, w.correction_bias, w.shared_gate)
    d = moe_dispatch_native(r.ids, 8)
    out = moe_combine_native(moe_experts_native(x, d, w.gate_up, w.down), d, r,
                             _shared(x, w, F.linear, lambda g, u: F.silu(g) * u), out_dtype=x.dtype)
    assert torch.equal(_bits(out), _bits(moe_forward_native(x, w, kind=kind, **KINDS[kind])))


def test_stock_dispatch_is_slot_major_inside_an_expert_the_invariant_one_token_ascending():
    ids = torch.tensor([[1, 2], [0, 1]])          # expert 1: token 0 in slot 0, token 1 in slot 1
    ids_topk_order = torch.tensor([[1, 2], [1, 0]])   # the stock router lists experts in top-k order
    assert dispatch(ids, 3).token.tolist() == [1, 0, 1, 0]
    stock = moe_dispatch_native(ids_topk_order, 3)
    assert stock.token.tolist() == [1, 0, 1, 0] and stock.offsets.tolist() == [0, 1, 3, 4]
    swapped = moe_dispatch_native(torch.tensor([[2, 1], [1, 0]]), 3)   # token 0 now has expert 1 in slot 1
    assert swapped.token.tolist() == [1, 1, 0, 0]                       # slot-major: token 1 before token 0


def test_router_shared_gate_is_fp32_sigmoid_of_the_invariant_gemm():
    from isoexec_kernels.gemm import linear

    w = _weights("softmax_topk", dtype=torch.bfloat16)
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    r = moe_route(x, w.router, RouterSpec("softmax_topk", 2), None, w.shared_gate)
    assert r.shared_gate.dtype == torch.float32 and r.shared_gate.shape == (7, 1)
    want = torch.sigmoid(linear(x.float(), w.shared_gate.float()).double())
    assert (r.shared_gate.double() - want).abs().max().item() < 1e-6


def test_routing_weights_and_expert_weights_get_gradients():
    from isoexec_kernels.activation import silu_and_mul
    from isoexec_kernels.gemm import linear

    w = _weights("sigmoid_group_topk")
    params = [w.router, w.gate_up, w.down]
    for p in params:
        p.requires_grad_(True)
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(4))
    spec = RouterSpec("sigmoid_group_topk", **KINDS["sigmoid_group_topk"])
    r = moe_route(x, w.router, spec, w.correction_bias)
    d = moe_dispatch(r.ids, 8)
    out = moe_combine(moe_experts(x, d, w.gate_up, w.down), d, r, _shared(x, w, linear, silu_and_mul))
    grads = torch.autograd.grad(out.square().sum(), params)
    assert all(bool(torch.isfinite(g).all()) and bool((g != 0).any()) for g in grads)
