"""What each rank of a gloo world of two runs for test_expert_parallel_plan.py: the expert-parallel
trainer on a tiny Qwen3.5-MoE-style model cut to 7 routed experts (3 and 4 per rank at ep = 2, so the
slices differ), bf16, under ``isoexec_ep4``; one train call; and what it allocated, in bytes, for the
plan to be compared with.

A rank reports: its expert slices' parameter bytes, their fp32 masters', the AdamW moments of the
masters after the step, the largest sum of the slices' ``p.grad`` and master gradients seen at the
entry of ``accumulate_grads`` (the end of a micro-batch's backward, where both exist), whether any
slice gradient was ever larger than its slice, the parameter elements FSDP2 manages per decoder
layer, and the elements of its FSDP2 shards. The contract and the model config come from the test
process (``make_job``).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback
from pathlib import Path

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

COMPOSITION = "isoexec_ep4"
EXPERTS = 7
EP = 2
WORLD = 2
MODEL_SEED = 5
LENGTHS = (14, 12, 5, 5, 9, 7, 10, 6)   # two mini-batches of 4; rank 0 packs two micro-batches of its share
PROMPT = 3
MINI = 4
CONFIG = dict(lr=1e-3, weight_decay=0.01, grad_clip=0.05, micro_batch_tokens=24)


def model_config():
    """hybrid_moe_tiny with ``EXPERTS`` routed experts."""
    from isoexec.compose import load_model_config
    from isoexec.model_config import HybridMoeConfig

    hf = dict(load_model_config("hybrid_moe_tiny")["hf_config"])
    hf["num_experts"] = EXPERTS
    return HybridMoeConfig.from_hf(hf)


def make_job() -> dict:
    from isoexec.compose import build_contract
    from isoexec.contract import encode

    return {"cfg": model_config(), "contract": encode(build_contract("hybrid_moe", COMPOSITION, "cpu",
                                                                     "hybrid_moe_tiny"))}


def _train_batch(vocab: int):
    from isoexec.train import TrainBatch

    g = torch.Generator().manual_seed(2000)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]
    adv = torch.randn(len(LENGTHS), generator=g).tolist()
    rollout = [-(torch.randn(n - PROMPT, generator=g).abs() + 5.0) for n in LENGTHS]
    return TrainBatch(seqs, [PROMPT] * len(LENGTHS), adv, rollout)


def measure(job: dict) -> dict:
    """This rank's allocations (module docstring)."""
    from isoexec.contract import decode
    from isoexec.dist.fsdp import ExpertParallelTrainer
    from isoexec.model import HybridMoeModel
    from isoexec.train import TrainConfig

    model = HybridMoeModel(job["cfg"], dtype=torch.bfloat16).init_random(MODEL_SEED)
    model.install(decode(job["contract"]))
    trainer = ExpertParallelTrainer(model, TrainConfig(**CONFIG), EP)
    opt = trainer.optimizer
    slices = {n: p for n, p in trainer.model.named_parameters() if n in opt.masters}
    seen = {"grads": 0, "larger_than_slice": False}
    accumulate = opt.accumulate_grads

    def measured_accumulate():
        now = 0
        for n, p in slices.items():
            for g in (p.grad, opt.masters[n].grad):
                if g is not None:
                    now += g.nbytes
                    seen["larger_than_slice"] |= g.shape != p.shape
        seen["grads"] = max(seen["grads"], now)
        accumulate()

    opt.accumulate_grads = measured_accumulate
    batch = _train_batch(job["cfg"].vocab_size)
    trainer.train(batch, trainer.old_logprobs(batch), mini_batch_size=MINI)
    moments = [t for m in opt.masters.values() for k, t in opt.expert_opt.state[m].items()
               if k in ("exp_avg", "exp_avg_sq")]
    fsdp = [p for p in trainer.model.parameters() if hasattr(p, "to_local")]
    return {"rank": dist.get_rank(), "expert_range": trainer.model.expert_range,
            "weights": sum(p.nbytes for p in slices.values()),
            "master": sum(m.nbytes for m in opt.masters.values()),
            "adam": sum(t.nbytes for t in moments), "grads": seen["grads"],
            "grad_larger_than_slice": seen["larger_than_slice"],
            "fsdp_layer": [sum(p.numel() for p in L.parameters() if hasattr(p, "to_local"))
                           for L in trainer.model.layers],
            "fsdp_local": sum(p.to_local().numel() for p in fsdp)}


def _entry(rank: int, port: int, out_dir: str, job: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    try:
        res = measure(job)
    except Exception:
        res = {"__error__": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def run_world(out_dir: Path, job: dict) -> list[dict]:
    """Every rank's ``measure`` in one world of ``WORLD`` gloo processes."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(port, str(out_dir), job), nprocs=WORLD, join=True)
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
