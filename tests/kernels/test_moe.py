"""Gates for the batch-invariant MoE layer (isoexec_kernels/moe/) and its stock twin (isoexec_kernels/moe/native.py).

Bits are compared through integer views (``kb``); every expected value is computed in this run,
on this machine. Tiny shapes keep the module at a few seconds.
"""

from __future__ import annotations

import pytest
import torch

from isoexec_kernels import moe
from isoexec_kernels.moe import native as moe_native

DTYPES = (torch.float32, torch.bfloat16)
DT_IDS = ("fp32", "bf16")
SIZES = (1, 2, 3, 5, 8, 16, 31, 64)

# the two router kinds at tiny sizes: (router settings, correction bias?, Qwen-style shared gate?)
KINDS = {
    "softmax_topk": (dict(kind="softmax_topk", top_k=2, norm_topk_prob=True), False, True),
    "sigmoid_group_topk": (dict(kind="sigmoid_group_topk", top_k=4, norm_topk_prob=True, n_group=4,
                                topk_group=2, routed_scaling_factor=2.5), True, False),
}


def _weights(E, H, I, Is, dtype, seed, bias=False, gated=False, shared=True):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    return moe.MoEWeights(
        router=r(E, H, scale=H ** -0.5),
        gate_up=r(E, 2 * I, H, scale=H ** -0.5).to(dtype),
        down=r(E, H, I, scale=I ** -0.5).to(dtype),
        correction_bias=r(E, scale=0.1) if bias else None,
        shared_gate_up=r(2 * Is, H, scale=H ** -0.5).to(dtype) if shared else None,
        shared_down=r(H, Is, scale=Is ** -0.5).to(dtype) if shared else None,
        shared_gate=r(1, H, scale=H ** -0.5) if (shared and gated) else None,
    ), g


def _layer(kind, dtype, seed=0):
    kw, bias, gated = KINDS[kind]
    w, g = _weights(16, 48, 24, 20, dtype, seed, bias=bias, gated=gated)
    return kw, w, g


# --------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_token_alone_equals_token_in_batch_bitwise(kb, kind, dtype):
    kw, w, g = _layer(kind, dtype, seed=1)
    H = w.router.shape[1]
    loads = set()
    for m in SIZES:
        row = torch.randn(H, generator=g).to(dtype)
        alone = moe.moe_forward(row[None], w, **kw)[0]
        batch, idx = kb.needle_batch(row, m, g)
        out = moe.moe_forward(batch, w, **kw)
        kb.assert_bitwise(out[idx], alone, f"{kind} {dtype} M={m} row {idx}")
        spec = moe.RouterSpec(**kw)
        ids = moe.route(moe.router_logits(batch, w.router), spec, w.correction_bias).ids
        loads.add(tuple(moe.dispatch(ids, w.num_experts).counts.tolist()))
        if m == 64:  # every row of the largest batch, each against itself alone
            for t in range(m):
                kb.assert_bitwise(out[t], moe.moe_forward(batch[t:t + 1], w, **kw)[0],
                                  f"{kind} {dtype} M=64 row {t}")
    # skewed loads: every token the same, so k experts get all of them and the others none
    row = torch.randn(H, generator=g).to(dtype)
    same = row[None].expand(37, H).contiguous()
    out = moe.moe_forward(same, w, **kw)
    alone = moe.moe_forward(row[None], w, **kw)[0]
    for t in (0, 17, 36):
        kb.assert_bitwise(out[t], alone, f"{kind} {dtype} all-same batch row {t}")
    ids = moe.route(moe.router_logits(same, w.router), moe.RouterSpec(**kw), w.correction_bias).ids
    counts = moe.dispatch(ids, w.num_experts).counts
    assert sorted(counts.tolist()) == [0] * (16 - kw["top_k"]) + [37] * kw["top_k"]
    assert len(loads) == len(SIZES), "expert loads were expected to differ between the batches"


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_output_does_not_depend_on_token_order_bitwise(kb, kind, dtype):
    kw, w, g = _layer(kind, dtype, seed=2)
    x = (torch.randn(48, w.router.shape[1], generator=g)
         * torch.exp(torch.randn(48, 1, generator=g))).to(dtype)
    out = moe.moe_forward(x, w, **kw)
    for s in range(3):
        perm = torch.randperm(48, generator=g)
        kb.assert_bitwise(moe.moe_forward(x[perm], w, **kw), out[perm], f"{kind} {dtype} permutation {s}")


