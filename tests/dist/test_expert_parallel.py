"""Expert parallelism keeps the bits of one process: one MoE layer of each MoE family (mla_moe: GLM
style sigmoid scores, correction bias, group-limited top-k, ungated shared expert; hybrid_moe:
Qwen3.5-MoE style softmax top-k, renormalised, sigmoid-gated shared expert) at EP = 1, 2 and 4 on
gloo (CPU), fp32 and bf16, against the model's own ``moe_layer`` under its installed ``isoexec``
plan, computed here. One world of 4 processes runs every case in groups of 1, 2 and 4 ranks
(ep_workers.py); EP = 1 also runs here without any process group. Bits compared through integer
views. The layer's backward under EP is checked against the one-process layer's gradients (within
rounding) and run to run (bitwise). The MoE model classes under EP: test_ep_model.py."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import dist_workers as dw  # noqa: E402
import ep_workers as ew  # noqa: E402
from isoexec.assembly import installed_model  # noqa: E402
from isoexec.dist.partition import expert_shard_range  # noqa: E402
from isoexec.model.mla_moe import moe_layer  # noqa: E402
from isoexec_kernels.moe import RouterSpec  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
T = 13          # tokens of a case's batch; ranks hold contiguous slices (uneven at EP = 2 and 4)
FAMILIES = {"glm": ("mla_moe", "mla_moe_tiny", 1), "qwen": ("hybrid_moe", "hybrid_moe_tiny", 0)}  # MoE layer index
VARIANTS = ("model", "top4", "uneven")


def _layer_weights(model, layer: int) -> dict:
    L = model.layers[layer]
    w = {"router": L.router_weight, "gate_up": L.experts_gate_up, "down": L.experts_down}
    for ours, theirs in (("correction_bias", "correction_bias"), ("shared_gate_up", "shared_gate_up"),
                         ("shared_down", "shared_down"), ("shared_gate", "shared_gate")):
        if hasattr(L, theirs):
            w[ours] = getattr(L, theirs)
    return {k: v.detach().clone() for k, v in w.items()}


def _case(family: str, spec: RouterSpec, w32: dict, variant: str, dt: str, seed: int) -> dict:
    """The weights in ``dt`` (the correction bias stays fp32, as the model keeps it) and T input
    rows. ``uneven``: routing pushed onto experts 0-2 (GLM: the correction bias; Qwen: inputs
    along one direction the router rows 0-3 share and 4-7 oppose), and the last rank holds no
    tokens."""
    g = torch.Generator().manual_seed(seed)
    w = {k: (v if k == "correction_bias" else v.to(DTYPES[dt])) for k, v in w32.items()}
    H = w32["router"].shape[1]
    x = torch.randn((T, H), generator=g)
    if variant == "top4":
        spec = RouterSpec(spec.kind, 4, spec.norm_topk_prob, spec.n_group, spec.n_group, spec.routed_scaling_factor)
    if variant == "uneven":
        if family == "glm":
            w["correction_bias"] = torch.tensor([2.0, 2.0, 2.0, 0.0, -2.0, -2.0, -2.0, -2.0])
        else:
            d = torch.randn(H, generator=g)
            d = d / d.norm()
            r = w32["router"].clone()
            r[:3] += 0.5 * d
            r[3:] -= 0.5 * d
            r[3] -= 0.5 * d   # expert 3 opposed too: it gets no tokens either
            w["router"] = r.to(DTYPES[dt])
            x = x * 0.2 + 4.0 * d
    return {"weights": w, "spec": spec, "x": x.to(DTYPES[dt]), "empty_last": variant == "uneven",
            "control": variant != "uneven"}


def _single_process(plan, case) -> torch.Tensor:
    """The model's MoE layer (``moe_layer``) under its installed plan, one process, whole batch."""
    w = case["weights"]
    L = SimpleNamespace(router_weight=w["router"], experts_gate_up=w["gate_up"], experts_down=w["down"],
                        **{k: w[k] for k in ("correction_bias", "shared_gate_up", "shared_down", "shared_gate")
                           if w.get(k) is not None})
    shared = w["shared_down"].shape[1] if w.get("shared_down") is not None else 0
    return moe_layer(plan, L, case["x"], case["spec"], w["router"].shape[0], shared)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Cases, the single-process outputs, the single-process EP = 1 outputs (no process group) and
    {ep: {group: [results of its ranks, in group-rank order]}} from one world of 4."""
    t0 = time.monotonic()
    root = tmp_path_factory.mktemp("ep")
    cases, plans = {}, {}
    for fam, (family, model_name, layer) in FAMILIES.items():
        m = installed_model(family, "isoexec", "cpu", model_name, seed=3).model
        plans[fam] = m._plan("trainer_score")
        w32 = _layer_weights(m, layer)
        for i, (variant, dt) in enumerate((v, d) for v in VARIANTS for d in DTYPES):
            cases[f"{fam}/{variant}/{dt}"] = _case(fam, m.router_spec, w32, variant, dt, seed=50 + i)
            cases[f"{fam}/{variant}/{dt}"]["family"] = fam
    # three experts: dealt 1 + 2 at EP = 2, refused at EP = 4 (a rank would own none)
    q = _layer_weights(installed_model("hybrid_moe", "isoexec", "cpu", "hybrid_moe_tiny", seed=3).model, 0)
    w3 = {k: (v[:3] if k in ("router", "gate_up", "down") else v) for k, v in q.items()}
    cases["qwen/e3/fp32"] = {"weights": w3, "spec": RouterSpec("softmax_topk", 2), "family": "qwen",
                             "x": torch.randn((T, w3["router"].shape[1]), generator=torch.Generator().manual_seed(7)),
                             "empty_last": False, "control": False, "refuse_above": 3}
    torch.save({"cases": cases}, root / "cases.pt")
    want = {name: _single_process(plans[c["family"]], c) for name, c in cases.items()}
    with torch.no_grad():   # EP = 1 without torch.distributed: group None, no default group
        alone = {name: ew.ep_layer(c["x"], c["weights"], c["spec"], None, 1, 0) for name, c in cases.items()}
    times = {"models and single process": round(time.monotonic() - t0, 1)}
    t1 = time.monotonic()
    ranks = ew.run_world(root)
    times["world of 4, every case at EP = 1, 2, 4"] = round(time.monotonic() - t1, 1)
    errors = [r["__error__"] for r in ranks if "__error__" in r]
    assert not errors, f"a rank failed:\n{errors[0]}"
    worlds = {ep: {tuple(m): [ranks[r][ep] for r in m] for m in groups} for ep, groups in ew.ep_groups().items()}
    print(f"\nexpert parallel, seconds: {times}")
    return SimpleNamespace(cases=cases, want=want, alone=alone, worlds=worlds, plans=plans)


def _gathered(ranks, name) -> torch.Tensor:
    """The ranks' token outputs in rank order: the whole batch (ranks hold contiguous slices)."""
    ends = [res[name]["tokens"] for res in ranks]
    assert ends[0][0] == 0 and ends[-1][1] == T and all(a[1] == b[0] for a, b in zip(ends, ends[1:])), ends
    return torch.cat([res[name]["out"] for res in ranks])


