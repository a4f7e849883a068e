"""YAML loading with clear errors and JSON-schema validation (jsonschema does the checking)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

import jsonschema
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from .errors import ConfigError


def load_yaml(path: str | Path, what: str) -> Any:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} file {str(path)!r} not found")
    try:
        with path.open("r", encoding="utf-8") as f:
            return yaml.safe_load(f)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML{where}: "
                          f"{getattr(exc, 'problem', None) or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {str(path)!r} is not UTF-8 text: {exc}") from None


def json_path(parts) -> str:
    out = "$"
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


# Stricter than JSON Schema's own types, as a Python reader of YAML needs: 2.0 is not an integer
# (YAML reads it as a float, which a step count or a size must not be), and NaN or infinity is not a
# number (every range check passes for NaN).
_TYPES = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many({
    "integer": lambda _, v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda _, v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
})
_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=_TYPES)


def _schema_file(uri: str) -> Resource:
    """A schema another schema refers to by a file URI (``$ref: ../x.yaml#/$defs/y``)."""
    path = Path(url2pathname(urlparse(uri).path))
    contents = dict(load_yaml(path, "schema"))
    # without its "$schema", jsonschema keeps validating with this module's stricter types instead of
    # switching to the dialect's own validator (for which 2.0 is an integer)
    contents.pop("$schema", None)
    return DRAFT202012.create_resource(contents)


def check_schema(data: Any, schema: dict, what: str, schema_path: str | Path | None = None) -> None:
    """Validate ``data`` against ``schema``; the error names the JSON path of the best match.
    ``schema_path``: the file ``schema`` was read from, so that a ``$ref`` to another file (the
    workflow schema's to the package's RL schema) resolves next to it."""
    if schema_path is None:
        validator = _Validator(schema)
    else:
        schema = {"$id": Path(schema_path).resolve().as_uri(), **schema}
        validator = _Validator(schema, registry=Registry(retrieve=_schema_file))
    errors = sorted(validator.iter_errors(data), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        best = jsonschema.exceptions.best_match(errors)
        raise ConfigError(f"{what}: {json_path(best.absolute_path)}: {best.message}")
