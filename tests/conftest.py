"""Shared fixtures: keep tests on CPU, block flash-linear-attention (docs/gpu_notes.md), one torch
thread.

The tests' tensors are tiny: a second intra-op thread only adds fork-join and spin-waits (tests/train
on a 2-core Xeon beside other load: 67 s with two threads, 25 s with one), so the suite and the
commands it starts run on one thread unless OMP_NUM_THREADS says otherwise. Tests that need several
threads set them themselves (e.g. the deterministic gradient norm under 1, 2, 1 threads)."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported; subprocesses inherit it

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
