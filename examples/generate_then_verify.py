"""Generate with the rollout engine, then score the same tokens with the trainer: bit for bit.

    python examples/generate_then_verify.py

Runs on CPU with a tiny random dense model (configs/models/dense_tiny.yaml).
"""

import torch

from isoexec.compose import build_contract, load_model_config
from isoexec.engine import Engine, EngineConfig, SamplingParams
from isoexec.model import build_model
from isoexec.train import PackedSequences, score_logprobs

contract = build_contract("dense", "isoexec", "cpu")          # the same contract on both sides
cfg = load_model_config("dense_tiny")["hf_config"]
trainer = build_model("dense", cfg).init_random(seed=0)
trainer.install(contract)
rollout = build_model("dense", cfg).init_random(seed=0)
rollout.install(contract)

# The handshake runs at start (and on every weight update): a numerical_policy mismatch is refused.
engine = Engine(rollout, contract, EngineConfig(max_num_seqs=8), trainer_contract=contract)
prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]
results = engine.generate(prompts, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=7))

packed = PackedSequences.from_lists([r.prompt + r.ids for r in results])
trainer_lp = packed.split(score_logprobs(trainer, packed))
for r, lp in zip(results, trainer_lp):
    generated = lp[len(r.prompt) - 1:]                       # logprobs of the sampled tokens
    differing = int((generated.view(torch.int32) != r.logprobs.view(torch.int32)).sum())
    print(f"{len(r.ids)} tokens ({r.finish_reason}); differing logprobs vs trainer: {differing}")
    assert differing == 0
