"""The activation estimate is an assumption, checked here against what it claims to count: for the
tiny models of every family under the isoexec composition, it is at least the bytes autograd saves
for the backward of a trainer forward (its logits and two fp32 working rows included, which cover
the logprob's saved tensors), and it grows linearly with the micro-batch's tokens."""

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


def test_activations_grow_linearly_with_tokens():
    model = installed_model("dense", "isoexec", "cpu", "dense_tiny", seed=None).model
    cfg = model.cfg
    assert trainer_activation_bytes(cfg, 2048, 2) == 2 * trainer_activation_bytes(cfg, 1024, 2)
    assert len(layer_widths(cfg)) == cfg.num_layers
    assert engine_activation_bytes(cfg, 2048, 0, 2) == 2048 * max(layer_widths(cfg)) * 2


def test_a_sequence_longer_than_the_budget_is_one_micro_batch():
    assert micro_batch_tokens(4096, 10240) == 10240
    assert micro_batch_tokens(4096, 1000) == 4096
