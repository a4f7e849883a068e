"""The MoE router and combine Triton launches (isoexec_kernels/moe/router_triton.py,
combine_triton.py): the combine gives the torch reference's bits; the router picks the
reference's experts (ties to the lower index, group limits), its weights match the reference at
fp32 tolerance, a row's ids and weights do not depend on the batch, and both backwards match the
reference's gradients. Interpreter cases run in the TRITON_INTERPRET=1 subprocess of conftest."""

from __future__ import annotations

import pytest
import torch

from isoexec_kernels import moe
from isoexec_kernels.moe import reference as ref
from isoexec_kernels.moe.combine_triton import combine_triton
from isoexec_kernels.moe.router_triton import route_triton, route_triton_supported

SPECS = {
    "softmax": moe.RouterSpec(kind="softmax_topk", top_k=4, norm_topk_prob=True),
    "softmax_raw": moe.RouterSpec(kind="softmax_topk", top_k=3, norm_topk_prob=False),
    "sigmoid_groups": moe.RouterSpec(kind="sigmoid_group_topk", top_k=4, norm_topk_prob=True, n_group=4,
                                     topk_group=2, routed_scaling_factor=2.5),
    "sigmoid_one_group": moe.RouterSpec(kind="sigmoid_group_topk", top_k=3, norm_topk_prob=True,
                                        routed_scaling_factor=1.8),
}


def _logits(name, T, E, g):
    z = torch.randn(T, E, generator=g) * 2
    bias = (torch.randn(E, generator=g) * 0.1) if name.startswith("sigmoid") else None
    return z, bias


def _dispatch_case(T, E, k, H, dtype, g, shared=True, gated=True):
    ids = torch.stack([torch.randperm(E, generator=g)[:k].sort().values for _ in range(T)])
    disp = ref.dispatch(ids, E)
    rows = torch.randn(T * k, H, generator=g).to(dtype)
    w = torch.rand(T, k, generator=g)
    sh = torch.randn(T, H, generator=g).to(dtype) if shared else None
    gate = torch.rand(T, 1, generator=g) if (shared and gated) else None
    return rows, disp, moe.Routing(ids=ids, weights=w, shared_gate=gate), sh


# --------------------------------------------------------------------------- interpreter


def interp_case_combine_triton_equals_the_reference_bitwise(kb):
    # bf16 rows are read and widened here, but the output stays fp32: the interpreter's cast to
    # bf16 is not round-to-nearest-even (the GPU test below checks a bf16 output)
    g = torch.Generator().manual_seed(81)
    for dtype in (torch.float32, torch.bfloat16):
        for shared, gated in ((True, True), (True, False), (False, False)):
            rows, disp, routing, sh = _dispatch_case(7, 6, 3, 1100, dtype, g, shared, gated)
            want = ref.combine(rows, disp, routing, sh, routing.shared_gate, torch.float32)
            got = combine_triton(rows, disp, routing, sh, routing.shared_gate, torch.float32)
            kb.assert_bitwise(got, want, f"combine {dtype} rows, shared={shared} gated={gated}")


def interp_case_router_picks_the_reference_experts_and_rows_do_not_see_the_batch(kb):
    g = torch.Generator().manual_seed(82)
    for name, spec in SPECS.items():
        E = 16
        z, bias = _logits(name, 40, E, g)
        ids, w, _ = route_triton(z, spec, bias)
        want = ref.route(z, spec, bias)
        assert torch.equal(ids, want.ids), name
        torch.testing.assert_close(w, want.weights, rtol=2e-6, atol=1e-7)
        for i in (0, 17, 39):
            one_ids, one_w, _ = route_triton(z[i:i + 1].clone(), spec, bias)
            assert torch.equal(one_ids[0], ids[i]), (name, i)
            kb.assert_bitwise(one_w[0], w[i], f"{name} row {i} alone vs in a batch of 40")


def interp_case_router_ties_go_to_the_lower_index_and_groups_are_limited(kb):
    spec = SPECS["softmax"]
    z = torch.zeros(2, 16)
    z[1, [3, 9, 12]] = 1.0        # three tied winners, then ties among the zeros
    ids, w, _ = route_triton(z, spec)
    assert ids.tolist() == [[0, 1, 2, 3], [0, 3, 9, 12]]
    gspec = SPECS["sigmoid_groups"]   # 4 groups of 4, the 2 best groups kept, top 4
    z = torch.full((1, 16), -3.0)
    z[0, [0, 1]] = 5.0                # group 0 scores 1.99
    z[0, 4], z[0, 5] = 3.0, 0.0       # group 1 scores 0.95 + 0.5
    z[0, 12] = 2.5                    # group 3 scores 0.92 + 0.05: dropped, though expert 12 beats 5
    ids, _, _ = route_triton(z, gspec, torch.zeros(16))
    want = ref.route(z, gspec, torch.zeros(16))
    assert torch.equal(ids, want.ids), (ids, want.ids)
    assert ids.tolist() == [[0, 1, 4, 5]], ids