def test_leading_dims_are_flattened_rows(kb):
    kw, w, g = _layer("sigmoid_group_topk", torch.bfloat16, seed=3)
    x = torch.randn(3, 5, w.router.shape[1], generator=g).bfloat16()
    kb.assert_bitwise(moe.moe_forward(x, w, **kw), moe.moe_forward(x.reshape(15, -1), w, **kw).reshape(x.shape),
                      "[3, 5, H] vs [15, H]")


# --------------------------------------------------------------------------- routing


def _tied_router(c, H, g):
    """Router rows c_j * u: experts with equal c_j have identical rows, hence identical logits."""
    u = torch.rand(H, generator=g) + 0.5
    return torch.tensor(c, dtype=torch.float32)[:, None] * u[None, :], u


def _tokens_along(u, n, g):
    return (torch.rand(n, 1, generator=g) + 0.5) * u[None, :]  # positive multiples: x.u > 0


def test_softmax_router_ties_break_to_the_lower_expert_index():
    g = torch.Generator().manual_seed(4)
    H = 24
    cases = [  # (c, top_k, expected ids)
        ([0, 2, 3, 2, 3, 1, 3, 2], 2, [2, 4]),
        ([0, 2, 3, 2, 3, 1, 3, 2], 4, [1, 2, 4, 6]),
        ([1] * 8, 3, [0, 1, 2]),
        ([0, 0, 0, 0, 0, 0, 0, 1], 3, [0, 1, 7]),
    ]
    for c, k, want in cases:
        w_router, u = _tied_router(c, H, g)
        x = _tokens_along(u, 5, g)
        z = moe.router_logits(x, w_router)
        tied = [j for j in range(8) if c[j] == c[want[-1]]]
        assert all(torch.equal(z[:, tied[0]], z[:, j]) for j in tied), "the tie did not occur"
        r = moe.route(z, moe.RouterSpec("softmax_topk", top_k=k, norm_topk_prob=True))
        assert r.ids.tolist() == [want] * 5, (c, k)
        assert torch.allclose(r.weights.sum(1), torch.ones(5))


def test_stock_topk_tie_order_is_not_the_lower_index_here():
    """Why route() sorts stably instead of calling torch.topk: on a tie, torch.topk's choice is not
    specified and changes with the number of experts. Skips where it happens to pick the lower index."""
    picks = {n: torch.topk(torch.zeros(3, n), 4).indices[0].sort().values.tolist() for n in (8, 64, 128, 256)}
    spec = moe.RouterSpec("softmax_topk", top_k=4)
    for n in picks:
        assert moe.route(torch.zeros(3, n), spec).ids.tolist() == [[0, 1, 2, 3]] * 3
    if all(p == [0, 1, 2, 3] for p in picks.values()):
        pytest.skip("torch.topk picked the lowest indices on ties here")


