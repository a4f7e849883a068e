"""Replay `isoexec bench engine`'s two workloads through the engine's scheduler alone (no model,
no device): steps, steps carrying a prefill chunk (eager on a GPU) and the mean rows of a decode
step, for prefill intervals 0 and 4 and, for comparison, the first interval rule that held a step
even when the waiting prompts would fill it. A CPU tool for reasoning about scheduling policy;
the throughput itself is measured by `isoexec bench engine` on the GPU.

    python3 scripts/scheduler_replay.py
"""

from __future__ import annotations

import random

from isoexec.engine import BlockManager, SamplingParams, Scheduler, Sequence


def workload(name: str) -> tuple[list[tuple[int, int, int]], int]:
    """(arrival step, prompt tokens, new tokens) per request, and the step's token budget, as in
    isoexec/bench/engine.py (SIZES["cuda"] and STAGGERED["cuda"])."""
    if name == "batch":
        return [(0, 256, 128)] * 64, 8192
    rng = random.Random(0)
    return [(i // 4, rng.randint(1, 300), rng.randint(16, 256)) for i in range(192)], 2048


def replay(name: str, interval: int, hold_always: bool = False) -> dict:
    reqs, budget = workload(name)
    sched = Scheduler(BlockManager(64 * 40 + 8, 16, 0), budget, 64, 64, 4096, prefill_interval=interval)
    if hold_always:      # the first rule: hold whatever prefill work is waiting
        sched._prefill_tokens_at_hand = lambda scheduled, left: 0
    pending = list(enumerate(reqs))
    steps = eager = 0
    decode_rows = []
    while pending or sched.has_unfinished():
        while pending and pending[0][1][0] <= steps:
            i, (_, prompt, new) = pending.pop(0)
            sched.add(Sequence(i, [1] * prompt, SamplingParams(temperature=0.0, max_tokens=new)))
        batch = sched.schedule()
        steps += 1
        if batch is None:
            continue
        if batch.is_decode:
            decode_rows.append(len(batch.seqs))
        else:
            eager += 1
        sched.postprocess(batch, [7] * sum(batch.samples), [-1.0] * sum(batch.samples))
    return {"steps": steps, "prefill_steps": eager, "mean_decode_rows": round(sum(decode_rows) / len(decode_rows), 2)}


def main() -> None:
    for name in ("batch", "staggered"):
        for interval, hold_always in ((0, False), (4, False), (4, True)):
            rule = "always hold" if hold_always else "hold unless the prefill fills the step"
            print(f"{name:9s} interval {interval} ({rule}): {replay(name, interval, hold_always)}")


if __name__ == "__main__":
    main()
