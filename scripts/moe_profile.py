"""Where the time of one MoE layer goes, IsoExec vs native (a tuning tool, GPU only).

Builds the layer of ``isoexec bench moe`` (GLM-4.7-Flash and Qwen3.5-35B-A3B dimensions, random
weights) under both compositions and, for each M in ``--m``, profiles a few eager forward calls
with torch.profiler: the top CUDA kernels by device time (with call counts) and the device time
per region (router, dispatch, experts, shared expert, combine: record_function ranges around the
plan's region calls). The bench says how slow a layer is; this says which kernels make it so.

    python3 scripts/moe_profile.py [--m 1 64 4096] [--train-m 4096] [--top 15] [--calls 3]

``--train-m`` also profiles forward + backward (the trainer's plan) at those sizes: the backward
kernels show up under the autograd nodes, not under the region ranges.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile, record_function


class _Ranged:
    """The plan with every region call wrapped in a record_function range of its name."""

    def __init__(self, plan):
        self.plan = plan
        self.wrapped = {}   # one wrapper per bound callable: fused regions stay one call

    def __getitem__(self, name):
        fn = self.plan[name]
        if id(fn) not in self.wrapped:
            def call(*a, _fn=fn, _name=name, **k):
                with record_function(f"region:{_name}"):
                    return _fn(*a, **k)
            self.wrapped[id(fn)] = call
        return self.wrapped[id(fn)]


def main() -> None:
    from isoexec.bench.moe import _shapes, moe_fn, moe_plan, moe_weights
    from isoexec.model.mla_moe import moe_layer

    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 64, 4096])
    ap.add_argument("--train-m", type=int, nargs="*", default=[])
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args()
    for shape in _shapes(big=True):
        layer = SimpleNamespace(**moe_weights(shape, "cuda", torch.bfloat16))
        for comp in ("isoexec", "native"):
            plan = _Ranged(moe_plan(shape.family, comp, "sm90", "engine_decode"))
            for m in a.m:
                x = torch.randn(m, shape.hidden, device="cuda", dtype=torch.bfloat16)
                with torch.no_grad():
                    for _ in range(2):   # compile and warm
                        moe_layer(plan, layer, x, shape.spec, shape.experts, shape.shared_inter)
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        for _ in range(a.calls):
                            moe_layer(plan, layer, x, shape.spec, shape.experts, shape.shared_inter)
                        torch.cuda.synchronize()
                _report(prof, f"{shape.name} {comp} M={m}", a)
            for m in a.train_m:
                fn, ws = moe_fn(moe_plan(shape.family, comp, "sm90", "trainer_fwd"), shape, vars(layer))
                ws = [w.detach().requires_grad_() for w in ws]
                x = torch.randn(m, shape.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                g = torch.randn(m, shape.hidden, device="cuda", dtype=torch.bfloat16)

                def step():
                    torch.autograd.grad(fn(x, *ws), [x, *ws], g)
                for _ in range(2):
                    step()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(a.calls):
                        step()
                    torch.cuda.synchronize()
                _report(prof, f"{shape.name} {comp} fwd+bwd M={m}", a)


def _report(prof, title: str, a) -> None:
    ev = prof.key_averages()
    kernels = sorted((e for e in ev if e.device_time_total > 0 and not e.key.startswith("region:")),
                     key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in kernels) / a.calls / 1e3
    print(f"==== {title}: device {total:.3f} ms per call, "
          f"{sum(e.count for e in kernels) // a.calls} kernels per call", flush=True)
    for e in ev:
        if e.key.startswith("region:"):
            print(f"  {e.key:<24} device {e.device_time_total / a.calls / 1e3:8.3f} ms  "
                  f"cpu {e.cpu_time_total / a.calls / 1e3:8.3f} ms")
    for e in kernels[:a.top]:
        print(f"  {e.device_time_total / a.calls / 1e3:8.3f} ms  x{e.count // a.calls:<4} {e.key[:110]}")


if __name__ == "__main__":
    main()