def interp_case_router_shared_gate_and_gradients_match_the_reference(kb):
    g = torch.Generator().manual_seed(83)
    for name in ("softmax", "sigmoid_groups"):
        spec = SPECS[name]
        z, bias = _logits(name, 9, 16, g)
        gl = torch.randn(9, 1, generator=g)
        dz = torch.randn(9, spec.top_k, generator=g)
        dg = torch.randn(9, 1, generator=g)
        z1, gl1 = z.clone().requires_grad_(), gl.clone().requires_grad_()
        ids, w, gate = route_triton(z1, spec, bias, gl1)
        ((w * dz).sum() + (gate * dg).sum()).backward()
        z2, gl2 = z.clone().double().requires_grad_(), gl.clone().double().requires_grad_()
        if spec.kind == "softmax_topk":
            w2 = torch.softmax(z2, -1).gather(1, ids)
            w2 = w2 / w2.sum(-1, keepdim=True)
        else:
            w2 = torch.sigmoid(z2).gather(1, ids)
            w2 = w2 / (w2.sum(-1, keepdim=True) + 1e-20) * spec.routed_scaling_factor
        ((w2 * dz.double()).sum() + (torch.sigmoid(gl2) * dg.double()).sum()).backward()
        assert kb.rel_l2(z1.grad, z2.grad) < 1e-5, name
        assert kb.rel_l2(gl1.grad, gl2.grad) < 1e-5, name
        torch.testing.assert_close(gate, torch.sigmoid(gl), rtol=1e-6, atol=1e-7)


def interp_case_combine_backward_matches_the_reference(kb):
    # the row and shared-expert gradients are one product and one rounding: the reference's bits;
    # the weight and gate gradients are sums over H in the kernel's own fixed order: float64
    # tolerance, and the same bits on a second call
    g = torch.Generator().manual_seed(84)
    for dtype, shared, gated in ((torch.float32, True, True), (torch.float16, True, False),
                                 (torch.float32, False, False)):
        rows, disp, routing, sh = _dispatch_case(5, 6, 2, 1100, dtype, g, shared, gated)
        grad = torch.randn(5, 1100, generator=g)
        ins = (rows, routing.weights, sh, routing.shared_gate)

        def grads(fn):
            leaves = [None if t is None else t.clone().requires_grad_() for t in ins]
            out = fn(leaves[0], disp, moe.Routing(routing.ids, leaves[1], leaves[3]), leaves[2], leaves[3],
                     torch.float32)
            (out * grad).sum().backward()
            return [None if t is None else t.grad for t in leaves]

        got, again, want = grads(combine_triton), grads(combine_triton), grads(ref.combine)
        for i, name in enumerate(("rows", "weights", "shared", "gate")):
            if want[i] is None or (name == "gate" and not shared):
                continue
            assert got[i] is not None and got[i].dtype == want[i].dtype, name
            kb.assert_bitwise(again[i], got[i], f"{name} gradient, second call")
            if name in ("rows", "shared"):
                kb.assert_bitwise(got[i], want[i], f"{name} gradient {dtype}")
            else:
                assert kb.rel_l2(got[i], want[i]) < 1e-5, (name, dtype)


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_moe_router_and_combine_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_moe_router_combine_triton", case)


# --------------------------------------------------------------------------- CPU


def test_group_layouts_the_router_kernel_takes():
    assert route_triton_supported(SPECS["sigmoid_groups"], 16)
    assert route_triton_supported(moe.RouterSpec(kind="sigmoid_group_topk", top_k=8, n_group=8, topk_group=4), 256)
    assert not route_triton_supported(moe.RouterSpec(kind="sigmoid_group_topk", top_k=2, n_group=3), 12)
    with pytest.raises(ValueError, match="powers of two"):
        route_triton(torch.zeros(1, 12), moe.RouterSpec(kind="sigmoid_group_topk", top_k=2, n_group=3))
    with pytest.raises(ValueError, match="fp32"):
        route_triton(torch.zeros(1, 16, dtype=torch.float64), SPECS["softmax"])


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SPECS))
def test_router_cuda_row_alone_equals_row_in_batch_bitwise(kb, name):
    g = torch.Generator().manual_seed(85)
    spec = SPECS[name]
    for E in (16, 64, 256):
        if spec.kind != "softmax_topk" and E // spec.n_group < 2:
            continue
        z, bias = _logits(name, 4096, E, g)
        z, bias = z.cuda(), (bias.cuda() if bias is not None else None)
        ids, w, _ = route_triton(z, spec, bias)
        want = ref.route(z.cpu(), spec, bias.cpu() if bias is not None else None)
        assert (ids.cpu() == want.ids).all(dim=1).float().mean() > 0.999
        for m in (1, 7, 64, 1000):
            i2, w2, _ = route_triton(z[:m].clone(), spec, bias)
            assert torch.equal(i2, ids[:m])
            kb.assert_bitwise(w2, w[:m], f"{name} E={E} M={m}")


@pytest.mark.gpu
def test_combine_cuda_equals_the_reference_bitwise(kb):
    g = torch.Generator().manual_seed(86)
    for shared, gated in ((True, True), (True, False), (False, False)):
        rows, disp, routing, sh = _dispatch_case(300, 64, 4, 2048, torch.bfloat16, g, shared, gated)
        cu = lambda t: None if t is None else t.cuda()  # noqa: E731
        disp = moe.Dispatch(token=disp.token.cuda(), offsets=disp.offsets.cuda(), row_of_pair=disp.row_of_pair.cuda(),
                            num_tokens=disp.num_tokens, top_k=disp.top_k)
        routing = moe.Routing(ids=routing.ids.cuda(), weights=routing.weights.cuda(), shared_gate=cu(routing.shared_gate))
        want = ref.combine(rows.cuda(), disp, routing, cu(sh), routing.shared_gate, torch.bfloat16)
        got = combine_triton(rows.cuda(), disp, routing, cu(sh), routing.shared_gate, torch.bfloat16)
        kb.assert_bitwise(got, want, f"cuda combine shared={shared} gated={gated}")
