"""Every parameter that requires a gradient gets one in every backward, a backward of no token
included: the FSDP2 trainer's lockstep runs empty passes (isoexec/dist/fsdp/trainer.py) and FSDP2
reduce-scatters the parameters that have a gradient, so on a torch whose FSDP2 lacks
``set_reduce_scatter_unused_params`` (2.11) the ranks' reduce-scatters have the same size only if
every rank's backward gives the same parameters a gradient (isoexec/dist/fsdp/shard.py). The MoE
layers' routed experts are stacked parameters: an idle expert is a zero slice of a gradient the
other experts fill, and a pass of no token still runs the experts region in the graph
(``isoexec_kernels.moe.reference.no_rows``). The four families under the isoexec composition on
the CPU, with and without activation checkpointing (whose recompute runs the same region)."""

from __future__ import annotations

import pytest
import torch

from isoexec.assembly import installed_model
from isoexec.model import ForwardBatch
from isoexec.model.ep_moe import is_expert_weight

FAMILIES = [("dense", "dense_tiny"), ("hybrid", "hybrid_tiny"), ("mla_moe", "mla_moe_tiny"),
            ("hybrid_moe", "hybrid_moe_tiny")]
CASE = "trainer_fwd"


def _model(family, name, checkpointing, dtype=torch.float32):
    m = installed_model(family, "isoexec", "cpu", name, seed=3, dtype=dtype).model
    m.activation_checkpointing = checkpointing
    return m


def _backward(model, lens):
    """Forward and backward of sequences of ``lens`` tokens (none: an empty pass, as
    ``FSDPTrainer._empty_pass`` runs it); {name: gradient or None} of the trainable parameters."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, model.cfg.vocab_size, (sum(lens),), generator=g)
    h = model.hidden_states(ids, ForwardBatch.packed(lens, CASE, "cpu"))
    lp = model.token_logprobs(h, ids, CASE)
    (lp * torch.randn(lp.shape, generator=g).to(lp.dtype)).sum().backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("family,name", FAMILIES)
def test_a_pass_of_no_token_gives_every_parameter_a_zero_gradient(family, name, checkpointing):
    model = _model(family, name, checkpointing)
    grads = _backward(model, [])
    missing = sorted(n for n, gr in grads.items() if gr is None)
    assert not missing, f"{family}: no gradient for {missing}"
    nonzero = sorted(n for n, gr in grads.items() if int(torch.count_nonzero(gr)))
    assert not nonzero, f"{family}: a pass of no token gave non-zero gradients to {nonzero}"
    moe_layers = sum(hasattr(L, "experts_gate_up") for L in model.layers)
    assert sum(is_expert_weight(n) for n in grads) == 2 * moe_layers and (moe_layers > 0) == family.endswith("moe")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family,name", [f for f in FAMILIES if f[0].endswith("moe")])
def test_a_short_sequence_gives_the_stacked_experts_a_whole_gradient_zero_for_idle_experts(family, name, dtype):
    """Two tokens pick at most 4 of the 8 experts of a layer: every parameter still has a gradient,
    the stacked expert weights' whole, with zeros in the slices of the experts no token picked."""
    grads = _backward(_model(family, name, False, dtype), [2])
    assert not [n for n, gr in grads.items() if gr is None]
    experts = {n: gr for n, gr in grads.items() if is_expert_weight(n)}
    assert experts
    for n, gr in experts.items():
        used = [bool(gr[e].abs().max() > 0) for e in range(gr.shape[0])]
        assert 0 < sum(used) <= 4 < len(used), (n, used)
