"""Activation checkpointing (``TrainConfig.activation_checkpointing``): each layer is recomputed in
the backward instead of keeping its activations. The recompute runs the same kernels on the same
inputs, so for every family the gradients are bitwise those of the run without it, and a trainer
step leaves bitwise the same weights; the recompute does happen (each layer runs twice)."""

from __future__ import annotations

import pytest
import torch

from isoexec.assembly import installed_model
from isoexec.errors import ConfigError
from isoexec.gates.compare import compare_bits
from isoexec.model import ForwardBatch
from isoexec.train import TrainBatch, TrainConfig, Trainer

FAMILIES = [("dense", "dense_tiny"), ("hybrid", "hybrid_tiny"), ("mla_moe", "mla_moe_tiny"),
            ("hybrid_moe", "hybrid_moe_tiny")]


def _model(family, name, checkpointing: bool):
    m = installed_model(family, "isoexec", "cpu", name, seed=3).model
    m.activation_checkpointing = checkpointing
    calls = {"layers": 0}
    inner = m._layer

    def counting(*a, **kw):
        calls["layers"] += 1
        return inner(*a, **kw)

    m._layer = counting
    return m, calls


def _grads(model):
    g = torch.Generator().manual_seed(5)
    lens = [7, 19, 3]
    ids = torch.randint(0, model.cfg.vocab_size, (sum(lens),), generator=g)
    batch = ForwardBatch.packed(lens, "trainer_fwd", "cpu")
    logits = model.logits(model.hidden_states(ids, batch), "trainer_fwd")
    lp = model.logprobs_from_logits(logits[:-1], ids[1:], "trainer_fwd")
    loss = (lp * torch.randn(lp.shape, generator=g)).sum()
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    return dict(zip(names, torch.autograd.grad(loss, params, allow_unused=True)))


@pytest.mark.parametrize("family,name", FAMILIES)
def test_checkpointed_layers_recompute_and_give_bitwise_the_same_gradients(family, name):
    plain, plain_calls = _model(family, name, False)
    ckpt, ckpt_calls = _model(family, name, True)
    want, got = _grads(plain), _grads(ckpt)
    n_layers = len(plain.layers)
    assert plain_calls["layers"] == n_layers and ckpt_calls["layers"] == 2 * n_layers   # the recompute ran
    for k, w in want.items():
        if w is None:
            assert got[k] is None, k
            continue
        assert compare_bits(got[k], w).differing == 0, k
    with torch.no_grad():   # nothing to recompute where autograd does not record
        ckpt.hidden_states(torch.tensor([1, 2, 3]), ForwardBatch.packed([3], "trainer_score", "cpu"))
    assert ckpt_calls["layers"] == 3 * n_layers


def test_a_trainer_step_with_checkpointing_leaves_bitwise_the_same_weights():
    out = []
    for on in (False, True):
        model = installed_model("dense", "isoexec", "cpu", "dense_tiny", seed=3).model
        tr = Trainer(model, TrainConfig(lr=1e-3, micro_batch_tokens=64, activation_checkpointing=on))
        assert model.activation_checkpointing is on
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 14, 6, 11)]
        pls = [3] * len(seqs)
        batch = TrainBatch(seqs, pls, [0.5, -1.0, 1.5, -0.25], tr.score(seqs, pls))
        tr.train(batch, tr.old_logprobs(batch), mini_batch_size=2)
        out.append([m.clone() for m in tr.optimizer.masters])
    assert all(compare_bits(a, b).differing == 0 for a, b in zip(*out))
    assert any(compare_bits(a, m).differing for a, m in zip(out[0], installed_model(
        "dense", "isoexec", "cpu", "dense_tiny", seed=3).model.parameters()))   # the step moved the weights


def test_activation_checkpointing_must_be_a_bool():
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        TrainConfig(activation_checkpointing="yes")
