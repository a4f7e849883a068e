"""Trainer and MasterAdamW: response slicing, batch-invariant scoring, gradient accumulation,
fp32 masters written in place, deterministic clipping, bitwise checkpoint/resume, SFT warm-up,
config validation."""

import io

import pytest
import torch

from isoexec.compose import build_contract
from isoexec.errors import ConfigError
from isoexec.gates.compare import compare_bits
from isoexec.model import build_model
from isoexec.train import (MasterAdamW, PackedSequences, TrainBatch, TrainConfig, Trainer, global_grad_norm,
                           policy_loss, score_logprobs)
from isoexec.train.optim import clip_coefficient
from isoexec.train.trainer import pack_by_tokens

TINY = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, hidden_act="silu",
            max_position_embeddings=128, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def contract():
    return build_contract("dense", "isoexec", "cpu")


def _model(contract, dtype=torch.float32, seed=1):
    m = build_model("dense", TINY, dtype=dtype).init_random(seed)
    m.install(contract)
    return m


def _sequences(n=6, seed=0, prompt=3):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(prompt + 2, prompt + 10, (n,), generator=g).tolist()
    return [torch.randint(0, 64, (k,), generator=g).tolist() for k in lens], [prompt] * n


def _batch(trainer, n=6, seed=0, noise=0.0):
    """A batch whose rollout logprobs are the trainer's own scores (plus optional noise)."""
    seqs, pls = _sequences(n, seed)
    g = torch.Generator().manual_seed(seed + 100)
    adv = (torch.randn(n, generator=g)).tolist()
    rl = [t + noise * torch.randn(t.shape, generator=g) for t in trainer.score(seqs, pls)]
    return TrainBatch(seqs, pls, adv, rl)


def _cfg(**kw):
    base = dict(lr=1e-3, weight_decay=0.01, micro_batch_tokens=4096)
    base.update(kw)
    return TrainConfig(**base)


def _bits_equal(a, b):
    return compare_bits(a.detach().contiguous(), b.detach().contiguous()).differing == 0


# ------------------------------------------------------------------------------------- scoring
def test_score_slices_the_response_rows(contract):
    tr = Trainer(_model(contract), _cfg())
    seqs, pls = _sequences(4)
    pls = [1, 2, 3, 4]
    got = tr.score(seqs, pls)
    for s, p, lp in zip(seqs, pls, got):
        full = score_logprobs(tr.model, PackedSequences.from_lists([s]))
        assert lp.shape == (len(s) - p,)
        # response token j (absolute index p + j) has its logprob at row p + j - 1
        for j in range(len(s) - p):
            assert _bits_equal(lp[j], full[p + j - 1])


def test_score_is_bitwise_independent_of_micro_batch_packing(contract):
    m = _model(contract)
    seqs, pls = _sequences(6)
    small = Trainer(m, _cfg(micro_batch_tokens=8)).score(seqs, pls)    # about one sequence per pack
    large = Trainer(m, _cfg(micro_batch_tokens=4096)).score(seqs, pls)  # one pack
    for a, b in zip(small, large):
        assert _bits_equal(a, b)


def test_old_logprobs_recompute_and_bypass(contract):
    m = _model(contract)
    tr = Trainer(m, _cfg(pi_old="recompute"))
    batch = _batch(tr, noise=0.1)
    for a, b in zip(tr.old_logprobs(batch), tr.score(batch.sequences, batch.prompt_lens)):
        assert _bits_equal(a, b)
    by = Trainer(m, _cfg(pi_old="bypass"))
    for a, b in zip(by.old_logprobs(batch), batch.rollout_logprobs):
        assert _bits_equal(a, b)


def test_pack_by_tokens_keeps_order_and_budget():
    assert pack_by_tokens([3, 4, 2, 9, 1], 7) == [[0, 1], [2], [3], [4]]
    assert pack_by_tokens([3, 4, 2], 100) == [[0, 1, 2]]


# ------------------------------------------------------------------------------------ training
def test_first_minibatch_is_exactly_on_policy(contract):
    """trainer_fwd == trainer_score bitwise, so with recomputed pi_old every ratio is exactly 1."""
    tr = Trainer(_model(contract), _cfg())
    batch = _batch(tr)
    stats = tr.train(batch, tr.old_logprobs(batch), mini_batch_size=len(batch))
    assert stats["ratio_min"] == 1.0 and stats["ratio_max"] == 1.0 and stats["clip_frac"] == 0.0
    assert stats["updates"] == 1 and tr.step == 1


