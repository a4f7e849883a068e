"""The engine warm-up before an RL run's first step (isoexec/engine/warmup.py): a no-op off the
GPU, and on a GPU it leaves the engine idle with later generations unchanged."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

from isoexec.assembly import installed_model  # noqa: E402
from isoexec.bits import count_differing  # noqa: E402
from isoexec.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from isoexec.engine.warmup import warm_up_engine  # noqa: E402


def test_engine_warm_up_is_a_no_op_on_a_cpu_engine():
    got = installed_model("dense", "isoexec", "cpu", "dense_tiny")
    engine = Engine(got.model, got.contract, EngineConfig(num_pages=32, max_num_seqs=4),
                    trainer_contract=got.contract)
    assert warm_up_engine(engine, 16, log=lambda s: None) == {"seconds": 0.0, "kernels_compiled": 0}
    assert engine.num_steps == 0 and not engine.has_unfinished()


@pytest.mark.gpu
def test_engine_warm_up_leaves_the_engine_idle_and_later_generations_unchanged():
    got = installed_model("dense", "isoexec", "sm90", "dense_tiny", dtype=torch.bfloat16, device="cuda")
    prompts = [[3, 5, 7] * k for k in (1, 4, 9)]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, seed=11)

    def engine():
        return Engine(got.model, got.contract,
                      EngineConfig(num_pages=64, max_num_seqs=8, cuda_graphs=True, max_model_len=64),
                      trainer_contract=got.contract)

    plain = engine().generate(prompts, params)
    warmed = engine()
    out = warm_up_engine(warmed, 40, log=lambda s: None)
    assert out["seconds"] > 0 and not warmed.has_unfinished()
    after = warmed.generate(prompts, params)
    assert [r.ids for r in after] == [r.ids for r in plain]
    assert all(count_differing(torch.as_tensor(a.logprobs), torch.as_tensor(b.logprobs)) == 0
               for a, b in zip(after, plain))
