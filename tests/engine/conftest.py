"""Module-scoped tiny models for the engine tests (helpers live in engine_fixtures)."""

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

from engine_fixtures import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def iso_fp32():
    return tiny_model("isoexec", torch.float32)


@pytest.fixture(scope="module")
def iso_bf16():
    return tiny_model("isoexec", torch.bfloat16)
