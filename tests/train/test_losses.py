"""Policy-gradient losses against hand-computed values: clip boundaries, asymmetric clip,
token-level vs sequence-level means, masks, denominators for micro-batch accumulation."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from isoexec.train.losses import dapo_loss, grpo_loss, k3_kl, policy_loss, reinforce_loss

# Six tokens chosen around the clip bounds; ratios r and advantages A:
#   t0 r=1.5  A=+1  above 1+0.28 -> clipped (high)     t3 r=0.5  A=+1  below 1-0.2 but A>0 -> unclipped
#   t1 r=0.5  A=-1  below 1-0.2  -> clipped (low)      t4 r=1.5  A=-1  above bound but A<0 -> unclipped
#   t2 r=1.1  A=+1  inside                             t5 r=1.25 A=+1  inside for DAPO (1.28), clipped for GRPO (1.2)
RATIOS = [1.5, 0.5, 1.1, 0.5, 1.5, 1.25]
ADV = [1.0, -1.0, 1.0, 1.0, -1.0, 1.0]


def _tokens():
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, -2.5])
    logp = (old.double() + torch.tensor(RATIOS, dtype=torch.float64).log()).float().requires_grad_(True)
    return logp, old, torch.tensor(ADV)


def test_dapo_values_at_clip_boundaries():
    logp, old, adv = _tokens()
    loss, stats = dapo_loss(logp, old, adv)
    per_tok = [-1.28, 0.8, -1.1, -0.5, 1.5, -1.25]
    assert loss.item() == pytest.approx(sum(per_tok) / 6, abs=1e-6)
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 6)
    assert stats["clip_frac_high"].item() == pytest.approx(1 / 6)
    assert stats["clip_frac"].item() == pytest.approx(2 / 6)
    assert stats["ratio_mean"].item() == pytest.approx(sum(RATIOS) / 6, abs=1e-6)
    assert stats["ratio_max"].item() == pytest.approx(1.5, abs=1e-6)
    assert stats["tokens"].item() == 6
    loss.backward()
    # clipped tokens give no gradient; the others -A r / N
    expect = [0.0, 0.0, -1.1 / 6, -0.5 / 6, 1.5 / 6, -1.25 / 6]
    assert torch.allclose(logp.grad, torch.tensor(expect), atol=1e-6)


def test_clip_is_asymmetric_for_dapo_and_symmetric_for_grpo():
    logp, old, adv = _tokens()
    _, d = dapo_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    _, g = grpo_loss(logp, old, adv, [6], clip=0.2)
    assert d["clip_frac_high"].item() == pytest.approx(1 / 6)   # t0 only
    assert g["clip_frac_high"].item() == pytest.approx(2 / 6)   # t0 and t5 (1.25 > 1.2)
    wide, _ = dapo_loss(logp, old, adv, clip_low=0.2, clip_high=10.0)
    narrow, _ = dapo_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    # with a huge upper bound t0 is not clipped: -1.5 instead of -1.28
    assert (wide - narrow).item() == pytest.approx((-1.5 + 1.28) / 6, abs=1e-6)


def test_token_level_mean_differs_from_sequence_level_mean():
    logp, old, adv = _tokens()
    grpo_tok = [-1.2, 0.8, -1.1, -0.5, 1.5, -1.2]          # symmetric clip at 0.2
    loss, stats = grpo_loss(logp, old, adv, [2, 4], clip=0.2)
    seq0, seq1 = sum(grpo_tok[:2]) / 2, sum(grpo_tok[2:]) / 4
    assert loss.item() == pytest.approx((seq0 + seq1) / 2, abs=1e-6)
    assert loss.item() != pytest.approx(sum(grpo_tok) / 6, abs=1e-3)
    assert stats["sequences"].item() == 2
    # the same tokens under DAPO with a symmetric clip: one mean over all tokens
    d, _ = dapo_loss(logp, old, adv, clip_low=0.2, clip_high=0.2)
    assert d.item() == pytest.approx(sum(grpo_tok) / 6, abs=1e-6)


def test_reinforce_is_minus_advantage_times_logprob():
    logp, old, adv = _tokens()
    loss, stats = reinforce_loss(logp, old, adv)
    assert loss.item() == pytest.approx(float(-(adv * logp.detach()).sum() / 6), abs=1e-6)
    assert stats["clip_frac"].item() == 0.0
    loss.backward()
    assert torch.equal(logp.grad, -adv / 6)


def test_mask_excludes_tokens_from_numerator_and_denominator():
    logp, old, adv = _tokens()
    mask = torch.tensor([True, True, True, False, False, False])
    bad = logp.detach().clone()
    bad[3:] = float("nan")                                 # masked garbage must not leak in
    bad.requires_grad_(True)
    loss, stats = dapo_loss(bad, old, adv, mask)
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 1.1) / 3, abs=1e-6)
    assert stats["tokens"].item() == 3
    loss.backward()
    assert torch.isfinite(bad.grad).all() and (bad.grad[3:] == 0).all()
    g, gs = grpo_loss(logp, old, adv, [2, 4], torch.tensor([True, True, False, False, False, False]))
    assert g.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-6)   # the empty sequence is not counted
    assert gs["sequences"].item() == 1


@pytest.mark.parametrize("kind", ["dapo", "reinforce"])
def test_micro_batch_shares_sum_to_the_mini_batch_loss_token_level(kind):
    logp, old, adv = _tokens()
    full, _ = policy_loss(kind, logp, old, adv, [2, 4])
    a, _ = policy_loss(kind, logp[:2], old[:2], adv[:2], [2], denom=6)
    b, _ = policy_loss(kind, logp[2:], old[2:], adv[2:], [4], denom=6)
    assert (a + b).item() == pytest.approx(full.item(), abs=1e-6)
    # and NOT the mean of the micro-batch means (the pitfall the denominator avoids)
    am, _ = policy_loss(kind, logp[:2], old[:2], adv[:2], [2])
    bm, _ = policy_loss(kind, logp[2:], old[2:], adv[2:], [4])
    assert ((am + bm) / 2).item() != pytest.approx(full.item(), abs=1e-3)


def test_micro_batch_shares_sum_to_the_mini_batch_loss_sequence_level():
    logp, old, adv = _tokens()
    full, _ = grpo_loss(logp, old, adv, [2, 1, 3])
    a, _ = grpo_loss(logp[:3], old[:3], adv[:3], [2, 1], denom=3)
    b, _ = grpo_loss(logp[3:], old[3:], adv[3:], [3], denom=3)
    assert (a + b).item() == pytest.approx(full.item(), abs=1e-6)


def test_grpo_k3_kl_term():
    logp, old, adv = _tokens()
    ref = old - 0.3
    base, _ = grpo_loss(logp, old, adv, [2, 4])
    with_kl, stats = grpo_loss(logp, old, adv, [2, 4], kl_coef=0.1, ref_logprobs=ref)
    d = (ref.double() - logp.detach().double())
    kl = torch.exp(d) - d - 1
    expect_kl = (kl[:2].mean() + kl[2:].mean()) / 2
    assert (with_kl - base).item() == pytest.approx(0.1 * expect_kl.item(), abs=1e-6)
    assert stats["kl"].item() == pytest.approx(kl.mean().item(), abs=1e-6)
    assert (k3_kl(logp.detach(), logp.detach()) == 0).all()
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logp, old, adv, [2, 4], kl_coef=0.1)


def test_weights_multiply_the_per_token_loss():
    logp, old, adv = _tokens()
    w = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0, 0.0])
    loss, _ = dapo_loss(logp, old, adv, weights=w)
    per_tok = torch.tensor([-1.28, 0.8, -1.1, -0.5, 1.5, -1.25])
    assert loss.item() == pytest.approx(float((w * per_tok).sum() / 6), abs=1e-6)


def test_bad_inputs_are_refused():
    logp, old, adv = _tokens()
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        dapo_loss(logp, old[:5], adv)
    with pytest.raises(ValueError, match="fp32"):
        dapo_loss(logp.detach().double(), old, adv)
    with pytest.raises(ValueError, match="seq_lens sum"):
        grpo_loss(logp, old, adv, [2, 3])
    with pytest.raises(ValueError, match="unknown loss 'ppo'"):
        policy_loss("ppo", logp, old, adv, [6])


def test_empty_mask_gives_zero_loss_with_a_graph():
    logp, old, adv = _tokens()
    loss, stats = dapo_loss(logp, old, adv, torch.zeros(6, dtype=torch.bool))
    assert loss.item() == 0.0 and stats["tokens"].item() == 0
    loss.backward()
    assert (logp.grad == 0).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(-20.0, -1e-3), st.floats(-5.0, 5.0)), min_size=1, max_size=16),
       st.floats(0.01, 0.9), st.floats(0.01, 2.0))
def test_on_policy_ratio_is_exactly_one_and_nothing_clips(tokens, clip_low, clip_high):
    lp = torch.tensor([t[0] for t in tokens], dtype=torch.float32)
    adv = torch.tensor([t[1] for t in tokens], dtype=torch.float32)
    x = lp.clone().requires_grad_(True)
    loss, stats = dapo_loss(x, lp, adv, clip_low=clip_low, clip_high=clip_high)
    assert stats["ratio_min"].item() == 1.0 and stats["ratio_max"].item() == 1.0
    assert stats["clip_frac"].item() == 0.0
    assert math.isclose(loss.item(), -adv.double().mean().item(), rel_tol=1e-5, abs_tol=1e-5)
    loss.backward()
    assert torch.allclose(x.grad, -adv / len(tokens), atol=1e-7)


# Dual clip (verl's DAPO recipe, c = 10): tokens with A < 0 and a ratio above c take loss -A c and
# no gradient; below c, and for A > 0, the ordinary clipped surrogate stands.
#   t0 r=20 A=-1 -> dual clip: 10      t1 r=5 A=-1 -> -A r = 5      t2 r=20 A=+1 -> clipped high: -1.28
DUAL_R, DUAL_A = [20.0, 5.0, 20.0], [-1.0, -1.0, 1.0]


def _dual_tokens():
    old = torch.tensor([-4.0, -3.0, -5.0])
    logp = (old.double() + torch.tensor(DUAL_R, dtype=torch.float64).log()).float().requires_grad_(True)
    return logp, old, torch.tensor(DUAL_A)


@pytest.mark.parametrize("loss", ["dapo", "grpo"])
def test_dual_clip_bounds_the_loss_of_negative_advantages(loss):
    logp, old, adv = _dual_tokens()
    kw = dict(clip_low=0.2, clip_high=0.28 if loss == "dapo" else 0.2)
    on, st_on = policy_loss(loss, logp, old, adv, [1, 1, 1], clip_ratio_c=10.0, **kw)
    on.backward()
    g_on = logp.grad.clone()
    logp.grad = None
    off, st_off = policy_loss(loss, logp, old, adv, [1, 1, 1], clip_ratio_c=None, **kw)
    off.backward()
    high = 1 + kw["clip_high"]
    assert on.item() == pytest.approx((10.0 + 5.0 - high) / 3, rel=1e-5)
    assert off.item() == pytest.approx((20.0 + 5.0 - high) / 3, rel=1e-5)
    assert g_on[0].item() == 0.0 and logp.grad[0].item() != 0.0      # capped token gives no gradient
    assert g_on[1].item() == pytest.approx(logp.grad[1].item())        # below c: unchanged
    assert st_on["dual_clip_frac"].item() == pytest.approx(1 / 3) and st_off["dual_clip_frac"].item() == 0.0


def test_dual_clip_bound_must_lie_above_the_upper_clip():
    from isoexec.errors import ConfigError
    from isoexec.train import TrainConfig

    assert TrainConfig().clip_ratio_c == 10.0                     # on by default, as in the DAPO recipe
    assert TrainConfig(clip_ratio_c=None).clip_ratio_c is None and TrainConfig(clip_ratio_c=0).clip_ratio_c == 0
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        TrainConfig(clip_ratio_c=1.2)                             # inside the ordinary clip range (1.28)
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        TrainConfig(clip_ratio_c="ten")
