"""The shared warm-up (`isoexec warmup`, isoexec/rl/warmup.py): one supervised warm-up with the
native composition that every arm of a family and seed starts from.

The two arms of a pair load bit-identical weights, equal to those the native arm's own in-run
warm-up makes (the warm-up reads the run's problems, prompts, tokenizer and seeds; only its
composition is fixed); the checkpoint folder round-trips bit for bit for every family; a warm-up
made from other settings is refused before any work; the key lists the workflow restates agree."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from isoexec.errors import ConfigError
from isoexec.rl import warmup as shared
from isoexec.rl.loop import RLConfig, RLRun, warm_up
from isoexec.train.trainer import TrainConfig

REPO = Path(__file__).resolve().parents[2]
TINY = dict(steps=1, prompts_per_step=2, samples_per_prompt=2, mini_batch_size=1, max_prompt_tokens=16,
            max_response_tokens=8, overlong_cache=2, prompt_style="compact", warmup_sft_steps=6, warmup_batch_size=8,
            synthetic={"n": 40, "max_operand": 9, "min_terms": 2, "max_terms": 2, "ops": "+"},
            train={"lr": 3e-3})
quiet = lambda s: None  # noqa: E731


def bits(state: dict) -> dict:
    """Every tensor of a state dict as its bytes (bitwise comparison, never float ==)."""
    return {k: v.detach().contiguous().flatten().view(torch.uint8).clone() for k, v in state.items()}


def same_bits(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def cfg(**over) -> RLConfig:
    return RLConfig.from_dict({**TINY, **over})


@pytest.fixture(scope="module")
def shared_warmup(tmp_path_factory):
    """A shared warm-up of the dense family, made from a config whose composition is isoexec (the
    warm-up runs native whatever it says)."""
    folder = tmp_path_factory.mktemp("warmup") / "dense"
    record = warm_up(cfg(composition="isoexec"), folder, log=quiet)
    return folder, record


def test_the_warmup_folder_is_a_checkpoint_with_its_record(shared_warmup):
    folder, record = shared_warmup
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "warmup.json"]
    assert json.loads((folder / "warmup.json").read_text()) == json.loads(json.dumps(record))
    assert record["composition"] == "native" and record["format"] == shared.FORMAT
    assert record["weights_sha256"] == shared.sha256_file(folder / "model.safetensors")
    assert len(record["nll"]) == TINY["warmup_sft_steps"] and record["nll"][-1] < record["nll"][0]
    assert record["settings"]["warmup_sft_steps"] == 6 and record["settings"]["train"]["lr"] == 3e-3


def test_both_arms_start_from_the_same_bits_as_the_native_in_run_warmup(shared_warmup, tmp_path):
    """The pair's two runs load bit-identical weights (trainer and engine), and they are the weights
    the native run's own warm-up makes: only the composition of the warm-up is fixed. Warmed up in
    the runs themselves, the two arms would start apart (the IsoExec warm-up computes other bits)."""
    folder, _ = shared_warmup
    arms = {c: RLRun(cfg(composition=c, checkpoint=str(folder)), tmp_path / c, log=quiet)
            for c in ("isoexec", "native")}
    iso, nat = (bits(arms[c].trainer_model.state_dict()) for c in ("isoexec", "native"))
    assert same_bits(iso, nat)
    for run in arms.values():   # the engine got the same weights at the first weight sync
        assert same_bits(bits(run.engine_model.state_dict()), iso)
    in_run = {c: RLRun(cfg(composition=c), tmp_path / f"{c}_in_run", log=quiet) for c in ("native", "isoexec")}
    assert same_bits(bits(in_run["native"].trainer_model.state_dict()), nat)
    assert not same_bits(bits(in_run["isoexec"].trainer_model.state_dict()), nat)


@pytest.mark.parametrize("family", ["dense", "hybrid", "mla_moe", "hybrid_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_saved_checkpoint_folder_loads_back_bit_for_bit(tmp_path, family, dtype):
    from isoexec.compose import load_model_config
    from isoexec.model import build_model, load_checkpoint, save_checkpoint

    hf = load_model_config(f"{family}_tiny")["hf_config"]
    model = build_model(family, hf, dtype=dtype)
    model.init_random(5)
    with torch.no_grad():   # off the init's grid, as trained weights are
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(p.dtype) * 1e-3)
    digest = save_checkpoint(model, hf, tmp_path / "a")
    assert save_checkpoint(model, hf, tmp_path / "b") == digest   # the bytes depend only on the weights
    back = build_model(family, hf, dtype=dtype)
    load_checkpoint(back, tmp_path / "a")
    assert same_bits(bits(back.state_dict()), bits(model.state_dict()))


@pytest.mark.parametrize("over,named", [
    (dict(seed=1), "seed"),
    (dict(train={"lr": 1e-3}), "train.lr"),
    (dict(train={"lr": 3e-3, "micro_batch_tokens": 64}), "train.micro_batch_tokens"),
    (dict(warmup_batch_size=4), "warmup_batch_size"),
    (dict(warmup_sft_steps=7), "warmup_sft_steps"),
    (dict(prompt_style="full", max_prompt_tokens=512), "prompt_style"),
    (dict(synthetic={**TINY["synthetic"], "max_operand": 8}), "synthetic"),
    (dict(family="hybrid", model="hybrid_tiny"), "family"),
])
def test_a_warmup_of_other_settings_is_refused_before_any_work(shared_warmup, tmp_path, over, named):
    folder, _ = shared_warmup
    with pytest.raises(ConfigError, match=r"is the shared warm-up of another configuration \(differs in .*"
                       + re.escape(named)) as e:
        RLRun(cfg(checkpoint=str(folder), **over), tmp_path / "out", log=quiet)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_settings_the_warmup_does_not_read_may_differ(shared_warmup):
    """The RL-only settings (composition, steps, the loss, the engine, ...) and a train key written out
    at its default value leave the warm-up as it is."""
    folder, _ = shared_warmup
    default_eps = TrainConfig().eps
    for over in (dict(composition="native"), dict(steps=9, temperature=0.5, samples_per_prompt=3),
                 dict(train={"lr": 3e-3, "tis_threshold": 2.0, "loss": "grpo", "eps": default_eps}),
                 dict(engine={"max_num_batched_tokens": 1024}), dict(checkpoint_every=0)):
        c = cfg(checkpoint=str(folder), **over)
        assert shared.check_shared_warmup(c, shared.read_record(folder)["hf_config"])["composition"] == "native"


def test_another_data_set_is_refused(shared_warmup, tmp_path):
    from isoexec.rl.data import synthetic_arithmetic, write_parquet

    data = tmp_path / "d.parquet"
    write_parquet(synthetic_arithmetic(n=40, seed=0, max_operand=9, min_terms=2, max_terms=2, ops="+"), data)
    made = warm_up(cfg(dataset=str(data)), tmp_path / "w", log=quiet)
    assert made["data_sha256"] == shared.sha256_file(data)
    write_parquet(synthetic_arithmetic(n=40, seed=1, max_operand=9, min_terms=2, max_terms=2, ops="+"), data)
    with pytest.raises(ConfigError, match=r"differs in data set\)"):
        shared.check_shared_warmup(cfg(dataset=str(data), checkpoint=str(tmp_path / "w")), made["hf_config"])


def test_a_record_of_another_format_is_refused(shared_warmup, tmp_path):
    import shutil

    folder = tmp_path / "w"
    shutil.copytree(shared_warmup[0], folder)
    rec = json.loads((folder / "warmup.json").read_text())
    (folder / "warmup.json").write_text(json.dumps({**rec, "format": "isoexec-warmup/0"}))
    with pytest.raises(ConfigError, match=r"not a warm-up record of format 'isoexec-warmup/1'"):
        RLRun(cfg(checkpoint=str(folder)), tmp_path / "out", log=quiet)
    (folder / "warmup.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable warm-up record"):
        RLRun(cfg(checkpoint=str(folder)), tmp_path / "out", log=quiet)


@pytest.mark.parametrize("over,message", [
    (dict(warmup_sft_steps=0), "warmup_sft_steps is 0: there is nothing to warm up"),
    (dict(checkpoint="some/folder"), "a run from a checkpoint has no warm-up"),
])
def test_warm_up_refuses_what_has_no_warmup_and_writes_nothing(tmp_path, over, message):
    with pytest.raises(ConfigError, match=message):
        warm_up(cfg(**over), tmp_path / "w", log=quiet)
    assert not (tmp_path / "w").exists()


def test_every_setting_is_placed_as_read_or_not_read_by_the_warmup():
    """A new RLConfig or TrainConfig field must be placed in one list: a field the warm-up reads but
    no list names would let two arms share a warm-up made from other settings."""
    fields = [f.name for f in dataclasses.fields(RLConfig)]
    placed = list(shared.WARMUP_KEYS) + list(shared.NOT_WARMUP_KEYS)
    assert sorted(placed) == sorted(fields), set(fields) ^ set(placed)
    train = [f.name for f in dataclasses.fields(TrainConfig)]
    assert sorted(shared.WARMUP_TRAIN_KEYS + shared.NOT_WARMUP_TRAIN_KEYS) == sorted(train)


def test_the_workflow_restates_the_warmup_keys():
    """workflow/rules/common.smk names the keys without importing the package: the same lists (less
    family, arch and seed, which the workflow fills in for every job)."""
    text = (REPO / "workflow/rules/common.smk").read_text()

    def literal(name):
        return ast.literal_eval(re.search(rf"^{name} = (\(.*?\))$", text, re.M | re.S).group(1))

    assert literal("WARMUP_KEYS") == tuple(k for k in shared.WARMUP_KEYS if k not in ("family", "arch", "seed"))
    assert literal("WARMUP_TRAIN_KEYS") == shared.WARMUP_TRAIN_KEYS
    assert re.search(r'^WARMUP_COMPOSITION = "(\w+)"$', text, re.M).group(1) == shared.COMPOSITION