@pytest.mark.parametrize("n_group,topk_group,top_k,c,want", [
    # groups of 2: g0 {1,3} and g2 {1,3} tie for the best group score; g0 is kept
    (4, 1, 1, [1, 3, 3, 0, 1, 3, 3, 0], [1]),
    (4, 1, 2, [1, 3, 3, 0, 1, 3, 3, 0], [0, 1]),
    # two groups kept: g0 and g2; inside them experts 1 and 5 tie, then 0 and 4 tie
    (4, 2, 3, [1, 3, 3, 0, 1, 3, 3, 0], [0, 1, 5]),
    # groups of 4: g0 == g1; inside g0 experts 0 and 2 tie
    (2, 1, 1, [3, 1, 3, 0, 3, 1, 3, 0], [0]),
    (2, 2, 3, [3, 1, 3, 0, 3, 1, 3, 0], [0, 2, 4]),
    # one group: plain top-k with ties
    (1, 1, 2, [2, 2, 2, 2, 2, 2, 2, 2], [0, 1]),
])
def test_sigmoid_group_router_ties_break_to_the_lower_group_and_expert_index(n_group, topk_group, top_k, c,
                                                                             want):
    g = torch.Generator().manual_seed(5)
    w_router, u = _tied_router([v * 0.3 for v in c], 16, g)
    x = _tokens_along(u, 4, g)
    z = moe.router_logits(x, w_router)
    bias = torch.full((8,), 0.05)  # equal bias keeps the ties
    spec = moe.RouterSpec("sigmoid_group_topk", top_k=top_k, norm_topk_prob=True, n_group=n_group,
                          topk_group=topk_group, routed_scaling_factor=1.5)
    r = moe.route(z, spec, bias)
    assert r.ids.tolist() == [want] * 4
    s = torch.sigmoid(z.double()).gather(1, r.ids)
    assert torch.allclose(r.weights.double(), 1.5 * s / s.sum(1, keepdim=True), rtol=1e-6)


def test_correction_bias_selects_but_does_not_weight():
    g = torch.Generator().manual_seed(6)
    z = torch.randn(6, 8, generator=g)
    bias = torch.zeros(8)
    bias[7] = 100.0  # expert 7 always chosen, weighted by its unbiased score
    spec = moe.RouterSpec("sigmoid_group_topk", top_k=2, norm_topk_prob=False, n_group=1, topk_group=1,
                          routed_scaling_factor=2.0)
    r = moe.route(z, spec, bias)
    assert (r.ids[:, 1] == 7).all()
    s = torch.sigmoid(z.double())
    assert torch.allclose(r.weights[:, 1].double(), 2.0 * s[:, 7], rtol=1e-6)


def test_dispatch_is_expert_major_token_ascending():
    ids = torch.tensor([[1, 3], [0, 3], [1, 2], [3, 4], [0, 1]])
    d = moe.dispatch(ids, 6)
    assert d.offsets.tolist() == [0, 2, 5, 6, 9, 10, 10]  # expert 5 owns no rows
    expert_of_row = torch.repeat_interleave(torch.arange(6), d.counts)
    assert expert_of_row.tolist() == [0, 0, 1, 1, 1, 2, 3, 3, 3, 4]
    assert d.token.tolist() == [1, 4, 0, 2, 4, 2, 0, 1, 3, 3]
    for t in range(5):
        for j in range(2):
            row = int(d.row_of_pair[t * 2 + j])
            assert int(d.token[row]) == t and int(expert_of_row[row]) == int(ids[t, j])


# --------------------------------------------------------------------------- correctness


