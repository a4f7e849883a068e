"""The RL trainer over the unified model: score, compute old logprobs, train, warm up by SFT.

One ``Trainer`` owns the model it trains (the same class, and under a colocated engine the same
tensors, as the rollout engine) and a :class:`MasterAdamW`. A training call takes a batch of
sampled sequences with their advantages and rollout logprobs and does, per mini-batch of
``mini_batch_size`` sequences (in order; one optimizer step each):

1. off-policy corrections (TIS weights, sequence rejection) from ``old`` vs rollout logprobs,
   computed once per batch (they do not depend on the parameters);
2. the kept sequences packed into micro-batches of at most ``micro_batch_tokens`` tokens, each
   scored with ``score_logprobs(grad=True)`` (case ``trainer_fwd``), its loss taken with the
   WHOLE mini-batch's denominator (token count for DAPO/REINFORCE, sequence count for GRPO) so
   the accumulated gradient is that of the mini-batch loss, then ``backward``;
3. clip by the fixed-order global norm, AdamW on fp32 masters, parameters overwritten in place.

Logprob layout: ``score_logprobs`` gives each sequence of length L its L - 1 rows, row i holding
log p(token i + 1 | tokens 0..i). Response token j sits at absolute index ``prompt_len + j``,
so its logprob is row ``prompt_len + j - 1``: the response slice is ``rows[prompt_len - 1:]``.

Why the old logprobs have two modes: "recompute" scores the batch with the trainer before any
update (``trainer_score``), the textbook pi_old; "bypass" reuses the rollout logprobs, saving a
forward pass. Under an IsoExec contract the two are bitwise identical (engine == trainer), so
bypass is free and exact; under a native contract they differ and the corrections matter.

The trainer draws randomness only when SFT samples sub-batches (from a generator seeded with
``config.seed`` and checkpointed), so a run and its resumption from a checkpoint are bitwise
identical.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Optional, Sequence

import torch

from ..errors import ConfigError
from .corrections import RS_KINDS, Correction, correct
from .losses import LOSSES, policy_loss
from .optim import MasterAdamW
from .scoring import PackedSequences, score_logprobs

PI_OLD_MODES = ("recompute", "bypass")
DEFAULT_CLIP_HIGH = {"dapo": 0.28}


# ------------------------------------------------------------------------------------------ config
@dataclass
class TrainConfig:
    """Everything that decides what a training step computes. Checked on construction."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: Optional[float] = 1.0          # max global grad norm; None: no clipping
    loss: str = "dapo"                         # dapo | grpo | reinforce
    clip_low: float = 0.2
    clip_high: Optional[float] = None          # None: 0.28 for dapo, clip_low for grpo (symmetric)
    kl_coef: float = 0.0                       # grpo only: weight of the k3 KL to a reference
    micro_batch_tokens: int = 4096             # token budget of one packed micro-batch
    pi_old: str = "recompute"                  # recompute | bypass
    tis_threshold: Optional[float] = None      # token-level truncated IS cap C (>= 1); None: off
    rs_kind: Optional[str] = None              # None | k1 | k3: sequence-level rejection
    rs_threshold: Optional[float] = None       # required with rs_kind
    clip_ratio_c: Optional[float] = 10.0       # dual clip for A < 0 (verl's DAPO recipe: 10); 0/None: off
    lr_warmup_steps: int = 0                   # linear LR warm-up over this many RL updates; 0: off
    seed: int = 0                              # SFT sub-batch sampling
    activation_checkpointing: bool = False     # recompute each layer in the backward (same bits, less memory)
    # FSDP2 trainer only (one process gathers nothing): free each decoder layer's gathered
    # parameters after its forward (True, the memory-frugal default: gathered again for its
    # backward) or keep them until its backward (False: one gather per micro-batch instead of two,
    # one per scoring pass instead of one per micro-batch, for the whole model's compute-dtype copy
    # held on every rank). The same bits either way: a gather copies the same shards
    reshard_after_forward: bool = True

    def __post_init__(self):
        def bad(name, why):
            raise ConfigError(f"TrainConfig.{name} = {getattr(self, name)!r}: {why}")

        def number(name, lo=None, lo_open=False, allow_none=False):
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, "must be a finite number" + (" or None" if allow_none else ""))
            if lo is not None and (v <= lo if lo_open else v < lo):
                bad(name, f"must be {'>' if lo_open else '>='} {lo}")

        number("lr", 0, lo_open=True)
        number("weight_decay", 0)
        number("eps", 0, lo_open=True)
        number("grad_clip", 0, lo_open=True, allow_none=True)
        betas = self.betas
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
            bad("betas", "must be two numbers in [0, 1), e.g. (0.9, 0.999)")
        self.betas = (float(betas[0]), float(betas[1]))
        if self.loss not in LOSSES:
            bad("loss", f"choose one of {', '.join(LOSSES)}")
        number("clip_low", 0, lo_open=True)
        if self.clip_low >= 1:
            bad("clip_low", "must be < 1 (the ratio's lower bound is 1 - clip_low)")
        number("clip_high", 0, lo_open=True, allow_none=True)
        if self.loss == "grpo":
            if self.clip_high is not None and self.clip_high != self.clip_low:
                bad("clip_high", f"grpo clips symmetrically; leave clip_high unset (or equal to clip_low "
                                 f"{self.clip_low}), or use loss='dapo' for a decoupled clip")
            self.clip_high = self.clip_low
        elif self.clip_high is None:
            self.clip_high = DEFAULT_CLIP_HIGH.get(self.loss, self.clip_low)
        number("kl_coef", 0)
        if self.kl_coef > 0 and self.loss != "grpo":
            bad("kl_coef", f"a KL penalty is part of grpo only; loss {self.loss!r} has none (set kl_coef=0)")
        if isinstance(self.micro_batch_tokens, bool) or not isinstance(self.micro_batch_tokens, int):
            bad("micro_batch_tokens", "must be an integer token count")
        if self.micro_batch_tokens < 2:
            bad("micro_batch_tokens", "must be >= 2 (a scored sequence has at least 2 tokens)")
        if self.pi_old not in PI_OLD_MODES:
            bad("pi_old", f"choose one of {', '.join(PI_OLD_MODES)}")
        number("tis_threshold", allow_none=True)
        if self.tis_threshold is not None and self.tis_threshold < 1:
            bad("tis_threshold", "must be >= 1: it caps the ratio pi_old/pi_rollout from above (None: TIS off)")
        if self.rs_kind is not None and self.rs_kind not in RS_KINDS:
            bad("rs_kind", f"choose None or one of {', '.join(RS_KINDS)}")
        number("rs_threshold", 0, lo_open=True, allow_none=True)
        if self.rs_kind is not None and self.rs_threshold is None:
            bad("rs_threshold", f"rs_kind {self.rs_kind!r} needs a threshold (> 0)")
        if self.rs_kind is None and self.rs_threshold is not None:
            bad("rs_threshold", "is set but rs_kind is None; set rs_kind to 'k1' or 'k3' or drop the threshold")
        number("clip_ratio_c", 0, allow_none=True)
        if self.loss in ("dapo", "grpo") and self.clip_ratio_c and self.clip_ratio_c <= 1 + self.clip_high:
            bad("clip_ratio_c", f"must exceed 1 + clip_high = {1 + self.clip_high} (it bounds the ratio for "
                                "negative advantages above the ordinary clip); 0 or None: dual clip off")
        for name in ("activation_checkpointing", "reshard_after_forward"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        for name in ("lr_warmup_steps", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                bad(name, "must be an integer")
        if self.lr_warmup_steps < 0:
            bad("lr_warmup_steps", "must be >= 0 (0: no warm-up)")

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """Build from a mapping (e.g. a YAML section); unknown keys are refused by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"TrainConfig: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        d = dict(d)
        if "betas" in d and isinstance(d["betas"], list):
            d["betas"] = tuple(d["betas"])
        return cls(**d)


# ------------------------------------------------------------------------------------------- batch
def check_prompt_lens(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> None:
    if len(sequences) != len(prompt_lens):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
    for i, (s, p) in enumerate(zip(sequences, prompt_lens)):
        if not 1 <= p < len(s):
            raise ValueError(f"sequence {i}: prompt_len {p} with {len(s)} tokens; need 1 <= prompt_len < "
                             "len(sequence) (a non-empty prompt and at least one response token)")


@dataclass
class TrainBatch:
    """Sampled sequences (prompt + response token ids) with what training needs of them."""

    sequences: list[list[int]]
    prompt_lens: list[int]
    advantages: list[float]                              # one per sequence
    rollout_logprobs: list[torch.Tensor]                 # fp32 [response_len] per sequence
    ref_logprobs: Optional[list[torch.Tensor]] = None    # grpo with kl_coef > 0 only

    def __post_init__(self):
        check_prompt_lens(self.sequences, self.prompt_lens)
        n = len(self.sequences)
        if len(self.advantages) != n:
            raise ValueError(f"{n} sequences but {len(self.advantages)} advantages")
        for name in ("rollout_logprobs", "ref_logprobs"):
            lps = getattr(self, name)
            if lps is None:
                continue
            if len(lps) != n:
                raise ValueError(f"{n} sequences but {len(lps)} {name}")
            for i, (t, r) in enumerate(zip(lps, self.response_lens)):
                if tuple(t.shape) != (r,):
                    raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)}; sequence {i} has {r} response "
                                     "token(s) and needs one logprob per response token")
                if t.dtype != torch.float32:
                    raise ValueError(f"{name}[{i}] is {t.dtype}; logprobs are fp32")

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def response_lens(self) -> list[int]:
        return [len(s) - p for s, p in zip(self.sequences, self.prompt_lens)]

    def select(self, indices: Sequence[int]) -> "TrainBatch":
        idx = list(indices)
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
        return TrainBatch(pick(self.sequences), pick(self.prompt_lens), pick(self.advantages),
                          pick(self.rollout_logprobs), pick(self.ref_logprobs))


def pack_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Greedy in-order packing: indices into ``lengths`` grouped so each group's total stays within
    ``budget``; a single sequence longer than the budget gets a micro-batch of its own (sequences
    are never split: attention needs the whole prefix)."""
    groups, cur, used = [], [], 0
    for i, n in enumerate(lengths):
        if cur and used + n > budget:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups


def merge_stats(parts: Sequence[dict]) -> dict:
    """Combine per-micro-batch loss statistics: counts add, ``*_max``/``*_min`` take the extreme
    over non-empty parts, everything else is a token-weighted mean. Returns python floats."""
    parts = [{k: float(v) for k, v in p.items()} for p in parts]
    total = sum(p["tokens"] for p in parts)
    out: dict = {}
    for k in sorted({k for p in parts for k in p}):
        vals = [(p[k], p["tokens"]) for p in parts if k in p]
        if k in ("tokens", "sequences"):
            out[k] = sum(v for v, _ in vals)
        elif k.endswith("_max") or k.endswith("_min"):
            live = [v for v, t in vals if t > 0]
            out[k] = (max if k.endswith("_max") else min)(live) if live else 1.0
        else:
            out[k] = sum(v * t for v, t in vals) / total if total else 0.0
    return out


# ----------------------------------------------------------------------------------------- trainer
class Trainer:
    """Trains ``model`` (an installed unified model) under ``config``; see the module docstring."""

    def __init__(self, model, config: TrainConfig):
        if not isinstance(config, TrainConfig):
            raise TypeError(f"Trainer needs a TrainConfig, got {type(config).__name__}")
        self.model, self.config = model, config
        model.activation_checkpointing = config.activation_checkpointing
        self.optimizer = MasterAdamW(model, lr=config.lr, betas=config.betas, eps=config.eps,
                                     weight_decay=config.weight_decay, grad_clip=config.grad_clip)
        self._rng = torch.Generator().manual_seed(config.seed)
        # RL updates taken so far: the LR warm-up counts these, not optimizer steps, because a
        # supervised warm-up of a random model (loop.warmup_sft_steps) uses the same optimizer
        # and must neither run at a reduced rate nor use up the RL warm-up.
        self.rl_updates = 0

    @property
    def device(self) -> torch.device:
        return self.optimizer.params[0].device

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (RL updates and SFT steps)."""
        return self.optimizer.steps

    def lr_scale(self, update: int) -> float:
        """Factor on the configured LR for RL update ``update`` (0-based): ``(update + 1) / W``
        for the first W = ``lr_warmup_steps`` updates, then 1. Linear like verl's
        constant-with-warm-up schedule, but the first update already moves (verl's LambdaLR
        starts at factor 0, which spends the first update at rate 0)."""
        w = self.config.lr_warmup_steps
        return 1.0 if w <= 0 or update >= w else (update + 1) / w

    # ------------------------------------------------------------------------------- scoring
    def _packs(self, sequences: Sequence[Sequence[int]]) -> list[list[int]]:
        return pack_by_tokens([len(s) for s in sequences], self.config.micro_batch_tokens)

    @staticmethod
    def _responses(packed: PackedSequences, flat: torch.Tensor, prompt_lens: Sequence[int]) -> list[torch.Tensor]:
        """Response-token logprobs of each packed sequence: rows ``prompt_len - 1`` onward."""
        return [rows[p - 1:] for rows, p in zip(packed.split(flat), prompt_lens)]

    def score(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> list[torch.Tensor]:
        """fp32 logprobs of each sequence's response tokens (case ``trainer_score``, no graph),
        scored in packed micro-batches of at most ``micro_batch_tokens`` tokens."""
        check_prompt_lens(sequences, prompt_lens)
        out: list = [None] * len(sequences)
        for group in self._packs(sequences):
            packed = PackedSequences.from_lists([sequences[i] for i in group], self.device)
            flat = score_logprobs(self.model, packed, grad=False)
            for i, r in zip(group, self._responses(packed, flat, [prompt_lens[i] for i in group])):
                out[i] = r.clone()
        return out

    def old_logprobs(self, batch: TrainBatch) -> list[torch.Tensor]:
        """pi_old of the PPO ratio: the trainer's own scores ("recompute") or the rollout's ("bypass")."""
        if self.config.pi_old == "recompute":
            return self.score(batch.sequences, batch.prompt_lens)
        return [t.detach().to(self.device, torch.float32).clone() for t in batch.rollout_logprobs]

    def nll(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> float:
        """Mean negative log-likelihood per response token (no graph)."""
        lps = self.score(sequences, prompt_lens)
        return -float(torch.cat(lps).to(torch.float64).mean())

    # ------------------------------------------------------------------------------- training
    def _checked_old(self, batch: TrainBatch, old_logprobs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(old_logprobs) != len(batch):
            raise ValueError(f"{len(batch)} sequences but {len(old_logprobs)} old_logprobs")
        out = []
        for i, (t, r) in enumerate(zip(old_logprobs, batch.response_lens)):
            if tuple(t.shape) != (r,):
                raise ValueError(f"old_logprobs[{i}] has shape {tuple(t.shape)}; "
                                 f"sequence {i} has {r} response token(s)")
            out.append(t.detach().to(self.device, torch.float32))
        return out

    def correction(self, batch: TrainBatch, old_logprobs: Sequence[torch.Tensor]) -> Correction:
        """The configured off-policy corrections of ``batch`` (old vs rollout logprobs)."""
        old = self._checked_old(batch, old_logprobs)
        cfg = self.config
        rollout = [t.to(self.device, torch.float32) for t in batch.rollout_logprobs]
        return correct(torch.cat(old), torch.cat(rollout), batch.response_lens,
                       cfg.tis_threshold, cfg.rs_kind, cfg.rs_threshold)

    def _kept(self, batch: TrainBatch, old_logprobs: Sequence[torch.Tensor], correction: Optional[Correction]):
        """The checks and the rejection of a mini-batch's backward: (old logprobs, correction, the
        kept sequences' indices, their response tokens, their count)."""
        old = self._checked_old(batch, old_logprobs)
        corr = correction if correction is not None else self.correction(batch, old)
        if self.config.loss == "grpo" and self.config.kl_coef > 0 and batch.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs TrainBatch.ref_logprobs (the reference model's logprobs)")
        kept = [i for i, k in enumerate(corr.keep.tolist()) if k]
        return old, corr, kept, sum(batch.response_lens[i] for i in kept), len(kept)

    def backward(self, batch: TrainBatch, old_logprobs: Sequence[torch.Tensor],
                 correction: Optional[Correction] = None) -> dict:
        """Accumulate the gradient of the loss of ``batch`` taken as ONE mini-batch (no optimizer
        step). Returns its statistics; ``loss`` is the mini-batch loss, ``tokens``/``sequences``
        count what was kept after rejection."""
        cfg = self.config
        old, corr, kept, n_tokens, n_seqs = self._kept(batch, old_logprobs, correction)
        resp_lens = batch.response_lens
        denom = n_seqs if cfg.loss == "grpo" else n_tokens
        weights = corr.sequence_weights()
        parts, loss_total = [], 0.0
        for group in pack_by_tokens([len(batch.sequences[i]) for i in kept], cfg.micro_batch_tokens):
            idx = [kept[j] for j in group]
            packed = PackedSequences.from_lists([batch.sequences[i] for i in idx], self.device)
            flat = score_logprobs(self.model, packed, grad=True)
            logp = torch.cat(self._responses(packed, flat, [batch.prompt_lens[i] for i in idx]))
            adv = torch.cat([torch.full((resp_lens[i],), float(batch.advantages[i]), dtype=torch.float32)
                             for i in idx]).to(self.device)
            w = None if weights[0] is None else torch.cat([weights[i] for i in idx]).to(self.device)
            ref = None if batch.ref_logprobs is None else torch.cat([batch.ref_logprobs[i] for i in idx])
            loss, st = policy_loss(cfg.loss, logp, torch.cat([old[i] for i in idx]), adv,
                                   [resp_lens[i] for i in idx], clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                   kl_coef=cfg.kl_coef, ref_logprobs=ref, weights=w,
                                   clip_ratio_c=cfg.clip_ratio_c, denom=denom)
            loss.backward()
            self.optimizer.accumulate_grads()
            loss_total += float(loss.detach())
            parts.append(st)
        stats = merge_stats(parts) if parts else {}
        stats.update(loss=loss_total, tokens=float(n_tokens), sequences=float(n_seqs))
        return stats

    def train(self, batch: TrainBatch, old_logprobs: Sequence[torch.Tensor], mini_batch_size: int) -> dict:
        """One pass over ``batch``: mini-batches of ``mini_batch_size`` sequences in order, one
        optimizer step each. Returns aggregated statistics (python floats): ``loss`` and
        ``grad_norm`` (means over updates), ``grad_norm_max``, ``updates``, ``skipped_updates``
        (mini-batches left with no token after rejection, or a non-finite gradient), ``tokens``,
        ``sequences``, ratio/clip statistics (token-weighted, ``dual_clip_frac`` included), the
        correction statistics of the whole batch (``tis_*``, ``rs_rejected_frac``, ``k1_mean``,
        ``k3_mean``), ``lr`` (the rate of the last update) and ``step``.

        ``mini_batch_size`` counts sequences here; the RL loop passes prompts x samples so that a
        mini-batch holds whole groups, as verl's ``ppo_mini_batch_size`` (prompts) does."""
        if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be a positive integer number of sequences, got {mini_batch_size!r}")
        if len(batch) == 0:
            raise ValueError("train: empty batch")
        old = self._checked_old(batch, old_logprobs)
        corr = self.correction(batch, old)
        parts, losses, norms, lrs, skipped = [], [], [], [], 0
        for start in range(0, len(batch), mini_batch_size):
            idx = list(range(start, min(start + mini_batch_size, len(batch))))
            st = self.backward(batch.select(idx), [old[i] for i in idx], corr.select(idx))
            if st["tokens"] == 0:
                self.optimizer.zero_grad()
                skipped += 1
                continue
            o = self.optimizer.step(self.lr_scale(self.rl_updates))
            if o["skipped"]:
                skipped += 1
                continue
            self.rl_updates += 1
            lrs.append(o["lr"])
            parts.append(st)
            losses.append(st["loss"])
            norms.append(o["grad_norm"])
        out = merge_stats([{k: v for k, v in p.items() if k != "loss"} for p in parts]) if parts else \
            {"tokens": 0.0, "sequences": 0.0}
        out.update(
            loss=sum(losses) / len(losses) if losses else 0.0,
            grad_norm=sum(norms) / len(norms) if norms else 0.0,
            grad_norm_max=max(norms) if norms else 0.0,
            updates=len(norms), skipped_updates=skipped, step=self.step,
            lr=lrs[-1] if lrs else self.optimizer.lr * self.lr_scale(self.rl_updates), **corr.stats)
        return out

    # ------------------------------------------------------------------------------------ sft
    def sft_step(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> dict:
        """One optimizer step on the mean NLL of the response tokens (token-level mean over all
        given sequences, accumulated over packed micro-batches). ``loss`` is the NLL before the
        step."""
        check_prompt_lens(sequences, prompt_lens)
        n_tokens = sum(len(s) - p for s, p in zip(sequences, prompt_lens))
        loss_total = 0.0
        for group in self._packs(sequences):
            packed = PackedSequences.from_lists([sequences[i] for i in group], self.device)
            flat = score_logprobs(self.model, packed, grad=True)
            logp = torch.cat(self._responses(packed, flat, [prompt_lens[i] for i in group]))
            loss = -logp.sum() / n_tokens
            loss.backward()
            self.optimizer.accumulate_grads()
            loss_total += float(loss.detach())
        o = self.optimizer.step()
        return {"loss": loss_total, "grad_norm": o["grad_norm"], "tokens": float(n_tokens), "step": self.step}

    def sft(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], steps: int,
            batch_size: Optional[int] = None) -> list[float]:
        """``steps`` SFT steps (e.g. a warm-up so a tiny random model's samples carry reward
        signal). Each step uses all sequences, or ``batch_size`` of them drawn without replacement
        from the trainer's seeded generator. Returns the per-step losses."""
        check_prompt_lens(sequences, prompt_lens)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
        n, losses = len(sequences), []
        for _ in range(steps):
            if batch_size is None or batch_size >= n:
                idx = list(range(n))
            else:
                idx = sorted(torch.randperm(n, generator=self._rng)[:batch_size].tolist())
            losses.append(self.sft_step([sequences[i] for i in idx], [prompt_lens[i] for i in idx])["loss"])
        return losses

    # ----------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """A snapshot: model tensors, optimizer masters/moments/step, the SFT generator, config."""
        return {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "rng": self._rng.get_state(),
                "rl_updates": self.rl_updates,
                "config": asdict(self.config)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a snapshot in place (parameter tensors keep their storage). The masters are the
        source of truth: the parameters end up equal to ``master.to(dtype)``. The config stays the
        one this trainer was built with."""
        with torch.no_grad():
            self.model.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self._rng.set_state(state["rng"])
        self.rl_updates = int(state.get("rl_updates", 0))   # absent in checkpoints from before the warm-up
