"""Policy-gradient losses over the response tokens of a packed mini-batch.

Every loss takes flat per-token fp32 tensors for the response tokens of some sequences, laid
out sequence after sequence (``seq_lens[b]`` tokens for sequence ``b``):

``logprobs``       log pi_theta(token), with autograd (``trainer_fwd``)
``old_logprobs``   log pi_old(token), the behaviour policy of the PPO ratio (no grad)
``advantages``     the sequence's advantage broadcast to each of its response tokens
``mask``           tokens that count (rejected or padded tokens are False); default all
``weights``        per-token off-policy weights (TIS, see ``corrections.py``), detached

Why a ``denom`` argument: the losses are means, and a mini-batch is usually scored in several
packed micro-batches whose gradients are accumulated. Giving each micro-batch the denominator of
the whole mini-batch (its token count for DAPO/REINFORCE, its sequence count for GRPO) makes the
micro-batch losses *shares* of the mini-batch loss, so their sum (and the sum of their gradients)
is the mini-batch loss exactly up to summation order. Left as ``None`` it is the local count.

Each function returns ``(loss, stats)``; ``stats`` are detached 0-d fp32 tensors (no host sync)
measured over the counted tokens: ``tokens``, ``ratio_mean/min/max``, ``clip_frac_low`` (A < 0 and
the ratio fell below ``1 - clip_low``: the clipped branch is taken and the token gives no
gradient), ``clip_frac_high`` (A > 0 and the ratio rose above ``1 + clip_high``) and
``clip_frac`` (their sum), ``dual_clip_frac`` (A < 0 and the ratio rose above the dual-clip
bound ``clip_ratio_c``: the loss is held at ``-A c`` and the token gives no gradient; 0 when the
dual clip is off); GRPO adds ``kl`` when a reference is used.

Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games"; on in verl's DAPO recipe
with ``clip_ratio_c = 10``): for a negative advantage the PPO objective ``max(-A r, -A clip(r))``
grows without bound in r, so one token whose probability rose a hundredfold since the rollout
(the H200 runs logged ratio_max 292) can dominate a mini-batch's gradient. The dual clip caps that
token's loss at ``-A c``; positive advantages are already capped by ``1 + clip_high``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

LOSSES = ("dapo", "grpo", "reinforce")

Tensor = torch.Tensor


def _prepare(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Optional[Tensor],
             weights: Optional[Tensor]):
    """Check shapes, bring everything to fp32 on the logprobs' device, zero masked tokens."""
    T = logprobs.shape[0]
    if logprobs.dim() != 1:
        raise ValueError(f"logprobs must be flat [T] per-token values, got shape {tuple(logprobs.shape)}")
    if logprobs.dtype != torch.float32:
        raise ValueError(f"logprobs must be fp32 (the logprob region's output), got {logprobs.dtype}")
    dev = logprobs.device
    named = {"old_logprobs": old_logprobs, "advantages": advantages, "mask": mask, "weights": weights}
    for name, t in named.items():
        if t is not None and tuple(t.shape) != (T,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected ({T},) like logprobs")
    m = torch.ones(T, dtype=torch.bool, device=dev) if mask is None else mask.to(dev, torch.bool)
    # Masked tokens are zeroed at the inputs, not only at the sum: a non-finite value there would
    # otherwise come back as NaN in the gradient (0 * d/dx of a NaN branch is NaN).
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    fill = lambda t: torch.where(m, t.to(dev, torch.float32), zero)  # noqa: E731
    lp = fill(logprobs)
    old = fill(old_logprobs.detach())
    adv = fill(advantages.detach())
    w = None if weights is None else fill(weights.detach())
    return lp, old, adv, m, w


def _denominator(denom, local: Tensor) -> Tensor:
    """``denom`` (or the local count) as an fp32 tensor, at least 1 so an empty batch gives 0."""
    d = local if denom is None else torch.as_tensor(denom, dtype=torch.float32, device=local.device)
    return d.to(torch.float32).clamp_min(1.0)


def _masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    # where(), not multiply: a masked token with a non-finite value must not poison the sum
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()


@torch.no_grad()
def ratio_stats(ratio: Tensor, advantages: Tensor, mask: Tensor, clip_low: Optional[float],
                clip_high: Optional[float], clip_ratio_c: Optional[float] = None) -> dict[str, Tensor]:
    """Ratio and clip statistics over the counted tokens (see the module docstring)."""
    r = ratio.detach()
    n = mask.sum().to(torch.float32)
    d = n.clamp_min(1.0)
    zero = torch.zeros((), dtype=torch.float32, device=r.device)
    if clip_low is None:
        low = high = zero
    else:
        low = (mask & (advantages < 0) & (r < 1.0 - clip_low)).sum().to(torch.float32) / d
        high = (mask & (advantages > 0) & (r > 1.0 + clip_high)).sum().to(torch.float32) / d
    # -A max(r, clip(r)) > -A c  <=>  r > c for A < 0, since clip(r) <= 1 + clip_high < c
    dual = zero if not clip_ratio_c else \
        (mask & (advantages < 0) & (r > clip_ratio_c)).sum().to(torch.float32) / d
    any_tok = bool(mask.any())
    return {
        "tokens": n,
        "ratio_mean": _masked_sum(r, mask) / d,
        "ratio_min": r[mask].min() if any_tok else zero + 1.0,
        "ratio_max": r[mask].max() if any_tok else zero + 1.0,
        "clip_frac_low": low,
        "clip_frac_high": high,
        "clip_frac": low + high,
        "dual_clip_frac": dual,
    }


def check_clip_ratio_c(clip_ratio_c: Optional[float], clip_high: float) -> None:
    """The dual-clip bound must lie above the upper clip bound, or it would cut into the
    ordinary clipped region (verl asserts c > 1 for the same reason)."""
    if clip_ratio_c and clip_ratio_c <= 1.0 + clip_high:
        raise ValueError(f"clip_ratio_c {clip_ratio_c} must exceed 1 + clip_high = {1.0 + clip_high} (0/None: off)")


def clipped_surrogate(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_low: float,
                      clip_high: float, clip_ratio_c: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """Per-token PPO loss ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`` and the ratio r;
    with ``clip_ratio_c`` (dual clip, see the module docstring) tokens with A < 0 take
    ``min(that, -A c)``. 0 or None: no dual clip.

    The ratio is formed from the log difference so identical logprobs give r = exp(0) = 1 exactly.
    """
    check_clip_ratio_c(clip_ratio_c, clip_high)
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -torch.minimum(ratio * advantages, clipped * advantages)
    if clip_ratio_c:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * clip_ratio_c), loss)
    return loss, ratio