def test_minibatches_give_one_update_each(contract):
    tr = Trainer(_model(contract), _cfg(micro_batch_tokens=16))
    batch = _batch(tr, n=5)
    stats = tr.train(batch, tr.old_logprobs(batch), mini_batch_size=2)
    assert stats["updates"] == 3 and tr.step == 3
    assert stats["tokens"] == sum(batch.response_lens)
    with pytest.raises(ValueError, match="mini_batch_size"):
        tr.train(batch, tr.old_logprobs(batch), mini_batch_size=0)


@pytest.mark.parametrize("loss", ["dapo", "grpo", "reinforce"])
def test_grad_accumulation_over_micro_batches_equals_one_big_batch(contract, loss):
    m = _model(contract)
    seqs, pls = _sequences(5)
    base = Trainer(m, _cfg(loss=loss))
    old = [t + 0.3 * torch.randn(t.shape, generator=torch.Generator().manual_seed(7))
           for t in base.score(seqs, pls)]                   # ratios away from 1: clipping is active
    batch = TrainBatch(seqs, pls, [1.0, -0.5, 0.25, -1.0, 2.0], [o.clone() for o in old])

    # reference: the whole mini-batch in one packed forward, the loss written out directly
    packed = PackedSequences.from_lists(seqs)
    flat = score_logprobs(m, packed, grad=True)
    logp = torch.cat([r[p - 1:] for r, p in zip(packed.split(flat), pls)])
    adv = torch.cat([torch.full((len(s) - p,), a) for s, p, a in zip(seqs, pls, batch.advantages)])
    ref_loss, _ = policy_loss(loss, logp, torch.cat(old), adv, batch.response_lens, clip_low=0.2,
                              clip_high=base.config.clip_high)
    ref_loss.backward()
    ref_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)

    results = {}
    for budget in (12, 4096):
        tr = Trainer(m, _cfg(loss=loss, micro_batch_tokens=budget))
        st = tr.backward(batch, old)
        results[budget] = (st, [g.clone() for g in tr.optimizer.grads])
        tr.optimizer.zero_grad()
    (st_small, g_small), (st_big, g_big) = results[12], results[4096]
    assert len(pack_by_tokens([len(s) for s in seqs], 12)) == len(seqs)   # really split
    assert st_small["loss"] == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-6)
    assert st_big["loss"] == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-6)
    assert st_small["clip_frac"] == pytest.approx(st_big["clip_frac"])
    for a, b, r in zip(g_small, g_big, ref_grads):
        assert torch.allclose(a, r, rtol=1e-4, atol=1e-6)
        assert torch.allclose(b, r, rtol=1e-4, atol=1e-6)


def test_masters_stay_fp32_and_bf16_params_are_their_rounding_in_place(contract):
    m = _model(contract, torch.bfloat16)
    tr = Trainer(m, _cfg(lr=1e-3))
    ptrs = [p.data_ptr() for p in m.parameters()]
    before = [p.detach().clone() for p in m.parameters()]
    batch = _batch(tr)
    tr.train(batch, tr.old_logprobs(batch), mini_batch_size=3)
    assert [p.data_ptr() for p in m.parameters()] == ptrs
    changed = 0
    for p, mst, b in zip(m.parameters(), tr.optimizer.masters, before):
        assert p.dtype == torch.bfloat16 and mst.dtype == torch.float32
        assert _bits_equal(p, mst.to(torch.bfloat16))
        changed += int(not torch.equal(p, b))
    assert changed == len(before)
    # the masters keep precision the bf16 copies cannot hold
    assert any(not torch.equal(mst, mst.to(torch.bfloat16).float()) for mst in tr.optimizer.masters)