NAMES = [f"{f}/{v}/{d}" for f in FAMILIES for v in VARIANTS for d in DTYPES]


@pytest.mark.parametrize("name", NAMES + ["qwen/e3/fp32"])
def test_ep1_ep2_ep4_equal_the_single_process_layer_bitwise(run, name):
    want = run.want[name]
    reports = {"EP=1 without a process group vs one process": dw.bit_report(run.alone[name], want)}
    ep1 = _gathered(run.worlds[1][(0,)], name)
    for ep, groups in run.worlds.items():
        if ep > run.cases[name].get("refuse_above", ep):
            continue
        for members, ranks in groups.items():
            got = _gathered(ranks, name)
            reports[f"EP={ep} group {members} vs one process"] = dw.bit_report(got, want)
            reports[f"EP={ep} group {members} vs EP=1"] = dw.bit_report(got, ep1)
    bad = {k: r for k, r in reports.items() if r["differing"]}
    assert not bad, f"{name}: differing elements {bad}"
    assert len(reports) == 1 + 2 * (4 + 2 + (0 if name == "qwen/e3/fp32" else 1))


def test_the_plan_binds_the_regions_the_workers_call(run):
    """The workers call the invariant regions directly; the installed plan binds those impls."""
    want = {"router": "moe_router_fp32", "dispatch": "moe_dispatch_stable", "experts": "moe_experts_loop",
            "combine": "moe_combine_fp32"}
    for fam, plan in run.plans.items():
        assert {op: plan[op].record.impl_id for op in want} == want, fam


