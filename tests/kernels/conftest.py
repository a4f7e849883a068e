"""Helpers for the kernel gates (fixture ``kb``): integer-view bit comparison, tolerances, the Triton interpreter.

Bits are compared through integer views (int32 for fp32, int16 for bf16/fp16): ``torch.equal``
on floats calls +0 and -0 equal and NaN unequal to itself. A gate passes only with 0 differing
elements; failures report count, first index, max |diff| and max ULP distance.
Triton interpreter checks: see the section below (fixture ``interp_results``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

INT_VIEW = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}
# rel L2 tolerance against a float64 evaluation of the same inputs
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# every M bucket of the GEMM tile table is crossed by this list (<=64, <=256, >256 on GPU)
BATCH_SIZES = (1, 2, 3, 5, 8, 16, 31, 64, 65, 100, 128, 129, 200, 256)


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(INT_VIEW[t.dtype])


def bit_report(a: torch.Tensor, b: torch.Tensor) -> dict:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    ia, ib = bits(a).long(), bits(b).long()
    diff = ia != ib
    rep = {"elements": a.numel(), "differing": int(diff.sum())}
    if rep["differing"]:
        da, db = a.detach().cpu().double(), b.detach().cpu().double()
        rep["max_abs_diff"] = float((da - db).abs().nan_to_num(float("inf")).max())
        rep["max_ulp"] = int((ia - ib).abs().max())
        rep["first_index"] = [int(i) for i in diff.nonzero()[0]]
    return rep


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    rep = bit_report(a, b)
    assert rep["differing"] == 0, f"{what}: {rep}"


def rel_l2(out: torch.Tensor, want: torch.Tensor) -> float:
    out, want = out.detach().double().cpu(), want.detach().double().cpu()
    den = want.norm().item()
    return (out - want).norm().item() / (den if den else 1.0)


def needle_batch(row: torch.Tensor, m: int, gen: torch.Generator, scale: float = 1.0):
    """A batch of ``m`` random rows (random magnitudes) with ``row`` placed at a random index;
    returns (batch, index)."""
    idx = int(torch.randint(0, m, (1,), generator=gen))
    batch = torch.randn((m,) + tuple(row.shape), generator=gen, dtype=torch.float32)
    mags = torch.exp(torch.randn((m,) + (1,) * row.dim(), generator=gen))
    batch = (batch * mags * scale).to(row.dtype)
    batch[idx] = row
    return batch, idx


# --------------------------------------------------------------------------- Triton interpreter
#
# Triton must be imported with TRITON_INTERPRET=1 already set (its own helper functions such as
# tl.cdiv/tl.sum are compiled objects otherwise), so the interpreter checks run in ONE
# subprocess per session: it loads every test module of this folder, runs each function named
# ``interp_case_*`` (argument: the ``kb`` helpers) and reports "ok" or the failure as JSON.

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_interpreter_cases() -> dict:
    import importlib.util
    import traceback

    try:
        import triton  # noqa: F401
    except Exception as e:  # pragma: no cover - machine dependent
        return {"__skip__": f"triton not importable ({type(e).__name__}: {e})"}
    import numpy

    np_ver = tuple(int(v) for v in numpy.__version__.split(".")[:2])
    if triton.__version__.startswith("3.6") and np_ver >= (2, 3):
        # seen on the GPU machine (numpy 2.5): "only 0-dimensional arrays can be converted
        # to Python scalars" inside any kernel loop
        return {"__skip__": f"triton 3.6's interpreter needs numpy < 2.3 (have {numpy.__version__})"}
    try:  # a tiny dot inside a runtime loop first
        import triton.language as tl

        @triton.jit
        def _probe(x_ptr, o_ptr, n, B: tl.constexpr):
            i = tl.arange(0, B)
            acc = tl.zeros((B, B), dtype=tl.float32)
            for _ in range(0, n, 1):
                a = tl.load(x_ptr + i[:, None] * B + i[None, :])
                acc = tl.dot(a, a, acc, input_precision="ieee")
            tl.store(o_ptr + i[:, None] * B + i[None, :], acc)

        x = torch.randn(16, 16)
        o = torch.empty(16, 16)
        _probe[(1,)](x, o, 2, B=16)
        assert torch.allclose(o, 2 * (x @ x), atol=1e-4), "interpreter dot is wrong"
    except Exception as e:  # pragma: no cover - machine dependent
        return {"__skip__": f"triton interpreter unusable here ({type(e).__name__}: {e})"}
    helpers = _helpers()
    results = {}
    for fname in sorted(os.listdir(_HERE)):
        if not (fname.startswith("test_") and fname.endswith(".py")):
            continue
        path = os.path.join(_HERE, fname)
        with open(path) as f:
            if "def interp_case_" not in f.read():
                continue
        spec = importlib.util.spec_from_file_location(f"_interp_{fname[:-3]}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for name in sorted(vars(mod)):
            if name.startswith("interp_case_"):
                key = f"{fname[:-3]}::{name}"
                try:
                    getattr(mod, name)(helpers)
                    results[key] = "ok"
                except Exception:
                    results[key] = traceback.format_exc(limit=4)
    return results


# The interpreter subprocesses (this file's ``interp_case_*`` run, about a minute on 2 cores, and
# test_attention.py's interpreter gates, about as long) are pure-Python Triton interpretation.
# They start as soon as collection shows that a selected test needs them, so they run beside the
# other tests instead of in front of the first test that uses them; the fixtures wait for them.
# Output goes to files (a full pipe would stop a child that nobody reads yet).
#
# Under pytest-xdist every worker collects every test, and the tests that read a run may land on
# any worker: the workers of one test run share a folder (named by xdist's test-run id), the first
# to claim a run starts it there, and every worker reads its result from there, so each run is
# made once per test run, not once per worker.
_ATTENTION_CODE = ("import importlib.util, json, sys; "
                   "spec = importlib.util.spec_from_file_location('attention_gates', {path!r}); "
                   "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
                   "print('RESULTS ' + json.dumps(m._run_interp_gates()))")
INTERP_RUNS = {  # fixture name -> argv of its TRITON_INTERPRET=1 subprocess
    "interp_results": lambda: [sys.executable, os.path.join(_HERE, "conftest.py")],
    "attention_interp": lambda: [sys.executable, "-c", _ATTENTION_CODE.format(
        path=os.path.join(_HERE, "test_attention.py"))],
}
# the run's output files are <folder>/<name>.out and .err; <name>.rc appears (atomically) when it ends
_RUN_TO_FILES = '"$@" > "$0.out" 2> "$0.err"; echo $? > "$0.rc.tmp"; mv "$0.rc.tmp" "$0.rc"'
_started: dict = {}
_needed: set = set()   # interpreter runs that a selected test uses


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _run_folder() -> Path:
    """Where this test run's interpreter outputs go: shared by the xdist workers of one run, a
    private folder otherwise."""
    import tempfile

    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid:
        folder = Path(tempfile.gettempdir()) / f"isoexec-interp-{uid}"
        folder.mkdir(exist_ok=True)
        return folder
    return Path(tempfile.mkdtemp(prefix="isoexec-interp-"))


def start_interp(name: str) -> dict:
    """Start the interpreter subprocess of fixture ``name`` unless this process started it or
    (xdist) another worker of this test run claimed it."""
    if name not in _started:
        if "__folder__" not in _started:
            _started["__folder__"] = _run_folder()
        folder = _started["__folder__"]
        base = folder / name
        try:   # O_EXCL: exactly one worker of the run wins the claim
            os.close(os.open(f"{base}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            _started[name] = {"base": base, "proc": None}
            return _started[name]
        # a session of its own, so that a kill reaches the interpreter under the shell too
        proc = subprocess.Popen(["sh", "-c", _RUN_TO_FILES, str(base), *INTERP_RUNS[name]()],
                                env=dict(os.environ, TRITON_INTERPRET="1"), stdin=subprocess.DEVNULL,
                                start_new_session=True)
        _started[name] = {"base": base, "proc": proc}
    return _started[name]


def wait_interp(name: str, timeout: float) -> subprocess.CompletedProcess:
    """Wait for (start, if need be) the subprocess of fixture ``name``; its exit code and output.
    The other runs the selected tests need start too, so that they run beside this wait."""
    for other in sorted(_needed - {name}):
        start_interp(other)
    run = start_interp(name)
    base, deadline = run["base"], time.monotonic() + timeout
    rc_file = Path(f"{base}.rc")
    while not rc_file.exists() and time.monotonic() < deadline:
        if run["proc"] is not None and run["proc"].poll() is not None and not rc_file.exists():
            break   # the shell itself died (killed): no rc will come
        time.sleep(0.2)
    if not rc_file.exists() and run["proc"] is not None and run["proc"].poll() is None:
        _kill(run["proc"])
    rc = int(rc_file.read_text()) if rc_file.exists() else -9
    read = lambda ext: Path(f"{base}.{ext}").read_text() if Path(f"{base}.{ext}").exists() else ""  # noqa: E731
    return subprocess.CompletedProcess(INTERP_RUNS[name](), rc, read("out"), read("err") or
                                       ("" if rc_file.exists() else f"no result after {timeout} s"))


def pytest_collection_modifyitems(config, items):
    """The test files that read an interpreter run go last (in their collection order), so the runs,
    started as collection ends, finish beside the other tests instead of holding a worker at the
    first file that waits for them (the interpreter cases take about 2 minutes of one core; under
    ``--dist loadfile`` each file is one unit of work)."""
    names = set(INTERP_RUNS)
    waiting = {it.path for it in items if names & set(getattr(it, "fixturenames", ()))}
    if waiting and len(waiting) < len({it.path for it in items}):
        items[:] = [it for it in items if it.path not in waiting] + [it for it in items if it.path in waiting]


def pytest_collection_finish(session):
    if not _has_triton():
        return
    _needed.update(n for item in session.items for n in getattr(item, "fixturenames", ()) if n in INTERP_RUNS)
    for name in sorted(_needed):
        start_interp(name)


def pytest_sessionfinish(session):
    shared = bool(os.environ.get("PYTEST_XDIST_WORKER"))
    for name, run in _started.items():
        proc = run.get("proc") if isinstance(run, dict) else None
        if proc is None or proc.poll() is not None:
            continue
        if shared and not (session.shouldfail or session.shouldstop):
            proc.wait(timeout=900)   # another worker may still read it: let it finish, never orphan it
        else:   # a run whose tests were not reached (-x, interrupted)
            _kill(proc)
    if not shared and "__folder__" in _started:   # a private folder: nobody reads it any more
        import shutil

        shutil.rmtree(_started["__folder__"], ignore_errors=True)


def _kill(proc: subprocess.Popen) -> None:
    import signal

    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="session")
def interp_results():
    """Results of every ``interp_case_*`` run in a TRITON_INTERPRET=1 subprocess."""
    if not _has_triton():
        pytest.skip("triton not installed: interpreter checks skipped")
    proc = wait_interp("interp_results", timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"interpreter subprocess failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if "__skip__" in res:
        pytest.skip(res["__skip__"])
    return res


def check_interp(results: dict, module: str, case: str) -> None:
    key = f"{module}::{case}"
    assert key in results, f"interpreter case {key} did not run"
    assert results[key] == "ok", f"{key}:\n{results[key]}"


def _helpers() -> SimpleNamespace:
    return SimpleNamespace(
        bits=bits, bit_report=bit_report, assert_bitwise=assert_bitwise, rel_l2=rel_l2,
        needle_batch=needle_batch, TOL=TOL, BATCH_SIZES=BATCH_SIZES, check_interp=check_interp,
        wait_interp=wait_interp,
    )


@pytest.fixture(scope="session")
def kb():
    """The helpers above as one object (test modules do not import conftest)."""
    return _helpers()


if __name__ == "__main__":
    print(json.dumps(_run_interpreter_cases()))
