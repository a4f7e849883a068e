"""Benchmark plumbing: timing (device events / do_bench, median of many), result JSON, the plan a
composition binds for a family and case, random inputs (rotated sets, a paged KV cache).

Result format (docs/benchmarks.md, stable): ``{"name", "env": {device, torch, triton, transformers,
commit, date}, "rows": [{<shape fields>, "baseline", "baseline_ms", "ours_ms", "speed_ratio"}]}``
with ``speed_ratio = baseline_ms / ours_ms`` (1.0 parity, 0.5 = ours twice as slow). Ours and the
stock baseline are always measured in the same run, on rotated random inputs.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from ..compose import build_contract
from ..enforce import ExecutionPlan
from ..envinfo import env_info
from ..paths import atomic_write

# the two sides of every composition benchmark: the stock baseline first, then ours
COMPOSITIONS = ("native", "isoexec")


def time_ms(fn: Callable[[], object], device: str, warmup_ms: float = 25, rep_ms: float = 120,
            min_reps: int = 5) -> float:
    """Median milliseconds of ``fn()``: triton's do_bench on CUDA, perf_counter on CPU (one
    warm-up call, then at least ``min_reps`` timed calls and more while ``rep_ms`` lasts)."""
    if device == "cuda-graph":
        return graph_time_ms(fn, rep_ms)
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1000
    while len(times) < min_reps or (time.perf_counter() < deadline and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def graph_time_ms(fn: Callable[[], object], rep_ms: float = 120) -> float:
    """Median milliseconds of ``fn()`` replayed from a CUDA graph (triton's do_bench_cudagraph):
    the device time of the kernels without the host's launch overhead, as the engine's decode
    graphs run them. ``fn`` is captured once per replay batch, so it must be capturable."""
    import triton.testing

    fn()  # compile outside the capture
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def time_compositions(make_run: Callable[[str], Callable[[], object]], device: str, graphs: bool = False,
                      **reps) -> tuple[dict, dict]:
    """``({composition: median ms}, timing fields)`` of ``make_run(c)()`` for both compositions.
    With ``graphs`` (CUDA only) the times are CUDA-graph replays and the eager times are kept as
    ``eager_baseline_ms`` / ``eager_ours_ms``; a composition that cannot be captured (it syncs with
    the host) leaves the times eager and says why in ``graph_error``. ``reps`` go to ``time_ms``."""
    t = {c: time_ms(make_run(c), device, **reps) for c in COMPOSITIONS}
    extra = {"timing": "eager"}
    if graphs:
        try:
            g = {c: time_ms(make_run(c), "cuda-graph") for c in COMPOSITIONS}
        except RuntimeError as exc:   # a composition that syncs with the host cannot be captured
            extra["graph_error"] = str(exc).splitlines()[0][:200]
        else:
            extra = {"timing": "cuda_graph", "eager_baseline_ms": round(t["native"], 6),
                     "eager_ours_ms": round(t["isoexec"], 6)}
            t = g
    return t, extra


def composition_plan(family: str, composition: str, arch: str, case: str) -> ExecutionPlan:
    """The regions ``composition`` binds for ``family`` on ``arch`` in ``case``: the plan the
    family's model runs there, built from the shipped composition."""
    return ExecutionPlan.build(build_contract(family, composition, arch), case)


def random_paged_kv(batch: int, context: int, page_size: int, heads: int, width: int, device: str,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random paged KV cache holding ``batch`` sequences of ``context`` keys: ``(k_cache,
    v_cache)`` [pages, page_size, heads, width] ~ N(0, 1), a block table [batch, context /
    page_size] of shuffled page ids (a sequence's pages are not contiguous, as after an engine's
    allocations), and the context lengths [batch] (int32)."""
    pages = batch * context // page_size
    kc = torch.randn(pages, page_size, heads, width, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    bt = torch.randperm(pages, device=device).to(torch.int32).view(batch, context // page_size)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return kc, vc, bt, lens


def rotating(make: Callable[[], tuple], count: int) -> Callable[[], tuple]:
    """Cycle through ``count`` independently drawn input sets so repeated calls do not just hit L2."""
    sets = [make() for _ in range(count)]
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % len(sets)
        return sets[state["i"]]

    return nxt


def row(fields: dict, baseline: str, baseline_ms: float, ours_ms: float) -> dict:
    return {**fields, "baseline": baseline, "baseline_ms": round(baseline_ms, 6), "ours_ms": round(ours_ms, 6),
            "speed_ratio": round(baseline_ms / ours_ms, 4) if ours_ms > 0 else None}


def write_result(name: str, rows: list[dict], out: str | Path, arch: str, extra: dict | None = None) -> Path:
    env = env_info(arch)
    env = {k: env[k] for k in ("device", "torch", "triton", "transformers", "commit", "date")}
    obj = {"name": name, "env": env, "rows": rows}
    if extra:
        obj.update(extra)
    return atomic_write(out, json.dumps(obj, indent=1) + "\n")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def print_rows(rows: list[dict], keys: list[str], log=print) -> None:
    for r in rows:
        shape = " ".join(f"{k}={r[k]}" for k in keys if k in r)
        log(f"{shape:<48} {r['baseline']:<14} {r['baseline_ms']:9.4f} ms  ours {r['ours_ms']:9.4f} ms  "
            f"ratio {r['speed_ratio']:.3f}")


def fwd_bwd(fn, inputs: tuple, grad_out: torch.Tensor):
    """One forward + backward of ``fn(*inputs)`` w.r.t. every input that requires grad."""
    def run():
        out = fn(*inputs)
        torch.autograd.grad(out, [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad], grad_out)
    return run


def leaf(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a fresh autograd leaf (what ``fwd_bwd`` differentiates with respect to)."""
    return t.detach().requires_grad_(True)
