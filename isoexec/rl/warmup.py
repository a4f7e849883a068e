"""The shared supervised warm-up: one per (family, seed), a starting point for every arm.

A tiny random model gets a short supervised warm-up before RL so that rewards carry signal
(``warmup_sft_steps``). Run inside each RL run, it would run with that run's own composition: the
arms of a native-vs-IsoExec pair would start from different weights, and the IsoExec arm would pay
for it on the slow CPU reference kernels. ``isoexec warmup`` (:func:`isoexec.rl.loop.warm_up`)
runs it once, with the **native** composition (the stock path, the fast one; the warm-up's weights
are a starting point and carry no bitwise claim), on exactly the problems, prompts, tokenizer,
seed and optimizer settings the run would use, and writes the warmed model as a Hugging Face
checkpoint folder; the runs load it through ``checkpoint:`` as they load any checkpoint, and start
RL from it with a fresh AdamW, as an RL pipeline starts from an SFT checkpoint.

The folder: ``config.json`` (the model's ``hf_config``),
``model.safetensors`` (transformers names, the model's dtype: it loads back bit for bit for every
family, ``tests/rl/test_shared_warmup.py``) and ``warmup.json``, the record written last: the settings the
warm-up read, the data set's SHA-256, the weights' SHA-256, the NLL before and after. A run whose
checkpoint folder holds a record checks it against its own settings before any work and refuses a
warm-up of another configuration (:func:`check_shared_warmup`).

The warm-up itself runs in :func:`isoexec.rl.loop.warm_up`, beside the run it stands in for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from ..errors import ConfigError
from ..paths import sha256_file
from ..train.trainer import TrainConfig

#: The composition every shared warm-up runs with.
COMPOSITION = "native"
#: The record in a warm-up folder (its presence makes a checkpoint folder a shared warm-up).
RECORD = "warmup.json"
WEIGHTS = "model.safetensors"
FORMAT = "isoexec-warmup/1"

#: The RLConfig keys the warm-up reads (besides the model, compared by its hf_config, and the data
#: set, compared by its SHA-256). The workflow restates them (workflow/rules/common.smk,
#: WARMUP_KEYS) without importing the package; a test keeps the two equal.
WARMUP_KEYS = ("family", "arch", "seed", "dtype", "tokenizer", "prompt_style", "max_prompt_tokens",
               "warmup_sft_steps", "warmup_batch_size")
#: The TrainConfig fields the warm-up's SFT steps read: the optimizer, the micro-batch packing (the
#: order gradients are summed in) and the seed of the SFT sub-batch sampling.
WARMUP_TRAIN_KEYS = ("lr", "betas", "eps", "weight_decay", "grad_clip", "micro_batch_tokens", "seed")
#: The keys the warm-up does not read (every RLConfig and TrainConfig field is in one list or the
#: other, a test checks it): a new field must be placed, or a changed value could be missed.
NOT_WARMUP_KEYS = ("composition", "contract", "checkpoint", "model", "dataset", "synthetic", "steps",
                   "prompts_per_step", "samples_per_prompt", "mini_batch_size", "max_response_tokens",
                   "overlong_cache", "temperature", "top_p", "dynamic_sampling", "max_refill_rounds", "engine_tp",
                   "trainer_ep", "kv_cache_gib", "checkpoint_every", "live_check", "train", "engine", "wandb")
#: activation_checkpointing is not read for the warm-up's bits: a checkpointed layer recomputes the
#: same forward, so its gradients are bitwise those without (tests/train/test_activation_checkpointing.py);
#: nor reshard_after_forward: when FSDP2 frees a gathered layer changes no value
#: (tests/dist/test_fsdp_per_layer.py).
NOT_WARMUP_TRAIN_KEYS = ("loss", "clip_low", "clip_high", "kl_coef", "pi_old", "tis_threshold", "rs_kind",
                         "rs_threshold", "clip_ratio_c", "lr_warmup_steps", "activation_checkpointing",
                         "reshard_after_forward")


def resolved_dtype(cfg) -> str:
    """The dtype name a run computes in: ``auto`` is bfloat16 on a GPU arch, float32 on cpu."""
    if cfg.dtype != "auto":
        return cfg.dtype
    return "float32" if cfg.arch == "cpu" else "bfloat16"


def warmup_settings(cfg) -> dict:
    """What the warm-up of run config ``cfg`` reads, as JSON values: the two arms of a pair have the
    same, whatever their compositions. ``train`` keys are resolved (a default left out equals the
    default written out); ``synthetic`` counts only for the synthetic data set."""
    t = TrainConfig.from_dict({"seed": cfg.seed, **cfg.train})
    s: dict[str, Any] = {k: getattr(cfg, k) for k in WARMUP_KEYS}
    s["dtype"] = resolved_dtype(cfg)
    s["train"] = {k: getattr(t, k) for k in WARMUP_TRAIN_KEYS}
    s["synthetic"] = dict(cfg.synthetic) if cfg.dataset == "synthetic" else None
    return json.loads(json.dumps(s, sort_keys=True))   # tuples as lists, as a record reads back


def data_digest(cfg) -> Optional[str]:
    """SHA-256 of the run's data set file (None for the in-memory synthetic task, whose parameters
    are part of :func:`warmup_settings`)."""
    return None if cfg.dataset == "synthetic" else sha256_file(cfg.dataset)


def read_record(folder: str | Path) -> Optional[dict]:
    """The warm-up record of a checkpoint folder; None when it is not a shared warm-up's folder."""
    p = Path(folder) / RECORD
    if not p.is_file():
        return None
    try:
        rec = json.loads(p.read_text())
    except ValueError as exc:
        raise ConfigError(f"{p}: not a readable warm-up record ({exc})") from None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise ConfigError(f"{p}: not a warm-up record of format {FORMAT!r} (found "
                          f"{rec.get('format') if isinstance(rec, dict) else type(rec).__name__!r}); "
                          "remake it with `isoexec warmup`")
    return rec


