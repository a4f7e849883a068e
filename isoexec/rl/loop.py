"""The synchronous RL loop: rollouts, reward, group advantages, dynamic sampling, pre-update
scoring, live bitwise check, mini-batch updates, weight sync with contract handshake.

One process holds the trainer and the engine (colocated, one device): weight sync is an in-place
copy of the trainer's parameters into the engine's model, preceded by the contract handshake.
Every step appends one metrics line; a checkpoint (trainer state, prompt-stream position, step)
is written every ``checkpoint_every`` steps with a temp-file-and-rename, and a restarted run
resumes from it and produces the same (non-timing) metrics as an uninterrupted run: every random
choice is keyed by (seed, step, ...) rather than drawn from a stream that a restart would reset.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..errors import ConfigError, IsoExecError


class LiveCheckFailed(IsoExecError):
    """Under a contract claiming tolerance 0, a rollout logprob differed from the trainer's."""

    exit_code = 1


@dataclass
class RLConfig:
    family: str = "dense"
    composition: str = "isoexec"
    model: str = "dense_tiny"
    arch: str = "cpu"
    contract: Optional[str] = None          # admitted contract JSON; None = build the draft here
    checkpoint: Optional[str] = None        # HF checkpoint folder; None = random init + SFT warm-up
    dataset: str = "synthetic"              # "synthetic" or a DAPO-schema parquet path
    tokenizer: str = "char"                 # "char" or an HF tokenizer folder
    seed: int = 0
    steps: int = 5
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    mini_batch_size: int = 16               # sequences per optimizer step
    max_prompt_tokens: int = 64
    max_response_tokens: int = 24
    overlong_cache: int = 8
    prompt_style: str = "full"             # full (DAPO instruction) | compact ("<expr>=", synthetic task only)
    temperature: float = 1.0
    top_p: float = 1.0
    dynamic_sampling: bool = True
    max_refill_rounds: int = 2
    warmup_sft_steps: int = 0
    warmup_batch_size: int = 32              # sequences per SFT step (sampled from the solved problems)
    checkpoint_every: int = 1               # steps between checkpoints (and after the last); 0: never
    live_check: Optional[bool] = None       # None: on iff the contract claims tolerance 0
    dtype: str = "auto"                     # auto = bfloat16 on GPU, float32 on CPU
    train: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    synthetic: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> "RLConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"rl config: unknown key(s) {', '.join(unknown)}")
        cfg = cls(**d)
        for name in ("steps", "prompts_per_step", "samples_per_prompt", "mini_batch_size", "max_response_tokens"):
            if getattr(cfg, name) < 1:
                raise ConfigError(f"rl config: {name} must be >= 1, got {getattr(cfg, name)}")
        if cfg.checkpoint_every < 0:
            raise ConfigError(f"rl config: checkpoint_every must be >= 0 (0: never), got {cfg.checkpoint_every}")
        if cfg.prompt_style not in ("full", "compact"):
            raise ConfigError(f"rl config: prompt_style must be full or compact, got {cfg.prompt_style!r}")
        if cfg.overlong_cache >= cfg.max_response_tokens:
            raise ConfigError("rl config: overlong_cache must be smaller than max_response_tokens")
        return cfg


def derive_seed(*parts: Any) -> int:
    """A 40-bit seed from (run seed, step, prompt, sample, ...): independent of batch order."""
    h = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()
    return int.from_bytes(h[:5], "little")


