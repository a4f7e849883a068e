"""Kernel-level gates (docs/gates.md families 1, 6, 7) of the row-wise region kinds and attention
(which kind gets which gates: ``kinds.KINDS``).

Each gate draws fresh seeded random inputs at the model's own shapes, runs the bound
implementation, and compares integer views:

- ``batch_invariance``: a row computed alone equals the same row inside a batch of M (every M
  in ``batch_sizes``, covering each M bucket a kernel uses), at a random position, with random
  neighbours; and equals it again inside a second, different batch.
- ``hazards``: the same comparison on inputs that contain the declared hazards (signed zeros,
  subnormals, a K or vocabulary not a multiple of the tile, non-contiguous inputs, ties); each
  hazard must be shown to have occurred in the inputs, otherwise the gate is vacuous and fails.
- ``negative_control``: ``batch_invariance`` run on the stock implementation; it PASSES when the
  stock kernel differs (the gate has teeth on this machine) and is INCONCLUSIVE when the stock
  kernel happens to be invariant at these shapes (recorded, not a failure: the whole-model
  negative control in ``runner`` is the one that must fail).

Every gate also checks correctness against a float64 reference at a loose tolerance: a kernel
that returns zeros would be perfectly invariant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from isoexec_kernels.attention import compute_slot_mapping, write_kv_pages
from isoexec_kernels.moe import RouterSpec

from .. import registry
from ..contract import Entry, ImplRef, frozen_mapping
from ..model_config import QKV_BIAS_MODEL_TYPES
from .compare import BitReport, compare_bits, merge

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}

SIGMOID_GROUP_TYPES = ("glm4_moe_lite", "deepseek_v3")


def moe_dims(cfg: dict) -> dict:
    """MoE shapes and router of a transformers config dict (mla_moe and hybrid_moe families)."""
    mt = cfg.get("model_type")
    h = cfg["hidden_size"]
    if mt in SIGMOID_GROUP_TYPES:
        E = cfg.get("n_routed_experts", 64)
        spec = RouterSpec("sigmoid_group_topk", cfg.get("num_experts_per_tok", 4),
                          bool(cfg.get("norm_topk_prob", True)), cfg.get("n_group") or 1, cfg.get("topk_group") or 1,
                          float(cfg.get("routed_scaling_factor", 1.0)))
        inter = cfg.get("moe_intermediate_size", 4 * h)
        shared = inter * cfg.get("n_shared_experts", 1)
        gated = False
    else:   # Qwen-style: softmax over the experts, top-k, renormalised, one gated shared expert
        E = cfg.get("num_experts", 8)
        spec = RouterSpec("softmax_topk", cfg.get("num_experts_per_tok", 2), bool(cfg.get("norm_topk_prob", True)))
        inter = cfg.get("moe_intermediate_size", 4 * h)
        shared = cfg.get("shared_expert_intermediate_size", 0)
        gated = bool(shared)
    return dict(E=E, H=h, I=inter, shared=shared, gated=gated, spec=spec, k=spec.top_k)



@dataclass
class GateOutcome:
    family: str
    shapes: dict
    dtype: str
    reports: list[BitReport]
    rel_err: float
    tolerance: float
    hazards_exercised: dict
    hazards_required: tuple[str, ...] = ()

    def verdict(self, expect_invariant: bool = True) -> str:
        counts = merge(self.reports)
        correct = math.isfinite(self.rel_err) and self.rel_err <= self.tolerance
        vacuous = [h for h in self.hazards_required if not self.hazards_exercised.get(h)]
        if not correct or vacuous:
            return "fail"
        if expect_invariant:
            return "pass" if counts["differing"] == 0 else "fail"
        # A kernel-level negative control that finds the stock kernel invariant at these shapes is
        # inconclusive, not a failure of ours: cuBLAS is row-invariant for some (M, K, N) (measured
        # on H200 at Qwen3-0.6B shapes). The whole-model negative control must still fail.
        return "pass" if counts["differing"] > 0 else "inconclusive"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    den = ref.norm().item()
    return (out - ref).norm().item() / (den if den > 0 else 1.0)


def _rand(shape, dtype, gen, device, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype).to(device)


def _rowwise_invariance(fn: Callable[[torch.Tensor], torch.Tensor], make: Callable[[int], torch.Tensor],
                        sizes, gen) -> list[BitReport]:
    """f(batch)[pos] == f(row alone) for each size, in two different random batches."""
    reports = []
    for m in sizes:
        for _ in range(2):
            batch = make(m)
            pos = int(torch.randint(0, m, (1,), generator=gen))
            row = batch[pos:pos + 1].clone()
            alone = fn(row)
            inside = fn(batch)[pos:pos + 1]
            reports.append(compare_bits(inside, alone))
    return reports


def _with_zeros_and_subnormals(x: torch.Tensor, gen) -> torch.Tensor:
    """~10% of ``x`` set to -0.0 and ~5% to 3e-39 (a subnormal in fp32 and bf16)."""
    mask = (torch.rand(x.shape, generator=gen) < 0.1).to(x.device)
    x = x.masked_fill(mask, -0.0)
    sub = (torch.rand(x.shape, generator=gen) < 0.05).to(x.device)
    return torch.where(sub, torch.full_like(x, 3e-39), x)


def _hazard_reports(fn: Callable[[torch.Tensor], torch.Tensor], make: Callable[[int], torch.Tensor], sizes, gen,
                    exercised: dict) -> list[BitReport]:
    """Row alone vs inside the batch on non-contiguous hazard inputs, counting what occurred."""
    reports = []
    for m in sizes:
        x = make(m).repeat(1, 2)[:, ::2]           # non-contiguous view: every other column
        exercised["noncontiguous"] = exercised.get("noncontiguous", False) or not x.is_contiguous()
        exercised["signed_zero"] = exercised.get("signed_zero", 0) + int(((x == 0) & torch.signbit(x)).sum())
        xf = x.float()
        exercised["subnormal"] = exercised.get("subnormal", 0) + int(
            ((xf != 0) & (xf.abs() < torch.finfo(torch.float32).tiny)).sum())
        pos = int(torch.randint(0, m, (1,), generator=gen))
        reports.append(compare_bits(fn(x)[pos:pos + 1], fn(x[pos:pos + 1])))
    return reports


# ------------------------------------------------------------------------------------ shapes
def _mla_linear_shape(region: tuple[str, ...], cfg: dict) -> tuple[int, int] | None:
    """(K, N) of the MLA projections and the MoE shared expert (None for other regions)."""
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    r = set(region)
    if "kv_lora_rank" in cfg:   # MLA (mla_moe family)
        qr, kvr, rope = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        nope, dv = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        if r & {"q_a_proj", "kv_a_proj"}:
            return h, sum({"q_a_proj": qr, "kv_a_proj": kvr + rope}[o] for o in region)
        if r == {"q_b_proj"}:
            return qr, nh * (nope + rope)
        if r == {"kv_b_proj"}:
            return kvr, nh * (nope + dv)
        if r == {"o_proj"}:
            return nh * dv, h
    if r & {"shared_gate_proj", "shared_up_proj", "shared_down_proj"}:
        shared = moe_dims(cfg)["shared"] or 1
        return (shared, h) if r == {"shared_down_proj"} else (h, shared * len(region))
    return None


def linear_shape(region: tuple[str, ...], cfg: dict) -> tuple[int, int]:
    h = cfg["hidden_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    inter = cfg.get("intermediate_size", 4 * h)
    r = set(region)
    n = 0
    mla = _mla_linear_shape(region, cfg)
    if mla is not None:
        return mla
    if r & {"q_proj", "k_proj", "v_proj"}:
        n = sum({"q_proj": nh * hd, "k_proj": nkv * hd, "v_proj": nkv * hd}[o] for o in region)
        return h, n
    if r == {"o_proj"}:
        return nh * hd, h
    if r & {"gate_proj", "up_proj"}:
        return h, inter * len(region)
    if r == {"down_proj"}:
        return inter, h
    if r == {"lm_head"}:
        return h, cfg["vocab_size"]
    return h, h


def linear_has_bias(region: tuple[str, ...], cfg: dict) -> bool:
    """Whether the model adds a bias in this linear region: the q/k/v projections of a model type
    in ``model_config.QKV_BIAS_MODEL_TYPES`` (Qwen2)."""
    return bool(set(region) & {"q_proj", "k_proj", "v_proj"}) and cfg.get("model_type") in QKV_BIAS_MODEL_TYPES


def norm_width(region: tuple[str, ...], cfg: dict) -> int:
    if set(region) == {"q_a_norm"}:
        return cfg["q_lora_rank"]
    if set(region) == {"kv_a_norm"}:
        return cfg["kv_lora_rank"]
    if set(region) & {"q_norm", "k_norm"}:
        return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["hidden_size"]


# ------------------------------------------------------------------------------------ per kind
def gate_linear(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants) -> GateOutcome:
    k, n = linear_shape(region, cfg)
    block_k = int(constants.get("BLOCK_K", 64))
    exercised: dict = {}
    if family == "hazards":
        k = k + 17 if k % block_k == 0 else k
        exercised["k_not_tile_multiple"] = k % block_k != 0
    w = _rand((n, k), dtype, gen, device, 1.0 / math.sqrt(k))
    shapes = {"K": k, "N": n, "M": list(sizes)}
    if linear_has_bias(region, cfg):   # the kernel adds the bias inside its rounding schedule
        b = _rand((n,), dtype, gen, device)
        shapes["bias"] = True
        run = lambda x: fn(x, w, b)  # noqa: E731
        ref = lambda x: x.double() @ w.double().T + b.double()  # noqa: E731
    else:
        run = lambda x: fn(x, w)  # noqa: E731
        ref = lambda x: x.double() @ w.double().T  # noqa: E731

    def make(m):
        x = _rand((m, k), dtype, gen, device)
        return _with_zeros_and_subnormals(x, gen) if family == "hazards" else x

    if family == "hazards":
        reports = _hazard_reports(run, make, sizes, gen, exercised)
    else:
        reports = _rowwise_invariance(run, make, sizes, gen)
    x = make(min(sizes[-1], 64))
    err = rel_err(run(x), ref(x))
    return GateOutcome(family, shapes, str(dtype), reports, err,
                       TOLERANCE[dtype], exercised, hazards if family == "hazards" else ())


def gate_norm(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants) -> GateOutcome:
    h = norm_width(region, cfg)
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    weight = (1.0 + 0.1 * _rand((h,), torch.float32, gen, "cpu")).to(dtype).to(device)
    exercised: dict = {}

    def make(m):
        x = _rand((m, h), dtype, gen, device)
        return _with_zeros_and_subnormals(x, gen) if family == "hazards" else x

    if family == "hazards":
        reports = _hazard_reports(lambda x: fn(x, weight, eps), make, sizes, gen, exercised)
    else:
        reports = _rowwise_invariance(lambda x: fn(x, weight, eps), make, sizes, gen)
    x = make(16)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    err = rel_err(fn(x, weight, eps), ref)
    return GateOutcome(family, {"H": h, "M": list(sizes)}, str(dtype), reports, err, TOLERANCE[dtype], exercised,
                       hazards if family == "hazards" else ())


def gate_logprob(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants) -> GateOutcome:
    v = cfg["vocab_size"]
    block_v = int(constants.get("BLOCK_V", 1024))
    exercised: dict = {}
    if family == "hazards" and v % block_v == 0:
        v += 37
    exercised["v_not_tile_multiple"] = v % block_v != 0

    def make(m):
        logits = _rand((m, v), dtype, gen, device, 3.0)
        if family == "hazards":
            top = logits.max(dim=-1, keepdim=True).values
            cols = torch.randint(0, v, (m, 2), generator=gen).to(device)
            logits.scatter_(1, cols, top.expand(m, 2))  # exact ties at the maximum
        return logits

    reports = []
    for m in sizes:
        for _ in range(2):
            logits = make(m)
            t = torch.randint(0, v, (m,), generator=gen).to(device)
            pos = int(torch.randint(0, m, (1,), generator=gen))
            inside = fn(logits, t)[pos:pos + 1]
            alone = fn(logits[pos:pos + 1].clone(), t[pos:pos + 1].clone())
            reports.append(compare_bits(inside, alone))
            if family == "hazards":
                mx = logits.max(dim=-1).values
                exercised["ties"] = exercised.get("ties", 0) + int(((logits == mx[:, None]).sum(-1) > 1).sum())
    logits = make(8)
    t = torch.randint(0, v, (8,), generator=gen).to(device)
    ref = torch.log_softmax(logits.double(), -1).gather(1, t[:, None]).squeeze(1)
    err = rel_err(fn(logits, t), ref)
    return GateOutcome(family, {"V": v, "M": list(sizes)}, str(dtype), reports, err, TOLERANCE[torch.float32],
                       exercised, hazards if family == "hazards" else ())


def entry_with_impl(entry: Entry, impl: ImplRef) -> Entry:
    spec = registry.impl_by_ref(impl.id, impl.version, impl.arch)
    return Entry(region=entry.region, cases=entry.cases, impl=impl, constants=frozen_mapping(spec.default_constants()),
                 discharge=None, half="function")


def _heads(cfg: dict) -> tuple[int, int, int]:
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    return nh, nkv, hd


def _rope_theta(cfg: dict) -> float:
    rp = cfg.get("rope_parameters") or {}
    return float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def gate_rope(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants) -> GateOutcome:
    nh, _, hd = _heads(cfg)
    hd = cfg.get("qk_rope_head_dim") or hd   # MLA rotates only the rope part of each head
    theta = _rope_theta(cfg)
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    reports = []
    for m in sizes:
        for _ in range(2):
            x = _rand((m, nh, hd), dtype, gen, device)
            pos = torch.randint(0, max_pos, (m,), generator=gen).to(device)
            i = int(torch.randint(0, m, (1,), generator=gen))
            inside = fn(x, pos, theta=theta)[i:i + 1]
            alone = fn(x[i:i + 1].clone(), pos[i:i + 1].clone(), theta=theta)
            reports.append(compare_bits(inside, alone))
    x = _rand((16, nh, hd), dtype, gen, device)
    pos = torch.randint(0, max_pos, (16,), generator=gen)
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ph = pos.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ph.cos(), ph.cos()], -1)[:, None], torch.cat([ph.sin(), ph.sin()], -1)[:, None]
    xd = x.double().cpu()
    rot = torch.cat([-xd[..., hd // 2:], xd[..., :hd // 2]], -1)
    err = rel_err(fn(x, pos.to(device), theta=theta), xd * cos + rot * sin)
    return GateOutcome(family, {"heads": nh, "head_dim": hd, "M": list(sizes)}, str(dtype), reports, err,
                       TOLERANCE[dtype], {})


def gate_activation(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants) -> GateOutcome:
    inter = cfg.get("intermediate_size", 4 * cfg["hidden_size"])
    if set(region) == {"shared_act"}:
        inter = moe_dims(cfg)["shared"] or inter

    def make(m):
        return _rand((m, 2 * inter), dtype, gen, device, 2.0)

    def call(gu):
        return fn(gu[:, :inter], gu[:, inter:])

    reports = _rowwise_invariance(call, make, sizes, gen)
    gu = make(16)
    g, u = gu[:, :inter].double(), gu[:, inter:].double()
    err = rel_err(call(gu), g * torch.sigmoid(g) * u)
    return GateOutcome(family, {"I": inter, "M": list(sizes)}, str(dtype), reports, err, TOLERANCE[dtype], {})


def gate_embed(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants) -> GateOutcome:
    v, h = cfg["vocab_size"], cfg["hidden_size"]
    table = _rand((v, h), dtype, gen, device)
    reports = []
    for m in sizes:
        ids = torch.randint(0, v, (m,), generator=gen).to(device)
        i = int(torch.randint(0, m, (1,), generator=gen))
        reports.append(compare_bits(fn(ids, table)[i:i + 1], fn(ids[i:i + 1].clone(), table)))
    ids = torch.randint(0, v, (16,), generator=gen).to(device)
    err = rel_err(fn(ids, table), table.double()[ids])
    return GateOutcome(family, {"V": v, "H": h, "M": list(sizes)}, str(dtype), reports, err, TOLERANCE[dtype], {})


def gate_attention(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants,
                   binds=None) -> GateOutcome:
    """Attention is gated across cases. ``binds`` maps case -> bound callable.

    batch_invariance: a sequence alone (varlen) equals the same sequence packed among random
    others at a random offset, for packs of up to 64 sequences.
    case_parity: for random sequences, varlen (trainer) rows == paged prefill rows with the
    prompt split at random points into chunks == decode rows for the tail tokens, with pages
    of the cache shuffled; lengths not multiples of BLOCK_N exercise the hazard.
    """
    nh, nkv, hd = _heads(cfg)
    dqk = dv = kv_width = hd
    vkw: dict = {}
    write_pages = write_kv_pages
    if "kv_lora_rank" in cfg:   # MLA: expanded heads, q/k and v head dims differ, pages padded to width
        from isoexec_kernels.mla import mla_width, write_mla_kv_pages

        write_pages = write_mla_kv_pages

        nkv, dqk, dv = nh, cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        kv_width, vkw = mla_width(dqk, dv), {"v_dim": cfg["v_head_dim"]}
    scale = dqk ** -0.5
    block_n = int(constants.get("BLOCK_N", 64))
    max_len = 160 if device == "cpu" else 700
    varlen = binds["trainer_score"]
    reports: list[BitReport] = []
    exercised = {"len_not_tile_multiple": False}

    def seq(n):
        return (_rand((n, nh, dqk), dtype, gen, device), _rand((n, nkv, dqk), dtype, gen, device),
                _rand((n, nkv, dv), dtype, gen, device))

    def pack(seqs):
        lens = [s[0].shape[0] for s in seqs]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
        return [torch.cat([s[j] for s in seqs]) for j in range(3)] + [cu, max(lens)]

    counts = [c for c in (1, 2, 5, 16, 64) if c <= max(sizes)]
    if family == "batch_invariance":
        for nseq in counts:
            n = int(torch.randint(1, max_len, (1,), generator=gen))
            target = seq(n)
            q, k, v, cu, mx = pack([target])
            alone = varlen(q, k, v, cu, mx, scale)
            others = [seq(int(torch.randint(1, max_len, (1,), generator=gen))) for _ in range(nseq - 1)]
            pos = int(torch.randint(0, nseq, (1,), generator=gen))
            allseq = others[:pos] + [target] + others[pos:]
            q, k, v, cu, mx = pack(allseq)
            off = int(cu[pos])
            reports.append(compare_bits(varlen(q, k, v, cu, mx, scale)[off:off + n], alone))
            exercised["len_not_tile_multiple"] |= n % block_n != 0
    else:
        prefill, decode = binds["engine_prefill"], binds["engine_decode"]
        page = 16
        for nseq in counts[:4]:
            lens = [int(torch.randint(2, max_len, (1,), generator=gen)) for _ in range(nseq)]
            seqs = [seq(n) for n in lens]
            q, k, v, cu, mx = pack(seqs)
            trainer = varlen(q, k, v, cu, mx, scale)
            pages_needed = sum(-(-n // page) for n in lens)
            perm = torch.randperm(pages_needed, generator=gen).tolist()
            tables, at = [], 0
            for n in lens:
                tables.append(perm[at:at + -(-n // page)])
                at += -(-n // page)
            width = max(len(t) for t in tables)
            bt = torch.zeros((nseq, width), dtype=torch.int32)
            for b, t in enumerate(tables):
                bt[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
            bt = bt.to(device)
            kc = torch.zeros((pages_needed, page, nkv, kv_width), dtype=dtype, device=device)
            vc = torch.zeros_like(kc)
            # prompts: all but a random tail; prefill them in random chunks (all sequences per step)
            tails = [int(torch.randint(1, min(n, 9), (1,), generator=gen)) if n > 1 else 0 for n in lens]
            done = [0] * nseq
            engine_rows = [[] for _ in range(nseq)]
            while any(done[b] < lens[b] - tails[b] for b in range(nseq)):
                qs, ks, vs, qlens, ctx = [], [], [], [], []
                for b in range(nseq):
                    left = lens[b] - tails[b] - done[b]
                    step = min(left, int(torch.randint(1, 2 * block_n, (1,), generator=gen))) if left > 0 else 0
                    sq, sk, sv = seqs[b]
                    qs.append(sq[done[b]:done[b] + step])
                    ks.append(sk[done[b]:done[b] + step])
                    vs.append(sv[done[b]:done[b] + step])
                    qlens.append(step)
                    ctx.append(done[b] + step)
                cuq = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
                ctx_t = torch.tensor(ctx, dtype=torch.int32)
                slots = compute_slot_mapping(bt.cpu(), cuq, ctx_t, page).to(device)
                write_pages(torch.cat(ks), torch.cat(vs), kc, vc, slots)
                out = prefill(torch.cat(qs), kc, vc, bt, cuq.to(device), ctx_t.to(device), scale, **vkw)
                at = 0
                for b in range(nseq):
                    engine_rows[b].append(out[at:at + qlens[b]])
                    at += qlens[b]
                    done[b] += qlens[b]
            for t in range(max(tails)):
                active = [b for b in range(nseq) if t < tails[b]]
                qs = torch.cat([seqs[b][0][done[b]:done[b] + 1] for b in active])
                ks = torch.cat([seqs[b][1][done[b]:done[b] + 1] for b in active])
                vs = torch.cat([seqs[b][2][done[b]:done[b] + 1] for b in active])
                ctx_t = torch.tensor([done[b] + 1 for b in active], dtype=torch.int32)
                cuq = torch.arange(len(active) + 1, dtype=torch.int32)
                sub_bt = bt[torch.tensor(active, device=device)]
                slots = compute_slot_mapping(sub_bt.cpu(), cuq, ctx_t, page).to(device)
                write_pages(ks, vs, kc, vc, slots)
                out = decode(qs, kc, vc, sub_bt, ctx_t.to(device), scale, **vkw)
                for j, b in enumerate(active):
                    engine_rows[b].append(out[j:j + 1])
                    done[b] += 1
            at = 0
            for b, n in enumerate(lens):
                reports.append(compare_bits(torch.cat(engine_rows[b]), trainer[at:at + n]))
                at += n
                exercised["len_not_tile_multiple"] |= n % block_n != 0
    # correctness: float64 causal attention on one packed batch
    seqs = [seq(int(torch.randint(1, 80, (1,), generator=gen))) for _ in range(3)]
    q, k, v, cu, mx = pack(seqs)
    out = varlen(q, k, v, cu, mx, scale)
    refs, rep = [], nh // nkv
    for sq, sk, sv in seqs:
        qd, kd, vd = sq.double().cpu(), sk.double().cpu().repeat_interleave(rep, 1), sv.double().cpu().repeat_interleave(
            rep, 1)
        s = torch.einsum("qhd,khd->hqk", qd, kd) * scale
        n = s.shape[-1]
        s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
        refs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vd))
    err = rel_err(out, torch.cat(refs))
    shapes = {"heads": nh, "kv_heads": nkv, "head_dim": hd, "max_len": max_len, "sequences": counts}
    if vkw:
        shapes.update(head_dim=dqk, v_head_dim=dv, width=kv_width)
    return GateOutcome(family, shapes, str(dtype), reports, err, TOLERANCE[dtype], exercised, hazards)

