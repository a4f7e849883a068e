"""Every parameter that requires a gradient gets one in every backward, a backward of no token
included: the FSDP2 trainer's lockstep runs empty passes (isoexec/dist/fsdp/trainer.py) and FSDP2
reduce-scatters the parameters that have a gradient, so on a torch whose FSDP2 lacks
``set_reduce_scatter_unused_params`` (2.11) the ranks' reduce-scatters have the same size only if
every rank's backward gives the same parameters a gradient (isoexec/dist/fsdp/shard.py). The MoE
layers' routed experts are stacked parameters: an idle expert is a zero slice of a gradient the
other experts fill, and a pass of no token still runs the experts region in the graph
(``isoexec_kernels.moe.reference.no_rows``). The four families under the isoexec composition and
the native ones (native, native_tp4 at tp = 1) on the CPU, with and without activation
checkpointing (whose recompute runs the same regions): a scoring pass of no token (``trainer_score``,
no graph) and a training pass (``trainer_fwd``, forward and backward). The native compositions' stock
regions that cannot run on no token (the padded SDPA / FlashAttention-2 varlen attention, the
Gated DeltaNet chunk form and conv) return an empty output kept in the graph
(``isoexec_kernels._empty.no_token``); before it the native compositions failed an empty pass on
the CPU for every family, and the isoexec dense family's scoring pass failed in its fused q/k norm
(the two-weight RMSNorm's reference path without a graph). The same passes on a GPU, bf16: the
``gpu`` tests at the end."""

from __future__ import annotations

import pytest
import torch

from isoexec.assembly import installed_model
from isoexec.model import ForwardBatch
from isoexec.model.ep_moe import is_expert_weight

FAMILIES = [("dense", "dense_tiny"), ("hybrid", "hybrid_tiny"), ("mla_moe", "mla_moe_tiny"),
            ("hybrid_moe", "hybrid_moe_tiny")]
COMPOSITIONS = ["isoexec", "native", "native_tp4"]
CASE = "trainer_fwd"


def _model(family, name, checkpointing, dtype=torch.float32, composition="isoexec", arch="cpu", device="cpu"):
    m = installed_model(family, composition, arch, name, seed=3, dtype=dtype, device=device).model
    m.activation_checkpointing = checkpointing
    return m


def _backward(model, lens, device="cpu"):
    """Forward and backward of sequences of ``lens`` tokens (none: an empty pass, as
    ``FSDPTrainer._empty_pass`` runs it); {name: gradient or None} of the trainable parameters."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, model.cfg.vocab_size, (sum(lens),), generator=g).to(device)
    h = model.hidden_states(ids, ForwardBatch.packed(lens, CASE, device))
    lp = model.token_logprobs(h, ids, CASE)
    (lp * torch.randn(lp.shape, generator=g).to(device=device, dtype=lp.dtype)).sum().backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _score_nothing(model, device="cpu"):
    """The scoring pass of no token, as ``FSDPTrainer._empty_pass(grad=False)`` runs it."""
    ids = torch.zeros(0, dtype=torch.long, device=device)
    with torch.no_grad():
        h = model.hidden_states(ids, ForwardBatch.packed([], "trainer_score", device))
        return model.token_logprobs(h, ids, "trainer_score")


def _check_zero_gradients(family, model, grads):
    missing = sorted(n for n, gr in grads.items() if gr is None)
    assert not missing, f"{family}: no gradient for {missing}"
    nonzero = sorted(n for n, gr in grads.items() if int(torch.count_nonzero(gr)))
    assert not nonzero, f"{family}: a pass of no token gave non-zero gradients to {nonzero}"
    moe_layers = sum(hasattr(L, "experts_gate_up") for L in model.layers)
    assert sum(is_expert_weight(n) for n in grads) == 2 * moe_layers and (moe_layers > 0) == family.endswith("moe")


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("family,name", FAMILIES)
@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_a_pass_of_no_token_gives_every_parameter_a_zero_gradient(composition, family, name, checkpointing):
    model = _model(family, name, checkpointing, composition=composition)
    _check_zero_gradients(family, model, _backward(model, []))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("family,name", FAMILIES)
@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_a_scoring_pass_of_no_token_gives_no_logprob(composition, family, name, checkpointing):
    lp = _score_nothing(_model(family, name, checkpointing, composition=composition))
    assert lp.shape == (0,) and lp.dtype == torch.float32


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


@pytest.mark.gpu
@pytest.mark.parametrize("family,name", FAMILIES)
@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_on_a_gpu_a_pass_of_no_token_scores_nothing_and_gives_zero_gradients(composition, family, name):
    """The CUDA paths in bf16 (FlashAttention-2 varlen or the Triton attention, the Triton or WY
    Gated DeltaNet kernels, torch's grouped_mm or the Triton grouped GEMM, cuBLAS or the invariant
    GEMM): the scoring pass and the training pass of no token, as on the CPU above."""
    model = _model(family, name, False, torch.bfloat16, composition, "sm90", "cuda")
    lp = _score_nothing(model, "cuda")
    assert lp.shape == (0,) and lp.dtype == torch.float32
    _check_zero_gradients(family, model, _backward(model, [], "cuda"))