def _float64_moe(x, w, kw):
    """Float64 recomputation, one token at a time, straight from the definitions."""
    xd = x.double()
    z = xd @ w.router.double().T
    E = z.shape[1]
    k = kw["top_k"]
    out = []
    for t in range(x.shape[0]):
        if kw["kind"] == "softmax_topk":
            p = torch.softmax(z[t], -1)
            ids = sorted(sorted(range(E), key=lambda j: (-float(p[j]), j))[:k])
            wt = p[ids]
            if kw["norm_topk_prob"]:
                wt = wt / wt.sum()
        else:
            s = torch.sigmoid(z[t])
            b = s + (w.correction_bias.double() if w.correction_bias is not None else 0.0)
            size = E // kw["n_group"]
            gs = [sum(sorted(b[q * size:(q + 1) * size].tolist(), reverse=True)[:2]) for q in range(kw["n_group"])]
            kept = sorted(range(kw["n_group"]), key=lambda q: (-gs[q], q))[:kw["topk_group"]]
            cand = [j for j in range(E) if j // size in kept]
            ids = sorted(sorted(cand, key=lambda j: (-float(b[j]), j))[:k])
            wt = s[ids]
            if kw["norm_topk_prob"]:
                wt = wt / (wt.sum() + 1e-20)
            wt = wt * kw["routed_scaling_factor"]
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for wj, e in zip(wt, ids):
            h = w.gate_up[e].double() @ xd[t]
            i = h.shape[0] // 2
            acc += wj * (w.down[e].double() @ (torch.nn.functional.silu(h[:i]) * h[i:]))
        if w.shared_gate_up is not None:
            h = w.shared_gate_up.double() @ xd[t]
            i = h.shape[0] // 2
            ys = w.shared_down.double() @ (torch.nn.functional.silu(h[:i]) * h[i:])
            if w.shared_gate is not None:
                ys = torch.sigmoid(w.shared_gate.double() @ xd[t]) * ys
            acc += ys
        out.append((acc, ids))
    return torch.stack([o[0] for o in out]), [o[1] for o in out]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_moe_matches_float64(kb, kind, dtype):
    kw, w, g = _layer(kind, dtype, seed=7)
    x = torch.randn(40, w.router.shape[1], generator=g).to(dtype)
    out = moe.moe_forward(x, w, **kw)
    want, ids = _float64_moe(x, w, kw)
    got_ids = moe.route(moe.router_logits(x, w.router), moe.RouterSpec(**kw), w.correction_bias).ids
    assert got_ids.tolist() == ids, "expert choice differs from the float64 recomputation"
    assert out.dtype == dtype
    assert kb.rel_l2(out, want) < kb.TOL[dtype]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dispatcher_and_building_blocks_are_the_reference(kb, kind):
    kw, w, g = _layer(kind, torch.bfloat16, seed=8)
    x = torch.randn(21, w.router.shape[1], generator=g).bfloat16()
    ref = moe.moe_forward_reference(x, w, **kw)
    kb.assert_bitwise(moe.moe_forward(x, w, **kw), ref, "dispatcher vs reference")
    r = moe.route(moe.router_logits(x, w.router), moe.RouterSpec(**kw), w.correction_bias)
    d = moe.dispatch(r.ids, w.num_experts)
    rows = moe.experts_forward(x, d, w.gate_up, w.down)
    ys, gate = moe.shared_expert_forward(x, w.shared_gate_up, w.shared_down, w.shared_gate)
    kb.assert_bitwise(moe.combine(rows, d, r, ys, gate), ref, "building blocks vs moe_forward")


def _copy(dst, src):
    with torch.no_grad():
        dst.copy_(src)


# transformers' expert paths: "grouped_mm" (what it gives a model, and the native composition's
# regions) and "eager" (what a bare block gets); the stock twin reproduces each bit for bit
EXPERTS_IMPLS = ("grouped_mm", "eager")


@pytest.mark.parametrize("impl", EXPERTS_IMPLS)
def test_matches_transformers_qwen3_moe_block(kb, impl):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    for norm in (True, False):
        cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                             norm_topk_prob=norm, hidden_act="silu")
        cfg._experts_implementation = impl
        block = Qwen3MoeSparseMoeBlock(cfg).eval()
        w, g = _weights(8, 32, 16, 1, torch.float32, seed=9 + norm, shared=False)
        _copy(block.gate.weight, w.router)
        _copy(block.experts.gate_up_proj, w.gate_up)
        _copy(block.experts.down_proj, w.down)
        x = torch.randn(2, 13, 32, generator=g)
        with torch.no_grad():
            want = block(x)
        out = moe.moe_forward(x, w, kind="softmax_topk", top_k=2, norm_topk_prob=norm)
        assert kb.rel_l2(out, want) < kb.TOL[torch.float32], f"norm_topk_prob={norm}"
        kb.assert_bitwise(moe_native.moe_forward_native(x, w, kind="softmax_topk", top_k=2, norm_topk_prob=norm,
                                                        experts_implementation=impl),
                          want, f"stock twin vs transformers {impl}, norm_topk_prob={norm}")


