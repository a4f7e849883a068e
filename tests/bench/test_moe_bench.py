"""``bench moe``: what it times is one function. For the same input and weights, the MoE layer under
the isoexec composition's regions and under the native composition's regions (the stock twins,
transformers' router and its grouped_mm experts path) agree at fp32 tolerance on the CPU, forward and backward, for
both benchmarked layer shapes; likewise the mla_moe attention region of the MLA rows in each case.
The quick run's result format is checked in test_bench.py."""

import pytest
import torch

from isoexec.bench.mla import mla_attention, mla_paged_kv, mla_regions, mla_shape
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


@pytest.mark.parametrize("case", ["trainer_fwd", "engine_prefill", "engine_decode"])
def test_isoexec_and_native_mla_attention_compute_the_same_function(case):
    """The MLA rows' calls (``mla_attention``, each composition's bound ``attn_core``) at the quick
    shape: the same attention on the same inputs, forward (and backward in the trainer's case)."""
    s = mla_shape(big=False)
    assert s.v_head_dim < s.width  # the quick shape pads the value side
    attn, page = mla_regions("cpu")
    gen = torch.Generator().manual_seed(4)
    b, n = 2, 32

    def rnd(t, d):
        return torch.randn(t, s.heads, d, generator=gen)

    if case == "trainer_fwd":
        T = b * n
        cu = torch.arange(0, T + 1, n, dtype=torch.int32)
        inputs, g = (rnd(T, s.qk_head_dim), rnd(T, s.qk_head_dim), rnd(T, s.v_head_dim)), rnd(T, s.v_head_dim)
        outs, grads = {}, {}
        for comp in ("native", "isoexec"):
            q, k, v = (t.detach().requires_grad_(True) for t in inputs)
            outs[comp] = mla_attention(attn[comp, case], s, case, q, (k, v), cu, n)
            grads[comp] = torch.autograd.grad(outs[comp], (q, k, v), g)
        for a, c in zip(grads["isoexec"], grads["native"]):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    else:
        torch.manual_seed(5)  # random_paged_kv draws from the global generator
        kv = mla_paged_kv(s, b, n, page, "cpu", torch.float32)
        rows = b * n if case == "engine_prefill" else b
        cu = torch.arange(0, rows + 1, rows // b, dtype=torch.int32)
        q = rnd(rows, s.qk_head_dim)
        outs = {comp: mla_attention(attn[comp, case], s, case, q, kv, cu, rows // b) for comp in ("native", "isoexec")}
    assert outs["isoexec"].shape[-1] == s.v_head_dim and outs["isoexec"].abs().max() > 0
    torch.testing.assert_close(outs["isoexec"].detach(), outs["native"].detach(), rtol=1e-5, atol=1e-5)
