"""Where the time of one RL step goes, in one process or under torchrun (a tuning tool).

Runs the RL settings of ``--config`` (an `isoexec run` config) for ``--steps`` steps and records
the last one with torch.profiler (host and device), then prints the step's stage times and the
operators and ``record_function`` ranges with the most host time and the most device time. Run it
plainly for the single-process path and under ``torchrun --nproc_per_node=1`` for the distributed
path (FSDP2 trainer, collectives) on the same device, and compare:

    python3 scripts/rl_step_profile.py --config rl.yaml --composition isoexec --out p_single
    torchrun --standalone --nproc_per_node=1 scripts/rl_step_profile.py --config rl.yaml \\
        --composition isoexec --out p_torchrun1

``--out`` gets metrics.jsonl (the run's), profile.json (the step's stage times, the top tables and
the process's threads: name, CPUs allowed, CPU seconds used, read from /proc before and after the
profiled step, so a thread that spins or a main thread narrowed to few CPUs shows; and Python's
garbage collections during the step, whose pauses land inside whichever operator was running) and, with
``--trace``, the chrome trace of the profiled step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
import yaml
from torch.profiler import ProfilerActivity, profile

from isoexec.rl import distributed as rl_dist
from isoexec.rl.loop import RLConfig, RLRun


def _top(prof, key: str, n: int) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:n]
    return [{"name": e.key[:120], "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
             "cpu_ms": round(e.cpu_time_total / 1e3, 3),
             "self_device_ms": round(getattr(e, "self_device_time_total", 0) / 1e3, 3),
             "device_ms": round(getattr(e, "device_time_total", 0) / 1e3, 3)} for e in rows]


def _threads() -> list[dict]:
    """Each thread of this process: name, the CPUs it may run on, CPU seconds used (Linux /proc)."""
    out = []
    if not Path("/proc/self/task").is_dir():   # not Linux: no per-thread view
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for task in sorted(Path("/proc/self/task").iterdir(), key=lambda p: int(p.name)):
        try:
            status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:   # the thread ended while we read
            continue
        out.append({"tid": int(task.name), "name": status.get("Name", "").strip(),
                    "cpus_allowed": status.get("Cpus_allowed_list", "").strip(),
                    "cpu_s": round((int(stat[11]) + int(stat[12])) / tick, 2)})
    return out


class _GcClock:
    """Python's garbage collections during a span: how many of each generation, and their seconds.
    A collection stops the interpreter wherever it is, so its cost lands in whatever operator ran."""

    def __init__(self):
        self.count, self.seconds, self._t0 = [0, 0, 0], 0.0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.count[info["generation"]] += 1

    def report(self) -> dict:
        return {"collections_by_generation": self.count, "seconds": round(self.seconds, 4),
                "tracked_objects": len(gc.get_objects())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--composition", default="isoexec")
    ap.add_argument("--steps", type=int, default=4, help="steps run; the last one is profiled")
    ap.add_argument("--out", required=True)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--trace", action="store_true")
    args = ap.parse_args()
    d = yaml.safe_load(Path(args.config).read_text())
    d = dict(d.get("rl", d), composition=args.composition, steps=args.steps)   # a workflow-style file or bare settings
    cfg = RLConfig.from_dict(d)
    out = Path(args.out)
    joined = rl_dist.init_from_env(cfg.arch)
    try:
        run = RLRun(cfg, out, print)
        while run.step < cfg.steps - 1:
            run.run_step()
        threads_before = _threads()
        gc_clock = _GcClock()
        gc.callbacks.append(gc_clock)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            line = run.run_step()
        run.metrics.close()
        threads_after = _threads()
        gc.callbacks.remove(gc_clock)
        if run.rank == 0:
            stages = {k: round(v, 4) for k, v in line.items() if k.startswith("time_") and v is not None}
            res = {"distributed": run.distributed, "world_size": run.world, "step": line["step"],
                   "stages_s": stages, "tokens": line["tokens"],
                   "by_self_cpu": _top(prof, "self_cpu_time_total", args.top),
                   "by_cpu": _top(prof, "cpu_time_total", args.top),
                   "by_self_device": _top(prof, "self_device_time_total", args.top),
                   "pid": os.getpid(), "torch_threads": torch.get_num_threads(),
                   "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                   "os_cpus": os.cpu_count(), "gc_during_step": gc_clock.report(),
                   "threads_before_step": threads_before,
                   "threads_after_step": threads_after}
            (out / "profile.json").write_text(json.dumps(res, indent=1))
            if args.trace:
                prof.export_chrome_trace(str(out / "trace.json"))
            print(f"==== {'torchrun world ' + str(run.world) if run.distributed else 'one process'}: {stages}")
            print(f"==== garbage collection during the step: {res['gc_during_step']}")
            print(f"==== threads (CPU seconds in the profiled step; CPUs allowed of {os.cpu_count()})")
            before = {x["tid"]: x["cpu_s"] for x in threads_before}
            for x in threads_after:
                print(f"  {x['tid']:8d} {x['name'][:20]:20s} {x['cpu_s'] - before.get(x['tid'], 0.0):8.2f} s  "
                      f"cpus {x['cpus_allowed']}")
            for key in ("by_self_cpu", "by_cpu", "by_self_device"):
                print(f"==== {key}")
                for r in res[key]:
                    print(f"  {r['self_cpu_ms']:9.2f} {r['cpu_ms']:9.2f} {r['self_device_ms']:9.2f} "
                          f"{r['device_ms']:9.2f} {r['calls']:7d}  {r['name']}")
    finally:
        if joined:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
