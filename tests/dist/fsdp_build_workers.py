"""What each rank of test_fsdp_build_order.py runs: a bf16 model sharded by the FSDP2 trainer
(``FSDPTrainer``) and by the expert-parallel trainer (``ExpertParallelTrainer``), with a spy on
``shard.py``'s ``fully_shard`` that records, at every call, what the model's parameters are at that
moment (and then calls the real ``fully_shard``: the spy changes nothing), and the local shards
afterwards beside the whole parameters they were cut from.

Run in a world of ``WORLD`` gloo ranks spawned by the test itself (``dist_workers.spawn_plan_world``).
"""

from __future__ import annotations

import sys
import time

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

WORLD = 2
#: name -> (family, model config, composition, trainer_ep: 1 = FSDPTrainer)
CASES = {"dense": ("dense", "dense_tiny", "isoexec", 1),
         "hybrid": ("hybrid", "hybrid_tiny", "isoexec", 1),
         "glm_ep": ("mla_moe", "mla_moe_tiny", "isoexec_ep4", 2)}
SEED = 3


def _is_dtensor(p) -> bool:
    return hasattr(p, "to_local")


def _snapshot(root, unit, ignored) -> dict:
    """What the parameters of ``root`` are when ``fully_shard(unit)`` is called: the bytes of
    fp32 parameters not yet cut into DTensor shards (FSDP2-managed ones only: the ignored stay out),
    the bytes still in the compute dtype, the local bytes of the shards made so far, and the bytes
    of the unit's own parameters that this call will shard."""
    out = {"fp32_whole": 0, "compute": 0, "shards": 0, "unit_fp32": 0}
    for p in root.parameters():
        if p in ignored:
            continue
        if _is_dtensor(p):
            out["shards"] += p.to_local().nbytes
        elif p.dtype == torch.float32:
            out["fp32_whole"] += p.nbytes
        else:
            out["compute"] += p.nbytes
    for p in unit.parameters():
        if p not in ignored and not _is_dtensor(p) and p.dtype == torch.float32:
            out["unit_fp32"] += p.nbytes
    out["unit"] = "root" if unit is root else next(i for i, L in enumerate(root.layers) if L is unit)
    return out


def _install_spies(log: list, roots: list):
    """Wrap ``shard.fully_shard`` (and ``shard_model``, to learn which model it shards) with
    recorders that call the real functions; returns a function that puts the originals back."""
    from isoexec.dist.fsdp import ep_trainer, shard, trainer

    real_fs, real_sm = shard.fully_shard, shard.shard_model

    def fully_shard(module, **kw):
        ignored = set(kw.get("ignored_params") or ())
        log.append(_snapshot(roots[-1], module, ignored))
        out = real_fs(module, **kw)
        # the shards this call made (alive with the unit's whole fp32 copy until the call returned)
        log[-1]["unit_shards"] = sum(p.to_local().nbytes for p in roots[-1].parameters()
                                     if p not in ignored and _is_dtensor(p)) - log[-1]["shards"]
        return out

    def shard_model(model, mesh, ignored=(), **kw):
        roots.append(model)
        return real_sm(model, mesh, ignored, **kw)

    shard.fully_shard = fully_shard
    trainer.shard_model = ep_trainer.shard_model = shard_model

    def restore():
        shard.fully_shard = real_fs
        trainer.shard_model, ep_trainer.shard_model = real_sm, real_sm

    return restore


def _unit_bytes(model, ignored_ids: set) -> list[int]:
    """fp32 bytes of each FSDP2 unit shard_model makes (the layers in order, then the root: every
    parameter outside the layers), the ignored parameters left out."""
    def size(params):
        return sum(4 * p.numel() for p in params if id(p) not in ignored_ids)

    in_layers = {id(p) for p in model.layers.parameters()}
    return [size(L.parameters()) for L in model.layers] + \
        [size(p for p in model.parameters() if id(p) not in in_layers)]


def one_case(name: str, ws: int, rank: int) -> dict:
    from isoexec.assembly import installed_model
    from isoexec.dist.fsdp import ExpertParallelTrainer, FSDPTrainer
    from isoexec.model.ep_moe import is_expert_weight
    from isoexec.train import TrainConfig

    family, model_name, comp, ep = CASES[name]
    model = installed_model(family, comp, "cpu", model_name, dtype=torch.bfloat16, seed=SEED).model
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    experts = {n for n in whole if is_expert_weight(n)} if ep > 1 else set()
    # the units' fp32 sizes, counted on the model as the trainer will shard it (the EP trainer's
    # cut holds only this rank's expert slices, which stay out of FSDP2 with the frozen ones)
    left_out = {id(p) for n, p in model.named_parameters() if n in frozen | experts}
    units = _unit_bytes(model, left_out)
    log, roots = [], []
    restore = _install_spies(log, roots)
    try:
        if ep > 1:
            t = ExpertParallelTrainer(model, TrainConfig(), ep)
        else:
            t = FSDPTrainer(model, TrainConfig())
    finally:
        restore()
    res = {"calls": log, "unit_bytes": units, "shards": {}, "kept": {}}
    # beside the units while they are sharded: the parameters left out of FSDP2 (the frozen fp32
    # ones; the EP trainer's expert slices), and under the EP trainer the whole model this caller
    # still holds (as RLRun does while the trainer is built)
    res["left_out_bytes"] = sum(p.nbytes for n, p in roots[0].named_parameters() if not _is_dtensor(p))
    res["caller_bytes"] = sum(p.nbytes for p in model.parameters()) if ep > 1 else 0
    # what the trainer holds once built, before its first step (AdamW's moments come with it)
    res["built_bytes"] = sum(p.to_local().nbytes if _is_dtensor(p) else p.nbytes for p in t.model.parameters()) + \
        sum(m.nbytes for m in getattr(t.optimizer, "masters", {}).values())
    res["case"] = (family, model_name, ep)
    for n, p in t.model.named_parameters():
        if _is_dtensor(p):
            chunks = torch.chunk(whole[n].to(torch.float32), ws, dim=0)
            want = chunks[rank] if rank < len(chunks) else whole[n].to(torch.float32)[:0]
            res["shards"][n] = (p.to_local().detach().clone(), want)
        else:   # left out of FSDP2: its own dtype, the whole (frozen) or this rank's expert slice
            want = whole[n]
            if n in experts:
                a, b = t.model.expert_range
                want = whole[n][a:b]
            res["kept"][n] = (p.detach().clone(), want)
    res["left_out"] = sorted(frozen | experts)
    return res


def plan(job: dict, ws: int, rank: int, out_dir: str) -> dict:
    res = {"times": {"start": time.monotonic()}}
    for name in CASES:
        res[name] = one_case(name, ws, rank)
        dist.barrier()
        res["times"][name] = time.monotonic()
    return res
