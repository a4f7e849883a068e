"""Engine warm-up before an RL run's first timed step: the kernel variants only the engine uses
(paged attention with block tables one page wide and wider, chunked prefill, the sampler's path)
compile here instead of inside a timed generation. The trainer-side warm-up, which covers every
GEMM bucket, is ``isoexec.train.precompile``."""

from __future__ import annotations

import time
from typing import Callable

import torch

from .. import kernel_compiles
from .sequence import SamplingParams


def warm_up_engine(engine, max_prompt_tokens: int, log: Callable[[str], None] = print) -> dict:
    """A few short generations before the first timed step: prompts of one page, of several
    pages and a mixed batch, two new tokens each, sampled (top-p on), so the engine's paged
    attention variants (block-table width 1 and more), its chunked prefill and the sampler's
    path are compiled. Request ids and seeds are the call's own; the engine is idle afterwards
    and no state carries over. Only meaningful on a GPU (no-op elsewhere)."""
    if engine.runner.device.type != "cuda":
        return {"seconds": 0.0, "kernels_compiled": 0}
    kernel_compiles.install()
    before = kernel_compiles.count()
    t0 = time.perf_counter()
    longest = max(2, min(int(max_prompt_tokens), engine.config.max_model_len - 2))
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=2, seed=0)
    for prompts in ([[1]], [[1] * longest], [[1] * n for n in sorted({1, 2, longest // 2, longest})]):
        engine.generate(prompts, [params] * len(prompts))
    torch.cuda.synchronize(engine.runner.device)
    out = {"seconds": time.perf_counter() - t0, "kernels_compiled": kernel_compiles.count() - before}
    log(f"engine warm-up in {out['seconds']:.1f}s, {out['kernels_compiled']} kernel(s) compiled")
    return out