def check_shared_warmup(cfg, hf_config: dict) -> Optional[dict]:
    """For a run whose ``checkpoint`` is a shared warm-up's folder: its record, after checking that
    the warm-up was made from this run's settings (the model's config, the data set and every
    setting it reads); a ConfigError naming what differs otherwise. None for any other checkpoint."""
    if not cfg.checkpoint:
        return None
    rec = read_record(cfg.checkpoint)
    if rec is None:
        return None
    diff = []
    mine, theirs = warmup_settings(cfg), rec.get("settings") or {}
    for k in sorted(set(mine) | set(theirs)):
        a, b = mine.get(k), theirs.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            diff += [f"{k}.{j}" for j in sorted(set(a) | set(b)) if a.get(j) != b.get(j)]
        elif a != b:
            diff.append(k)
    if rec.get("hf_config") != json.loads(json.dumps(hf_config)):
        diff.append("model (its hf_config)")
    if rec.get("data_sha256") != data_digest(cfg):
        diff.append("data set")
    if diff:
        raise ConfigError(f"checkpoint {str(cfg.checkpoint)!r} is the shared warm-up of another configuration "
                          f"(differs in {', '.join(diff)}); make it from this run's settings with `isoexec warmup`")
    return rec


def describe(rec: dict, folder: str | Path) -> str:
    """One log line about a shared warm-up."""
    nll = rec.get("nll") or []
    shown = f", NLL {nll[0]:.3f} -> {nll[-1]:.3f}" if len(nll) >= 2 else ""
    return (f"starting from the shared warm-up {folder} ({rec.get('composition')} composition, "
            f"{rec.get('settings', {}).get('warmup_sft_steps')} SFT steps{shown}, weights sha256 "
            f"{str(rec.get('weights_sha256'))[:16]}...); no warm-up in this run")
