"""The stored transformers config attributes (isoexec/hf_config_store.py): what a process reads back
is what transformers' config object says, a second process reads it without importing transformers,
and a rejected or unreadable config is never served from the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from isoexec import hf_config_store
from isoexec.errors import ConfigError
from isoexec.model_config import DenseConfig, HybridConfig, HybridMoeConfig, MlaMoeConfig, _build_hf_config

REPO = Path(__file__).resolve().parents[1]
FAMILY_CONFIG = {"dense": DenseConfig, "hybrid": HybridConfig, "hybrid_moe": HybridMoeConfig,
                 "mla_moe": MlaMoeConfig}
MODEL_YAMLS = sorted((REPO / "configs" / "models").glob("*.yaml"))


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A private store folder and an empty in-process memo."""
    monkeypatch.setenv("ISOEXEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hf_config_store, "_IN_PROCESS", {})
    return tmp_path / "cache" / "hf_config"


def _model(path: Path) -> tuple[str, dict]:
    data = yaml.safe_load(path.read_text())
    return data["family"], data["hf_config"]


@pytest.mark.parametrize("path", MODEL_YAMLS, ids=lambda p: p.stem)
def test_every_model_config_reads_the_same_from_the_store_as_from_the_transformers_object(path, store):
    family, hf = _model(path)
    cls = FAMILY_CONFIG[family]
    from_object = cls.from_hf(_build_hf_config(hf))       # transformers' own config object
    built = cls.from_hf(hf)                                 # first read: built, then stored
    assert len(list(store.glob("*.json"))) == 1
    hf_config_store._IN_PROCESS.clear()
    read_back = cls.from_hf(hf)                             # read from the stored entry
    assert from_object == built == read_back
    # the keys the class declares (the MoE families refuse a YAML key that is none of them)
    stored = hf_config_store.stored_config(hf, _build_hf_config)
    assert hf_config_store.declared_keys(stored) == hf_config_store.declared_keys(_build_hf_config(hf)) is not None


def test_aliases_of_the_config_class_are_stored(store):
    _, hf = _model(REPO / "configs" / "models" / "mla_moe_tiny.yaml")
    obj = _build_hf_config(hf)
    assert type(obj).attribute_map, "the GLM config class has attribute aliases (the point of this test)"
    got = hf_config_store.stored_config(hf, _build_hf_config)
    for alias in type(obj).attribute_map:
        assert getattr(got, alias) == getattr(obj, alias), alias
    with pytest.raises(AttributeError):
        got.no_such_attribute
    assert getattr(got, "no_such_attribute", 7) == 7


def test_a_second_process_reads_the_entry_without_importing_transformers(store):
    code = ("import json, sys, yaml; from isoexec.model_config import HybridConfig; "
            f"hf = yaml.safe_load(open({str(REPO / 'configs/models/hybrid_tiny.yaml')!r}))['hf_config']; "
            "cfg = HybridConfig.from_hf(hf); "
            "print(json.dumps({'transformers': 'transformers' in sys.modules, 'layers': cfg.num_layers}))")
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], env=dict(os.environ), check=True,
                                      capture_output=True, text=True).stdout) for _ in range(2)]
    assert runs[0] == {"transformers": True, "layers": 4}     # built: transformers imported
    assert runs[1] == {"transformers": False, "layers": 4}    # read back


def test_a_rejected_config_raises_every_time_and_is_never_stored(store):
    bad = {"model_type": "qwen3", "vocab_size": "many"}   # transformers' validator refuses it
    for _ in range(2):
        with pytest.raises(ConfigError, match="vocab_size"):
            DenseConfig.from_hf(bad)
    assert not list(store.glob("*.json"))


def test_an_unreadable_entry_is_a_miss_and_is_written_again(store):
    _, hf = _model(REPO / "configs" / "models" / "dense_tiny.yaml")
    want = DenseConfig.from_hf(hf)
    (entry,) = store.glob("*.json")
    entry.write_text('{"attributes": ')                    # cut short
    hf_config_store._IN_PROCESS.clear()
    assert DenseConfig.from_hf(hf) == want
    assert json.loads(entry.read_text())["attributes"]["hidden_size"] == hf["hidden_size"]


def test_another_transformers_version_or_config_is_another_entry(store, monkeypatch):
    _, hf = _model(REPO / "configs" / "models" / "dense_tiny.yaml")
    key = hf_config_store.entry_key(hf)
    assert hf_config_store.entry_key(dict(hf, vocab_size=hf["vocab_size"] + 1)) != key
    monkeypatch.setattr(hf_config_store, "_transformers_version", lambda: "0.0.0")
    assert hf_config_store.entry_key(hf) != key


def test_an_empty_cache_dir_turns_the_store_off(tmp_path, monkeypatch):
    monkeypatch.setenv("ISOEXEC_CACHE_DIR", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(hf_config_store, "_IN_PROCESS", {})
    _, hf = _model(REPO / "configs" / "models" / "dense_tiny.yaml")
    assert DenseConfig.from_hf(hf).hidden_size == hf["hidden_size"]
    assert hf_config_store.cache_folder() is None
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_a_folder_that_cannot_be_written_costs_only_the_build(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("ISOEXEC_CACHE_DIR", str(blocker))
    monkeypatch.setattr(hf_config_store, "_IN_PROCESS", {})
    _, hf = _model(REPO / "configs" / "models" / "dense_tiny.yaml")
    assert DenseConfig.from_hf(hf).hidden_size == hf["hidden_size"]


def test_a_stored_config_is_read_only_and_survives_a_pickle(store):
    import pickle

    _, hf = _model(REPO / "configs" / "models" / "hybrid_tiny.yaml")
    got = hf_config_store.stored_config(hf, _build_hf_config)
    with pytest.raises(AttributeError):
        got.hidden_size = 1
    assert pickle.loads(pickle.dumps(got)) == got
