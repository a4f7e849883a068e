"""The data-parallel RL trainer: ``Trainer``'s training step over a ``dp`` mesh, FSDP2-sharded.

Every rank builds the same model and is handed the same batch (the whole list of sequences, their
advantages and rollout logprobs); each takes a fixed share of the work:

- **which sequences.** Rank r of dp takes the contiguous run ``[r * n / dp, (r + 1) * n / dp)``
  of every batch it works on: of each mini-batch when training (by index within the mini-batch,
  before rejection), of the sequence list when scoring or in an SFT step
  (``partition.sequence_share``). dp must divide every such count; otherwise one ``ValueError``
  naming the sizes is raised on every rank before any collective (they all see the same sizes).
- **the loss.** Everything that spans the mini-batch is computed by every rank from the whole
  (replicated) mini-batch, with no communication: the off-policy corrections, the rejected
  sequences, and the loss's denominator (kept tokens for DAPO / REINFORCE, kept sequences for
  GRPO). Each rank packs its kept sequences into micro-batches of ``micro_batch_tokens``, and each
  micro-batch's loss is its share of the mini-batch loss, exactly as in ``Trainer.backward``; the
  sum over ranks of their gradients is therefore the mini-batch gradient.
- **the gradient.** Every micro-batch's backward reduce-scatters its gradients layer by layer,
  the ranks added in rank order (``reduce_scatter.py``), and FSDP2 adds the reduced fp32 shard
  into the shard's gradient, in micro-batch order: between micro-batches a rank holds only its
  shards (``shard.py``: each layer is gathered for its forward and again for its backward, then
  freed). This is the memory-frugal order of the fp32 additions: the sum over micro-batches of
  each micro-batch's rank-order sum, where keeping every layer's unsharded gradient until the
  last micro-batch would reduce the sum of a rank's micro-batches once (a whole unsharded fp32
  gradient per rank, which a model of the paper's size cannot hold beside the rest).
- **lockstep.** Every forward and backward pass is a series of collectives (each layer's
  all-gather, each layer's reduce-scatter), so every rank runs the same number of passes: ranks
  pack their own sequences into micro-batches by tokens, so their counts may differ; each rank
  works out every rank's count from the whole batch it holds (no communication) and runs empty
  passes (no token: they join the collectives and add nothing) up to the largest (``_lockstep``).
  A rank whose whole share was rejected still runs one forward and backward (its first sequence,
  every token masked: zero loss, zero gradient); if the whole mini-batch was rejected no rank runs
  anything and the update is skipped, as in ``Trainer.train``.
- **the step.** ``ShardedAdamW`` on the fp32 shards, clipped by a fixed-order sharded norm.
- **the statistics.** Each rank's per-micro-batch statistics and loss shares are gathered and
  merged in global order (rank order, micro-batch order within a rank) by the single-process
  rules, so every rank returns the same dict.

What matches a single process, and how (tests/dist/test_fsdp_trainer.py):

- the forward is bitwise: a sequence's logprobs do not depend on the batch around it, and FSDP2
  only gathers the parameters (an fp32 or bf16 copy), so ``score`` and the training forward give
  the single-process ``Trainer``'s bits at any dp;
- with one micro-batch per rank and mini-batch, the step is bitwise equal to a single-process
  step whose micro-batches are the ranks' shares (the same per-rank gradients, added in the same
  order) when the clip does not engage;
- with several micro-batches per rank the sum is over micro-batches of rank-order sums, an
  association no single process makes (it adds one micro-batch after another), and against a
  single process that packs the mini-batch differently the gradient's fp32 sums run in another
  order too: the step agrees within a tolerance (stated in tests/dist/test_fsdp_determinism.py);
- run to run at a fixed dp everything is bitwise: every reduction has a fixed order.

Checkpoints: ``save(path)`` / ``load(path)`` write and read a sharded checkpoint with
``torch.distributed.checkpoint`` (``get_state_dict`` / ``set_state_dict`` for the model and
the optimizer, plus the trainer's own counters and SFT generator). A run resumed from one is
bitwise the uninterrupted run at the same dp.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh

from isoexec.dist.lazy_parameters import GatheredParameters
from isoexec.dist.mesh import DP, check_dp_mesh, dp_mesh
from isoexec.dist.partition import sequence_share
from isoexec.model.batch import ForwardBatch
from isoexec.train.losses import policy_loss
from isoexec.train.scoring import PackedSequences, score_logprobs
from isoexec.train.trainer import TrainBatch, TrainConfig, Trainer, check_prompt_lens, merge_stats, pack_by_tokens

from .adamw import ShardedAdamW
from .shard import free_params, shard_model


def _floats(stats: dict) -> dict:
    return {k: float(v) for k, v in stats.items()}


class FSDPTrainer(Trainer):
    """``Trainer`` over the ``dp`` axis of ``mesh`` (default: every rank of the default group);
    ``model`` is sharded in place. Every rank calls every method with the same arguments."""

    def __init__(self, model, config: TrainConfig, mesh: Optional[DeviceMesh] = None):
        if not isinstance(config, TrainConfig):
            raise TypeError(f"FSDPTrainer needs a TrainConfig, got {type(config).__name__}")
        if mesh is None:
            mesh = dp_mesh(device_type=next(model.parameters()).device.type)
        self.dp, self.rank = check_dp_mesh(mesh)
        self.mesh, self.group = mesh, mesh.get_group(DP)
        # frozen parameters stay out of FSDP2 (GLM's router correction bias: fp32 in a bf16 model,
        # which FSDP2's one compute dtype would refuse, or its mixed-precision cast round): replicated
        # on every rank in their own dtype, no gradient to reduce, as in the expert-parallel trainer
        frozen = [p for p in model.parameters() if not p.requires_grad]
        self.model, self.config = shard_model(model, mesh, ignored=frozen,
                                              reshard_after_forward=config.reshard_after_forward), config
        # the checkpoint runs inside each layer's FSDP2 unit (shard.py): the recompute in the
        # backward reads the layer gathered again, the same bits
        model.activation_checkpointing = config.activation_checkpointing
        self.optimizer = ShardedAdamW(model, self.group, self.dp, lr=config.lr, betas=config.betas, eps=config.eps,
                                      weight_decay=config.weight_decay, grad_clip=config.grad_clip)
        self._rng = torch.Generator().manual_seed(config.seed)
        self.rl_updates = 0

    # ------------------------------------------------------------------------ communication
    def _share(self, n: int) -> range:
        s0, s1 = sequence_share(n, self.dp, self.rank)
        return range(s0, s1)

    def _all_gather(self, obj) -> list:
        """Every rank's ``obj`` (python objects, CPU tensors) in rank order."""
        out = [None] * self.dp
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _lockstep(self, passes_of: Callable[[int], int]) -> int:
        """The forward passes this rank runs in a call in which rank q has ``passes_of(q)`` of its
        own: the most of any rank, the extra ones empty (module docstring, "lockstep"). Every rank
        holds the whole batch, so it counts the others' passes itself."""
        return max(passes_of(q) for q in range(self.dp))

    def _pack_counts(self, sequences: Sequence[Sequence[int]]) -> Callable[[int], int]:
        """rank q -> the micro-batches its share of ``sequences`` packs into (scoring, SFT)."""
        def count(q: int) -> int:
            s0, s1 = sequence_share(len(sequences), self.dp, q)
            return len(self._packs(sequences[s0:s1]))
        return count

    def _empty_pass(self, grad: bool) -> None:
        """A forward (and with ``grad`` a backward) of no token: it takes part in the collectives
        of the model's layers and adds nothing to any gradient (its backward gives every parameter
        zeros, the routed experts included, so it reduce-scatters what the others' passes do:
        shard.py)."""
        case = "trainer_fwd" if grad else "trainer_score"
        ids = torch.zeros(0, dtype=torch.long, device=self.device)
        with torch.enable_grad() if grad else torch.no_grad():
            h = self.model.hidden_states(ids, ForwardBatch.packed([], case, self.device))
            lp = self.model.token_logprobs(h, ids, case)
        if grad:
            lp.sum().backward()

    def _accumulate(self, groups: list[list[int]], sequences: Sequence[Sequence[int]], loss_of,
                    passes: Optional[int] = None) -> list[tuple]:
        """Forward and backward of each micro-batch (indices into ``sequences``) in order, then
        empty passes up to ``passes`` (``_lockstep``); every backward reduce-scatters, and FSDP2
        adds the reduced shards into the shards' gradients. ``loss_of(idx, packed, flat)`` gives
        (loss, stats)."""
        out = []
        passes = len(groups) if passes is None else passes
        for k in range(passes):
            if k >= len(groups):
                self._empty_pass(grad=True)
                self.optimizer.accumulate_grads()
                continue
            idx = groups[k]
            packed = PackedSequences.from_lists([sequences[i] for i in idx], self.device)
            flat = score_logprobs(self.model, packed, grad=True)
            loss, st = loss_of(idx, packed, flat)
            loss.backward()
            self.optimizer.accumulate_grads()   # the expert slices' (ep_adamw.py); FSDP2 accumulates the rest
            out.append((float(loss.detach()), st))
        return out

    # ------------------------------------------------------------------------------- scoring
    def score(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> list[torch.Tensor]:
        """fp32 logprobs of each sequence's response tokens, the single-process bits: each rank
        scores its share, then every rank receives all of them."""
        check_prompt_lens(sequences, prompt_lens)
        mine = self._share(len(sequences))
        passes_of = self._pack_counts(sequences)
        try:
            lps = super().score([sequences[i] for i in mine], [prompt_lens[i] for i in mine])
            for _ in range(self._lockstep(passes_of) - passes_of(self.rank)):
                self._empty_pass(grad=False)
        finally:
            free_params(self.model)
        parts = self._all_gather([t.cpu() for t in lps])
        return [t.to(self.device) for part in parts for t in part]

    # ------------------------------------------------------------------------------ training
    def train(self, batch: TrainBatch, old_logprobs: Sequence[torch.Tensor], mini_batch_size: int) -> dict:
        """``Trainer.train`` with each mini-batch dealt out over dp (module docstring)."""
        if isinstance(mini_batch_size, int) and not isinstance(mini_batch_size, bool) and mini_batch_size >= 1 \
                and len(batch) and (mini_batch_size % self.dp or len(batch) % self.dp):
            raise ValueError(f"data-parallel train: mini_batch_size {mini_batch_size} and a batch of {len(batch)} "
                             f"sequences over dp={self.dp}; dp must divide both, so that every mini-batch deals "
                             "the same number of whole sequences to each rank")
        return super().train(batch, old_logprobs, mini_batch_size)

    def backward(self, batch: TrainBatch, old_logprobs: Sequence[torch.Tensor], correction=None) -> dict:
        """Accumulate the gradient of ``batch`` taken as ONE mini-batch, this rank's share of it,
        and reduce-scatter it over dp (no optimizer step). Returns the mini-batch's statistics,
        the same on every rank."""
        cfg = self.config
        mine = self._share(len(batch))
        old, corr, kept, n_tokens, n_seqs = self._kept(batch, old_logprobs, correction)
        resp_lens = batch.response_lens
        if n_tokens == 0:   # every rank sees it: none runs a forward, the update is skipped
            return {"loss": 0.0, "tokens": 0.0, "sequences": 0.0}
        denom = n_seqs if cfg.loss == "grpo" else n_tokens
        weights = corr.sequence_weights()

        def groups_of(q):   # rank q's micro-batches of its kept sequences
            s0, s1 = sequence_share(len(batch), self.dp, q)
            kept_q = [i for i in kept if s0 <= i < s1]
            return [[kept_q[j] for j in g]
                    for g in pack_by_tokens([len(batch.sequences[i]) for i in kept_q], cfg.micro_batch_tokens)]

        groups = groups_of(self.rank)
        null = not groups
        if null:                      # a share with no kept sequence: one masked micro-batch
            groups = [[mine[0]]]

        def loss_of(idx, packed, flat):
            logp = torch.cat(self._responses(packed, flat, [batch.prompt_lens[i] for i in idx]))
            adv = torch.cat([torch.full((resp_lens[i],), float(batch.advantages[i]), dtype=torch.float32)
                             for i in idx]).to(self.device)
            w = None if weights[0] is None else torch.cat([weights[i] for i in idx]).to(self.device)
            ref = None if batch.ref_logprobs is None else torch.cat([batch.ref_logprobs[i] for i in idx])
            mask = torch.zeros(logp.shape[0], dtype=torch.bool, device=self.device) if null else None
            return policy_loss(cfg.loss, logp, torch.cat([old[i] for i in idx]), adv, [resp_lens[i] for i in idx],
                               mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high, kl_coef=cfg.kl_coef,
                               ref_logprobs=ref, weights=w, clip_ratio_c=cfg.clip_ratio_c, denom=denom)

        # a rank with no kept sequence runs one masked micro-batch (above): at least one pass
        passes = self._lockstep(lambda q: max(1, len(groups_of(q))))
        done = self._accumulate(groups, batch.sequences, loss_of, passes)
        local = [] if null else [(loss, _floats(st)) for loss, st in done]
        every = [item for part in self._all_gather(local) for item in part]   # global micro-batch order
        loss_total = 0.0
        for loss, _ in every:
            loss_total += loss
        stats = merge_stats([st for _, st in every]) if every else {}
        stats.update(loss=loss_total, tokens=float(n_tokens), sequences=float(n_seqs))
        return stats

    # ------------------------------------------------------------------------------------ sft
    def sft_step(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> dict:
        """``Trainer.sft_step`` (token-mean NLL of the response tokens of all ``sequences``, one
        optimizer step) with the sequences dealt out over dp."""
        check_prompt_lens(sequences, prompt_lens)
        mine = self._share(len(sequences))
        n_tokens = sum(len(s) - p for s, p in zip(sequences, prompt_lens))
        groups = [[mine[j] for j in g] for g in self._packs([sequences[i] for i in mine])]

        def loss_of(idx, packed, flat):
            logp = torch.cat(self._responses(packed, flat, [prompt_lens[i] for i in idx]))
            return -logp.sum() / n_tokens, {}

        done = self._accumulate(groups, sequences, loss_of, self._lockstep(self._pack_counts(sequences)))
        loss_total = 0.0
        for part in self._all_gather([loss for loss, _ in done]):
            for loss in part:
                loss_total += loss
        o = self.optimizer.step()
        return {"loss": loss_total, "grad_norm": o["grad_norm"], "tokens": float(n_tokens), "step": self.step}

    # ----------------------------------------------------------------------------- checkpoint
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered whole (fp32 masters), by name, frozen ones too (an engine's
        weight update takes every parameter: GLM's router correction bias is frozen); a collective:
        every rank calls it. All at once: the weight sync reads :meth:`gathered_parameters`."""
        return dict(self.gathered_parameters())

    def gathered_parameters(self) -> GatheredParameters:
        """:meth:`full_parameters` read one parameter at a time (``GatheredParameters``: each read a
        collective, in the same order on every rank), so that a weight sync holds one whole
        parameter at a time, not the model's whole fp32 copy."""
        free_params(self.model)
        params = dict(self.model.named_parameters())

        def gather(name: str) -> torch.Tensor:
            p = params[name].detach()
            return p.full_tensor() if hasattr(p, "full_tensor") else p.to(torch.float32, copy=True)  # frozen: whole

        return GatheredParameters({n: tuple(p.shape) for n, p in params.items()}, gather)

    def state_dict(self) -> dict:
        """The trainer's state for ``torch.distributed.checkpoint``: model and optimizer from
        ``get_state_dict`` (sharded DTensors, the live tensors, not a copy), the counters and the
        SFT generator (replicated). Refused before the first optimizer step: DCP gives an optimizer
        without state a zero-LR step to create it, which would change the run's next update."""
        if self.optimizer.steps == 0 or not self.optimizer.opt.state:
            raise RuntimeError("FSDPTrainer.state_dict: no optimizer step taken yet; a fresh trainer is the "
                               "same state (checkpoint after the first step)")
        return self._state()

    def _state(self) -> dict:
        free_params(self.model)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer.opt)
        return {"model": model_sd, "optimizer": optim_sd,
                "trainer": {"rng": self._rng.get_state(), "rl_updates": torch.tensor(self.rl_updates),
                            "steps": torch.tensor(self.optimizer.steps)}}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` in place (``set_state_dict``)."""
        free_params(self.model)
        set_state_dict(self.model, self.optimizer.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        t = state["trainer"]
        self._rng.set_state(t["rng"])
        self.rl_updates = int(t["rl_updates"])
        self.optimizer.steps = int(t["steps"])
        self.optimizer.zero_grad()

    def save(self, path: str) -> None:
        """Write a sharded checkpoint to the folder ``path`` (every rank calls it)."""
        dcp.save(self.state_dict(), checkpoint_id=path)

    def load(self, path: str) -> None:
        """Read a checkpoint written by :meth:`save` at the same dp into this trainer (every rank
        calls it); the run continues bitwise as the saved one would have."""
        state = self._state()
        dcp.load(state, checkpoint_id=path)
        self.load_state_dict(state)