@pytest.mark.parametrize("fam", FAMILIES)
def test_uneven_routing_leaves_experts_and_ranks_without_rows(run, fam):
    """The ``uneven`` cases do what they claim: experts 3-7 get no token (so at EP = 2 rank 1
    receives no rows, at EP = 4 ranks 2 and 3 none), and the last rank holds no tokens."""
    for dt in DTYPES:
        c = run.cases[f"{fam}/uneven/{dt}"]
        w = c["weights"]
        r = run.plans[fam]["router"](c["x"], w["router"], c["spec"], w.get("correction_bias"), w.get("shared_gate"))
        used = set(r.ids.flatten().tolist())
        assert used and used <= {0, 1, 2}, (fam, dt, used)
        for ws in (2, 4):
            idle = [q for q in range(ws) if not used & set(range(*expert_shard_range(8, ws, q)))]
            assert idle == ([1] if ws == 2 else [2, 3]), (fam, dt, ws, idle)
            for ranks in run.worlds[ws].values():
                t0, t1 = ranks[-1][f"{fam}/uneven/{dt}"]["tokens"]
                assert t0 == t1 == T


def test_negative_control_summing_rank_partials(run):
    """A stock combine (each rank's experts summed first, the ranks' partials by all_reduce) on
    the same routing and expert rows. Top-2: a token's two terms in either grouping are one
    add, so it cannot differ (asserted: 0). Top-4: the grouping (a + b) + (c + d) by owner rank
    shows in fp32 at EP = 2 and 4 (asserted: some elements differ); bf16 is recorded only."""
    counts = {}
    for name in NAMES:
        if not run.cases[name]["control"]:
            continue
        for ep in (2, 4):
            got = run.worlds[ep][tuple(range(ep))][0][name]["stock_all_reduce"]
            counts[f"{name} EP={ep}"] = dw.bit_report(got, run.want[name])["differing"]
            for ranks in run.worlds[ep].values():   # the same on every rank of every group
                for res in ranks:
                    assert dw.bit_report(res[name]["stock_all_reduce"], got)["differing"] == 0
        # the control is the single process's arithmetic at EP = 1 (one rank, nothing to group)
        assert dw.bit_report(run.worlds[1][(0,)][0][name]["stock_all_reduce"], run.want[name])["differing"] == 0, name
    print(f"\nnegative control, differing of {T * 64} elements per case: {counts}")
    for key, n in counts.items():
        if "/model/" in key:
            assert n == 0, (key, n)
        elif "/top4/fp32" in key:
            assert n > 0, (key, n)


def test_refusals_on_every_rank_before_any_collective(run):
    """EP = 4 with three experts: every rank raises the one ValueError naming the sizes (and the
    world went on to the next case, so no rank waited in a collective)."""
    for res in run.worlds[4][(0, 1, 2, 3)]:
        msg = res["qwen/e3/fp32"]["refusal"]
        assert msg.startswith("ValueError: expert parallelism: 3 expert(s) cannot be dealt to ep=4"), msg


