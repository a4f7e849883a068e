"""The RL loop against verl's DAPO recipe, on CPU with the tiny dense model: mini_batch_size counts
prompts, overlong prompts are filtered with a count, a refill shortfall is logged and recorded,
the chat template frames prompts where the tokenizer has one, W&B mirrors the metrics (the real
library, offline)."""

from __future__ import annotations

import glob
import re
import struct
import time

import pytest
import yaml

from isoexec.errors import ConfigError
from isoexec.rl.data import synthetic_arithmetic
from isoexec.rl.loop import RLConfig, RLRun, WandbConfig

BASE = dict(steps=1, prompts_per_step=4, samples_per_prompt=2, mini_batch_size=2, max_prompt_tokens=16,
            max_response_tokens=8, overlong_cache=2, prompt_style="compact", warmup_sft_steps=0,
            synthetic={"n": 40, "max_operand": 9, "min_terms": 2, "max_terms": 2, "ops": "+"},
            train={"lr": 3e-3})


def _run(tmp_path, name="r", logs=None, **kw):
    log = logs.append if logs is not None else (lambda s: None)
    return RLRun(RLConfig.from_dict(dict(BASE, **kw)), tmp_path / name, log=log)


def test_mini_batch_size_counts_prompts(tmp_path):
    """4 prompts x 2 samples, mini_batch_size 2 prompts: 2 updates of 4 sequences (counting
    sequences, as before, would have made 4 updates of 2)."""
    line = _run(tmp_path, dynamic_sampling=False).run_step()
    assert line["responses_trained"] == 8 and line["train_updates"] == 2
    line = _run(tmp_path, "r1", dynamic_sampling=False, mini_batch_size=1).run_step()
    assert line["train_updates"] == 4
    with pytest.raises(ConfigError, match="mini_batch_size 8 counts prompts"):
        RLConfig.from_dict(dict(BASE, mini_batch_size=8))


def test_overlong_prompts_are_filtered_with_a_count_and_a_short_step_says_so(tmp_path):
    syn = {"n": 40, "max_operand": 99, "min_terms": 2, "max_terms": 2, "ops": "+"}
    exprs = [re.search(r"Compute (.+?)\.", r["prompt"][0]["content"]).group(1)
             for r in synthetic_arithmetic(seed=0, **syn)]
    too_long = sum(len(e) + 1 > 5 for e in exprs)                  # compact prompt "<expr>=", one id per char
    assert 0 < too_long < len(exprs)
    logs = []
    run = _run(tmp_path, logs=logs, synthetic=syn, max_prompt_tokens=5, max_refill_rounds=1)
    assert len(run.problems) == len(exprs) - too_long
    assert all(len(run._prompt_ids[p.id]) <= 5 for p in run.problems)
    assert any(f"warning: {too_long} of {len(exprs)} prompts are longer than max_prompt_tokens=5" in s for s in logs)
    # a random model (no warm-up) gets every group all wrong: dynamic sampling drops them all
    line = run.run_step()
    assert line["prompts_filtered_overlong"] == too_long
    assert line["generation_rounds"] == 2 and line["groups_kept"] == 0
    assert line["groups_short"] == 4 and line["trained"] is False
    assert any("warning: step 0: dynamic sampling kept 0 of 4 groups after 2 generation round(s)" in s
               and "groups_short=4" in s for s in logs)


def test_every_prompt_too_long_is_refused_before_the_output_folder_exists(tmp_path):
    with pytest.raises(ConfigError, match="every one of the 40 prompts is longer than max_prompt_tokens=3"):
        _run(tmp_path, max_prompt_tokens=3)
    assert not (tmp_path / "r").exists()


def test_chat_template_frames_the_prompts_of_a_run(tmp_path, chat_tokenizer_dir):
    from isoexec.rl.tokenizer import HFTokenizer

    run = _run(tmp_path, tokenizer=str(chat_tokenizer_dir), dynamic_sampling=False)
    tok = HFTokenizer(chat_tokenizer_dir)
    p = run.problems[0]
    expr = re.search(r"Compute (.+?)\.", p.prompt_text).group(1)
    assert run._prompt_ids[p.id] == tok.encode(f"<|user|>{expr}=<|assistant|>")
    line = run.run_step()
    assert line["tokens"] > 0 and line["bitwise_equal_frac"] == 1.0


def _wandb_records(path):
    """Records of an offline W&B run file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buf = open(path, "rb").read(), 7, 32768, b""   # 7-byte ":W&B" file header
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:                                   # a block's tail too short for a header
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):                                            # FULL or LAST fragment
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def test_wandb_mirror_is_switched_on_by_the_config(tmp_path, monkeypatch):
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))          # keep the library out of $HOME
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = _run(tmp_path, dynamic_sampling=False, wandb={"enabled": True, "project": "isoexec-test"})
    lines = run.run()
    files = glob.glob(str(tmp_path / "r" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    # W&B's service process writes the file; on a loaded machine its last records can land a
    # moment after finish() returned (seen once in a full suite beside other load): read until the
    # run record is there, for at most a minute
    deadline = time.monotonic() + 60
    while True:
        history, names = [], []
        for rec in _wandb_records(files[0]):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                history.append({(i.key or "/".join(i.nested_key)): yaml.safe_load(i.value_json)
                                for i in rec.history.item})
            elif kind == "run":
                names.append((rec.run.project, rec.run.display_name))
        if (names and history) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert ("isoexec-test", "dense-isoexec-seed0") in names
    assert len(history) == 1
    for key in ("reward_mean", "logprob_abs_diff_max", "groups_short", "train_updates"):
        assert history[0][key] == pytest.approx(lines[0][key]), key
    assert WandbConfig().mode == "offline" and WandbConfig().enabled is False   # off unless asked, then offline
