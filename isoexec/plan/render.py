"""The plan as text (the terminal) or markdown (``--markdown``): the same sections, the same cells.

Sections: what was read; bytes per parameter per GPU of each state; the parameter counts; the
per-GPU table with a verdict per row; the assumptions behind the figures that are not read off an
allocation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .activations import LOGIT_FP32_COPIES
from .expert_slices import REPLICA_SUM_BYTES
from .memory import MemoryPlan
from .rows import GIB, PlanRow
from .states import GATHERED_LAYERS, REDUCE_BYTES, STATE_LABELS, STATES


@dataclass(frozen=True)
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    right: set                    # indices of right-aligned (numeric) columns


def _gib(b: int) -> str:
    return f"{b / GIB:,.1f}"


def _count(n: int) -> str:
    if n >= 10**9:
        return f"{n / 1e9:.2f} B"
    if n >= 10**6:
        return f"{n / 1e6:.1f} M"
    return f"{n:,}"


def _bytes(x: float) -> str:
    return f"{x:g}"


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (as a user typed it)."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _engine_line(rows) -> str:
    tps = sorted({r.shape.engine_tp for r in rows})
    if tps == [1]:
        return "engine: one per GPU, its weights and pools whole (engine_tp 1)."
    return ("engine: sharded over engine_tp GPUs where a row's `engine TP` says so (its weights the largest "
            "rank's shards, its KV pages the rank's kv heads), else whole on every GPU.")


def _trainer_line(wf, rows) -> str:
    if wf.dp == 1:
        return "one process (isoexec.train.Trainer)"
    out = f"FSDP2 over dp = {wf.dp} (isoexec.dist.fsdp)"
    if any(r.shape.trainer_ep > 1 for r in rows):
        out += (", the routed experts over trainer_ep GPUs where a row's `trainer EP` says so (each GPU its "
                "slice whole, isoexec.dist.fsdp.ExpertParallelTrainer)")
    return out


def header_lines(plan: MemoryPlan) -> list[str]:
    wf = plan.workflow
    out = [f"Memory plan of {wf.path}: run {wf.run_name!r}, arch {wf.arch}, gpus {wf.gpus}"
           + (f" per node x {wf.nodes} nodes" if wf.nodes > 1 else "")
           + (f" (merged over {_shown(wf.merged_over)}, as `snakemake --configfile` does)" if wf.merged_over else "")
           + ".",
           f"GPU memory: {plan.gpu_gib:g} GiB per GPU ({plan.gpu_note}).",
           f"Trainer: {_trainer_line(wf, plan.rows)}; " + _engine_line(plan.rows)]
    if not wf.rl_enabled:
        out.append("rl.enabled is false: the workflow starts no RL run; the plan is of the runs its settings describe.")
    return out


def tables(rows: list[PlanRow]) -> list[Table]:
    out = []
    layouts = list(dict.fromkeys([r.per_param for r in rows] + [r.expert_per_param for r in rows
                                                                  if r.expert_per_param]))
    for pp in layouts:
        notes = pp.notes()
        body = [[STATE_LABELS[s], _bytes(getattr(pp, s)), notes[s]] for s in STATES]
        body.append(["total", _bytes(pp.total), ""])
        out.append(Table(f"Bytes per parameter per GPU ({pp.dtype}, {pp.trainer})", ["state", "bytes", "what"],
                         body, {1}))
    models: dict = {}
    for r in rows:                              # one line per model, whatever its arms
        models.setdefault((r.shape.family, r.shape.model), r.params)
    out.append(Table("Parameters (counted from the model config by isoexec.plan.params)",
                     ["family", "model", "embed", "attention", "MLP", "experts", "norms", "lm_head", "total"],
                     [[fam, model, _count(p.embed), _count(p.attention), _count(p.mlp), _count(p.experts),
                       _count(p.norms), _count(p.lm_head) if p.lm_head else "tied", f"{p.total:,}"]
                      for (fam, model), p in models.items()],
                     set(range(2, 9))))
    # the trainer's expert-parallel size, where a row has one (a config without leaves the table as it was)
    ep = any(r.shape.trainer_ep > 1 for r in rows)
    head = ["family", "arms", "params", "dp", "engine TP", *(["trainer EP"] if ep else []),
            *[STATE_LABELS[s] for s in STATES], "KV pool", "GDN state", "activations", "total", "build peak", "GPU",
            "verdict"]
    body = []
    for r in rows:
        s = r.shape
        body.append([s.family, ", ".join(s.arms), _count(r.params.total), str(s.dp), str(s.engine_tp),
                     *([str(s.trainer_ep)] if ep else []), *[_gib(r.states[k]) for k in STATES], _gib(r.kv_pool),
                     _gib(r.recurrent_state) if r.recurrent_state else "-", _gib(r.activations), _gib(r.total),
                     _gib(r.build), _gib(r.capacity), r.verdict()])
    out.append(Table("Per GPU, GiB", head, body, set(range(2, len(head) - 1))))
    return out


def assumptions(rows: list[PlanRow]) -> list[str]:
    out = []
    for r in rows:
        s = r.shape
        pool = (f"{s.num_pages:,} KV pages of {s.page_size} tokens" + (
            f", {s.num_state_slots:,} + 1 GDN state slots (chunk {s.gdn_chunk})" if s.num_state_slots else ""))
        line = (f"{s.family} ({s.model}, {s.dtype}): {pool}; max_num_seqs {s.max_num_seqs:,}, "
                   f"max_num_batched_tokens {s.max_num_batched_tokens:,}; largest micro-batch "
                   f"{max(s.micro_batch_budget, s.longest_sequence):,} tokens"
                   f"{' (activation checkpointing)' if s.activation_checkpointing else ''}; activations: trainer "
                   f"{_gib(r.trainer_activations)}, engine {_gib(r.engine_activations)} GiB"
                   + (f"; FSDP2 units: root {_count(r.units.root)} (embedding, final norm, lm_head), largest layer"
                      f"{' without its routed experts' if r.experts else ''} {_count(r.units.layer)}: gathered "
                      f"{_gib(r.units.gathered_bytes(s.dtype))}"
                      f"{'' if r.units.reshard_after_forward else ' (every layer: reshard_after_forward false)'}"
                      f", gradient in flight "
                      f"{_gib(r.units.grads_in_flight_bytes(s.dtype))} GiB" if r.units else "")
                   + (_expert_note(r) if r.experts else "")
                   + (f"; build: sharding the trainer {_gib(r.build_trainer)}, then the engine's model "
                      f"{_gib(r.build_engine)} GiB" if r.units else "") + ".")
        if line not in out:   # the arms of a family that differ only in their engine state say it once
            out.append(line)
    if any(r.experts for r in rows):
        out.append(
            "Expert-parallel trainer (trainer_ep > 1, isoexec.dist.fsdp.ExpertParallelTrainer): the ranks form "
            "dp / trainer_ep groups of trainer_ep consecutive GPUs, each group one copy of every MoE layer's routed "
            "experts, each GPU its slice of whole experts (the largest rank's counted when trainer_ep does not "
            "divide them); the slice is out of FSDP2, held whole in the compute dtype with its fp32 master and two "
            "fp32 moments, and its gradients are slice-sized: p.grad in the compute dtype beside the fp32 master "
            "gradient, plus one expert weight in flight after the backward (the fp32 copy of its p.grad, or its "
            f"replica sum: {REPLICA_SUM_BYTES} bytes per element per replica). Every other parameter is sharded by "
            "FSDP2 over all dp GPUs, its units without the experts (gathered and in flight). Activations: the "
            "estimate counts a GPU's own tokens' top-k expert rows; under expert parallelism its experts run the "
            "rows the ep group sends them instead (the same count under balanced routing, more under imbalance), "
            "and the exchange's send and receive buffers are not counted.")
    out += [
        "Engine pools: the settings `isoexec run` builds its engine with (isoexec.rl.loop.engine_config: "
        "engine.* of the config over one running sequence and full-length KV pages for every sequence of a "
        "step that its engine group serves: prompts are dealt whole to dp / engine_tp groups), sized by the engine's own allocators; page size and GDN chunk from the arm's contract.",
        "Peak = every state held at once + the larger of the trainer's and the engine's activations "
        "(rollout and training alternate): the `total` column. The verdict takes the larger of it and the "
        "`build peak`, what a GPU holds while the run builds its models: in one process the trainer's model, the "
        "engine's and the fp32 masters (within the total); under torchrun (dp > 1, isoexec.rl.loop.RLRun) first "
        "the trainer's model whole in the compute dtype, which FSDP2 shards one unit at a time, each converted to "
        "its fp32 masters just before (isoexec.dist.fsdp.shard): the units not yet sharded in the compute dtype, "
        "one unit whole in fp32 and the fp32 shards so far"
        + (" (with trainer_ep > 1 also the whole model the run built, alive until the expert-parallel trainer "
           "has cut and sharded its copy, and the GPU's expert slice)" if any(r.experts for r in rows) else "")
        + "; then, with the trainer sharded, the engine's model whole in the compute dtype, plus its "
        "tensor-parallel shards at engine_tp > 1 (cut before the whole copy goes). AdamW's moments, the KV "
        "pool and the state slots come after both.",
        "FSDP2 (dp > 1, isoexec.dist.fsdp.shard): one unit per decoder layer plus the root; trainer weights are the "
        f"root and {GATHERED_LAYERS} layers gathered in the compute dtype (each layer is gathered for its forward "
        "and again for its backward and freed after each; FSDP2 prefetches one more; with "
        "train.reshard_after_forward false a layer stays gathered from its forward to its backward, so every "
        "layer at the forward's end), gradients the fp32 shards "
        f"plus one unit's reduce-scatter ({REDUCE_BYTES} bytes per element: the fp32 input and the rank-order "
        "sum's receive buffer) while the root's compute-dtype gradient waits, or the root's own at the "
        "backward's end if larger.",
        "Activations are an estimate, not an allocation: every tensor a layer passes between its ops, kept "
        "once for the backward, in the compute dtype, for the largest micro-batch (with activation "
        "checkpointing: each layer's input, plus the widest layer's tensors while it is recomputed), "
        f"plus the logits and {LOGIT_FP32_COPIES} fp32 [tokens, vocab] working tensors; "
        "the engine: one layer's tensors for a step's tokens plus the sampled rows' logits "
        "(isoexec/plan/activations.py).",
        "Not counted: the CUDA context, allocator fragmentation, CUDA graph pools, "
        "NCCL buffers, data and tokenizer.",
        "Model dimensions come from the model YAML; a checkpoint's config.json must agree with it "
        "(loading refuses a tensor whose shape differs).",
    ]
    return out


def _expert_note(r: PlanRow) -> str:
    """A row's expert-parallel slice: who holds what, and its bytes."""
    x, dtype = r.experts, r.shape.dtype
    per_gpu = " or ".join(map(str, sorted(set(x.experts_per_rank))))     # 7 over 2: "3 or 4"
    groups = f"{x.replicas} ep group{'s' if x.replicas > 1 else ''}"
    sb = x.state_bytes(dtype)
    return (f"; trainer_ep {x.ep}: {groups} of {x.ep} GPUs, each GPU {per_gpu} of the "
            f"{x.experts} routed experts of every MoE layer, a slice of {_count(x.slice)} of "
            f"{_count(x.total)} expert weights: weights {_gib(sb['weights'])}, fp32 master {_gib(sb['master'])}, "
            f"Adam {_gib(sb['adam'])}, gradients {_gib(sb['grads'])} + in flight "
            f"{_gib(x.grads_in_flight_bytes(dtype))} GiB")


