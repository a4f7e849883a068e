"""What each rank of test_fsdp_per_layer.py runs: the FSDP2 trainer's model in a world of two gloo
ranks, watched at every decoder layer's entry (``LayerWatch``), for the test to read when each
layer's parameters are gathered and when they are freed.

Per case (family, dtype, activation checkpointing), on the trainer's own sharded model: a scoring
call to learn every unit's gathered tensors (FSDP2 refills the same tensors at every gather, which
the watch checks at each layer it sees), a second scoring call watched, then a training forward
and backward of this rank's share of a step's sequences, watched, and the reduced gradients'
presence. A run of config C (several micro-batches per rank) with activation checkpointing, made
twice, for the run-to-run and the checkpointing comparisons. The same watch and run C again with
``reshard_after_forward=False`` (layers kept gathered from their forward to their backward), with
and without activation checkpointing.
"""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import fsdp_workers as fw  # noqa: E402
from isoexec.train import PackedSequences, score_logprobs  # noqa: E402

WORLD = 2
# (family, dtype, activation checkpointing): the hybrid tiny model has four layers of two kinds;
# bf16 gathers the compute-dtype copies FSDP2's mixed precision makes
CASES = (("hybrid", "fp32", False), ("hybrid", "fp32", True), ("dense", "bf16", False))
# (family, dtype) watched with ``reshard_after_forward=False``: each layer kept from its forward to
# its backward
KEPT_CASES = (("hybrid", "fp32"), ("dense", "bf16"))


class _Probe(torch.autograd.Function):
    """The identity (a copy) at a layer's entry, inside the layer's FSDP2 unit: its forward records
    when the layer's forward (or its recompute) starts, its backward when the gradient of the
    layer's input is complete, which is before FSDP2's post-backward hook reduces and frees it."""

    @staticmethod
    def forward(ctx, x, watch, k):
        ctx.watch, ctx.k = watch, k
        watch.record("recompute" if watch.in_backward else "forward", k)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.watch.record("backward", ctx.k)
        return g, None, None


class LayerWatch:
    """Wraps a sharded model's ``run_layer`` so that a ``_Probe`` runs first inside every layer's
    call, and records at each probe, per layer: whether its module holds gathered tensors (FSDP2
    swaps plain tensors in for the DTensor shards while gathered), the bytes of storage its gathered
    tensors hold (0 once freed), and the bytes of their unsharded gradients; the root's too."""

    def __init__(self, model):
        self.model, self.layers = model, list(model.layers)
        self.tensors: dict = {}          # unit ("root" or layer index) -> its gathered tensors
        self.events: list[dict] = []
        self.in_backward = False
        self.refilled = True             # every gather refilled the tensors first seen
        sharded = model.run_layer

        def probed(L, layer_fn, x):
            k = next(i for i, m in enumerate(self.layers) if m is L)
            return sharded(L, lambda x: layer_fn(_Probe.apply(x, self, k)), x)

        model.run_layer = probed

    def _params(self, unit):
        if unit == "root":
            return [p for n, p in self.model.named_parameters() if not n.startswith("layers.")]
        return list(self.layers[unit].parameters())

    def _gathered(self, unit) -> bool:
        return not any(isinstance(p, DTensor) for p in self._params(unit))

    def record(self, phase: str, k: int) -> None:
        units = [*range(len(self.layers)), "root"]
        for u in units:
            if self._gathered(u):
                now = self._params(u)
                if u in self.tensors:
                    self.refilled &= all(a is b for a, b in zip(now, self.tensors[u]))
                else:
                    self.tensors[u] = now
        # each gathered tensor owns its storage (FSDP2's per-parameter all-gather output, its
        # dim 0 padded to a multiple of dp); counted once per storage all the same
        held = {u: sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in self.tensors.get(u, ())}.values()) for u in units}
        grads = {u: sum(t.grad.nbytes for t in self.tensors.get(u, ()) if t.grad is not None) for u in units}
        self.events.append({"phase": phase, "layer": k, "gathered": {u: self._gathered(u) for u in units},
                            "bytes": held, "grad_bytes": grads,
                            "prefetched": {j: self._all_gather_in_flight(j) for j in range(len(self.layers))}})

    def _all_gather_in_flight(self, k: int) -> bool:
        """Whether layer k's all-gather has been issued and not yet copied out into its tensors
        (a prefetch: its buffer, one layer in the compute dtype, is allocated; FSDP2's private
        state, read here only to count it)."""
        state = self.layers[k]._get_fsdp_state()   # torch 2.11: one group; 2.13: a list of them
        groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
        return any(getattr(g, "_all_gather_result", None) is not None for g in groups)


def _case(job, family, dtype_name, checkpointing, reshard_after_forward=True) -> dict:
    from isoexec.dist.fsdp import FSDPTrainer, free_params

    # config C (one sequence's tokens per micro-batch) where the layers stay gathered: its scoring
    # runs several micro-batches, the later ones on layers the first gathered
    cfg = fw.config("A" if reshard_after_forward else "C", activation_checkpointing=checkpointing,
                    reshard_after_forward=reshard_after_forward)
    t = FSDPTrainer(fw.build_model(job, family, fw.DTYPES[dtype_name]), cfg)
    watch = LayerWatch(t.model)
    seqs, pls = fw.score_batch()
    t.score(seqs, pls)                       # learns every unit's gathered tensors
    watch.events.clear()
    out = {"score": t.score(seqs, pls), "score_events": watch.events}
    watch.events = []
    share = list(t._share(fw.N_SEQ))
    packed = PackedSequences.from_lists([fw.train_batch(0).sequences[i] for i in share])
    flat = score_logprobs(t.model, packed, grad=True)
    watch.record("after_forward", -1)
    watch.in_backward = True
    flat.sum().backward()
    watch.in_backward = False
    watch.record("after_backward", -1)
    out["train_events"] = watch.events
    out["fwd"] = flat.detach()
    out["grads"] = {n: type(p.grad).__name__ for n, p in t.model.named_parameters()}
    out["unit_bytes"] = {u: sum(p.numel() * p.element_size() for p in ts) for u, ts in watch.tensors.items()}
    out["refilled"] = watch.refilled
    free_params(t.model)
    return out


def plan(job, ws, rank) -> dict:
    res = {f"{f}/{d}/{'ac' if c else 'plain'}": _case(job, f, d, c) for f, d, c in CASES}
    res.update({f"kept/{f}/{d}": _case(job, f, d, False, reshard_after_forward=False) for f, d in KEPT_CASES})
    runs = {}
    for name, ckpt, reshard in (("C", False, True), ("C_ac", True, True), ("C_ac_again", True, True),
                                ("C_kept", False, False), ("C_ac_kept", True, False)):
        runs[name] = fw._fsdp_run(job, "hybrid", fw.config("C", activation_checkpointing=ckpt,
                                                           reshard_after_forward=reshard))
    res["runs"] = runs
    return res
