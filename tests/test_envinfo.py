"""Facts about the machine (isoexec/envinfo.py): the recorded package versions are the installed
ones, read without importing a package the process has not imported."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata


def test_env_info_names_versions_without_importing_transformers_or_triton():
    code = ("import json, sys; from isoexec.envinfo import env_info; info = env_info('cpu'); "
            "print(json.dumps({'info': info, 'imported': [m for m in ('transformers', 'triton') if m in sys.modules]}))")
    out = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                    text=True).stdout)
    assert out["imported"] == []
    assert out["info"]["transformers"] == metadata.version("transformers")
    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = "absent"
    assert out["info"]["triton"] == triton


def test_an_imported_package_reports_its_own_version():
    import torch

    from isoexec.envinfo import env_info

    assert env_info("cpu")["torch"] == torch.__version__


def test_a_package_that_is_not_installed_is_absent():
    from isoexec.envinfo import _version

    assert _version("no_such_package_isoexec_test") == "absent"
