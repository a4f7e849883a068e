"""The FSDP2 trainer on a model with a frozen parameter of another dtype: GLM's router correction
bias is fp32 and frozen in a bf16 mla_moe model. FSDP2 shards a model of one compute dtype, so the
trainer keeps frozen parameters out of it (replicated, in their own dtype, never updated), as the
expert-parallel trainer does. Before, a bf16 mla_moe model was refused ("several dtypes")."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from isoexec.assembly import installed_model  # noqa: E402
from isoexec.dist.fsdp.trainer import FSDPTrainer  # noqa: E402
from isoexec.train.trainer import TrainConfig  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _steps(vocab: int) -> tuple[dict, list[float]]:
    model = installed_model("mla_moe", "isoexec", "cpu", "mla_moe_tiny", dtype=torch.bfloat16, seed=0).model
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(t.dtype == torch.float32 for t in frozen.values())   # the model under test has one
    trainer = FSDPTrainer(model, TrainConfig(lr=1e-3, seed=0))
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 14, 6)]
    losses = [trainer.sft_step(seqs, [2, 3, 1])["loss"] for _ in range(2)]
    full = trainer.full_parameters()
    for n, before in frozen.items():   # replicated, fp32, never updated; in the weight sync's dict
        assert full[n].dtype == torch.float32 and torch.equal(full[n], before), n
    return full, losses


def test_a_bf16_mla_moe_model_with_its_fp32_frozen_bias_trains_under_fsdp(group_of_one):
    vocab = installed_model("mla_moe", "isoexec", "cpu", "mla_moe_tiny", seed=0).model.cfg.vocab_size
    full, losses = _steps(vocab)
    assert losses[1] < losses[0]                       # the step trained the other parameters
    again, losses2 = _steps(vocab)                     # and it is deterministic run to run
    assert losses2 == losses
    assert all(torch.equal(full[n].view(torch.int32), again[n].view(torch.int32)) for n in full)
