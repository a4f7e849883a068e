"""Next-token choice that depends only on (logits row, params, seed, request id, position).

Sampling is Gumbel-max, done by the ``sampling`` kernel (``isoexec_kernels.sampling``, one fused
Triton pass per row on CUDA, its float64 torch twin on CPU): ``argmax_v(z_v / T + g_v)`` over the
allowed support, with the noise ``g_v = -log(-log(u_v))`` and ``u_v`` a 23-bit uniform drawn from a
counter-based hash of (row key, v); the row key is a 32-bit hash of (seed, request id, position),
computed here on the host. There is no shared RNG stream and no reduction across rows: running a
request alone or among 63 others gives the same token.

Filters, applied before sampling (never for greedy), become one per-row cut on the logits (the
kernel keeps ``z >= cut``):

* top-k: keep every token whose logit is >= the k-th largest logit (ties at the cut are kept);
* top-p: on the tempered distribution restricted to top-k, keep the smallest prefix (by
  descending logit) whose mass reaches p, then every token >= the smallest kept logit. The mass
  is summed in 24-bit fixed point (int64) and compared with ``p`` in 20-bit fixed point, exact
  and therefore order-free. The tempered weights are fp32 ``exp`` of ``(z - max) / T``: on CUDA
  the device's elementwise ``exp`` (a pure function of the element), on CPU the position-free
  float64 ``_ref.exp64`` rounded to fp32 (the CPU's vectorised ``exp`` may round an element
  differently depending on where it falls in the tensor).

Greedy is ``argmax`` of the logits (first index on ties).

The returned logprob is that of the UNTEMPERED, unfiltered model distribution, computed by the
contract's ``logprob`` region on the same logits: the number the trainer's ``score_logprobs``
computes for the same token, bit for bit. Top-n logprobs come from that same region too (the row
repeated n times with the n candidate ids as targets), never from a separate log-softmax.

The per-row parameters (temperature, key, filters) travel to the device in :meth:`Sampler.plan`,
which the engine calls before it launches the step's forward, so no host-to-device copy waits
for the forward to finish.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence as Seq

import numpy as np
import torch

from isoexec_kernels._ref import exp64
from isoexec_kernels.sampling import gumbel_argmax, mix32

from .sequence import SamplingParams

_M32 = 0xFFFFFFFF
_MASS_BITS = 24               # fixed-point bits of a token's top-p mass (e <= 1)
_P_BITS = 20                  # fixed-point bits of p


def row_key(seed: int, request_id: int, position: int) -> int:
    """32-bit key of one sampled position (pure Python ints; :func:`row_keys` for many)."""
    h = mix32(0x243F6A88)
    for word in (seed & _M32, seed >> 32, request_id & _M32, (request_id >> 32) & _M32, position & _M32):
        h = mix32(h ^ word)
    return h


def row_keys(seeds: Seq[int], request_ids: Seq[int], positions: Seq[int]) -> np.ndarray:
    """:func:`row_key` of each row, as int64, computed with numpy (one pass, no Python loop)."""
    seed = np.asarray(seeds, dtype=np.uint64)
    rid = np.asarray(request_ids, dtype=np.uint64)
    pos = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    m = np.uint64(_M32)
    h = np.full(seed.shape, mix32(0x243F6A88), dtype=np.uint64)
    for word in (seed & m, seed >> np.uint64(32), rid & m, (rid >> np.uint64(32)) & m, pos & m):
        h = mix32(h ^ word)
    return h.astype(np.int64)


def p_fixed(top_p: float) -> int:
    """top_p in 20-bit fixed point (the top-p comparison is done in integers)."""
    return int(round(top_p * (1 << _P_BITS)))


def support_cut(z: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p_fix: torch.Tensor, any_top_p: Optional[bool] = None) -> torch.Tensor:
    """fp32 [R]: the smallest allowed logit of each row of z [R, V] under its top-k and top-p
    (module docstring; ``top_p_fix`` = :func:`p_fixed` of top_p, int64); top_k 0 = all, top_p 1 =
    all. Rows with neither give the row minimum. ``any_top_p``: whether some row has top_p < 1,
    when the caller knows it on the host (else it is read from the device: a sync that would
    stall the host until the step's forward is done)."""
    R, V = z.shape
    if V >= 1 << (63 - _MASS_BITS - _P_BITS):
        raise ValueError(f"support_cut: a vocabulary of {V} tokens overflows the fixed-point mass")
    s = torch.sort(z.to(torch.float32), dim=-1, descending=True).values   # values only: ties cannot matter
    k = torch.where((top_k > 0) & (top_k < V), top_k, torch.full_like(top_k, V))
    cut = s.gather(1, (k - 1)[:, None])                                    # k-th largest logit
    use_p = top_p_fix < (1 << _P_BITS)
    if any_top_p if any_top_p is not None else bool(use_p.any()):
        x = (s - s[:, :1]) / temperature[:, None]                            # <= 0, fp32
        e = torch.exp(x) if z.is_cuda else exp64(x.to(torch.float64)).to(torch.float32)
        e = torch.where(s >= cut, e, torch.zeros_like(e))
        q = torch.floor(e * float(1 << _MASS_BITS)).to(torch.int64)         # exact integer masses
        total = q.sum(-1, keepdim=True)
        need = (total * top_p_fix[:, None]) >> _P_BITS
        before = torch.cumsum(q, -1) - q
        n_keep = (before < need).sum(-1, keepdim=True).clamp(min=1)
        cut = torch.where(use_p[:, None], torch.maximum(cut, s.gather(1, n_keep - 1)), cut)
    return cut[:, 0]


@dataclass
class SamplingPlan:
    """The per-row parameters of one sampling call, already on the device."""

    rows: int
    greedy: bool                               # every row greedy: plain argmax
    temperature: Optional[torch.Tensor]        # fp32 [R], 0 for greedy rows
    keys: Optional[torch.Tensor]               # int64 [R]
    filtered: Optional[torch.Tensor]           # int64 indices of rows with top-k / top-p
    top_k: Optional[torch.Tensor]              # int64 [F]
    top_p_fix: Optional[torch.Tensor]          # int64 [F], p_fixed(top_p)
    logprobs: tuple[int, ...]                  # top-n logprobs wanted per row
    any_top_p: bool = False                    # some filtered row has top_p < 1 (known on the host)


@dataclass
class SampleOutput:
    tokens: torch.Tensor                      # int64 [R]
    logprobs: torch.Tensor                    # fp32 [R], untempered model logprobs of tokens
    top: list[Optional[tuple[list[int], list[float]]]]   # per row: (ids, fp32 values) or None


LogprobFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Sampler:
    def plan(self, params: Seq[SamplingParams], request_ids: Seq[int], positions: Seq[int],
             device) -> SamplingPlan:
        """Move the rows' parameters to ``device`` (module docstring)."""
        R = len(params)
        lp = tuple(p.logprobs for p in params)
        if all(p.greedy for p in params):
            return SamplingPlan(R, True, None, None, None, None, None, lp)
        temp = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
        keys = torch.from_numpy(row_keys([p.seed for p in params], request_ids, positions))
        filt = [i for i, p in enumerate(params) if not p.greedy and (p.top_k > 0 or p.top_p < 1.0)]
        f_idx = f_k = f_p = None
        any_p = any(p_fixed(params[i].top_p) < (1 << _P_BITS) for i in filt)
        if filt:
            f_idx = torch.tensor(filt, dtype=torch.int64).to(device, non_blocking=True)
            f_k = torch.tensor([params[i].top_k for i in filt], dtype=torch.int64).to(device, non_blocking=True)
            f_p = torch.tensor([p_fixed(params[i].top_p) for i in filt], dtype=torch.int64).to(device, non_blocking=True)
        return SamplingPlan(R, False, temp.to(device, non_blocking=True), keys.to(device, non_blocking=True),
                            f_idx, f_k, f_p, lp, any_p)

    def choose_planned(self, logits: torch.Tensor, plan: SamplingPlan) -> torch.Tensor:
        """The next token of every row of ``logits`` [R, V] (int64 [R])."""
        if plan.greedy:
            return torch.argmax(logits, dim=-1)          # first maximum
        cut = torch.full((plan.rows,), float("-inf"), dtype=torch.float32, device=logits.device)
        if plan.filtered is not None:
            cut[plan.filtered] = support_cut(logits[plan.filtered], plan.temperature[plan.filtered],
                                             plan.top_k, plan.top_p_fix, plan.any_top_p)
        return gumbel_argmax(logits, plan.temperature, cut, plan.keys)

    def choose(self, logits: torch.Tensor, params: Seq[SamplingParams], request_ids: Seq[int],
               positions: Seq[int]) -> torch.Tensor:
        """The next token of every row of ``logits`` [R, V] (int64 [R])."""
        return self.choose_planned(logits, self.plan(params, request_ids, positions, logits.device))

    def sample(self, logits: torch.Tensor, plan: SamplingPlan, logprob_fn: "LogprobFn") -> SampleOutput:
        """Choose the tokens, then their logprobs (and top-n) through the logprob region."""
        tokens = self.choose_planned(logits, plan)
        lps = logprob_fn(logits, tokens)
        top: list[Optional[tuple[list[int], list[float]]]] = []
        for r, want in enumerate(plan.logprobs):
            n = min(want, logits.shape[-1])
            if not n:
                top.append(None)
                continue
            row = logits[r].to(torch.float32)                                     # exact
            cand = torch.sort(row, descending=True, stable=True).indices[:n]  # ties: lower id first
            vals = logprob_fn(logits[r:r + 1].expand(n, -1).contiguous(), cand)
            top.append((cand.tolist(), vals.tolist()))
        return SampleOutput(tokens, lps, top)

    def __call__(self, logits: torch.Tensor, params: Seq[SamplingParams], request_ids: Seq[int],
                 positions: Seq[int], logprob_fn: "LogprobFn") -> SampleOutput:
        return self.sample(logits, self.plan(params, request_ids, positions, logits.device), logprob_fn)
