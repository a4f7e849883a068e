"""The activation estimate is an assumption, checked here against what it claims to count: for the
tiny models of every family under the isoexec composition, it is at least the bytes autograd saves
for the backward of a trainer forward (its logits and two fp32 working rows included, which cover
the logprob's saved tensors), with activation checkpointing too, and it grows linearly with the
micro-batch's tokens."""

import pytest
import torch

from isoexec.assembly import installed_model
from isoexec.plan.activations import (engine_activation_bytes, layer_widths, micro_batch_tokens,
                                      trainer_activation_bytes)
from isoexec.train.scoring import PackedSequences, score_logprobs

TOKENS = 128


def _saved_bytes(model, tokens):
    """Bytes of the distinct storages autograd keeps for the backward, parameters left out."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.cfg.vocab_size, (32,), generator=g).tolist() for _ in range(tokens // 32)]
    seen = {}

    def keep(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        score_logprobs(model, PackedSequences.from_lists(seqs), grad=True)
    return sum(n for k, n in seen.items() if k not in params)


@pytest.mark.parametrize("family", ["dense", "hybrid", "mla_moe", "hybrid_moe"])
def test_the_estimate_covers_what_autograd_saves_for_the_tiny_models(family):
    model = installed_model(family, "isoexec", "cpu", f"{family}_tiny", dtype=torch.float32).model
    saved = _saved_bytes(model, TOKENS)
    est = trainer_activation_bytes(model.cfg, TOKENS, 4)
    assert saved <= est <= 2 * saved, (saved, est)


def _saved_bytes_by_layer(model, tokens, checkpointing):
    """Bytes autograd saves inside each decoder layer's call, outside them, and the layers' inputs
    (what a checkpointed layer keeps instead), distinct storages, parameters left out."""
    model.activation_checkpointing = checkpointing
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.cfg.vocab_size, (32,), generator=g).tolist() for _ in range(tokens // 32)]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    outside, layers, inputs = {}, [], {}
    where = [outside]
    run_layer = model.checkpointed

    def tagged(layer_fn, x):   # every family runs each decoder layer through checkpointed
        inputs.setdefault(x.untyped_storage().data_ptr(), x.untyped_storage().nbytes())
        layers.append({})
        where.append(layers[-1])
        try:
            return run_layer(layer_fn, x)
        finally:
            where.pop()

    def keep(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            where[-1].setdefault(s.data_ptr(), s.nbytes())
        return t

    model.checkpointed = tagged
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            score_logprobs(model, PackedSequences.from_lists(seqs), grad=True)
    finally:
        del model.checkpointed
        model.activation_checkpointing = False
    return sum(outside.values()), [sum(d.values()) for d in layers], sum(inputs.values())


@pytest.mark.parametrize("family", ["dense", "hybrid", "mla_moe", "hybrid_moe"])
def test_the_checkpointing_estimate_covers_the_layer_inputs_and_one_recomputed_layer(family):
    """With activation checkpointing the forward keeps what lies outside the layers and each layer's
    input; the backward recomputes one layer at a time, which then saves what that layer saves
    without checkpointing. The estimate covers that sum, within 2x, and is below the estimate
    without checkpointing."""
    model = installed_model(family, "isoexec", "cpu", f"{family}_tiny", dtype=torch.float32).model
    _, plain_layers, _ = _saved_bytes_by_layer(model, TOKENS, checkpointing=False)
    outside, ck_layers, inputs = _saved_bytes_by_layer(model, TOKENS, checkpointing=True)
    assert len(ck_layers) == len(plain_layers) == model.cfg.num_layers
    # a checkpointed layer keeps its input at most, nothing of its inside
    assert all(0 < n <= inputs // len(ck_layers) for n in ck_layers), (ck_layers, inputs)
    assert sum(plain_layers) > 2 * inputs
    held = outside + inputs + max(plain_layers)
    est = trainer_activation_bytes(model.cfg, TOKENS, 4, checkpointing=True)
    assert held <= est <= 2 * held, (held, est)
    assert est < trainer_activation_bytes(model.cfg, TOKENS, 4)


def test_activations_grow_linearly_with_tokens():
    model = installed_model("dense", "isoexec", "cpu", "dense_tiny", seed=None).model
    cfg = model.cfg
    assert trainer_activation_bytes(cfg, 2048, 2) == 2 * trainer_activation_bytes(cfg, 1024, 2)
    assert len(layer_widths(cfg)) == cfg.num_layers
    assert engine_activation_bytes(cfg, 2048, 0, 2) == 2048 * max(layer_widths(cfg)) * 2


def test_a_sequence_longer_than_the_budget_is_one_micro_batch():
    assert micro_batch_tokens(4096, 10240) == 10240
    assert micro_batch_tokens(4096, 1000) == 4096
