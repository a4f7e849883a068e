"""Where configuration lives, and safe (temp-then-rename) writing of outputs."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

from .errors import ConfigError


def configs_dir() -> Path:
    """``$ISOEXEC_CONFIGS`` if set, else ``configs/`` of the checkout this package lives in."""
    env = os.environ.get("ISOEXEC_CONFIGS")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parents[1] / "configs"
    if here.is_dir():
        return here
    return Path.cwd() / "configs"


def resolve_config(kind: str, name_or_path: str) -> Path:
    """A composition or model config given by name (``isoexec``) or by path (``x/y.yaml``)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml", ".json") or os.sep in name_or_path:
        if not p.is_file():
            raise ConfigError(f"{kind} file {name_or_path!r} not found")
        return p
    cand = configs_dir() / kind / f"{name_or_path}.yaml"
    if not cand.is_file():
        known = sorted(x.stem for x in (configs_dir() / kind).glob("*.yaml"))
        raise ConfigError(f"unknown {kind[:-1] if kind.endswith('s') else kind} {name_or_path!r} "
                          f"(looked for {cand}); known: {', '.join(known) or 'none'}")
    return cand


def check_output_path(path: str | Path, folder: bool = False) -> None:
    """Refuse, before any work, an output that cannot be written: a file wanted where a folder
    is, a folder wanted where a file is, or a parent path that runs through a regular file."""
    p = Path(path)
    if p.exists() and p.is_dir() != folder:
        raise ConfigError(f"output {str(path)!r} is {'a file' if folder else 'a folder'}; "
                          f"expected {'a folder' if folder else 'a file path'}")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"output {str(path)!r}: {str(parent)!r} is a file, not a folder")
            if not os.access(parent, os.W_OK):
                raise ConfigError(f"output {str(path)!r}: folder {str(parent)!r} is not writable")
            return


@contextlib.contextmanager
def atomic_writer(path: str | Path):
    """A binary file handle whose content appears at ``path`` only when the block succeeds: it is
    written to a temp file in the same folder, synced, and renamed; on error the temp file goes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write(path: str | Path, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` through a temp file in the same folder and a rename, so a
    crash or a refused check never leaves a half-written output behind."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    with atomic_writer(path) as f:
        f.write(data)
    return Path(path)


def sha256_file(path: str | Path) -> str:
    """SHA-256 (hex) of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
