"""The spawned worlds of this folder's tests, made once per test run (worlds.py says what runs in them).

Each test file asks for its part through a fixture of ``PART_FIXTURES``; the worlds run the parts
that the selected tests ask for, all in one world per size. Under pytest-xdist (the README's
`-n auto --dist loadfile`) the files land on different workers: the first worker to need the
worlds claims a folder that the workers of the test run share and makes them there, and a worker
that needs them meanwhile waits for that one instead of spawning worlds of its own.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402

# fixture -> the worlds.py parts it returns
PART_FIXTURES = {"tp_kernel_worlds": ("tp_kernels",), "tp_model_worlds": ("tp_model",),
                 "fsdp_trainer_worlds": ("fsdp_trainer",), "fsdp_determinism_worlds": ("fsdp_determinism",),
                 "fsdp_checkpoint_worlds": ("fsdp_save", "fsdp_resume")}
WAIT_S = 1800   # a worker waiting for another's worlds gives up after this long
_needed: set[str] = set()


def pytest_collection_finish(session):
    # every xdist worker collects every selected test, so each computes the same set
    for item in session.items:
        for name in getattr(item, "fixturenames", ()):
            _needed.update(PART_FIXTURES.get(name, ()))


def _shared_folder(tmp_path_factory, name: str):
    """A folder every worker of this test run sees under the same name (xdist gives worker gwN the
    base temp <run>/gwN); a fresh one without xdist."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.getbasetemp().parent / name
        folder.mkdir(exist_ok=True)
        return folder
    return tmp_path_factory.mktemp(name)


@pytest.fixture(scope="session")
def fsdp_job(tmp_path_factory):
    """The FSDP ranks' inputs (fsdp_workers.make_job); its checkpoint folder is shared, like the worlds."""
    import fsdp_workers

    return fsdp_workers.make_job(str(_shared_folder(tmp_path_factory, "dist-checkpoint")))


@pytest.fixture(scope="session")
def dist_worlds(request, tmp_path_factory):
    """{part: {world size: [rank results]}} of every part the selected tests need."""
    import worlds

    parts = sorted(_needed)
    folder = _shared_folder(tmp_path_factory, "dist-worlds-" + "-".join(parts))
    done, failed = folder / "done", folder / "failed"
    try:   # O_EXCL: exactly one worker of the run makes the worlds
        os.close(os.open(folder / "claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        deadline = time.monotonic() + WAIT_S
        while not (done.exists() or failed.exists()) and time.monotonic() < deadline:
            time.sleep(0.5)
        if failed.exists():
            pytest.fail(f"the worlds failed in another worker:\n{failed.read_text()}")
        if not done.exists():
            pytest.fail(f"no worlds from another worker after {WAIT_S} s")
    else:
        try:
            job = {}
            if any(p.startswith("fsdp") for p in parts):
                job["fsdp"] = request.getfixturevalue("fsdp_job")
            if "tp_model" in parts:
                import tp_model_workers

                job["tp_model"] = tp_model_workers.make_job()
            times = worlds.run(parts, job, folder)
        except BaseException:
            failed.write_text(traceback.format_exc())
            raise
        print(f"\nworld start-up and parts {parts}, seconds per world: {times}")
        done.write_text("")
    return worlds.load(parts, folder)


def _part(dist_worlds, part: str) -> dict:
    import worlds

    by_size = dist_worlds[part]
    error = worlds.failure(part, by_size)
    assert not error, error
    return by_size


@pytest.fixture(scope="session")
def tp_kernel_worlds(dist_worlds):
    """{TP: [rank results]} of the tensor-parallel kernels, TP = 1, 2, 4."""
    return _part(dist_worlds, "tp_kernels")


@pytest.fixture(scope="session")
def tp_model_worlds(dist_worlds):
    """{TP: [results of each rank of a group of that size]}: TP = 2 from both pairs, 4 from the world."""
    import tp_model_workers

    ranks = _part(dist_worlds, "tp_model")[tp_model_workers.WORLD]
    return {tp: [r[tp] for r in ranks] for tp in (2, 4)}


@pytest.fixture(scope="session")
def fsdp_trainer_worlds(dist_worlds):
    return _part(dist_worlds, "fsdp_trainer")


@pytest.fixture(scope="session")
def fsdp_determinism_worlds(dist_worlds):
    return _part(dist_worlds, "fsdp_determinism")


@pytest.fixture(scope="session")
def fsdp_checkpoint_worlds(dist_worlds):
    """(the saving world's rank results, the resumed world's), at fsdp_workers.CHECKPOINT_DP."""
    import fsdp_workers

    dp = fsdp_workers.CHECKPOINT_DP
    return _part(dist_worlds, "fsdp_save")[dp], _part(dist_worlds, "fsdp_resume")[dp]
