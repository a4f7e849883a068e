"""Next-token choice that depends only on (logits row, params, seed, request id, position).

Sampling is Gumbel-max: ``argmax_v(z_v / T + g_v)`` over the allowed support, with the noise
``g_v = -log(-log(u_v))`` and ``u_v`` a 52-bit uniform drawn from a counter-based hash of
(seed, request id, position, v). The hash is 32-bit integer mixing (lowbias32) done with int64
tensor ops that never overflow, and the logs are ``isoexec_kernels._ref.log64`` (float64 from
basic operations only), so the noise of a row has the same bits whatever the batch, the row's
place in it, the thread count, or the device's vector width. There is no shared RNG stream:
running a request alone or among 63 others gives the same token.

Every float step is elementwise and correctly rounded (fp32/bf16 -> float64 is exact, then one
division by T and one addition), and ``argmax`` returns the first maximum, so the choice is a
pure function of the row. Filters, applied before sampling (never for greedy):

* top-k: keep every token whose logit is >= the k-th largest logit (ties at the cut are kept);
* top-p: on the tempered distribution restricted to top-k, keep the smallest prefix (by
  descending logit) whose mass reaches p, then every token >= the smallest kept logit. The mass
  is summed in 40-bit fixed point (int64), exact and therefore order-free.

The returned logprob is that of the UNTEMPERED, unfiltered model distribution, computed by the
contract's ``logprob`` region on the same logits: the number the trainer's ``score_logprobs``
computes for the same token, bit for bit. Top-n logprobs come from that same region too (the row
repeated n times with the n candidate ids as targets), never from a separate log-softmax.

Greedy is ``argmax`` of the logits (first index on ties).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence as Seq

import torch

from isoexec_kernels._ref import exp64, log64

from .sequence import SamplingParams

_M32 = 0xFFFFFFFF
_FIX = float(2 ** 40)         # fixed-point scale of the top-p mass


def _mul32(x, c: int):
    """(x * c) mod 2**32 for 0 <= x < 2**32, without leaving int64 (ints or int64 tensors)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def mix32(x):
    """lowbias32 (C. Wellons): a 32-bit integer hash with good avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_key(seed: int, request_id: int, position: int) -> int:
    """32-bit key of one sampled position (pure Python ints, same mixing as the tensor path)."""
    h = mix32(0x243F6A88)
    for word in (seed & _M32, seed >> 32, request_id & _M32, (request_id >> 32) & _M32, position & _M32):
        h = mix32(h ^ word)
    return h


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float64 [R, V] uniforms in (0, 1), 52 random bits each, from int64 row keys [R]."""
    v = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    hv = mix32(v ^ 0x9E3779B9)
    h1 = mix32(keys[:, None] ^ hv[None, :])
    h2 = mix32(h1 ^ 0x85EBCA6B)
    n = ((h1 >> 6) << 26) | (h2 >> 6)                 # < 2**52: exact in float64
    return (n.to(torch.float64) + 0.5) * (2.0 ** -52)


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return -log64(-log64(uniform_noise(keys, vocab_size)))


def support_mask(z: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor) -> torch.Tensor:
    """Allowed tokens [R, V] (bool) for float64 logits z [R, V]; top_k 0 = all, top_p 1 = all."""
    R, V = z.shape
    s = torch.sort(z, dim=-1, descending=True).values  # values only: tie order cannot matter
    k = torch.where((top_k > 0) & (top_k < V), top_k, torch.full_like(top_k, V))
    cut = s.gather(1, (k - 1)[:, None])                                    # k-th largest logit
    use_p = top_p < 1.0
    if bool(use_p.any()):
        e = exp64((s - s[:, :1]) / temperature[:, None])
        e = torch.where(s >= cut, e, torch.zeros_like(e))
        q = torch.floor(e * _FIX).to(torch.int64)                          # exact integer masses
        total = q.sum(-1, keepdim=True)
        before = torch.cumsum(q, -1) - q
        keep = before.to(torch.float64) < total.to(torch.float64) * top_p[:, None]
        n_keep = keep.sum(-1, keepdim=True).clamp(min=1)
        cut_p = s.gather(1, n_keep - 1)
        cut = torch.where(use_p[:, None], torch.maximum(cut, cut_p), cut)
    return z >= cut


@dataclass
class SampleOutput:
    tokens: torch.Tensor                      # int64 [R]
    logprobs: torch.Tensor                    # fp32 [R], untempered model logprobs of tokens
    top: list[Optional[tuple[list[int], list[float]]]]   # per row: (ids, fp32 values) or None


LogprobFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Sampler:
    def choose(self, logits: torch.Tensor, params: Seq[SamplingParams], request_ids: Seq[int],
               positions: Seq[int]) -> torch.Tensor:
        """The next token of every row of ``logits`` [R, V] (int64 [R])."""
        R, V = logits.shape
        device = logits.device
        z = logits.to(torch.float64)                     # exact for bf16/fp16/fp32
        tokens = torch.argmax(z, dim=-1)                 # greedy rows keep this (first max)
        idx = [i for i, p in enumerate(params) if not p.greedy]
        if not idx:
            return tokens
        zs = z[idx]
        temp = torch.tensor([params[i].temperature for i in idx], dtype=torch.float64, device=device)
        top_k = torch.tensor([params[i].top_k for i in idx], dtype=torch.int64, device=device)
        top_p = torch.tensor([params[i].top_p for i in idx], dtype=torch.float64, device=device)
        keys = torch.tensor([row_key(params[i].seed, request_ids[i], positions[i]) for i in idx],
                            dtype=torch.int64, device=device)
        scores = zs / temp[:, None] + gumbel_noise(keys, V)
        if bool(((top_k > 0) & (top_k < V)).any() or (top_p < 1.0).any()):
            allowed = support_mask(zs, temp, top_k, top_p)
            scores = torch.where(allowed, scores, torch.full_like(scores, -torch.inf))
        tokens[torch.tensor(idx, device=device)] = torch.argmax(scores, dim=-1)
        return tokens

    def __call__(self, logits: torch.Tensor, params: Seq[SamplingParams], request_ids: Seq[int],
                 positions: Seq[int], logprob_fn: LogprobFn) -> SampleOutput:
        """Choose the tokens, then their logprobs (and top-n) through the logprob region."""
        tokens = self.choose(logits, params, request_ids, positions)
        lps = logprob_fn(logits, tokens)
        top: list[Optional[tuple[list[int], list[float]]]] = []
        for r, p in enumerate(params):
            n = min(p.logprobs, logits.shape[-1])
            if not n:
                top.append(None)
                continue
            row = logits[r].to(torch.float64)
            cand = torch.sort(row, descending=True, stable=True).indices[:n]  # ties: lower id first
            vals = logprob_fn(logits[r:r + 1].expand(n, -1).contiguous(), cand)
            top.append((cand.tolist(), vals.tolist()))
        return SampleOutput(tokens, lps, top)