def dapo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Optional[Tensor] = None, *,
              clip_low: float = 0.2, clip_high: float = 0.28, clip_ratio_c: Optional[float] = None,
              weights: Optional[Tensor] = None, denom=None) -> tuple[Tensor, dict]:
    """DAPO: decoupled clip (a higher upper bound lets low-probability tokens grow: "clip-higher")
    and a TOKEN-level mean over every counted token of the mini-batch, so long responses weigh
    in proportion to their length instead of being averaged down per sequence. No KL term.
    ``clip_ratio_c``: the dual clip for negative advantages (the trainer's default is 10)."""
    logprobs, old, adv, m, w = _prepare(logprobs, old_logprobs, advantages, mask, weights)
    tok, ratio = clipped_surrogate(logprobs, old, adv, clip_low, clip_high, clip_ratio_c)
    if w is not None:
        tok = tok * w
    stats = ratio_stats(ratio, adv, m, clip_low, clip_high, clip_ratio_c)
    loss = _masked_sum(tok, m) / _denominator(denom, stats["tokens"])
    return loss, stats


def reinforce_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Optional[Tensor] = None, *,
                   weights: Optional[Tensor] = None, denom=None) -> tuple[Tensor, dict]:
    """REINFORCE: ``-A log pi`` with a token-level mean; unclipped, so it is only unbiased on
    policy. ``old_logprobs`` only feed the ratio statistics (clip fractions are zero)."""
    logprobs, old, adv, m, w = _prepare(logprobs, old_logprobs, advantages, mask, weights)
    tok = -adv * logprobs
    if w is not None:
        tok = tok * w
    stats = ratio_stats(torch.exp(logprobs.detach() - old), adv, m, None, None)
    loss = _masked_sum(tok, m) / _denominator(denom, stats["tokens"])
    return loss, stats


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || ref): ``exp(d) - d - 1`` with ``d = ref - logp``;
    non-negative and unbiased for tokens sampled from pi, differentiable through ``logprobs``."""
    d = ref_logprobs - logprobs
    return torch.expm1(d) - d


def grpo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, seq_lens: Sequence[int],
              mask: Optional[Tensor] = None, *, clip: float = 0.2, kl_coef: float = 0.0,
              ref_logprobs: Optional[Tensor] = None, weights: Optional[Tensor] = None,
              clip_ratio_c: Optional[float] = None, denom=None) -> tuple[Tensor, dict]:
    """GRPO: symmetric clip, the token mean taken PER SEQUENCE and then the mean over sequences
    (each response counts once whatever its length), plus ``kl_coef`` times the k3 KL to a
    reference policy. ``kl_coef = 0`` (the default) needs no reference model.

    ``denom`` counts sequences here; a sequence with no counted token is left out of the count.
    """
    logprobs, old, adv, m, w = _prepare(logprobs, old_logprobs, advantages, mask, weights)
    lens = [int(n) for n in seq_lens]
    if sum(lens) != logprobs.shape[0]:
        raise ValueError(f"seq_lens sum to {sum(lens)} but there are {logprobs.shape[0]} tokens")
    tok, ratio = clipped_surrogate(logprobs, old, adv, clip, clip, clip_ratio_c)
    if w is not None:  # the off-policy weight corrects the policy-gradient term, not the KL penalty
        tok = tok * w
    kl = None
    if kl_coef:
        if ref_logprobs is None:
            raise ValueError("grpo_loss: kl_coef > 0 needs ref_logprobs (the reference policy's logprobs)")
        if tuple(ref_logprobs.shape) != tuple(logprobs.shape):
            raise ValueError(f"ref_logprobs has shape {tuple(ref_logprobs.shape)}; expected {tuple(logprobs.shape)}")
        ref = torch.where(m, ref_logprobs.detach().to(logprobs.device, torch.float32), 0.0)
        kl = k3_kl(logprobs, ref)
        tok = tok + kl_coef * kl
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    masked = torch.where(m, tok, zero)
    counts = torch.stack([c.sum() for c in m.to(torch.float32).split(lens)]) if lens else zero[None][:0]
    sums = torch.stack([s.sum() for s in masked.split(lens)]) if lens else zero[None][:0]
    present = counts > 0
    seq_means = torch.where(present, sums / counts.clamp_min(1.0), zero)
    loss = seq_means.sum() / _denominator(denom, present.sum().to(torch.float32))
    stats = ratio_stats(ratio, adv, m, clip, clip, clip_ratio_c)
    stats["sequences"] = present.sum().to(torch.float32)
    if kl is not None:
        stats["kl"] = _masked_sum(kl.detach(), m) / stats["tokens"].clamp_min(1.0)
    return loss, stats


def policy_loss(kind: str, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, seq_lens: Sequence[int],
                mask: Optional[Tensor] = None, *, clip_low: float = 0.2, clip_high: float = 0.28,
                kl_coef: float = 0.0, ref_logprobs: Optional[Tensor] = None, weights: Optional[Tensor] = None,
                clip_ratio_c: Optional[float] = None, denom=None) -> tuple[Tensor, dict]:
    """Dispatch on ``kind`` (one of ``LOSSES``). ``denom`` is a token count for dapo/reinforce and a
    sequence count for grpo (which clips symmetrically at ``clip_low``). ``clip_ratio_c`` (dual
    clip) applies to the clipped losses, dapo and grpo; reinforce has no ratio in its loss."""
    if kind == "dapo":
        return dapo_loss(logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                         clip_ratio_c=clip_ratio_c, weights=weights, denom=denom)
    if kind == "grpo":
        return grpo_loss(logprobs, old_logprobs, advantages, seq_lens, mask, clip=clip_low, kl_coef=kl_coef,
                         ref_logprobs=ref_logprobs, weights=weights, clip_ratio_c=clip_ratio_c, denom=denom)
    if kind == "reinforce":
        return reinforce_loss(logprobs, old_logprobs, advantages, mask, weights=weights, denom=denom)
    raise ValueError(f"unknown loss {kind!r}; choose one of {', '.join(LOSSES)}")
