"""The spawned worlds of this folder's tests, made once per test run, in the background (worlds.py
says what runs in them).

Each test file asks for its part through a fixture of ``PART_FIXTURES``; the worlds run the parts
that the selected tests ask for, all in one world per size. They start in a subprocess as soon as
collection shows which parts are needed, so that they run beside the other tests rather than in
front of the first test that reads them, and the fixtures wait for them (tests/kernels/conftest.py
runs the Triton interpreter checks the same way). Under pytest-xdist (the README's `-n auto --dist
loadfile`) every worker collects every test: the first to claim a folder that the workers of the
test run share starts the subprocess there, and every worker reads the results from there. This
folder's tests are also moved to the end of the run, so that the worlds are ready when the workers
reach them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402

HERE = Path(__file__).resolve().parent
# fixture -> the worlds.py parts it returns
PART_FIXTURES = {"tp_kernel_worlds": ("tp_kernels",), "tp_model_worlds": ("tp_model",),
                 "tp_engine_worlds": ("tp_engine",), "ep_model_worlds": ("ep_model",),
                 "tp_hybrid_worlds": ("tp_hybrid",),
                 "tp_moe_worlds": ("tp_moe",), "tp_moe_engine_worlds": ("tp_moe_engine",),
                 "tp_native_worlds": ("tp_native",), "tp_vocab_triton_worlds": ("tp_vocab_triton",),
                 "fsdp_trainer_worlds": ("fsdp_trainer",), "fsdp_determinism_worlds": ("fsdp_determinism",),
                 "fsdp_checkpoint_worlds": ("fsdp_save", "fsdp_resume"), "fsdp_layer_worlds": ("fsdp_layers",),
                 "fsdp_moe_worlds": ("fsdp_moe",)}
WAIT_S = 1800   # the fixtures give up on the worlds after this long
# the output files are <folder>/run.out and run.err; run.rc appears (atomically) when it ends
_RUN_TO_FILES = '"$@" > "$0/run.out" 2> "$0/run.err"; echo $? > "$0/run.rc.tmp"; mv "$0/run.rc.tmp" "$0/run.rc"'
_run: dict = {}   # "parts", "folder", and "proc" where this process started the worlds


def pytest_collection_modifyitems(config, items):
    mine = [it for it in items if it.path.resolve().parent == HERE]
    if mine and len(mine) < len(items):
        items[:] = [it for it in items if it.path.resolve().parent != HERE] + mine


def pytest_collection_finish(session):
    parts = sorted({p for item in session.items for name in getattr(item, "fixturenames", ())
                    for p in PART_FIXTURES.get(name, ())})
    if parts and not session.config.option.collectonly:
        _start(session.config, parts)


def _start(config, parts: list[str]) -> None:
    """Start the worlds of ``parts`` unless a worker of this test run did (O_EXCL claim)."""
    base = config._tmp_path_factory.getbasetemp()   # what the tmp_path_factory fixture uses
    if os.environ.get("PYTEST_XDIST_WORKER"):   # xdist gives worker gwN the base temp <run>/gwN
        base = base.parent
    folder = base / ("dist-worlds-" + "-".join(parts))
    folder.mkdir(parents=True, exist_ok=True)
    _run.update(parts=parts, folder=folder, proc=None)
    try:
        os.close(os.open(folder / "claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    # a session of its own, so that a kill reaches the worlds under the shell too
    _run["proc"] = subprocess.Popen(["sh", "-c", _RUN_TO_FILES, str(folder), sys.executable, str(HERE / "worlds.py"),
                                     str(folder), *parts], cwd=HERE, stdin=subprocess.DEVNULL, start_new_session=True)


def pytest_sessionfinish(session):
    proc = _run.get("proc")
    if proc is None or proc.poll() is not None:
        return
    if os.environ.get("PYTEST_XDIST_WORKER") and not (session.shouldfail or session.shouldstop):
        proc.wait(timeout=WAIT_S)   # another worker may still read it: let it finish, never orphan it
    else:   # worlds whose tests were not reached (-x, interrupted)
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def group_of_one(tmp_path):
    """A gloo process group of this test process alone (a file store, no port), removed afterwards:
    for code that needs an initialised group but no peers."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp_path, "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def fsdp_job():
    """The FSDP inputs the ranks got (fsdp_workers.make_job), for the single-process references."""
    import fsdp_workers

    return fsdp_workers.make_job(str(_run["folder"] / "checkpoint"))