def _text_table(t: Table) -> str:
    widths = [max(len(h), *(len(r[i]) for r in t.rows)) if t.rows else len(h) for i, h in enumerate(t.headers)]

    def line(cells):
        return "  ".join(c.rjust(w) if i in t.right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([t.title + ":", line(t.headers), line(["-" * w for w in widths]), *map(line, t.rows)])


def _md_table(t: Table) -> str:
    def line(cells):
        return "| " + " | ".join(cells) + " |"

    sep = ["---:" if i in t.right else "---" for i in range(len(t.headers))]
    return "\n".join([f"**{t.title}**", "", line(t.headers), line(sep), *map(line, t.rows)])


def render_text(plan: MemoryPlan) -> str:
    parts = ["\n".join(header_lines(plan)), *map(_text_table, tables(plan.rows)),
             "Assumptions:\n" + "\n".join(f"- {a}" for a in assumptions(plan.rows))]
    return "\n\n".join(parts) + "\n"


def render_markdown(plan: MemoryPlan, command: str) -> str:
    parts = [f"Made by `{command}`.", *header_lines(plan), *map(_md_table, tables(plan.rows)),
             "Assumptions:\n\n" + "\n".join(f"- {a}" for a in assumptions(plan.rows))]
    return "\n\n".join(parts) + "\n"
