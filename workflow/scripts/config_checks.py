"""One-line refusals of the workflow config's per-family keys, `rl.family_settings` and
`gates.models`, checked by the Snakefile before the schema (whose message for a mapping's key
would dump the key's whole schema entry) and before any rule is planned. YAML only: no torch and
no isoexec import in the Snakemake process.

* `rl.family_settings`: family -> RL settings overrides. Each key must be a family (the schema's
  list); the settings themselves are the schema's to check, as in `rl.settings`.
* `gates.models`: family -> the model config the gates rule runs that family's gates with, instead
  of `models.<family>`. Each key must be a family and each value a model config of that family that
  exists. Admission matches a contract entry with gate artifacts by region, kernel (id, version,
  arch) and constants, not by model (docs/contract.md), and the kernel gates run at the model
  config's per-layer shapes; so a gate model must have the run model's layer dimensions (every
  `hf_config` key equal but the layer count, and the same kinds of layer), or the contract of the
  run model would be admitted on gates measured at other shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import yaml

#: The hf_config keys that say how many layers a model has and in what order; only these may differ
#: between a family's run model and its gate model (the kinds of layer listed must be the same).
LAYER_COUNT_KEYS = ("num_hidden_layers",)
LAYER_LIST_KEYS = ("layer_types", "mlp_layer_types")


def known_families(schema_path: str | Path) -> list[str]:
    """The families of the workflow schema (`$defs.family`, which refers to the package's RL schema)."""
    schema_path = Path(schema_path)
    node = yaml.safe_load(schema_path.read_text())["$defs"]["family"]
    if "$ref" in node:
        file, _, pointer = node["$ref"].partition("#")
        schema_path = (schema_path.parent / file).resolve()
        node = yaml.safe_load(schema_path.read_text())
        for part in pointer.strip("/").split("/"):
            node = node[part]
    return list(node["enum"])


def model_path(name: str) -> Path:
    """A model given by name (configs/models/<name>.yaml) or by a YAML path, as the rules declare it."""
    if name.endswith((".yaml", ".yml")) or "/" in name:
        return Path(name)
    return Path("configs/models") / f"{name}.yaml"


def _load_model(name: str) -> dict | None:
    p = model_path(name)
    if not p.is_file():
        return None
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) and isinstance(data.get("hf_config"), dict) else None


def layer_dimensions(hf_config: Mapping) -> dict:
    """What the kernel gates' shapes depend on: every hf_config key but the layer count, the layer
    lists as the set of kinds they hold."""
    out = {k: v for k, v in hf_config.items() if k not in LAYER_COUNT_KEYS + LAYER_LIST_KEYS}
    for k in LAYER_LIST_KEYS:
        if k in hf_config:
            out[k] = sorted(set(hf_config[k]))
    return out


def _unknown_family(key: str, fam, families: list[str]) -> str:
    return f"config: {key}: {fam!r} is not a family (one of {', '.join(families)})"


def _family_map(config: Mapping, section: str, key: str, what: str, example: str,
                families: list[str]) -> tuple[Mapping | None, str | None]:
    """``config[section][key]`` when it is a mapping of known families (else an error line);
    (None, None) when it is not set."""
    sec = config.get(section)
    m = sec.get(key) if isinstance(sec, Mapping) else None
    if m is None:
        return None, None
    name = f"{section}.{key}"
    if not isinstance(m, Mapping):
        return None, f"config: `{name}` must map a family to {what}, e.g. `{name}: {example}`, got {m!r}"
    for fam in m:
        if fam not in families:
            return None, _unknown_family(name, fam, families)
    return m, None


def family_settings_error(config: Mapping, families: list[str]) -> str | None:
    """Why `rl.family_settings` is not usable (None: it is, or it is not set), one line."""
    fs, err = _family_map(config, "rl", "family_settings", "its RL settings overrides",
                          "{mla_moe: {trainer_ep: 8}}", families)
    if fs is None:
        return err
    for fam, s in fs.items():
        if not isinstance(s, Mapping):
            return f"config: rl.family_settings.{fam} must be a mapping of RL settings, got {s!r}"
    return None


def gate_models_error(config: Mapping, families: list[str]) -> str | None:
    """Why `gates.models` is not usable (None: it is, or it is not set), one line: an unknown family, a
    value that is not a name or path, a model config that is not there or is of another family, or one
    with other layer dimensions than the family's `models` entry."""
    gm, err = _family_map(config, "gates", "models", "a model config (a name in configs/models/ or a YAML path)",
                          "{dense: dense_qwen3_8b_dims}", families)
    if gm is None:
        return err
    run_models = config.get("models") if isinstance(config.get("models"), Mapping) else {}
    for fam, name in gm.items():
        key = f"gates.models.{fam}"
        if not isinstance(name, str) or not name:
            return f"config: {key} must be a model config name or YAML path, got {name!r}"
        gate = _load_model(name)
        if gate is None:
            return f"config: {key}: {name!r} is not a model config ({model_path(name)} is missing or has no hf_config)"
        if gate.get("family") != fam:
            return f"config: {key}: {name!r} is a {gate.get('family')} model, not {fam}"
        run_name = run_models.get(fam)
        if not isinstance(run_name, str):
            continue   # no run model to compare with: `models` refuses that on its own
        run = _load_model(run_name)
        if run is None:
            return (f"config: {key}: cannot compare {name!r} with models.{fam} {run_name!r} "
                    f"({model_path(run_name)} is missing or has no hf_config)")
        a, b = layer_dimensions(gate["hf_config"]), layer_dimensions(run["hf_config"])
        diff = sorted(k for k in set(a) | set(b) if a.get(k, "<none>") != b.get(k, "<none>"))
        if diff:
            shown = ", ".join(f"{k} {a.get(k, '<none>')!r} vs {b.get(k, '<none>')!r}" for k in diff[:3])
            more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
            return (f"config: {key}: {name!r} has other layer dimensions than models.{fam} {run_name!r} ({shown}{more}); "
                    "admission matches gate results by region, kernel and constants, not by model, so a gate model "
                    "must have the run model's layer dimensions (only the number of layers may differ)")
    return None


def per_family_error(config: Mapping, schema_path: str | Path) -> str | None:
    """The first of :func:`family_settings_error` and :func:`gate_models_error` (None: neither)."""
    families = known_families(schema_path)
    return family_settings_error(config, families) or gate_models_error(config, families)
