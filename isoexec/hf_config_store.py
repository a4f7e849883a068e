"""The attributes of the transformers configs that model YAMLs build, stored once per machine.

Why this file exists: a model YAML's ``hf_config`` is checked and completed by transformers
(``AutoConfig.for_model``: defaults, validators, derived fields such as ``layer_types``), but in
transformers 5.17 building one costs about 3.4 s of CPU in a fresh process: importing transformers,
then the config class, whose docstring decorator imports the model auto-classes and the generation
code. isoexec only reads the config's attributes, and every CLI process reads one (a workflow run
starts dozens), so the first process that builds a config stores its attributes as JSON and the
others read them back without importing transformers.

What is stored: ``to_dict()`` plus the class's attribute aliases (``attribute_map``: a GLM config
answers ``head_dim`` with ``qk_rope_head_dim``) and the keys the class declares (``declared_keys``:
the MoE families refuse a YAML key that is none of them), read back as a :class:`StoredConfig` that
answers attribute reads only. Every process gets a ``StoredConfig``, the one that built the config too, so
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

FORMAT = 2
"""Bumped when what an entry holds changes, so entries of an older layout are not read."""


class StoredConfig:
    """A transformers config's attributes, read back: attribute reads only (``getattr`` with a
    default works as on the config object; a name the config lacks raises AttributeError)."""

    __slots__ = ("_attrs", "_declared")

    def __init__(self, attrs: dict, declared: list | None = None) -> None:
        object.__setattr__(self, "_attrs", dict(attrs))
        object.__setattr__(self, "_declared", None if declared is None else frozenset(declared))

    def __getattr__(self, name: str) -> Any:
        if name in ("_attrs", "_declared"):   # not set yet (copy/pickle probing an empty instance)
            raise AttributeError(name)
        try:
            return self._attrs[name]
        except KeyError:
            raise AttributeError(f"{self._attrs.get('model_type')!r} config has no attribute {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a stored transformers config is read-only")

    def __getstate__(self) -> tuple:
        return self._attrs, self._declared

    def __setstate__(self, state: tuple) -> None:
        object.__setattr__(self, "_attrs", state[0])
        object.__setattr__(self, "_declared", state[1])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoredConfig) and (self._attrs, self._declared) == (other._attrs, other._declared)

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


def declared_keys(cfg: Any) -> frozenset | None:
    """The keys ``cfg``'s class declares: its dataclass fields and attribute aliases (None when the
    class is not a dataclass). Stored with the attributes, since a config's ``to_dict()`` also holds
    the loose keys transformers keeps from the YAML, which the families refuse (``model_config``)."""
    if isinstance(cfg, StoredConfig):
        return cfg._declared
    import dataclasses

    cls = type(cfg)
    if not dataclasses.is_dataclass(cls):
        return None
    return frozenset({f.name for f in dataclasses.fields(cls)} | set(getattr(cls, "attribute_map", None) or {}))


def _read(path: Path) -> dict | None:
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (isinstance(entry, dict) and isinstance(entry.get("attributes"), dict)
            and (entry.get("declared") is None or isinstance(entry.get("declared"), list))):
        return None
    return entry


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text + "\n")
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
    entry = _read(path) if path is not None else None
    if entry is None:
        cfg = build(config)
        declared = declared_keys(cfg)
        try:
            text = json.dumps({"config": config, "transformers": _transformers_version(),
                               "declared": None if declared is None else sorted(declared),
                               "attributes": _attributes(cfg)}, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError):
            return cfg
        if path is not None:
            _write(path, text)
        entry = json.loads(text)   # what later processes read back
    _IN_PROCESS[key] = StoredConfig(entry["attributes"], entry.get("declared"))
    return _IN_PROCESS[key]
