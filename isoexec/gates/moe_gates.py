"""Kernel-level gates of the mixture-of-experts regions (docs/gates.md families 1 and 6).

Every gate draws seeded random inputs at the model config's MoE shapes and compares integer views:

- ``router`` (batch_invariance, hazards): a token's expert ids and fp32 weights alone == inside
  a batch. The hazards input makes exact ties: zero correction bias, the router rows of experts
  0..k equal (when they score highest, k+1 experts tie across the top-k boundary), and a fifth of
  the tokens all zero (every logit +0, so every expert and every group ties).
  ``topk_tie`` counts the tokens whose k-th and (k+1)-th selection scores (inside the kept groups)
  are equal, ``group_tie`` those whose last kept and first dropped group scores are equal; a gate
  whose inputs held no boundary tie fails as vacuous.
- ``dispatch`` (batch_invariance): the dispatch of a batch is the canonical order (expert-major,
  token-ascending: the unique sort by expert * T + token, built here independently), and the
  needle's experts appear in the same order alone and inside the batch.
- ``experts`` (batch_invariance, hazards): a token's k expert output rows alone (each expert
  holds one row) == inside a batch. The hazards batches send every token to the same k experts
  (each of those holds all M rows, the others none) or three quarters of them to one expert set
  (skewed loads); ``expert_full_load``, ``expert_zero_load`` and ``skewed_load`` count what occurred.
- ``combine`` (batch_invariance): a token's combined row alone == inside a batch, from the same
  per-pair expert rows, weights and shared-expert row.

Each gate also checks correctness against float64 (routing weights for the chosen experts,
SwiGLU outputs, the weighted sum).
"""

from __future__ import annotations

import math

import torch

from .compare import BitReport, compare_bits
from .kernel_gates import TOLERANCE, GateOutcome, _rand, moe_dims, rel_err



def _random_ids(gen, m: int, E: int, k: int) -> torch.Tensor:
    """[m, k] distinct experts per row, ascending (the reference router's order)."""
    return torch.sort(torch.rand((m, E), generator=gen).argsort(-1)[:, :k], -1).values


