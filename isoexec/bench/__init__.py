"""Microbenchmarks, ours vs the stock path in the same run (docs/benchmarks.md).

``BENCHES`` names every benchmark ``isoexec bench NAME`` runs and the function of this package
that runs it, as ``"<module>.<function>"``: the function is imported when the benchmark runs
(:func:`bench_function`), because the benchmark modules import torch and the CLI builds its
``bench`` choices from these names at every start, ``isoexec contract show`` included.
"""

from __future__ import annotations

import importlib
from typing import Callable

BENCHES: dict[str, str] = {
    "gemm": "kernels.bench_gemm", "attention": "kernels.bench_attention", "rmsnorm": "kernels.bench_rmsnorm",
    "logprob": "kernels.bench_logprob", "engine": "engine.bench_engine", "cpr": "cpr.bench_cpr_rows",
    "train": "train.bench_train", "moe": "moe.bench_moe", "tp_linear": "tp_linear.bench_tp_linear",
    "tp_dist": "tp_dist.bench_tp_dist",
}
#: benchmarks of several ranks, launched by torchrun (one rank per GPU), not by the workflow's
#: one-GPU ``bench`` rule: scripts/gpu_run.sh (MODE=tp TP_BENCH=1) runs them
DISTRIBUTED_BENCHES = ("tp_dist",)


def bench_function(name: str) -> Callable:
    """The function of benchmark ``name``: ``fn(device, quick=False, log=print)`` returns its rows,
    or (rows, extra fields of the result)."""
    module, _, fn = BENCHES[name].rpartition(".")
    return getattr(importlib.import_module(f"{__name__}.{module}"), fn)