class RLRun:
    """Holds the colocated trainer and engine of one run and executes its steps."""

    def __init__(self, cfg: RLConfig, out_dir: str | Path, log: Callable[[str], None] = print):
        from ..compose import build_contract, load_model_config
        from ..contract import decode
        from ..contract import check as check_contract
        from ..engine import Engine, EngineConfig
        from ..model import build_model
        from ..train.trainer import TrainConfig, Trainer
        from .data import PromptStream, load_problems, problems_from_rows, synthetic_arithmetic
        from .metrics import MetricsWriter
        from .tokenizer import CharTokenizer, HFTokenizer

        self.cfg, self.out, self.log = cfg, Path(out_dir), log
        device = "cpu" if cfg.arch == "cpu" else "cuda"
        dtype = {"auto": torch.float32 if device == "cpu" else torch.bfloat16, "float32": torch.float32,
                 "bfloat16": torch.bfloat16}[cfg.dtype]
        if cfg.contract:
            if not Path(cfg.contract).is_file():
                raise ConfigError(f"contract file {cfg.contract!r} not found")
            self.contract = check_contract(decode(Path(cfg.contract).read_bytes()))
        else:
            self.contract = build_contract(cfg.family, cfg.composition, cfg.arch, cfg.model)
        hf_cfg = load_model_config(cfg.model)["hf_config"]
        self.tok = CharTokenizer() if cfg.tokenizer == "char" else HFTokenizer(cfg.tokenizer)
        if self.tok.vocab_size > hf_cfg["vocab_size"]:
            raise ConfigError(f"tokenizer has {self.tok.vocab_size} ids but the model's vocab is "
                              f"{hf_cfg['vocab_size']}")
        self.trainer_model = build_model(cfg.family, hf_cfg, dtype=dtype, device=device)
        self.engine_model = build_model(cfg.family, hf_cfg, dtype=dtype, device=device)
        if cfg.checkpoint:
            from ..model import load_checkpoint

            load_checkpoint(self.trainer_model, cfg.checkpoint)      # dispatches on the model's family
        else:
            self.trainer_model.init_random(cfg.seed)
        for m in (self.trainer_model, self.engine_model):
            m.install(self.contract)
        self.trainer = Trainer(self.trainer_model, TrainConfig.from_dict({"seed": cfg.seed, **cfg.train}))
        if cfg.dataset == "synthetic":
            try:
                problems = problems_from_rows(synthetic_arithmetic(**{"n": 256, "seed": cfg.seed, **cfg.synthetic}))
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"rl config `synthetic`: {exc}") from None
        else:
            problems = load_problems(cfg.dataset)
        self.problems = problems
        self.stream = PromptStream(problems, cfg.prompts_per_step, cfg.seed)
        pages = (cfg.prompts_per_step * cfg.samples_per_prompt * (cfg.max_prompt_tokens + cfg.max_response_tokens)
                 // 16 + 64)
        ecfg = {"max_num_seqs": cfg.prompts_per_step * cfg.samples_per_prompt, "num_pages": pages,
                "max_num_batched_tokens": 2048, **cfg.engine}
        self.engine = Engine(self.engine_model, self.contract, EngineConfig(**ecfg),
                             trainer_contract=self.contract)
        self.out.mkdir(parents=True, exist_ok=True)   # only once every input has been checked
        self.metrics = MetricsWriter(self.out / "metrics.jsonl")
        self.live_check = self.contract.claims.claims_zero_tolerance if cfg.live_check is None else cfg.live_check
        self.step = 0
        self._resume_or_start()

    # ------------------------------------------------------------------------------ checkpoints
    @property
    def ckpt_path(self) -> Path:
        return self.out / "checkpoint.pt"

    def _resume_or_start(self) -> None:
        if self.ckpt_path.exists():
            state = torch.load(self.ckpt_path, map_location="cpu", weights_only=False)
            saved = dict(state.get("config") or {})
            now = asdict(self.cfg)
            saved.pop("steps", None)
            now.pop("steps", None)       # a finished run may be extended with more steps
            if saved != now:
                diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
                raise ConfigError(f"{self.ckpt_path} was written by a run with another configuration "
                                  f"(differs in {', '.join(diff)}); use a fresh output folder or the same config")
            self.trainer.load_state_dict(state["trainer"])
            self.stream.load_state_dict(state["stream"])
            self.step = state["step"]
            self.metrics.truncate_after(self.step - 1)
            self.log(f"resumed from {self.ckpt_path} at step {self.step}")
        else:
            self.metrics.truncate_after(-1)
            if self.cfg.warmup_sft_steps and not self.cfg.checkpoint:
                self._warmup()
        self._sync_weights()

    def _save(self) -> None:
        from ..paths import atomic_write

        buf = io.BytesIO()
        torch.save({"config": asdict(self.cfg), "step": self.step, "trainer": self.trainer.state_dict(),
                    "stream": self.stream.state_dict()}, buf)
        atomic_write(self.ckpt_path, buf.getvalue())

    def _warmup(self) -> None:
        """Supervised warm-up of a random model on solved problems so that rewards carry signal."""
        seqs, prompt_lens = [], []
        for p in self.problems[:128]:
            prompt = self.tok.encode(self._prompt_text(p))
            answer = self.tok.encode(f" {p.ground_truth}\nAnswer: {p.ground_truth}") + [self.tok.eos_id]
            seqs.append(prompt + answer)
            prompt_lens.append(len(prompt))
        t0 = time.time()
        stats = self.trainer.sft(seqs, prompt_lens, steps=self.cfg.warmup_sft_steps,
                                 batch_size=min(self.cfg.warmup_batch_size, len(seqs)))
        nll = [float(x) for x in stats] if isinstance(stats, (list, tuple)) else []
        shown = f"NLL {nll[0]:.3f} -> {nll[-1]:.3f}" if nll else str(stats)
        self.log(f"warm-up SFT: {self.cfg.warmup_sft_steps} steps in {time.time() - t0:.1f}s, {shown}")

    def _clock(self) -> float:
        """Seconds on a monotonic clock, after the device has finished the work queued so far: a
        stage boundary must not bill one stage's asynchronous GPU work to the next stage."""
        dev = next(self.trainer_model.parameters()).device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    def _sync_weights(self) -> float:
        t0 = self._clock()
        self.engine.update_weights(self.trainer_model, trainer_contract=self.contract)
        return self._clock() - t0

    def _prompt_text(self, problem) -> str:
        """The prompt string. ``compact`` keeps only the expression of a synthetic problem
        ("12+7*3="): the tiny CPU models cannot afford the 250-character DAPO instruction."""
        from .tokenizer import chat_prompt

        if self.cfg.prompt_style == "compact":
            m = re.search(r"Compute (.+?)\.", problem.prompt_text)
            if m:
                return f"{m.group(1)}="
        return chat_prompt(problem)

    def _decode(self, ids) -> str:
        # the model's vocabulary may be larger than the tokenizer's: ids it does not know read as UNK
        unk = getattr(self.tok, "unk_id", self.tok.eos_id)
        return self.tok.decode([i if i < self.tok.vocab_size else unk for i in ids])

    # ------------------------------------------------------------------------------ one step
    def _generate(self, problems, step: int, round_: int):
        from ..engine import SamplingParams

        cfg = self.cfg
        prompts, params, owners = [], [], []
        for pi, p in enumerate(problems):
            ids = self.tok.encode(self._prompt_text(p))[-cfg.max_prompt_tokens:]
            for si in range(cfg.samples_per_prompt):
                prompts.append(ids)
                params.append(SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                             max_tokens=cfg.max_response_tokens, stop_token_ids=(self.tok.eos_id,),
                                             seed=derive_seed(cfg.seed, step, round_, p.id, si)))
                owners.append(pi)
        results = self.engine.generate(prompts, params)
        return results, owners

    def _region_hint(self, seqs, plens, first) -> str:
        """Where the first differing logprob is born (isoexec.debug): trainer vs engine model."""
        if not first:
            return ""
        from ..debug import first_divergence

        seq_i, tok_i = first
        tokens = seqs[seq_i][:plens[seq_i] + tok_i + 1]
        try:
            d = first_divergence(self.trainer_model, self.engine_model, tokens, "decode" if tok_i else "prefill")
        except Exception as exc:  # noqa: BLE001 - a hint must never hide the live-check failure itself
            return f" (locator failed: {exc})"
        return f"; {d}" if d else "; the locator found no differing region (a sampling-path difference?)"

    def run_step(self) -> dict:
        from ..train.trainer import TrainBatch
        from .advantages import dynamic_sampling, group_advantages
        from .metrics import logprob_diff_stats, summary_line
        from .reward import reward

        cfg, step = self.cfg, self.step
        t_step = self._clock()
        groups, generated, t_gen, rounds, dropped = [], [], 0.0, 0, 0
        while len(groups) < cfg.prompts_per_step and rounds <= cfg.max_refill_rounds:
            need = cfg.prompts_per_step - len(groups)
            problems = self.stream.next_batch(need)
            t0 = self._clock()
            results, owners = self._generate(problems, step, rounds)
            t_gen += self._clock() - t0
            rs = []
            for r, owner in zip(results, owners):
                total, correct = reward(self._decode(r.ids), problems[owner].ground_truth, len(r.ids),
                                        cfg.max_response_tokens, cfg.overlong_cache)
                rs.append((total, correct))
            n = cfg.samples_per_prompt
            # DAPO's dynamic sampling filters on accuracy: a group all right or all wrong has no signal
            keep = dynamic_sampling([float(x[1]) for x in rs], n) if cfg.dynamic_sampling else [True] * len(problems)
            for gi, k in enumerate(keep):
                members = [len(generated) + j for j in range(gi * n, gi * n + n)]
                if k and len(groups) < cfg.prompts_per_step:
                    groups.append(members)
                else:
                    dropped += 1
            generated += list(zip(results, rs))
            rounds += 1

        # Pre-update scoring of EVERY generated response: the mismatch metric covers all rollouts,
        # and the kept groups' scores are pi_old (recompute) without a second pass.
        all_seqs = [r.prompt + r.ids for r, _ in generated]
        all_plens = [len(r.prompt) for r, _ in generated]
        all_rollout = [r.logprobs for r, _ in generated]
        t0 = self._clock()
        all_trainer = self.trainer.score(all_seqs, all_plens)
        t_score = self._clock() - t0
        stats = logprob_diff_stats(all_rollout, all_trainer)
        if self.live_check and stats.get("bitwise_equal_frac", 1.0) < 1.0:
            first = stats.get("first_differing")
            raise LiveCheckFailed(
                f"step {step}: contract claims tolerance 0 but rollout and trainer logprobs differ "
                f"({stats['bitwise_equal_frac']:.6f} of tokens equal); first differing token: response "
                f"{first[0] if first else '?'}, token {first[1] if first else '?'}"
                f"{self._region_hint(all_seqs, all_plens, first)}; stopping before the backward pass.")
        kept = [i for g in groups for i in g]
        rewards_kept = [generated[i][1][0] for i in kept]
        adv = group_advantages(rewards_kept, cfg.samples_per_prompt) if kept else []
        sequences = [all_seqs[i] for i in kept]
        prompt_lens = [all_plens[i] for i in kept]
        rollout_lp = [all_rollout[i] for i in kept]
        trainer_lp = [all_trainer[i] for i in kept]
        all_rewards = [x[1][0] for x in generated]
        t0 = self._clock()
        train_stats = {}
        if kept:
            batch = TrainBatch(sequences=sequences, prompt_lens=prompt_lens, advantages=adv,
                               rollout_logprobs=rollout_lp)
            old = trainer_lp if self.trainer.config.pi_old == "recompute" else rollout_lp
            train_stats = self.trainer.train(batch, old, cfg.mini_batch_size)
        t_train = self._clock() - t0
        t_sync = self._sync_weights()
        lengths = [len(r.ids) for r, _ in generated]
        gen_tokens = sum(lengths)
        line = {
            "step": step,
            "logprob_abs_diff_mean": stats.get("logprob_abs_diff_mean", 0.0),
            "logprob_abs_diff_std": stats.get("logprob_abs_diff_std", 0.0),
            "logprob_abs_diff_max": stats.get("logprob_abs_diff_max", 0.0),
            "bitwise_equal_frac": stats.get("bitwise_equal_frac", 1.0),
            "kl_k1": stats.get("kl_k1", 0.0), "kl_k3": stats.get("kl_k3", 0.0),
            "tokens": stats.get("tokens", 0),
            "reward_mean": sum(all_rewards) / len(all_rewards) if all_rewards else 0.0,
            "accuracy": sum(x[1][1] for x in generated) / len(generated) if generated else 0.0,
            "responses": len(generated), "responses_trained": len(kept),
            "response_length_mean": sum(lengths) / len(lengths) if lengths else 0.0,
            "groups_kept": len(groups), "groups_dropped": dropped, "generation_rounds": rounds,
            **{f"train_{k}": v for k, v in train_stats.items() if isinstance(v, (int, float))},
            # time_training_s is the mini-batch updates alone (verl's "policy training"); scoring
            # is its own stage. A step that kept no group trained nothing: "trained" is False and
            # the tables keep it out of the training means.
            "trained": bool(kept), "tokens_generated": gen_tokens,
            "time_generation_s": t_gen, "time_scoring_s": t_score, "time_training_s": t_train,
            "time_weight_sync_s": t_sync,
            "time_generation_per_1k_tokens_s": t_gen / gen_tokens * 1000 if gen_tokens else None,
            "time_step_s": self._clock() - t_step,
        }
        self.metrics.write(line)
        self.log(summary_line(line))
        self.step += 1
        every = self.cfg.checkpoint_every
        if every and (self.step % every == 0 or self.step == self.cfg.steps):
            self._save()
        return line

    def run(self) -> list[dict]:
        out = []
        while self.step < self.cfg.steps:
            out.append(self.run_step())
        return out


def run_rl(cfg: RLConfig, out_dir: str | Path, log: Callable[[str], None] = print) -> list[dict]:
    run = RLRun(cfg, out_dir, log)
    return run.run()