@pytest.mark.parametrize("name", ew.GRAD_CASES)
def test_layer_backward_is_deterministic_and_equals_one_process_within_rounding(run, name):
    """The layer's backward under EP (rows' gradients back by the reverse all_to_all, expert
    weight gradients on their owners): the same bits twice on every rank, and within 1e-5 relative
    L2 of the one-process layer's gradients (x's rows and the expert slices concatenated in rank
    order, the replicated weights' gradients added over the ranks), top-4 GLM and the skewed Qwen
    case (idle owners, a rank without tokens)."""
    case = run.cases[name]
    w = {k: v.detach().clone().requires_grad_(k != "correction_bias") for k, v in case["weights"].items()}
    x = case["x"].detach().clone().requires_grad_()
    L = SimpleNamespace(router_weight=w["router"], experts_gate_up=w["gate_up"], experts_down=w["down"],
                        **{k: w[k] for k in ("correction_bias", "shared_gate_up", "shared_down", "shared_gate")
                           if w.get(k) is not None})
    shared = w["shared_down"].shape[1] if w.get("shared_down") is not None else 0
    out = moe_layer(run.plans[case["family"]], L, x, case["spec"], w["router"].shape[0], shared)
    out.backward(ew.upstream(x.shape, out.dtype))
    want = {"x": x.grad, **{k: v.grad for k, v in w.items() if k != "correction_bias"}}
    worst = {}
    for ep, groups in run.worlds.items():
        for members, ranks in groups.items():
            got = [res[f"grad/{name}"] for res in ranks]
            assert all(g["deterministic"] for g in got), (name, ep, members)
            for k, ref in want.items():
                parts = [g["grads"][k] for g in got]
                total = torch.cat(parts) if k in ("x", "gate_up", "down") else torch.stack(parts).sum(0)
                err = float((total.double() - ref.double()).norm() / ref.double().norm())
                worst[k] = max(worst.get(k, 0.0), err)
    print(f"\n{name}: largest relative L2 gradient error over EP = 1, 2, 4: {worst}")
    assert all(e <= 1e-5 for e in worst.values()), worst


def test_expert_shard_range_deals_whole_contiguous_ranges():
    """Part j of E over ep starts at j * E // ep: the ranges tile [0, E) in rank order, sizes
    differ by at most one (6 over 4: 1, 2, 1, 2); ep > E or ep < 1 is one ValueError naming the sizes."""
    for E in (3, 6, 8, 64):
        for ep in range(1, E + 1):
            r = [expert_shard_range(E, ep, j) for j in range(ep)]
            assert r[0][0] == 0 and r[-1][1] == E and all(a[1] == b[0] for a, b in zip(r, r[1:]))
            sizes = [b - a for a, b in r]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert [expert_shard_range(6, 4, j) for j in range(4)] == [(0, 1), (1, 3), (3, 4), (4, 6)]
    for E, ep in ((3, 4), (8, 0), (8, 9)):
        with pytest.raises(ValueError, match=f"{E} expert\\(s\\) cannot be dealt to ep={ep}"):
            expert_shard_range(E, ep, 0)
    with pytest.raises(ValueError, match="rank 2 of a group of size 2"):
        expert_shard_range(8, 2, 2)


@pytest.mark.parametrize("dt", DTYPES)
def test_the_cpu_experts_region_gives_a_row_the_same_bits_whatever_rows_share_the_call(dt):
    """The claim the owner's step rests on, checked on the region the workers run (the CPU loop of
    the invariant linear and silu_and_mul): a row's output is the same when its expert gets all 20
    rows, the rows in reverse order, or that row alone."""
    from isoexec_kernels.moe import Dispatch, regions
    g = torch.Generator().manual_seed(5)
    E, H, I, n = 8, 64, 32, 20
    gate_up = (0.05 * torch.randn((E, 2 * I, H), generator=g)).to(DTYPES[dt])
    down = (0.05 * torch.randn((E, H, I), generator=g)).to(DTYPES[dt])
    x = torch.randn((n, H), generator=g).to(DTYPES[dt])
    ids = torch.sort(torch.randint(0, E, (n, 1), generator=g), dim=0).values   # expert-major rows

    def run_rows(rows: list[int]) -> torch.Tensor:
        e = ids[rows, 0]
        offsets = torch.zeros(E + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(torch.bincount(e, minlength=E), 0)
        order = torch.argsort(e, stable=True)
        tok = torch.tensor(rows)[order]
        disp = Dispatch(token=tok, offsets=offsets, row_of_pair=torch.argsort(order), num_tokens=len(rows), top_k=1)
        out = torch.empty((len(rows), H), dtype=x.dtype)
        out[order] = regions.moe_experts(x, disp, gate_up, down)
        return out

    together = run_rows(list(range(n)))
    reverse = run_rows(list(range(n))[::-1]).flip(0)
    alone = torch.cat([run_rows([t]) for t in range(n)])
    assert len(set(ids[:, 0].tolist())) > 3
    assert dw.bit_report(reverse, together)["differing"] == 0
    assert dw.bit_report(alone, together)["differing"] == 0