def test_master_adamw_on_fp32_model_equals_torch_adamw_bitwise(contract):
    m, ref = _model(contract), _model(contract)   # same seed: same initial values
    opt = MasterAdamW(m, lr=1e-2, weight_decay=0.1)
    ref_params = list(ref.parameters())
    torch_opt = torch.optim.AdamW([{"params": [p for p in ref_params if p.dim() >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in ref_params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=1e-2, foreach=True)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p, q in zip(m.parameters(), ref_params):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        torch_opt.step()
    for p, q in zip(m.parameters(), ref_params):
        assert _bits_equal(p, q)


def test_grad_norm_and_clip_factor_are_deterministic(contract):
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(s, generator=g) * 3 for s in [(64, 32), (32,), (100, 7), (1,), (4096,)]]
    threads = torch.get_num_threads()
    try:
        norms = []
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            norms.append(global_grad_norm(grads))
    finally:
        torch.set_num_threads(threads)
    assert all(_bits_equal(x, norms[0]) for x in norms)
    direct = torch.linalg.vector_norm(torch.cat([x.reshape(-1) for x in grads]).double())
    assert norms[0].item() == pytest.approx(direct.item(), rel=1e-6)
    coef = clip_coefficient(norms[0], 1.0)
    assert (coef * norms[0]).item() == pytest.approx(1.0, rel=1e-5)
    assert clip_coefficient(norms[0], 1e9).item() == 1.0 and clip_coefficient(norms[0], None).item() == 1.0

    # through the optimizer: the same gradients give the same clip factor and the same update
    outs = []
    for _ in range(2):
        m = _model(contract)
        opt = MasterAdamW(m, lr=1e-2, grad_clip=0.5)
        gg = torch.Generator().manual_seed(9)
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=gg)
        outs.append((opt.step(), [p.detach().clone() for p in m.parameters()]))
    assert outs[0][0] == outs[1][0] and outs[0][0]["clip_coef"] < 1.0
    assert all(_bits_equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))


def test_non_finite_gradient_skips_the_update(contract):
    m = _model(contract)
    opt = MasterAdamW(m, lr=1e-2, grad_clip=1.0)
    before = [p.detach().clone() for p in m.parameters()]
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    next(m.parameters()).grad[0] = float("inf")
    out = opt.step()
    assert out["skipped"] and opt.steps == 0
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))


def test_checkpoint_resume_is_bitwise_equal_to_an_uninterrupted_run(contract):
    """Three steps (SFT on a sampled sub-batch, train, SFT again); checkpoint after the first, so
    the resumed run must also restore the sampling generator to draw the same second sub-batch."""
    def steps(tr, which):
        for k in which:
            if k == "sft":
                tr.sft(*_sequences(8, seed=11), steps=1, batch_size=3)     # draws from the seeded generator
            else:
                b = _batch(tr, n=4, seed=2, noise=0.05)
                tr.train(b, tr.old_logprobs(b), mini_batch_size=2)

    cfg = _cfg(lr=3e-3, grad_clip=0.5)
    a = Trainer(_model(contract, torch.bfloat16), cfg)
    steps(a, ["sft"])
    snap = a.state_dict()                     # kept in memory: later steps must not alter it
    buf = io.BytesIO()
    torch.save(snap, buf)
    steps(a, ["train", "sft"])

    for source in (snap, torch.load(io.BytesIO(buf.getvalue()), weights_only=False)):
        b = Trainer(_model(contract, torch.bfloat16, seed=99), cfg)   # different init: all state must come back
        ptrs = [p.data_ptr() for p in b.model.parameters()]
        b.load_state_dict(source)
        assert [p.data_ptr() for p in b.model.parameters()] == ptrs
        steps(b, ["train", "sft"])
        assert b.step == a.step
        for pa, pb in zip(a.model.parameters(), b.model.parameters()):
            assert _bits_equal(pa, pb)
        for ma, mb in zip(a.optimizer.masters, b.optimizer.masters):
            assert _bits_equal(ma, mb)
        sa, sb = a.optimizer.opt.state_dict()["state"], b.optimizer.opt.state_dict()["state"]
        for k in sa:
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert _bits_equal(sa[k][name], sb[k][name])


def test_sft_warm_up_reduces_nll(contract):
    tr = Trainer(_model(contract, torch.bfloat16), _cfg(lr=1e-2, weight_decay=0.0))
    seqs = [[(a + k) % 64 for k in range(8)] for a in range(0, 64, 8)]    # "count up from the prompt"
    pls = [1] * len(seqs)
    before = tr.nll(seqs, pls)
    losses = tr.sft(seqs, pls, steps=10)
    after = tr.nll(seqs, pls)
    assert losses[0] == pytest.approx(before, rel=1e-5)
    assert after < 0.5 * before, (before, after)


