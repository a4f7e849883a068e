"""The packaged RL config schema (isoexec/rl/config.schema.yaml) and the dataclasses it describes
cannot drift apart: the same keys, every default valid, and the workflow's `rl.settings` is that
schema (by reference, not a copy) minus the keys the workflow sets itself."""

from __future__ import annotations

import inspect
import json
import tomllib
from dataclasses import asdict, fields
from pathlib import Path

import jsonschema
import pytest
import yaml

from isoexec import registry
from isoexec.engine.config import EngineConfig
from isoexec.errors import ConfigError
from isoexec.rl.data import synthetic_arithmetic
from isoexec.rl.loop import SCHEMA_PATH, RLConfig, WandbConfig, config_schema
from isoexec.train.trainer import TrainConfig
from isoexec.yamlio import check_schema

REPO = Path(__file__).resolve().parents[2]
SECTIONS = {"train": TrainConfig, "engine": EngineConfig, "wandb": WandbConfig}
SET_BY_WORKFLOW = {"family", "composition", "model", "arch", "seed", "contract", "dataset", "synthetic"}


def section(name: str) -> dict:
    return config_schema()["$defs"][name]


def as_yaml_would_read(obj) -> dict:
    """A dataclass as YAML would give it (tuples become lists)."""
    return json.loads(json.dumps(asdict(obj)))


def test_schema_is_a_valid_draft_2020_12_schema():
    jsonschema.Draft202012Validator.check_schema(config_schema())


def test_schema_keys_are_the_dataclass_fields():
    assert set(config_schema()["properties"]) == {f.name for f in fields(RLConfig)}
    for name, cls in SECTIONS.items():
        assert set(section(name)["properties"]) == {f.name for f in fields(cls)}, name
    params = set(inspect.signature(synthetic_arithmetic).parameters) - {"seed"}
    assert set(section("synthetic")["properties"]) == params


def test_schema_enums_are_the_registrys():
    assert section("family")["enum"] == list(registry.FAMILIES)
    assert section("arch")["enum"] == list(registry.ARCHES)


def test_every_mapping_refuses_unknown_keys():
    def objects(node):
        if isinstance(node, dict):
            if "properties" in node:
                yield node
            for v in node.values():
                yield from objects(v)

    found = list(objects(config_schema()))
    assert len(found) == 1 + 4      # the run and its train, engine, synthetic, wandb sections
    assert all(o.get("additionalProperties") is False for o in found)


def test_every_default_validates():
    check_schema(as_yaml_would_read(RLConfig()), config_schema(), "RLConfig defaults")
    for name, cls in SECTIONS.items():
        check_schema({name: as_yaml_would_read(cls())}, config_schema(), f"{cls.__name__} defaults")
    defaults = {k: p.default for k, p in inspect.signature(synthetic_arithmetic).parameters.items()
                if p.default is not inspect.Parameter.empty}
    assert defaults and "n" not in defaults
    check_schema({"synthetic": {"n": 1, **defaults}}, config_schema(), "synthetic_arithmetic defaults")
    assert RLConfig.from_dict({}) == RLConfig()


def test_a_value_the_dataclass_would_take_is_refused_by_the_schema():
    """The schema is stricter than Python's constructors where YAML needs it."""
    with pytest.raises(ConfigError, match=r"^rl config: \$\.engine\.max_num_seqs: 8\.0 is not of type 'integer'$"):
        RLConfig.from_dict({"engine": {"max_num_seqs": 8.0}})
    with pytest.raises(ConfigError, match=r"^rl config: \$\.train\.lr: inf is not of type 'number'$"):
        RLConfig.from_dict({"train": {"lr": float("inf")}})
    with pytest.raises(ConfigError, match=r"^rl config: \$\.steps: True is not of type 'integer'$"):
        RLConfig.from_dict({"steps": True})


def test_the_schema_is_package_data():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["isoexec"]
    pkg = REPO / "isoexec"
    assert any(SCHEMA_PATH in pkg.glob(p) for p in patterns)


def test_workflow_rl_settings_refer_to_the_packaged_schema():
    wf_dir = REPO / "workflow/schemas"
    wf = yaml.safe_load((wf_dir / "config.schema.yaml").read_text())
    settings = wf["$defs"]["rl_settings"]
    assert (wf_dir / settings["$ref"]).resolve() == SCHEMA_PATH.resolve()
    assert set(settings["propertyNames"]["not"]["enum"]) == SET_BY_WORKFLOW
    assert "properties" not in settings            # no restated keys
    rl = wf["properties"]["rl"]["properties"]
    assert rl["settings"]["$ref"] == "#/$defs/rl_settings"
    assert rl["arms"]["additionalProperties"]["properties"]["settings"]["$ref"] == "#/$defs/rl_settings"
    for ref in (rl["synthetic"]["$ref"], wf["$defs"]["family"]["$ref"], wf["properties"]["arch"]["$ref"]):
        path, _, pointer = ref.partition("#")
        assert (wf_dir / path).resolve() == SCHEMA_PATH.resolve() and pointer.startswith("/$defs/"), ref
