"""YAML loading with clear errors and JSON-schema validation (jsonschema does the checking)."""

from __future__ import annotations

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


def check_schema(data: Any, schema: dict, what: str) -> None:
    """Validate ``data`` against ``schema``; the error names the JSON path of the best match."""
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(data), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        best = jsonschema.exceptions.best_match(errors)
        raise ConfigError(f"{what}: {json_path(best.absolute_path)}: {best.message}")