@pytest.fixture(scope="session")
def dist_worlds():
    """{part: {world size: [rank results]}} of every part the selected tests need."""
    import worlds

    folder, proc = _run["folder"], _run["proc"]
    rc_file, deadline = folder / "run.rc", time.monotonic() + WAIT_S
    while not rc_file.exists() and time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None and not rc_file.exists():
            break   # the shell itself died (killed): no rc will come
        time.sleep(0.2)
    read = lambda name: (folder / name).read_text() if (folder / name).exists() else ""  # noqa: E731
    if not rc_file.exists():
        pytest.fail(f"the worlds gave no result after {WAIT_S} s:\n{read('run.out')[-3000:]}\n{read('run.err')[-3000:]}")
    if int(rc_file.read_text()) != 0:
        pytest.fail(f"the worlds failed:\n{read('run.out')[-3000:]}\n{read('run.err')[-5000:]}")
    print(read("run.out"))
    return worlds.load(_run["parts"], folder)


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
def tp_vocab_triton_worlds(dist_worlds):
    """{TP: [results of each rank of a group of that size]} of the Triton-schedule vocabulary-parallel
    logprob, TP = 1, 2, 4 in one world of 4 run under the Triton interpreter."""
    import vocab_triton_workers

    ranks = _part(dist_worlds, "tp_vocab_triton")[vocab_triton_workers.WORLD]
    return {tp: [r[tp] for r in ranks] for tp in (1, 2, 4)}


@pytest.fixture(scope="session")
def tp_model_worlds(dist_worlds):
    """{TP: [results of each rank of a group of that size]}: TP = 2 from both pairs, 4 from the world."""
    import tp_model_workers

    ranks = _part(dist_worlds, "tp_model")[tp_model_workers.WORLD]
    return {tp: [r[tp] for r in ranks] for tp in (2, 4)}


@pytest.fixture(scope="session")
def tp_engine_worlds(dist_worlds):
    """{TP: [results of each rank of a group of that size]} of the tensor-parallel engine."""
    import tp_model_workers

    ranks = _part(dist_worlds, "tp_engine")[tp_model_workers.WORLD]
    return {tp: [r[tp] for r in ranks] for tp in (2, 4)}


@pytest.fixture(scope="session")
def tp_hybrid_worlds(dist_worlds):
    """{TP: [results of each rank of a group of that size]} of the tensor-parallel hybrid model."""
    import tp_model_workers

    ranks = _part(dist_worlds, "tp_hybrid")[tp_model_workers.WORLD]
    return {tp: [r[tp] for r in ranks] for tp in (2, 4)}


@pytest.fixture(scope="session")
def tp_moe_worlds(dist_worlds):
    """{TP: [results of each rank of a group of that size]} of the tensor-parallel MoE models."""
    import tp_model_workers

    ranks = _part(dist_worlds, "tp_moe")[tp_model_workers.WORLD]
    return {tp: [r[tp] for r in ranks] for tp in (2, 4)}


@pytest.fixture(scope="session")
def tp_moe_engine_worlds(dist_worlds):
    """{TP: [results of each rank of a group of that size]} of the engine on the tensor-parallel MoE models."""
    import tp_model_workers

    ranks = _part(dist_worlds, "tp_moe_engine")[tp_model_workers.WORLD]
    return {tp: [r[tp] for r in ranks] for tp in (2, 4)}


@pytest.fixture(scope="session")
def tp_native_worlds(dist_worlds):
    """[rank results] of the native composition's tensor-parallel models and engines at TP = 2."""
    import tp_native_workers

    return _part(dist_worlds, "tp_native")[tp_native_workers.WORLD]


@pytest.fixture(scope="session")
def ep_model_worlds(dist_worlds):
    """{ep: {group members: [results of each rank of that group, in group-rank order]}} of the
    expert-parallel MoE models: EP = 1 (rank 0 alone), 2 (both pairs) and 4 in the world of 4."""
    import ep_model_workers

    ranks = _part(dist_worlds, "ep_model")[ep_model_workers.WORLD]
    return {ep: {tuple(m): [ranks[r][ep] for r in m] for m in groups}
            for ep, groups in ep_model_workers.ep_groups().items()}


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


@pytest.fixture(scope="session")
def fsdp_layer_worlds(dist_worlds):
    """[rank results] of the watched FSDP2 model, in its world of fsdp_layer_workers.WORLD."""
    import fsdp_layer_workers

    return _part(dist_worlds, "fsdp_layers")[fsdp_layer_workers.WORLD]


@pytest.fixture(scope="session")
def fsdp_moe_worlds(dist_worlds):
    """[rank results] of the FSDP2 trainer on the MoE models, in its world of fsdp_moe_workers.WORLD."""
    import fsdp_moe_workers

    return _part(dist_worlds, "fsdp_moe")[fsdp_moe_workers.WORLD]
