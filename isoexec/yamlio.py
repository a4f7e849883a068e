"""YAML loading with clear errors and JSON-schema validation (jsonschema does the checking)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jsonschema
import yaml

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


def check_schema(data: Any, schema: dict, what: str) -> None:
    """Validate ``data`` against ``schema``; the error names the JSON path of the best match."""
    validator = _Validator(schema)
    errors = sorted(validator.iter_errors(data), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        best = jsonschema.exceptions.best_match(errors)
        raise ConfigError(f"{what}: {json_path(best.absolute_path)}: {best.message}")