# ------------------------------------------------------------------------------------------ router
def _selection(x: torch.Tensor, w: torch.Tensor, bias, spec):
    """(selection scores inside the kept groups [M, E] (-inf outside), group scores [M, G]) as the
    reference computes them: the quantities whose ties the hazard counts."""
    from isoexec_kernels.gemm import linear
    from isoexec_kernels.moe.reference import _sigmoid_fp32, _softmax_fp32, router_logits

    z = router_logits(x, w, linear)
    if spec.kind == "softmax_topk":
        return _softmax_fp32(z), None
    b = _sigmoid_fp32(z) + (0.0 if bias is None else bias.float())
    M, E = b.shape
    bg = b.view(M, spec.n_group, E // spec.n_group)
    top2 = torch.sort(bg, dim=-1, descending=True, stable=True).values[:, :, :2]
    gs = top2[:, :, 0] + top2[:, :, 1]
    kept = torch.sort(gs, dim=-1, descending=True, stable=True).indices[:, :spec.topk_group]
    keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, kept, True)
    return b.masked_fill(~keep.repeat_interleave(E // spec.n_group, 1), float("-inf")), gs


def _count_ties(sel: torch.Tensor, gs, spec) -> tuple[int, int]:
    v = torch.sort(sel, -1, descending=True).values
    k = spec.top_k
    topk = int((v[:, k - 1] == v[:, k]).sum()) if v.shape[1] > k else 0
    group = 0
    if gs is not None and gs.shape[1] > spec.topk_group:
        g = torch.sort(gs, -1, descending=True).values
        group = int((g[:, spec.topk_group - 1] == g[:, spec.topk_group]).sum())
    return topk, group


def _routing64(x, w, bias, spec, ids) -> torch.Tensor:
    """float64 weights of the chosen experts ``ids`` (the router's formula in float64)."""
    z = x.double().cpu() @ w.double().cpu().T
    if spec.kind == "softmax_topk":
        p = torch.softmax(z, -1).gather(1, ids.cpu())
        return p / p.sum(-1, keepdim=True) if spec.norm_topk_prob else p
    s = torch.sigmoid(z).gather(1, ids.cpu())
    if spec.norm_topk_prob:
        s = s / (s.sum(-1, keepdim=True) + 1e-20)
    return s * spec.routed_scaling_factor


def gate_router(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants) -> GateOutcome:
    d = moe_dims(cfg)
    E, H, spec = d["E"], d["H"], d["spec"]
    w = _rand((E, H), dtype, gen, device, 1.0 / math.sqrt(H))
    bias = None if spec.kind == "softmax_topk" else (0.01 * torch.randn(E, generator=gen)).to(device)
    gate_w = _rand((1, H), dtype, gen, device, 1.0 / math.sqrt(H)) if d["gated"] else None
    exercised: dict = {}
    if family == "hazards":
        w = w.clone()
        w[1:spec.top_k + 1] = w[0]           # experts 0..k equal: a tie across the top-k boundary when on top
        bias = None if bias is None else torch.zeros_like(bias)
        exercised.update(topk_tie=0, group_tie=0)

    def make(m):
        x = _rand((m, H), dtype, gen, device)
        if family == "hazards":
            x[(torch.rand(m, generator=gen) < 0.2).to(device)] = 0.0
            sel, gs = _selection(x, w, bias, spec)
            t, g = _count_ties(sel, gs, spec)
            exercised["topk_tie"] += t
            exercised["group_tie"] += g
        return x

    def call(x):
        return fn(x, w, spec, bias, gate_w)

    reports: list[BitReport] = []
    for m in sizes:
        for _ in range(2):
            x = make(m)
            pos = int(torch.randint(0, m, (1,), generator=gen))
            inside, alone = call(x), call(x[pos:pos + 1].clone())
            reports += [compare_bits(inside.ids[pos:pos + 1], alone.ids), compare_bits(inside.weights[pos:pos + 1],
                                                                                       alone.weights)]
            if gate_w is not None:
                reports.append(compare_bits(inside.shared_gate[pos:pos + 1], alone.shared_gate))
    x = make(32)
    r = call(x)
    err = rel_err(r.weights.float(), _routing64(x, w, bias, spec, r.ids))
    return GateOutcome(family, {"E": E, "H": H, "k": spec.top_k, "router": spec.kind, "n_group": spec.n_group,
                                "topk_group": spec.topk_group, "M": list(sizes)}, str(dtype), reports, err,
                       TOLERANCE[dtype], exercised, hazards if family == "hazards" else ())


# ---------------------------------------------------------------------------------------- dispatch
def _canonical(ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token of each dispatched row, offsets) in expert-major, token-ascending order, by a plain
    Python sort: the order the dispatch region must produce."""
    T, k = ids.shape
    pairs = sorted((int(ids[t, j]), t) for t in range(T) for j in range(k))
    counts = [0] * E
    for e, _ in pairs:
        counts[e] += 1
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    return torch.tensor([t for _, t in pairs], dtype=torch.long), torch.tensor(offs, dtype=torch.long)


def gate_dispatch(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants) -> GateOutcome:
    d = moe_dims(cfg)
    E, k = d["E"], d["k"]
    reports: list[BitReport] = []
    consistent = True

    def experts_in_order(disp, token):
        rows = (disp.token == token).nonzero().flatten()
        return torch.bucketize(rows, disp.offsets[1:], right=True)   # the expert owning each row, in row order

    for m in sizes:
        ids = _random_ids(gen, m, E, k).to(device)
        disp = fn(ids, E)
        tok, offs = _canonical(ids.cpu(), E)
        reports += [compare_bits(disp.token.cpu().long(), tok), compare_bits(disp.offsets.cpu().long(), offs)]
        pos = int(torch.randint(0, m, (1,), generator=gen))
        alone = fn(ids[pos:pos + 1].clone(), E)
        reports.append(compare_bits(experts_in_order(disp, pos).cpu(), experts_in_order(alone, 0).cpu()))
        # every (token, slot) pair lands on exactly one row, owned by the expert the pair chose
        pair_rows = disp.row_of_pair.cpu().long()
        owner = torch.bucketize(pair_rows, disp.offsets.cpu()[1:], right=True)
        consistent &= bool(torch.equal(torch.sort(pair_rows).values, torch.arange(m * k)))
        consistent &= bool(torch.equal(owner, ids.cpu().reshape(-1).long()))
        consistent &= bool(torch.equal(disp.token.cpu()[pair_rows], torch.arange(m).repeat_interleave(k)))
    return GateOutcome(family, {"E": E, "k": k, "M": list(sizes)}, "int64", reports, 0.0 if consistent else math.inf,
                       0.0, {})


# ----------------------------------------------------------------------------------------- experts
def gate_experts(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants) -> GateOutcome:
    from isoexec_kernels.moe import dispatch

    d = moe_dims(cfg)
    E, H, inter, k = d["E"], d["H"], d["I"], d["k"]
    gate_up = _rand((E, 2 * inter, H), dtype, gen, device, 1.0 / math.sqrt(H))
    down = _rand((E, H, inter), dtype, gen, device, 1.0 / math.sqrt(inter))
    exercised = {"expert_zero_load": 0, "expert_full_load": 0, "skewed_load": 0}
    hot = torch.arange(k)   # the experts every token of an all-same batch picks

    def ids_for(m, mode):
        ids = _random_ids(gen, m, E, k)
        if mode == "all_same":
            ids[:] = hot
        elif mode == "skewed":
            ids[torch.rand(m, generator=gen) < 0.75] = hot
        return ids

    def count(ids, m):
        c = torch.bincount(ids.reshape(-1), minlength=E)
        exercised["expert_zero_load"] += int((c == 0).sum())
        exercised["expert_full_load"] += int((c == m).sum()) if m > 1 else 0
        exercised["skewed_load"] += int(m >= 4 and int(c.max()) >= 4 * max(1, int(c.min())) and int(c.min()) < m)

    reports: list[BitReport] = []
    modes = ("all_same", "skewed") if family == "hazards" else ("random", "random")
    for m in sizes:
        for mode in modes:
            x = _rand((m, H), dtype, gen, device)
            ids = ids_for(m, mode)
            count(ids, m)
            disp = dispatch(ids.to(device), E)
            rows = fn(x, disp, gate_up, down)
            pos = int(torch.randint(0, m, (1,), generator=gen))
            needle_ids = ids[pos:pos + 1].clone().to(device)
            alone = fn(x[pos:pos + 1].clone(), dispatch(needle_ids, E), gate_up, down)
            # pair (pos, j) -> its row; alone, each of the k experts holds one row, in slot order
            inside = rows[disp.row_of_pair[pos * k:(pos + 1) * k]]
            reports.append(compare_bits(inside, alone))
    x = _rand((16, H), dtype, gen, device)
    ids = _random_ids(gen, 16, E, k).to(device)
    disp = dispatch(ids, E)
    out = fn(x, disp, gate_up, down)
    xd, gu, dn = x.double().cpu(), gate_up.double().cpu(), down.double().cpu()
    ref = torch.empty(out.shape, dtype=torch.float64)
    tok, offs = disp.token.cpu(), disp.offsets.tolist()
    for e in range(E):
        r0, r1 = offs[e], offs[e + 1]
        if r1 > r0:
            h = xd[tok[r0:r1]] @ gu[e].T
            ref[r0:r1] = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ dn[e].T
    return GateOutcome(family, {"E": E, "H": H, "I": inter, "k": k, "M": list(sizes)}, str(dtype), reports,
                       rel_err(out, ref), TOLERANCE[dtype], exercised if family == "hazards" else {},
                       hazards if family == "hazards" else ())


# ----------------------------------------------------------------------------------------- combine
def gate_combine(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants) -> GateOutcome:
    from isoexec_kernels.moe import Routing, dispatch

    d = moe_dims(cfg)
    E, H, k = d["E"], d["H"], d["k"]
    with_shared = bool(d["shared"])

    def inputs(m):
        ids = _random_ids(gen, m, E, k).to(device)
        w = torch.rand((m, k), generator=gen).to(device)
        y = _rand((m, k, H), dtype, gen, device)          # each pair's expert output row
        sh = _rand((m, H), dtype, gen, device) if with_shared else None
        g = torch.rand((m, 1), generator=gen).to(device) if d["gated"] else None
        return ids, w, y, sh, g

    def call(ids, w, y, sh, g):
        disp = dispatch(ids, E)
        rows = torch.empty((ids.numel(), H), dtype=dtype, device=device)
        rows[disp.row_of_pair] = y.reshape(-1, H)
        return fn(rows, disp, Routing(ids=ids, weights=w, shared_gate=g), sh, out_dtype=dtype)

    reports: list[BitReport] = []
    for m in sizes:
        for _ in range(2):
            ids, w, y, sh, g = inputs(m)
            pos = int(torch.randint(0, m, (1,), generator=gen))
            one = [None if t is None else t[pos:pos + 1].clone() for t in (ids, w, y, sh, g)]
            reports.append(compare_bits(call(ids, w, y, sh, g)[pos:pos + 1], call(*one)))
    ids, w, y, sh, g = inputs(16)
    ref = (w.double()[..., None] * y.double()).sum(1)
    if sh is not None:
        ref = ref + (sh.double() if g is None else g.double() * sh.double())
    err = rel_err(call(ids, w, y, sh, g), ref)
    return GateOutcome(family, {"E": E, "H": H, "k": k, "shared": with_shared, "M": list(sizes)}, str(dtype),
                       reports, err, TOLERANCE[dtype], {})


