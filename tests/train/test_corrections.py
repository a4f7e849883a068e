"""Off-policy corrections: exact no-ops when rollout == trainer logprobs bitwise (unit and end to
end through the Trainer), and the expected action when they differ."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from isoexec.compose import build_contract
from isoexec.gates.compare import compare_bits
from isoexec.model import build_model
from isoexec.train import (TrainBatch, TrainConfig, Trainer, correct, dapo_loss, mismatch_stats, rejection_keep,
                           sequence_k1, sequence_k3, tis_weights)
from isoexec.train.corrections import k3_terms

TINY = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, hidden_act="silu",
            max_position_embeddings=128, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)


def _bits_equal(a, b):
    return compare_bits(a.detach().contiguous(), b.detach().contiguous()).differing == 0


logprob_lists = st.lists(st.floats(-30.0, 0.0, width=32), min_size=1, max_size=24)


# ------------------------------------------------------------------------------------ no-ops
@settings(max_examples=80, deadline=None)
@given(logprob_lists, st.floats(1.0, 10.0), st.floats(1e-6, 1.0))
def test_identical_logprobs_give_exact_unit_weights_and_zero_scores(values, cap, threshold):
    old = torch.tensor(values, dtype=torch.float32)
    rollout = old.clone()
    lens = [len(values)]
    assert _bits_equal(tis_weights(old, rollout, cap), torch.ones_like(old))
    assert _bits_equal(sequence_k1(old, rollout, lens), torch.zeros(1))
    assert _bits_equal(sequence_k3(old, rollout, lens), torch.zeros(1))
    for kind in ("k1", "k3"):
        assert rejection_keep(old, rollout, lens, kind, threshold).all()


def test_unit_weights_leave_the_loss_and_gradient_bitwise_unchanged():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(40, generator=g) * 5
    logp = (old + 0.3 * torch.randn(40, generator=g)).requires_grad_(True)
    adv = torch.randn(40, generator=g)
    w = correct(old, old.clone(), [10, 30], tis_threshold=2.0, rs_kind="k3", rs_threshold=1e-3).weights
    plain, _ = dapo_loss(logp, old, adv)
    (ga,) = torch.autograd.grad(plain, logp)
    weighted, _ = dapo_loss(logp, old, adv, weights=w)
    (gb,) = torch.autograd.grad(weighted, logp)
    assert _bits_equal(plain, weighted) and _bits_equal(ga, gb)


def test_correction_stats_for_identical_logprobs():
    old = torch.tensor([-1.0, -2.0, -3.0, -0.5])
    c = correct(old, old.clone(), [1, 3], tis_threshold=2.0, rs_kind="k1", rs_threshold=0.01)
    assert c.keep.tolist() == [True, True]
    assert c.stats == {"k1_mean": 0.0, "k3_mean": 0.0, "rs_rejected_frac": 0.0, "tis_weight_mean": 1.0,
                       "tis_truncated_frac": 0.0}
    m = mismatch_stats(old, old.clone(), [1, 3])
    assert m["tokens_differing"] == 0 and m["abs_diff_max"] == 0.0 and m["k3_mean"] == 0.0


# --------------------------------------------------------------------------------- they act
def test_tis_truncates_and_scores_are_the_hand_computed_ones():
    lr = torch.tensor([0.0, 1.0, -1.0, 2.0])
    rollout = torch.tensor([-2.0, -3.0, -1.5, -4.0])
    old = rollout + lr
    w = tis_weights(old, rollout, 2.0)
    assert torch.allclose(w, torch.tensor([1.0, 2.0, math.exp(-1.0), 2.0]), atol=1e-6)
    k1 = sequence_k1(old, rollout, [2, 2])
    k3 = sequence_k3(old, rollout, [2, 2])
    assert torch.allclose(k1, torch.tensor([0.5, 0.5]), atol=1e-6)
    expect = [(0.0 + (math.e - 2.0)) / 2, ((math.exp(-1) - 1 + 1) + (math.exp(2) - 3)) / 2]
    assert torch.allclose(k3, torch.tensor(expect), atol=1e-6)
    c = correct(old, rollout, [2, 2], tis_threshold=2.0)
    assert c.stats["tis_truncated_frac"] == 0.5
    with pytest.raises(ValueError, match=">= 1"):
        tis_weights(old, rollout, 0.5)


def test_rejection_uses_abs_k1_and_k3_thresholds():
    rollout = torch.full((6,), -2.0)
    old = rollout + torch.tensor([0.01, -0.01, -0.5, -0.5, 0.3, -0.3])   # seq means: 0, -0.5, 0
    lens = [2, 2, 2]
    assert rejection_keep(old, rollout, lens, "k1", 0.1).tolist() == [True, False, True]
    # K3 sees the third sequence's spread that K1's mean cancels out
    k3 = sequence_k3(old, rollout, lens)
    thr = float(k3[2]) / 2
    assert float(k3[0]) < thr
    assert rejection_keep(old, rollout, lens, "k3", thr).tolist() == [True, False, False]
    nan = old.clone()
    nan[0] = float("nan")
    assert rejection_keep(nan, rollout, lens, "k3", 10.0).tolist() == [False, True, True]
    with pytest.raises(ValueError, match="unknown rejection kind"):
        rejection_keep(old, rollout, lens, "k2", 0.1)


def test_k3_terms_are_accurate_for_small_log_ratios():
    lr = torch.tensor([1e-4, -1e-4, 1e-3], dtype=torch.float32)
    exact = [x * x / 2 + x ** 3 / 6 for x in lr.double().tolist()]
    assert torch.allclose(k3_terms(lr).double(), torch.tensor(exact, dtype=torch.float64), rtol=1e-5)


def test_mismatch_stats_count_differing_tokens():
    a = torch.tensor([-1.0, -2.0, -3.0])
    b = a.clone()
    b[1] = torch.nextafter(b[1], torch.tensor(0.0))
    m = mismatch_stats(a, b, [3])
    assert m["tokens_differing"] == 1 and 0 < m["abs_diff_max"] < 1e-6


# ---------------------------------------------------------------------------- through Trainer
@pytest.fixture(scope="module")
def contract():
    return build_contract("dense", "isoexec", "cpu")


def _trainer(contract, **kw):
    m = build_model("dense", TINY, dtype=torch.bfloat16).init_random(3)
    m.install(contract)
    return Trainer(m, TrainConfig(lr=1e-3, micro_batch_tokens=24, **kw))


def _batch(tr, perturb=None):
    g = torch.Generator().manual_seed(1)
    lens = [6, 9, 7, 11]
    seqs = [torch.randint(0, 64, (n,), generator=g).tolist() for n in lens]
    pls = [2, 3, 2, 4]
    rollout = tr.score(seqs, pls)              # the engine's logprobs under IsoExec: the trainer's bits
    if perturb is not None:
        rollout[perturb] = rollout[perturb] - 0.7
    return TrainBatch(seqs, pls, [1.0, -1.0, 0.5, -0.25], rollout)


def _params(tr):
    return [p.detach().clone() for p in tr.model.parameters()]


@pytest.mark.parametrize("pi_old", ["recompute", "bypass"])
def test_corrections_are_exact_no_ops_end_to_end_when_rollout_equals_trainer(contract, pi_old):
    plain = _trainer(contract, pi_old=pi_old)
    corrected = _trainer(contract, pi_old=pi_old, tis_threshold=2.0, rs_kind="k3", rs_threshold=1e-6)
    results = []
    for tr in (plain, corrected):
        for _ in range(2):                     # the second batch sees updated weights
            b = _batch(tr)
            st_ = tr.train(b, tr.old_logprobs(b), mini_batch_size=2)
        results.append((st_, _params(tr)))
    (sa, pa), (sb, pb) = results
    assert sb["rs_rejected_frac"] == 0.0 and sb["tis_weight_mean"] == 1.0 and sb["k3_mean"] == 0.0
    assert sa["loss"] == sb["loss"] and sa["grad_norm"] == sb["grad_norm"]
    assert all(_bits_equal(x, y) for x, y in zip(pa, pb))


def test_rejection_drops_a_mismatched_sequence_from_loss_and_denominator(contract):
    """Rejecting sequence 1 must train exactly as if the batch never contained it."""
    tr = _trainer(contract, rs_kind="k1", rs_threshold=0.1)
    b = _batch(tr, perturb=1)
    stats = tr.train(b, tr.old_logprobs(b), mini_batch_size=4)
    assert stats["rs_rejected_frac"] == 0.25 and stats["sequences"] == 3
    assert stats["k1_mean"] == pytest.approx(0.7 / 4, rel=1e-5)

    ref = _trainer(contract)
    keep = [0, 2, 3]
    rb = _batch(ref).select(keep)
    ref.train(rb, ref.old_logprobs(rb), mini_batch_size=3)
    assert all(_bits_equal(x, y) for x, y in zip(_params(tr), _params(ref)))


def test_a_fully_rejected_mini_batch_skips_its_update(contract):
    tr = _trainer(contract, rs_kind="k1", rs_threshold=0.1)
    b = _batch(tr, perturb=0)
    before = _params(tr)
    stats = tr.train(b.select([0]), tr.old_logprobs(b.select([0])), mini_batch_size=1)
    assert stats["updates"] == 0 and stats["skipped_updates"] == 1 and tr.step == 0
    assert all(_bits_equal(x, y) for x, y in zip(before, _params(tr)))


def test_tis_weights_change_the_update_when_logprobs_differ(contract):
    plain, tis = _trainer(contract), _trainer(contract, tis_threshold=1.5)
    for tr in (plain, tis):
        b = _batch(tr, perturb=2)
        st_ = tr.train(b, tr.old_logprobs(b), mini_batch_size=4)
    assert st_["tis_weight_mean"] > 1.0 and st_["tis_truncated_frac"] > 0.0
    assert any(not torch.equal(x, y) for x, y in zip(_params(plain), _params(tis)))
