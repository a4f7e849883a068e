"""Kernel-level gates (GATES.md families 1, 6, 7) for every region kind.

Each gate draws fresh seeded random inputs at the model's own shapes, runs the bound
implementation, and compares integer views:

- ``batch_invariance``: a row computed alone equals the same row inside a batch of M (every M
  in ``batch_sizes``, covering each M bucket a kernel uses), at a random position, with random
  neighbours; and equals it again inside a second, different batch.
- ``hazards``: the same comparison on inputs that contain the declared hazards (signed zeros,
  subnormals, a K or vocabulary not a multiple of the tile, non-contiguous inputs, ties); each
  hazard must be shown to have occurred in the inputs, otherwise the gate is vacuous and fails.
- ``negative_control``: ``batch_invariance`` run on the stock implementation; it PASSES when the
  stock kernel differs (the gate has teeth on this machine).

Every gate also checks correctness against a float64 reference at a loose tolerance: a kernel
that returns zeros would be perfectly invariant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..contract import Entry, ImplRef, frozen_mapping
from ..enforce import bind
from .compare import BitReport, compare_bits, merge

GATE_FAMILIES = {
    "linear": ("batch_invariance", "hazards"),
    "norm": ("batch_invariance", "hazards"),
    "embed": ("batch_invariance",),
    "activation": ("batch_invariance",),
    "rope": ("batch_invariance",),
    "logprob": ("batch_invariance", "hazards"),
    "attention": ("batch_invariance", "case_parity"),
}

# Kinds whose stock kernel is known to be batch-variant on an arch (measured; GPU_ENV.md): the
# negative control must fail to be invariant there.
NEGATIVE_CONTROLS = {"cpu": ("linear",), "sm90": ("linear", "attention")}

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def gate_families_for(entry: Entry) -> tuple[str, ...]:
    from .. import registry

    return GATE_FAMILIES.get(registry.OPS[entry.region[0]].kind, ())


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
        return "pass" if counts["differing"] > 0 else "fail"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    den = ref.norm().item()
    return (out - ref).norm().item() / (den if den > 0 else 1.0)


def _rand(shape, dtype, gen, device, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype).to(device)


def _neighbourhood(row: torch.Tensor, m: int, gen, dtype, device, make) -> tuple[torch.Tensor, int]:
    """A batch of ``m`` random rows with ``row`` at a random position."""
    batch = make(m)
    pos = int(torch.randint(0, m, (1,), generator=gen))
    batch[pos] = row
    return batch, pos


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


# ------------------------------------------------------------------------------------ shapes
def linear_shape(region: tuple[str, ...], cfg: dict) -> tuple[int, int]:
    h = cfg["hidden_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    inter = cfg.get("intermediate_size", 4 * h)
    r = set(region)
    n = 0
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


def norm_width(region: tuple[str, ...], cfg: dict) -> int:
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

    def make(m):
        x = _rand((m, k), dtype, gen, device)
        if family == "hazards":
            mask = torch.rand((m, k), generator=gen) < 0.1
            x[mask.to(device)] = -0.0
            sub = torch.rand((m, k), generator=gen) < 0.05
            tiny = torch.full((m, k), 3e-39, dtype=torch.float32).to(dtype).to(device)  # subnormal in fp32 and bf16
            x = torch.where(sub.to(device), tiny, x)
        return x

    reports = []
    if family == "hazards":
        for m in sizes:
            wide = make(m).repeat(1, 2)            # non-contiguous view: every other column pair
            x = wide[:, ::2]
            exercised["noncontiguous"] = exercised.get("noncontiguous", False) or not x.is_contiguous()
            exercised["signed_zero"] = exercised.get("signed_zero", 0) + int(
                ((x == 0) & torch.signbit(x)).sum())
            xf = x.float()
            exercised["subnormal"] = exercised.get("subnormal", 0) + int(
                ((xf != 0) & (xf.abs() < torch.finfo(torch.float32).tiny)).sum())
            pos = int(torch.randint(0, m, (1,), generator=gen))
            reports.append(compare_bits(fn(x, w)[pos:pos + 1], fn(x[pos:pos + 1], w)))
    else:
        reports = _rowwise_invariance(lambda x: fn(x, w), make, sizes, gen)
    x = make(min(sizes[-1], 64))
    err = rel_err(fn(x, w), x.double() @ w.double().T)
    return GateOutcome(family, {"K": k, "N": n, "M": list(sizes)}, str(dtype), reports, err,
                       TOLERANCE[dtype], exercised, hazards if family == "hazards" else ())


def gate_norm(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants) -> GateOutcome:
    h = norm_width(region, cfg)
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    weight = (1.0 + 0.1 * _rand((h,), torch.float32, gen, "cpu")).to(dtype).to(device)
    exercised: dict = {}

    def make(m):
        x = _rand((m, h), dtype, gen, device)
        if family == "hazards":
            x[(torch.rand((m, h), generator=gen) < 0.1).to(device)] = -0.0
            sub = (torch.rand((m, h), generator=gen) < 0.05).to(device)
            x = torch.where(sub, torch.full_like(x, 3e-39), x)
        return x

    if family == "hazards":
        reports = []
        for m in sizes:
            x = make(m).repeat(1, 2)[:, ::2]
            exercised["noncontiguous"] = exercised.get("noncontiguous", False) or not x.is_contiguous()
            exercised["signed_zero"] = exercised.get("signed_zero", 0) + int(((x == 0) & torch.signbit(x)).sum())
            xf = x.float()
            exercised["subnormal"] = exercised.get("subnormal", 0) + int(
                ((xf != 0) & (xf.abs() < torch.finfo(torch.float32).tiny)).sum())
            pos = int(torch.randint(0, m, (1,), generator=gen))
            reports.append(compare_bits(fn(x, weight, eps)[pos:pos + 1], fn(x[pos:pos + 1], weight, eps)))
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


GATE_RUNNERS = {"linear": gate_linear, "norm": gate_norm, "logprob": gate_logprob}


def entry_with_impl(entry: Entry, impl: ImplRef) -> Entry:
    from .. import registry

    spec = registry.impl_by_ref(impl.id, impl.version, impl.arch)
    return Entry(region=entry.region, cases=entry.cases, impl=impl, constants=frozen_mapping(spec.default_constants()),
                 discharge=None, half="function")
