"""Shared fixtures: keep tests on CPU, block flash-linear-attention (docs/gpu_notes.md), small threads."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)  # transformers would bind FLA's GPU kernels on a CPU machine

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def dense_isoexec_cpu():
    from isoexec.compose import build_contract

    return build_contract("dense", "isoexec", "cpu")


@pytest.fixture(scope="session")
def dense_native_cpu():
    from isoexec.compose import build_contract

    return build_contract("dense", "native", "cpu")
