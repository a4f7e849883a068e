"""``bench moe``: what it times is one function. For the same input and weights, the MoE layer under
the isoexec composition's regions and under the native composition's regions (the stock twins,
transformers' router and its grouped_mm experts path) agree at fp32 tolerance on the CPU, forward and backward, for
both benchmarked layer shapes. The quick run's result format is checked in test_bench.py."""

import pytest
import torch

from isoexec.bench.moe import _shapes, moe_fn, moe_plan, moe_weights


@pytest.mark.parametrize("shape", _shapes(big=False), ids=lambda s: s.name)
def test_isoexec_and_native_moe_layer_compute_the_same_function(shape):
    weights = moe_weights(shape, "cpu", torch.float32, seed=1)
    x = torch.randn(64, shape.hidden, generator=torch.Generator().manual_seed(2))
    g = torch.randn(64, shape.hidden, generator=torch.Generator().manual_seed(3))
    outs, grads = {}, {}
    for comp in ("native", "isoexec"):
        fn, ws = moe_fn(moe_plan(shape.family, comp, "cpu", "trainer_fwd"), shape, weights)
        leaves = [t.detach().requires_grad_(True) for t in (x, *ws)]
        outs[comp] = fn(*leaves)
        grads[comp] = torch.autograd.grad(outs[comp], leaves, g)
    # the random router spreads the tokens: most experts receive some (so the layer is exercised)
    routing = moe_plan(shape.family, "isoexec", "cpu", "trainer_fwd")["router"](
        x, weights["router_weight"], shape.spec, weights.get("correction_bias"), weights.get("shared_gate"))
    assert torch.bincount(routing.ids.flatten(), minlength=shape.experts).gt(0).sum() >= shape.experts // 2
    nat, ours = outs["native"].detach(), outs["isoexec"].detach()
    assert ours.abs().max() > 0 and not torch.equal(nat, torch.zeros_like(nat))
    # fp32 tolerance relative to the output's scale (weights ~ 0.02 make the outputs ~1e-3)
    torch.testing.assert_close(ours, nat, rtol=1e-5, atol=1e-5 * nat.abs().max().item())
    for a, b in zip(grads["isoexec"], grads["native"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