# ------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("kw, match", [
    (dict(loss="ppo"), "TrainConfig.loss = 'ppo'"),
    (dict(lr=0.0), "TrainConfig.lr"),
    (dict(lr=float("nan")), "TrainConfig.lr"),
    (dict(weight_decay=-1.0), "weight_decay"),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(grad_clip=0.0), "grad_clip"),
    (dict(clip_low=1.0), "clip_low"),
    (dict(loss="grpo", clip_high=0.28), "grpo clips symmetrically"),
    (dict(loss="dapo", kl_coef=0.1), "KL penalty is part of grpo only"),
    (dict(micro_batch_tokens=0), "micro_batch_tokens"),
    (dict(micro_batch_tokens=64.0), "micro_batch_tokens"),
    (dict(pi_old="reuse"), "pi_old"),
    (dict(tis_threshold=0.5), "tis_threshold"),
    (dict(rs_kind="k2", rs_threshold=0.1), "rs_kind"),
    (dict(rs_kind="k3"), "needs a threshold"),
    (dict(rs_threshold=0.1), "rs_kind is None"),
    (dict(seed="0"), "seed"),
    (dict(reshard_after_forward="false"), "TrainConfig.reshard_after_forward = 'false': must be true or false"),
    (dict(reshard_after_forward=0), "reshard_after_forward"),
])
def test_bad_configs_raise_clear_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(**kw)


def test_config_defaults_and_from_dict():
    assert TrainConfig().clip_high == 0.28
    assert TrainConfig(loss="grpo").clip_high == 0.2
    assert TrainConfig.from_dict({"loss": "grpo", "betas": [0.9, 0.95]}).betas == (0.9, 0.95)
    with pytest.raises(ConfigError, match="unknown key.*learning_rate"):
        TrainConfig.from_dict({"learning_rate": 1e-6})


def test_bad_batches_raise_clear_errors(contract):
    seqs, pls = _sequences(2)
    rl = [torch.zeros(len(s) - p) for s, p in zip(seqs, pls)]
    with pytest.raises(ValueError, match="prompt_len"):
        TrainBatch(seqs, [0, 3], [1.0, 1.0], rl)
    with pytest.raises(ValueError, match="advantages"):
        TrainBatch(seqs, pls, [1.0], rl)
    with pytest.raises(ValueError, match=r"rollout_logprobs\[1\] has shape"):
        TrainBatch(seqs, pls, [1.0, 1.0], [rl[0], rl[1][:-1]])
    with pytest.raises(ValueError, match="fp32"):
        TrainBatch(seqs, pls, [1.0, 1.0], [r.double() for r in rl])
    tr = Trainer(_model(contract), _cfg(loss="grpo", kl_coef=0.1))
    with pytest.raises(ValueError, match="ref_logprobs"):
        tr.train(TrainBatch(seqs, pls, [1.0, 1.0], rl), rl, 2)
    with pytest.raises(TypeError, match="TrainConfig"):
        Trainer(tr.model, {"lr": 1e-3})


def test_lr_warmup_is_linear_over_rl_updates_and_spares_sft(contract):
    """lr_warmup_steps=3: RL updates 0, 1, 2 run at 1/3, 2/3, 3/3 of lr, then lr; SFT steps before
    them run at the full rate and use none of the warm-up. Read from the optimizer's own groups."""
    trainer = Trainer(_model(contract), _cfg(lr=1e-3, lr_warmup_steps=3))
    seqs, pls = _sequences(4, seed=3)
    trainer.sft(seqs, pls, steps=2)
    assert [g["lr"] for g in trainer.optimizer.opt.param_groups] == [1e-3] * len(trainer.optimizer.opt.param_groups)
    seen = []
    for k in range(5):
        batch = _batch(trainer, n=2, seed=10 + k)
        st = trainer.train(batch, batch.rollout_logprobs, mini_batch_size=2)
        assert st["updates"] == 1
        seen.append(trainer.optimizer.opt.param_groups[0]["lr"])
        assert st["lr"] == seen[-1]
    assert seen == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3, 1e-3], rel=1e-12)
    assert trainer.rl_updates == 5
    resumed = Trainer(_model(contract), _cfg(lr=1e-3, lr_warmup_steps=3))
    resumed.load_state_dict(trainer.state_dict())
    assert resumed.rl_updates == 5 and resumed.lr_scale(resumed.rl_updates) == 1.0
    with pytest.raises(ConfigError, match="lr_warmup_steps"):
        _cfg(lr_warmup_steps=-1)
