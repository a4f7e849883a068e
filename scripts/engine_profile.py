"""Where the time of an engine decode step goes (a tuning tool, GPU only).

Builds the dense model at Qwen3-0.6B dimensions under a composition, admits ``--seqs`` prompts of
``--prompt`` tokens, runs the prefill, then profiles ``--steps`` decode steps (CUDA graphs on):
per-step host time (until ``Engine.step`` returned) against wall time, torch.profiler's top CPU
ops and CUDA kernels, and cProfile's top Python functions: greedy and top-p sampled decode steps
in CUDA graphs (the sampler's share), then greedy eager steps (the host cost of the eager path,
which every prefill step takes).

    python3 scripts/engine_profile.py [--composition isoexec] [--seqs 64] [--top 25] [--greedy-graphs-only]
    python3 scripts/engine_profile.py --replay-only [--steps 50]

``--replay-only`` asks where the wall time of a graph decode step goes without profiling it: it
times the bucket's graph replayed back to back on the device (CUDA events: the kernels plus the
gaps between them, no host in the way), the greedy ``Engine.step`` with a sync after each, and
``Engine.step`` with decode lookahead (no sync). The difference between the first and the others is
what the host adds to a step.

It prints, per run, the number of device kernels (and copies) per decode step and their summed
device time, which unlike the wall time do not move with the speed of the machine's host.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch


def _decode_steps(engine, n: int) -> tuple[float, float]:
    """Mean host and wall ms of n Engine.step calls."""
    host = wall = 0.0
    for _ in range(n):
        t0 = time.perf_counter()
        engine.step()
        host += time.perf_counter() - t0
        torch.cuda.synchronize()
        wall += time.perf_counter() - t0
    return host / n * 1e3, wall / n * 1e3


def _decode_engine(composition: str, seqs: int, prompt: int, max_tokens: int, sampled: bool, graphs: bool,
                   built=None, **engine_kw):
    """An engine at Qwen3-0.6B dimensions, warmed up, with ``seqs`` prompts admitted and prefilled:
    every later step is a decode step. ``built`` reuses a (model, contract, hf config) triple."""
    from isoexec.bench.engine import _model
    from isoexec.engine import Engine, EngineConfig, SamplingParams

    model, contract, cfg = built or _model("dense_qwen3_0p6b", composition, "cuda", torch.bfloat16)
    max_len = prompt + max_tokens + 16
    ecfg = EngineConfig(max_num_batched_tokens=8192, max_num_seqs=seqs, num_pages=seqs * (-(-max_len // 16)) + 8,
                        max_model_len=max_len, cuda_graphs=graphs, **engine_kw)
    engine = Engine(model, contract, ecfg, trainer_contract=contract)
    params = (SamplingParams(temperature=1.0, top_p=0.9, max_tokens=max_tokens, seed=1) if sampled
              else SamplingParams(temperature=0.0, max_tokens=max_tokens))
    engine.generate([[1, 2, 3]] * 2, params)        # compile kernels, capture graphs
    gen = torch.Generator().manual_seed(0)
    for i, p in enumerate(torch.randint(0, cfg["vocab_size"], (seqs, prompt), generator=gen).tolist()):
        engine.add_request(p, params, 10_000 + i)
    while len(engine.scheduler.waiting):
        engine.step()                                 # prefill (chunked) until every sequence decodes
    return engine, (model, contract, cfg)


def replay_only(seqs: int, prompt: int, steps: int) -> None:
    """The ``--replay-only`` rows (module docstring), lookahead off then on, one model for both."""
    built = None
    for overlap in (False, True):
        engine, built = _decode_engine("isoexec", seqs, prompt, 3 * steps + 16, False, True, built,
                                       overlap_decode=overlap)
        _decode_steps(engine, 3)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t0) / steps * 1e3
        line = f"==== overlap={overlap}: Engine.step {step_ms:.3f} ms ({seqs / step_ms * 1e3:.0f} tok/s)"
        if not overlap:
            host, wall = _decode_steps(engine, steps)
            graphs = engine.runner.graphs
            g = graphs.graphs[graphs.bucket(seqs)]
            g.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(steps):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            line += (f"; synced steps host {host:.3f} / wall {wall:.3f} ms; graph replayed back to back "
                     f"{start.elapsed_time(end) / steps:.3f} ms per step")
        print(line, flush=True)
        del engine
        torch.cuda.empty_cache()


def profile(composition: str, seqs: int, prompt: int, steps: int, top: int, sampled: bool, graphs: bool = True) -> None:
    engine, _ = _decode_engine(composition, seqs, prompt, 3 * steps + 16, sampled, graphs)
    _decode_steps(engine, 3)
    host, wall = _decode_steps(engine, steps)
    tag = f"{composition} {'top-p sampled' if sampled else 'greedy'} {seqs} seqs {'graphs' if graphs else 'eager'}"
    print(f"==== {tag}: decode step host {host:.2f} ms, wall {wall:.2f} ms ({seqs / wall * 1e3:.0f} tok/s)",
          flush=True)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _decode_steps(engine, steps)
    ka = prof.key_averages()
    kernels = [e for e in ka if e.device_type == DeviceType.CUDA]
    print(f"==== {tag}: per step {sum(e.count for e in kernels) / steps:.0f} device kernels and copies, "
          f"{sum(e.self_device_time_total for e in kernels) / steps / 1e3:.3f} ms of summed device time",
          flush=True)
    print(f"---- {tag}: top by self CPU time ({steps} steps)")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
    print(f"---- {tag}: top by self device time ({steps} steps)")
    print(ka.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60))
    cp = cProfile.Profile()
    cp.enable()
    _decode_steps(engine, steps)
    cp.disable()
    s = io.StringIO()
    pstats.Stats(cp, stream=s).sort_stats("tottime").print_stats(top)
    print(f"---- {tag}: cProfile by own time ({steps} steps)\n" + "\n".join(s.getvalue().splitlines()[:top + 12]),
          flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--composition", default="isoexec")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--greedy-graphs-only", action="store_true", help="only the greedy decode in CUDA graphs")
    ap.add_argument("--replay-only", action="store_true", help="graph replay and step times, lookahead off and on")
    args = ap.parse_args()
    if args.replay_only:
        replay_only(args.seqs, args.prompt, args.steps)
        return
    runs = ((False, True),) if args.greedy_graphs_only else ((False, True), (True, True), (False, False))
    for sampled, graphs in runs:
        profile(args.composition, args.seqs, args.prompt, args.steps, args.top, sampled, graphs)


if __name__ == "__main__":
    main()
