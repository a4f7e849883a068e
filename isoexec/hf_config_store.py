"""The attributes of the transformers configs that model YAMLs build, stored once per machine.

Why this file exists: a model YAML's ``hf_config`` is checked and completed by transformers
(``AutoConfig.for_model``: defaults, validators, derived fields such as ``layer_types``), but in
transformers 5.17 building one costs about 3.4 s of CPU in a fresh process: importing transformers,
then the config class, whose docstring decorator imports the model auto-classes and the generation
code. isoexec only reads the config's attributes, and every CLI process reads one (a workflow run
starts dozens), so the first process that builds a config stores its attributes as JSON and the
others read them back without importing transformers.

What is stored: ``to_dict()`` plus the class's attribute aliases (``attribute_map``: a GLM config
answers ``head_dim`` with ``qk_rope_head_dim``), read back as a :class:`StoredConfig` that answers
attribute reads only. Every process gets a ``StoredConfig``, the one that built the config too, so
the first process of a run reads the same values as the others.

Key: the transformers version and the config dict's canonical JSON, so an edited YAML or another
transformers version builds afresh. Only configs transformers accepted are stored: a rejected one
raises its one-line error in every process.

Folder: ``$ISOEXEC_CACHE_DIR/hf_config``; ISOEXEC_CACHE_DIR defaults to ``$XDG_CACHE_HOME/isoexec``
(``~/.cache/isoexec``), and set to the empty string it turns the store off (every process builds).
A folder that cannot be written or an entry that cannot be read is a miss, never an error.
Entries are written to a temporary file and renamed, so processes that build the same config at
once never read half an entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

FORMAT = 1
"""Bumped when what an entry holds changes, so entries of an older layout are not read."""


class StoredConfig:
    """A transformers config's attributes, read back: attribute reads only (``getattr`` with a
    default works as on the config object; a name the config lacks raises AttributeError)."""

    __slots__ = ("_attrs",)

    def __init__(self, attrs: dict) -> None:
        object.__setattr__(self, "_attrs", dict(attrs))

    def __getattr__(self, name: str) -> Any:
        if name == "_attrs":   # not set yet (copy/pickle probing an empty instance)
            raise AttributeError(name)
        try:
            return self._attrs[name]
        except KeyError:
            raise AttributeError(f"{self._attrs.get('model_type')!r} config has no attribute {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a stored transformers config is read-only")

    def __getstate__(self) -> dict:
        return self._attrs

    def __setstate__(self, attrs: dict) -> None:
        object.__setattr__(self, "_attrs", attrs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoredConfig) and self._attrs == other._attrs

    __hash__ = None

    def __repr__(self) -> str:
        return f"StoredConfig(model_type={self._attrs.get('model_type')!r}, {len(self._attrs)} attributes)"


def cache_folder() -> Path | None:
    """Where entries live, or None when ISOEXEC_CACHE_DIR is set to the empty string."""
    root = os.environ.get("ISOEXEC_CACHE_DIR")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "isoexec")
    return Path(root) / "hf_config" if root else None


def _transformers_version() -> str:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "absent"


def entry_key(config: dict) -> str | None:
    """The entry name for ``config`` (None when it is not JSON: such a config is never stored)."""
    try:
        text = json.dumps({"format": FORMAT, "transformers": _transformers_version(), "config": config},
                          sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _attributes(cfg: Any) -> dict:
    attrs = cfg.to_dict()
    for alias in getattr(type(cfg), "attribute_map", None) or {}:
        attrs[alias] = getattr(cfg, alias)
    return attrs


def _read(path: Path) -> dict | None:
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return entry.get("attributes") if isinstance(entry, dict) and isinstance(entry.get("attributes"), dict) else None


def _write(path: Path, config: dict, attrs_text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write('{"config": ' + json.dumps(config, sort_keys=True) + ', "transformers": '
                        + json.dumps(_transformers_version()) + ', "attributes": ' + attrs_text + "}\n")
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass   # a read-only or full disk only costs the next process the build


_IN_PROCESS: dict[str, StoredConfig] = {}


def stored_config(config: dict, build: Callable[[dict], Any]) -> Any:
    """The config ``build(config)`` makes, as a :class:`StoredConfig`: read from the store when an
    earlier process built it, else built now (``build``'s errors propagate) and stored. A config
    that is not JSON, or whose attributes are not, is returned as ``build`` made it."""
    key = entry_key(config)
    if key is None:
        return build(config)
    if key in _IN_PROCESS:
        return _IN_PROCESS[key]
    folder = cache_folder()
    path = folder / f"{key}.json" if folder is not None else None
    attrs = _read(path) if path is not None else None
    if attrs is None:
        cfg = build(config)
        try:
            attrs_text = json.dumps(_attributes(cfg), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError):
            return cfg
        if path is not None:
            _write(path, config, attrs_text)
        attrs = json.loads(attrs_text)   # the values every later process reads back
    _IN_PROCESS[key] = StoredConfig(attrs)
    return _IN_PROCESS[key]
