"""Per-step metrics of an RL run: how far the trainer's logprobs are from the rollout's, and the
``metrics.jsonl`` file the tables and figures are drawn from (docs/benchmarks.md, "Run metrics").

:func:`logprob_diff_stats` compares, token by token, the logprob the rollout engine reported
when it sampled a token with the logprob the trainer computes for the same token. IsoExec's
claim is that they are the same bits, so besides the usual |difference| statistics it reports
the fraction of tokens whose fp32 values are bitwise equal (compared as int32 views: 0.0 vs -0.0
or two NaNs with different payloads count as different, equal-valued floats as equal) and the
first token that differs, which is where a divergence hunt starts.

KL(rollout || trainer) is estimated on the sampled tokens (they were drawn from the rollout
policy) with the estimators verl reports as its rollout-mismatch metrics. With
``log r = logprob_trainer - logprob_rollout`` per token:

* ``kl_k1 = mean(-log r) = mean(logprob_rollout - logprob_trainer)`` - unbiased, can be < 0;
* ``kl_k3 = mean(r - 1 - log r)`` - unbiased and never negative (Schulman's k3).

(k1 is the mean of ``-log r``: the plain mean of ``log r`` would estimate -KL.) Everything is
accumulated in float64 over all tokens of the step (token mean, not sequence mean); a token
whose two values are bitwise equal contributes exactly 0 to every difference, so identical
inputs give exactly 0 (also for -inf logprobs, where the subtraction would give NaN).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..bits import INT_VIEW, int_view
from ..errors import IsoExecError
from ..paths import atomic_write

#: Keys every metrics.jsonl line must have (docs/benchmarks.md); more may follow.
REQUIRED_KEYS = (
    "step", "logprob_abs_diff_mean", "logprob_abs_diff_std", "logprob_abs_diff_max",
    "bitwise_equal_frac", "reward_mean", "time_generation_s", "time_scoring_s",
    "time_training_s", "time_step_s",
)

def _bits(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in INT_VIEW:
        raise TypeError(f"logprobs must be a floating tensor (fp32 expected), got {x.dtype}")
    return int_view(x)


def logprob_diff_stats(rollout: Sequence[torch.Tensor], trainer: Sequence[torch.Tensor],
                       rollout_top1: Sequence[torch.Tensor] | None = None,
                       trainer_top1: Sequence[torch.Tensor] | None = None) -> dict:
    """Compare per-sequence logprob vectors (``rollout[i]`` and ``trainer[i]`` of one sequence's
    response tokens, same shape and dtype). Returns ``logprob_abs_diff_{mean,std,max}`` (std is
    the population std over the step's tokens: it describes this step, it estimates nothing),
    ``bitwise_equal_frac``, ``tokens``, ``first_differing`` ((sequence, token) or None),
    ``kl_k1``, ``kl_k3``; and :func:`argmax_flips`' keys when both top-1 id lists are given."""
    if len(rollout) != len(trainer):
        raise ValueError(f"logprob_diff_stats: {len(rollout)} rollout sequences vs {len(trainer)} trainer sequences")
    diffs, k1s, k3s = [], [], []
    equal, total = 0, 0
    first = None
    for i, (r, t) in enumerate(zip(rollout, trainer)):
        r, t = r.detach().cpu(), t.detach().cpu()   # engine results live on the host, trainer scores may not
        if r.shape != t.shape or r.dtype != t.dtype:
            raise ValueError(f"logprob_diff_stats: sequence {i}: rollout {tuple(r.shape)} {r.dtype} "
                             f"vs trainer {tuple(t.shape)} {t.dtype}")
        same = (_bits(r) == _bits(t)).reshape(-1)
        n_same = int(same.sum())
        equal += n_same
        total += same.numel()
        if first is None and n_same < same.numel():
            first = (i, int((~same).nonzero()[0]))
        r64 = r.detach().reshape(-1).to(torch.float64)
        t64 = t.detach().reshape(-1).to(torch.float64)
        log_r = torch.where(same, 0.0, t64 - r64)
        diffs.append(log_r.abs())
        k1s.append(-log_r)
        k3s.append(torch.where(same, 0.0, torch.expm1(log_r) - log_r))
    if total == 0:
        raise ValueError("logprob_diff_stats: no tokens to compare")
    d = torch.cat(diffs)
    out = {
        "logprob_abs_diff_mean": float(d.mean()),
        "logprob_abs_diff_std": float(d.std(unbiased=False)),
        "logprob_abs_diff_max": float(d.max()),
        "bitwise_equal_frac": equal / total,
        "tokens": total,
        "first_differing": first,
        "kl_k1": float(torch.cat(k1s).mean()),
        "kl_k3": float(torch.cat(k3s).mean()),
    }
    if (rollout_top1 is None) != (trainer_top1 is None):
        raise ValueError("logprob_diff_stats: give both rollout_top1 and trainer_top1, or neither")
    if rollout_top1 is not None:
        out.update(argmax_flips(rollout_top1, trainer_top1))
    return out


def argmax_flips(rollout_top1: Sequence[torch.Tensor], trainer_top1: Sequence[torch.Tensor]) -> dict:
    """How many positions have a different most-likely token on the two sides.

    A logprob difference that also flips the argmax changes what greedy decoding would emit,
    the visible symptom of a mismatch. Returns ``argmax_flips`` (count) and ``argmax_flip_frac``.
    """
    if len(rollout_top1) != len(trainer_top1):
        raise ValueError(f"argmax_flips: {len(rollout_top1)} vs {len(trainer_top1)} sequences")
    flips, total = 0, 0
    for i, (a, b) in enumerate(zip(rollout_top1, trainer_top1)):
        if a.shape != b.shape:
            raise ValueError(f"argmax_flips: sequence {i}: shapes {tuple(a.shape)} vs {tuple(b.shape)}")
        flips += int((a.reshape(-1) != b.reshape(-1)).sum())
        total += a.numel()
    return {"argmax_flips": flips, "argmax_flip_frac": flips / total if total else 0.0}


# --------------------------------------------------------------------------- the JSONL file


class MetricsFileError(IsoExecError):
    """A metrics line is incomplete, or the file cannot be appended to or resumed."""


def _plain(v: Any) -> Any:
    """JSON-ready copy: tensors/numpy scalars to Python numbers, tuples to lists."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise MetricsFileError(f"metric value is a tensor of {v.numel()} elements; log a scalar")
        return v.item()
    if hasattr(v, "item") and hasattr(v, "dtype"):        # numpy scalar
        return v.item()
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, Path):
        return str(v)
    return v


def _validate(obj: dict) -> None:
    missing = [k for k in REQUIRED_KEYS if k not in obj]
    if missing:
        raise MetricsFileError(f"metrics line for step {obj.get('step', '?')} lacks required key(s) "
                               f"{', '.join(missing)} (docs/benchmarks.md run-metrics format)")
    step = obj["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise MetricsFileError(f"metrics 'step' must be an int >= 0, got {step!r}")
    for k, v in obj.items():
        if k in REQUIRED_KEYS and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise MetricsFileError(f"metrics step {step}: {k!r} must be a number, got {v!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise MetricsFileError(f"metrics step {step}: {k!r} is {v}; JSON readers refuse NaN/inf")


class _WandbMirror:
    """Sends each line to Weights & Biases too. Off unless asked for; offline by default (our
    machines have no network, and an offline run can be synced later with ``wandb sync``)."""

    def __init__(self, project: str, run_name: str | None, mode: str, config: Mapping | None, directory: Path):
        self.run = None
        try:
            import wandb
        except ImportError:
            warnings.warn("MetricsWriter: wandb mirror requested but wandb is not installed; "
                          "writing metrics.jsonl only", stacklevel=3)
            return
        self.run = wandb.init(project=project, name=run_name, mode=mode, dir=str(directory),
                              config=dict(config or {}))

    def log(self, obj: dict) -> None:
        if self.run is not None:
            flat = {k: v for k, v in obj.items() if k != "step" and isinstance(v, (int, float))}
            self.run.log(flat, step=obj["step"])

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MetricsWriter:
    """Appends one JSON object per RL step to ``path`` (``metrics.jsonl``).

    Every line is validated (the docs/benchmarks.md keys, finite numbers, steps strictly increasing),
    then written, flushed and fsynced: a run killed at any moment leaves whole lines for all
    finished steps and at most one torn last line.

    Opening never destroys lines. To resume from a checkpoint taken after step ``k``, call
    :meth:`truncate_after` with ``k`` (or pass ``resume_from=k``): lines of later steps (written
    after the checkpoint, then lost with the kill) and a torn last line are dropped, so the
    resumed run's file ends with exactly the steps of an uninterrupted one. A fresh run over an
    old file calls ``truncate_after(-1)``; if it forgets, its first write is refused (step not
    after the file's last step) instead of silently mixing two runs in one file.

    ``wandb=True`` also mirrors each line to W&B (``wandb_mode`` "offline" unless told
    otherwise); it is skipped with a warning when wandb is not importable.
    """

    def __init__(self, path: str | os.PathLike, *, resume_from: int | None = None,
                 wandb: bool = False, wandb_project: str = "isoexec", wandb_mode: str = "offline",
                 run_name: str | None = None, config: Mapping | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.last_step: int | None = None
        self._torn = False
        if resume_from is None:
            _, self.last_step, self._torn = self._scan()
        else:
            self.truncate_after(resume_from)
        self._f = open(self.path, "a", encoding="utf-8")
        self._wandb = _WandbMirror(wandb_project, run_name, wandb_mode, config, self.path.parent) if wandb else None

    def write(self, metrics: Mapping[str, Any]) -> dict:
        """Validate and append one step's metrics; returns the object as written."""
        if self._f is None:
            raise MetricsFileError(f"{self.path}: writer is closed")
        obj = _plain(dict(metrics))
        _validate(obj)
        if self._torn:
            raise MetricsFileError(f"{self.path} ends with a torn line (a killed run); call "
                                   f"truncate_after(<checkpoint step>) before writing")
        if self.last_step is not None and obj["step"] <= self.last_step:
            raise MetricsFileError(f"{self.path}: step {obj['step']} written after step {self.last_step}; "
                                   f"steps must increase (resuming? call truncate_after(<checkpoint "
                                   f"step>); a fresh run: truncate_after(-1))")
        obj = {"step": obj["step"], **{k: v for k, v in obj.items() if k != "step"}}
        line = json.dumps(obj, allow_nan=False)
        self._f.write(line + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.last_step = obj["step"]
        if self._wandb is not None:
            self._wandb.log(obj)
        return obj

    def _scan(self, upto: int | None = None) -> tuple[list[str], int | None, bool]:
        """(lines of steps <= ``upto`` (all if None), their last step, whether a torn line ended
        the file). A line that does not parse is a torn write only if it is the last one."""
        kept: list[str] = []
        last = None
        if not self.path.exists():
            return kept, last, False
        lines = self.path.read_text(encoding="utf-8").split("\n")
        torn = lines[-1] != ""          # a complete file ends with a newline
        if not torn:
            lines.pop()
        for n, line in enumerate(lines):
            try:
                s = json.loads(line)["step"]
                if torn and n == len(lines) - 1:
                    raise ValueError("no newline")
            except (ValueError, KeyError, TypeError):
                if n == len(lines) - 1:
                    return kept, last, True
                raise MetricsFileError(f"{self.path}: line {n + 1} is not a metrics object; "
                                       f"refusing to append to or resume over a damaged file") from None
            if upto is not None and s > upto:
                break
            kept.append(line)
            last = s
        return kept, last, False

    def truncate_after(self, step: int) -> int:
        """Keep only the lines of steps <= ``step`` (and drop a torn last line); returns how many
        lines remain. The file is rewritten atomically, so a kill during resume loses nothing."""
        f = getattr(self, "_f", None)
        if f is not None:
            f.close()
        kept, last, _ = self._scan(upto=step)
        atomic_write(self.path, "".join(line + "\n" for line in kept))
        self.last_step = last
        self._torn = False
        if f is not None:
            self._f = open(self.path, "a", encoding="utf-8")
        return len(kept)

    def close(self) -> None:
        if getattr(self, "_f", None) is not None:
            self._f.close()
            self._f = None
        if getattr(self, "_wandb", None) is not None:
            self._wandb.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All lines of a metrics.jsonl as dicts (for reports and tests)."""
    text = Path(path).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def summary_line(m: Mapping[str, Any]) -> str:
    """One human line per step, e.g.
    ``step 3 | reward +0.250 | |dlp| mean 1.60e-02 max 5.07e+00 | equal 8.40% | gen 1.20s score 0.30s train 0.90s step 2.50s``."""
    def num(key, fmt):
        v = m.get(key)
        return "-" if v is None else format(v, fmt)

    parts = [f"step {m.get('step', '?')}",
             f"reward {num('reward_mean', '+.3f')}",
             f"|dlp| mean {num('logprob_abs_diff_mean', '.2e')} max {num('logprob_abs_diff_max', '.2e')}",
             f"equal {num('bitwise_equal_frac', '.2%')}",
             f"gen {num('time_generation_s', '.2f')}s score {num('time_scoring_s', '.2f')}s "
             f"train {num('time_training_s', '.2f')}s step {num('time_step_s', '.2f')}s"]
    if m.get("first_differing") is not None:
        seq, tok = m["first_differing"]
        parts.append(f"first diff seq {seq} tok {tok}")
    return " | ".join(parts)