@pytest.mark.parametrize("impl", EXPERTS_IMPLS)
def test_matches_transformers_qwen3_5_moe_block_with_gated_shared_expert(kb, impl):
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    cfg = Qwen3_5MoeTextConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                               shared_expert_intermediate_size=24, hidden_act="silu")
    cfg._experts_implementation = impl
    block = Qwen3_5MoeSparseMoeBlock(cfg).eval()
    w, g = _weights(8, 32, 16, 24, torch.float32, seed=11, gated=True)
    _copy(block.gate.weight, w.router)
    _copy(block.experts.gate_up_proj, w.gate_up)
    _copy(block.experts.down_proj, w.down)
    _copy(block.shared_expert.gate_proj.weight, w.shared_gate_up[:24])
    _copy(block.shared_expert.up_proj.weight, w.shared_gate_up[24:])
    _copy(block.shared_expert.down_proj.weight, w.shared_down)
    _copy(block.shared_expert_gate.weight, w.shared_gate)
    x = torch.randn(3, 11, 32, generator=g)
    with torch.no_grad():
        want = block(x)
    out = moe.moe_forward(x, w, kind="softmax_topk", top_k=2, norm_topk_prob=True)
    assert kb.rel_l2(out, want) < kb.TOL[torch.float32]
    kb.assert_bitwise(moe_native.moe_forward_native(x, w, kind="softmax_topk", top_k=2, norm_topk_prob=True,
                                                    experts_implementation=impl),
                      want, f"stock twin vs transformers {impl}")


@pytest.mark.parametrize("impl", EXPERTS_IMPLS)
def test_matches_transformers_deepseek_v3_moe(kb, impl):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    kw = dict(kind="sigmoid_group_topk", top_k=4, norm_topk_prob=True, n_group=4, topk_group=2,
              routed_scaling_factor=2.5)
    cfg = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
                           n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5,
                           norm_topk_prob=True, hidden_act="silu")
    cfg._experts_implementation = impl
    block = DeepseekV3MoE(cfg).eval()
    w, g = _weights(16, 32, 16, 32, torch.float32, seed=12, bias=True)  # 2 shared experts: Is = 2 * 16
    _copy(block.gate.weight, w.router)
    _copy(block.gate.e_score_correction_bias, w.correction_bias)
    _copy(block.experts.gate_up_proj, w.gate_up)
    _copy(block.experts.down_proj, w.down)
    _copy(block.shared_experts.gate_proj.weight, w.shared_gate_up[:32])
    _copy(block.shared_experts.up_proj.weight, w.shared_gate_up[32:])
    _copy(block.shared_experts.down_proj.weight, w.shared_down)
    x = torch.randn(2, 17, 32, generator=g)
    with torch.no_grad():
        want = block(x)
        _, _, hf_ids = block.gate(x)
    ids = moe.route(moe.router_logits(x.reshape(-1, 32), w.router), moe.RouterSpec(**kw), w.correction_bias).ids
    assert ids.tolist() == hf_ids.sort(-1).values.tolist()
    out = moe.moe_forward(x, w, **kw)
    assert kb.rel_l2(out, want) < kb.TOL[torch.float32]
    kb.assert_bitwise(moe_native.moe_forward_native(x, w, **kw, experts_implementation=impl), want,
                      f"stock twin vs transformers {impl}")


# --------------------------------------------------------------------------- negative control


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_stock_twin_is_not_batch_invariant_on_this_cpu(kb, kind, dtype):
    """The negative control: the same needle test on the stock twin must find differing bits.
    Skips (with the count) where the stock path happens to be invariant on this CPU."""
    kw, w, g = _layer(kind, dtype, seed=13)
    H = w.router.shape[1]
    differing = elements = 0
    for m in SIZES:
        row = torch.randn(H, generator=g).to(dtype)
        alone = moe_native.moe_forward_native(row[None], w, **kw)[0]
        batch, idx = kb.needle_batch(row, m, g)
        rep = kb.bit_report(moe_native.moe_forward_native(batch, w, **kw)[idx], alone)
        differing += rep["differing"]
        elements += rep["elements"]
        ours = moe.moe_forward(batch, w, **kw)[idx]
        kb.assert_bitwise(ours, moe.moe_forward(row[None], w, **kw)[0], f"ours, M={m}")
    if differing == 0:
        pytest.skip(f"stock MoE was batch invariant here for {kind} {dtype} (0 of {elements} elements differ)")
