"""Kernel-level gates of the hybrid family's Gated DeltaNet regions (docs/gates.md families 1, 2, 7).

Two of the regions carry per-sequence state across calls (the short conv's window and the delta
rule's state), so their gates are sequence gates, like attention's:

- batch_invariance: a sequence alone (trainer varlen call) == the same sequence packed among
  random others at a random offset.
- case_parity: trainer varlen rows == engine prefill rows with every sequence cut at random
  points into pieces (several sequences per call, state slots shuffled) == decode rows for the
  tail tokens, one token per sequence per call. Lengths cross chunk boundaries (the CPR core's
  CHUNK) and are not multiples of it: the ``len_not_chunk_multiple`` hazard.

The stateless regions (prep, gated output norm, sigmoid gate) are row-wise: a token's row alone
== the same row inside a batch. Every gate also checks correctness against float64 at tolerance.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from isoexec_kernels.gdn_core import GDNState

from ..model.hybrid import CHUNK_FORM_IMPLS
from .compare import BitReport, compare_bits
from .kernel_gates import TOLERANCE, GateOutcome, _rand, _rowwise_invariance, rel_err


def _dims(cfg: dict) -> dict:
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    return dict(hk=hk, hv=hv, dk=dk, dv=dv, conv_dim=2 * hk * dk + hv * dv, width=cfg["linear_conv_kernel_dim"])


def _cu(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _max_len(device: str) -> int:
    return 160 if device == "cpu" else 600


def _sequence_gate(family: str, gen, sizes, device, chunk: int, make: Callable[[int], list[torch.Tensor]],
                   varlen, engine, decode, new_state: Callable[[int], object]) -> tuple[list[BitReport], dict]:
    """The two sequence gates for a stateful region. ``make(n)`` -> per-token tensors of one
    sequence (dim 0 = tokens); ``varlen(ts, cu)``, ``engine(ts, cu_q, slots, state)``,
    ``decode(ts, slots, state)`` call the bound region; ``new_state(num_slots)`` allocates."""
    max_len = _max_len(device)
    reports: list[BitReport] = []
    exercised = {"len_not_chunk_multiple": False, "chunk_boundary_crossed": False}

    def pack(seqs):
        return [torch.cat([s[j] for s in seqs]) for j in range(len(seqs[0]))]

    counts = [c for c in (1, 2, 5, 16, 64) if c <= max(sizes)]
    if family == "batch_invariance":
        for nseq in counts:
            n = int(torch.randint(1, max_len, (1,), generator=gen))
            target = make(n)
            alone = varlen(target, _cu([n], device))
            others = [make(int(torch.randint(1, max_len, (1,), generator=gen))) for _ in range(nseq - 1)]
            pos = int(torch.randint(0, nseq, (1,), generator=gen))
            seqs = others[:pos] + [target] + others[pos:]
            lens = [s[0].shape[0] for s in seqs]
            off = sum(lens[:pos])
            reports.append(compare_bits(varlen(pack(seqs), _cu(lens, device))[off:off + n], alone))
            exercised["len_not_chunk_multiple"] |= n % chunk != 0
            exercised["chunk_boundary_crossed"] |= n > chunk
        return reports, exercised
    for nseq in counts[:4]:
        lens = [int(torch.randint(2, max_len, (1,), generator=gen)) for _ in range(nseq)]
        seqs = [make(n) for n in lens]
        trainer = varlen(pack(seqs), _cu(lens, device))
        state = new_state(nseq + 3)
        slot_of = torch.randperm(nseq + 3, generator=gen)[:nseq].tolist()   # shuffled, some slots unused
        tails = [int(torch.randint(1, min(n, 9), (1,), generator=gen)) for n in lens]
        done = [0] * nseq
        rows: list[list[torch.Tensor]] = [[] for _ in range(nseq)]
        while any(done[b] < lens[b] - tails[b] for b in range(nseq)):
            live = [b for b in range(nseq) if done[b] < lens[b] - tails[b]]
            steps = {b: min(lens[b] - tails[b] - done[b], int(torch.randint(1, 2 * chunk, (1,), generator=gen)))
                     for b in live}
            ts = [torch.cat([seqs[b][j][done[b]:done[b] + steps[b]] for b in live]) for j in range(len(seqs[0]))]
            slots = torch.tensor([slot_of[b] for b in live], dtype=torch.int32, device=device)
            out = engine(ts, _cu([steps[b] for b in live], device), slots, state)
            at = 0
            for b in live:
                rows[b].append(out[at:at + steps[b]])
                at += steps[b]
                done[b] += steps[b]
        for t in range(max(tails)):
            live = [b for b in range(nseq) if t < tails[b]]
            ts = [torch.cat([seqs[b][j][done[b]:done[b] + 1] for b in live]) for j in range(len(seqs[0]))]
            slots = torch.tensor([slot_of[b] for b in live], dtype=torch.int32, device=device)
            out = decode(ts, slots, state)
            for i, b in enumerate(live):
                rows[b].append(out[i:i + 1])
                done[b] += 1
        at = 0
        for b, n in enumerate(lens):
            reports.append(compare_bits(torch.cat(rows[b]), trainer[at:at + n]))
            at += n
            exercised["len_not_chunk_multiple"] |= n % chunk != 0
            exercised["chunk_boundary_crossed"] |= n > chunk
    return reports, exercised


# ------------------------------------------------------------------------------------ gdn_core
def _core_inputs(d: dict, dtype, gen, device):
    def make(n):
        q = F.normalize(torch.randn((n, d["hk"], d["dk"]), generator=gen), dim=-1) * d["dk"] ** -0.5
        k = F.normalize(torch.randn((n, d["hk"], d["dk"]), generator=gen), dim=-1)
        v = torch.randn((n, d["hv"], d["dv"]), generator=gen).to(dtype)
        g = -torch.rand((n, d["hv"]), generator=gen) * 0.5          # log decay in (-0.5, 0]
        beta = torch.sigmoid(torch.randn((n, d["hv"]), generator=gen))
        return [t.to(device) for t in (q, k, v, g, beta)]
    return make


def _recurrence64(q, k, v, g, beta) -> torch.Tensor:
    """The gated delta rule token by token in float64 (one sequence)."""
    q, k, v, g, beta = (t.double().cpu() for t in (q, k, v, g, beta))
    rep = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    S = torch.zeros(v.shape[1], q.shape[2], v.shape[2], dtype=torch.float64)
    out = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", S, k[t])) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(out)


def gate_gdn_core(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants, binds=None) -> GateOutcome:
    d = _dims(cfg)
    chunk = int(constants.get("CHUNK", 64))
    make = _core_inputs(d, dtype, gen, device)
    varlen, engine, decode = binds["trainer_score"], binds.get("engine_prefill"), binds.get("engine_decode")
    # the state the model allocates for the bound impl (a chunk-form core's keeps the open chunk's
    # queries and rows of Vn and T, and its values in their dtype)
    chunk_form = any(getattr(b, "record", None) is not None and b.record.impl_id in CHUNK_FORM_IMPLS
                     for b in binds.values())
    reports, exercised = _sequence_gate(
        family, gen, sizes, device, chunk, make,
        lambda ts, cu: varlen(*ts, cu, chunk=chunk),
        lambda ts, cu, slots, st: engine(*ts, cu, slots, st, chunk=chunk),
        lambda ts, slots, st: decode(*ts, slots, st, chunk=chunk),
        lambda n: GDNState.allocate(n, d["hv"], d["dk"], d["dv"], device, chunk=chunk, with_q=chunk_form,
                                    value_dtype=dtype))
    one = make(int(torch.randint(chunk + 1, 2 * chunk + 40, (1,), generator=gen)))
    err = rel_err(varlen(*one, _cu([one[0].shape[0]], device), chunk=chunk), _recurrence64(*one))
    return GateOutcome(family, dict(d, chunk=chunk, max_len=_max_len(device)), str(dtype), reports, err,
                       TOLERANCE[dtype], exercised, ("len_not_chunk_multiple", "chunk_boundary_crossed"))


# ------------------------------------------------------------------------------------ gdn_conv
def gate_gdn_conv(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants, binds=None) -> GateOutcome:
    d = _dims(cfg)
    D, W = d["conv_dim"], d["width"]
    weight = _rand((D, W), dtype, gen, device, 0.5)
    varlen, engine, decode = binds["trainer_score"], binds.get("engine_prefill"), binds.get("engine_decode")

    def make(n):
        return [_rand((n, D), dtype, gen, device)]

    reports, exercised = _sequence_gate(
        family, gen, sizes, device, W, make,
        lambda ts, cu: varlen(ts[0], weight, cu),
        lambda ts, cu, slots, st: engine(ts[0], weight, cu, slots, st),
        lambda ts, slots, st: decode(ts[0], weight, slots, st),
        lambda n: torch.zeros((n, D, W - 1), dtype=dtype, device=device))
    x = make(50)[0]
    ref = F.conv1d(x.double().cpu().T[None], weight.double().cpu()[:, None], padding=W - 1, groups=D)[0, :, :50].T
    err = rel_err(varlen(x, weight, _cu([50], device)), F.silu(ref))
    return GateOutcome(family, {"D": D, "width": W, "max_len": _max_len(device)}, str(dtype), reports, err,
                       TOLERANCE[dtype], exercised, ("len_not_chunk_multiple",))


# ------------------------------------------------------------------------------------ row-wise regions
def gate_gdn_prep(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants) -> GateOutcome:
    d = _dims(cfg)
    hk, hv, dk = d["hk"], d["hv"], d["dk"]
    A_log = _rand((hv,), torch.float32, gen, device, 0.5)
    dt_bias = _rand((hv,), torch.float32, gen, device, 0.5)
    width = 2 * hk * dk + 2 * hv

    def call(x):
        q, k = x[:, :hk * dk].reshape(-1, hk, dk), x[:, hk * dk:2 * hk * dk].reshape(-1, hk, dk)
        a, b = x[:, 2 * hk * dk:2 * hk * dk + hv], x[:, 2 * hk * dk + hv:]
        return torch.cat([t.float().reshape(t.shape[0], -1) for t in fn(q, k, a, b, A_log, dt_bias)], dim=1)

    def make(m):
        return _rand((m, width), dtype, gen, device)

    reports = _rowwise_invariance(call, make, sizes, gen)
    x = make(16)
    xd = x.double().cpu()
    q, k = xd[:, :hk * dk].reshape(-1, hk, dk), xd[:, hk * dk:2 * hk * dk].reshape(-1, hk, dk)
    a, b = xd[:, 2 * hk * dk:2 * hk * dk + hv], xd[:, 2 * hk * dk + hv:]
    g = -A_log.double().cpu().exp() * F.softplus(a + dt_bias.double().cpu())
    ref = torch.cat([(F.normalize(q, dim=-1, eps=1e-6) * dk ** -0.5).reshape(16, -1),
                     F.normalize(k, dim=-1, eps=1e-6).reshape(16, -1), g, torch.sigmoid(b)], dim=1)
    return GateOutcome(family, {"hk": hk, "hv": hv, "dk": dk, "M": list(sizes)}, str(dtype), reports,
                       rel_err(call(x), ref), TOLERANCE[dtype], {})


def gate_gated_norm(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants) -> GateOutcome:
    d = _dims(cfg)
    hv, dv = d["hv"], d["dv"]
    weight = (1.0 + 0.1 * torch.randn((dv,), generator=gen)).to(dtype).to(device)
    eps = float(cfg.get("rms_norm_eps", 1e-6))

    def call(x):
        return fn(x[:, :hv * dv].reshape(-1, hv, dv), x[:, hv * dv:].reshape(-1, hv, dv), weight, eps)

    def make(m):
        return _rand((m, 2 * hv * dv), dtype, gen, device)

    reports = _rowwise_invariance(call, make, sizes, gen)
    x = make(16)
    xd = x.double().cpu()
    o, z = xd[:, :hv * dv].reshape(-1, hv, dv), xd[:, hv * dv:].reshape(-1, hv, dv)
    ref = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight.double().cpu() * F.silu(z)
    return GateOutcome(family, {"hv": hv, "dv": dv, "M": list(sizes)}, str(dtype), reports, rel_err(call(x), ref),
                       TOLERANCE[dtype], {})


def gate_sigmoid_gate(fn, region, cfg, family, dtype, device, gen, sizes, hazards, constants) -> GateOutcome:
    width = cfg["num_attention_heads"] * cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])

    def call(x):
        return fn(x[:, :width], x[:, width:])

    def make(m):
        return _rand((m, 2 * width), dtype, gen, device, 2.0)

    reports = _rowwise_invariance(call, make, sizes, gen)
    x = make(16)
    xd = x.double().cpu()
    return GateOutcome(family, {"width": width, "M": list(sizes)}, str(dtype), reports,
                       rel_err(call(x), xd[:, :width] * torch.sigmoid(xd[:, width:])), TOLERANCE[dtype], {})

