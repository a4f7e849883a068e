"""Where the host time of a trainer step and of the engine's eager steps goes (a tuning tool).

On a GPU the IsoExec trainer step is host bound (about 110 us of host time per kernel launch in
the committed torch.profiler run); this prints Python-level profiles (cProfile, sorted by own
time and by cumulative time) of one IsoExec trainer step at the bench-train shape and of a short
staggered-arrival engine run, plus the wall time per launch, so the overhead can be located.

    python3 scripts/host_profile.py [--top 40]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch


def _report(prof: cProfile.Profile, top: int, title: str) -> None:
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(top)
        print(f"==== {title}: by {key}\n" + "\n".join(s.getvalue().splitlines()[:top + 12]), flush=True)


def trainer(top: int) -> None:
    from isoexec.bench.train import _model_steps

    _, T, _, make = _model_steps("cuda", False)
    for comp in ("isoexec", "native"):
        step = make(comp)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            step()
        host = (time.perf_counter() - t0) / 5
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 5
        print(f"trainer step {comp}: host {host * 1e3:.1f} ms (launches returned), wall {wall * 1e3:.1f} ms", flush=True)
        if comp == "isoexec":
            prof = cProfile.Profile()
            prof.enable()
            step()
            torch.cuda.synchronize()
            prof.disable()
            _report(prof, top, f"trainer step ({comp})")
        del step


def engine(top: int) -> None:
    from isoexec.bench.engine import _model, _staggered_run

    size = dict(requests=48, max_prompt=300, min_tokens=8, max_tokens=48, max_num_seqs=32, arrivals=4)
    for comp in ("isoexec", "native"):
        m, c, cfg = _model("dense_qwen3_0p6b", comp, "cuda", torch.bfloat16)
        r = _staggered_run(m, c, "cuda", True, size, cfg["vocab_size"])
        print(f"engine staggered {comp}: {r['tokens'] / r['ms'] * 1000:.0f} tok/s, {r['steps']} steps, "
              f"{r['ms'] / r['steps']:.1f} ms/step", flush=True)
        if comp == "isoexec":
            prof = cProfile.Profile()
            prof.enable()
            _staggered_run(m, c, "cuda", True, size, cfg["vocab_size"], seed=1)
            prof.disable()
            _report(prof, top, f"engine staggered ({comp})")
        del m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--only", choices=["trainer", "engine"])
    args = ap.parse_args()
    if args.only in (None, "trainer"):
        trainer(args.top)
    if args.only in (None, "engine"):
        engine(args.top)


if __name__ == "__main__":
    main()
