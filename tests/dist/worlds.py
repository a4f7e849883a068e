"""One spawned gloo world per size for every test file of this folder (conftest.py makes them once
per test run).

Starting a world costs more than most of what the tests then compute in it: each process imports
torch and the package, and the rendezvous waits for the slowest (on a 2-core CPU about 2 s for one
or two processes, 4 s for four, twice that beside other tests). So every part the selected tests
need runs in the same world of each size, one after the other, in the order of ``PARTS``:

- ``tp_kernels``: the row-, column- and vocabulary-parallel kernels at TP = 1, 2, 4 (dist_workers.py;
  test_tensor_parallel.py)
- ``tp_model``: the tensor-parallel dense model at TP = 2 (two pairs) and 4 in the world of 4
  (tp_model_workers.py; test_tp_dense_model.py)
- ``tp_engine``: the engine on that model's shards, the same sizes in the same world
  (tp_engine_workers.py; test_tp_engine.py)
- ``tp_hybrid``: the tensor-parallel hybrid model (trainer cases and its engine) at TP = 2 (two
  pairs) and 4 in the same world (tp_hybrid_workers.py; test_tp_hybrid_model.py)
- ``tp_moe``: the tensor-parallel MoE models (mla_moe, hybrid_moe; trainer cases) at TP = 2 (two
  pairs) and 4 in the same world (tp_moe_workers.py; test_tp_moe_model.py)
- ``tp_moe_engine``: the engine on those models' shards, the same sizes in the same world
  (tp_moe_engine_workers.py; test_tp_moe_engine.py)
- ``tp_native``: the dense and hybrid models and their engines under the native composition for
  tensor parallelism (``native_tp4``: stock kernels, row-parallel sums all-reduced) at TP = 2 in the
  world of 2 (tp_native_workers.py; test_tp_native.py)
- ``ep_model``: the MoE models with their experts over EP = 1 (rank 0 alone), 2 (the pairs) and 4
  in the world of 4 (ep_model_workers.py; test_ep_model.py)
- ``fsdp_trainer``, ``fsdp_determinism``: the FSDP2 trainer at dp = 1, 2, 4 (fsdp_workers.py;
  test_fsdp_trainer.py, test_fsdp_determinism.py)
- ``fsdp_layers``: the FSDP2 trainer's model watched at every layer's entry at dp = 2: when each
  layer is gathered and freed (fsdp_layer_workers.py; test_fsdp_per_layer.py)
- ``fsdp_moe``: the FSDP2 trainer on the MoE models (experts sharded) at dp = 2, with FSDP2's
  set_reduce_scatter_unused_params and without it, a rank running an empty pass
  (fsdp_moe_workers.py; test_fsdp_moe.py)
- ``fsdp_save`` in the world of 2, then ``fsdp_resume`` in a second world of 2 started after the
  first is torn down (test_fsdp_checkpoint.py: a resume is only a resume in a new world)
- ``tp_vocab_triton``: the vocabulary-parallel logprob's Triton schedule at TP = 1, 2 and 4 in a
  world of 4 of its own, spawned with ``TRITON_INTERPRET=1`` (vocab_triton_workers.py;
  test_vocab_parallel_triton.py)

Each rank saves ``{part: results}`` to ``<folder>/<world>_rank<r>.pt``; a part that raises records
its traceback as ``{"__error__": ...}`` and the others still run (a failure fails only the tests of
its part). Every comparison is between two computations on the same machine: no stored bits.

``python worlds.py FOLDER PART...`` builds the ranks' inputs and runs the worlds (conftest.py starts
it in the background when collection ends).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
from pathlib import Path

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import dist_workers  # noqa: E402
import ep_model_workers  # noqa: E402
import fsdp_layer_workers  # noqa: E402
import fsdp_moe_workers  # noqa: E402
import fsdp_workers  # noqa: E402
import tp_engine_workers  # noqa: E402
import tp_hybrid_workers  # noqa: E402
import tp_model_workers  # noqa: E402
import tp_moe_engine_workers  # noqa: E402
import tp_moe_workers  # noqa: E402
import tp_native_workers  # noqa: E402
import vocab_triton_workers  # noqa: E402

# part -> (round, world sizes, what one rank runs: fn(job, world_size, rank) -> results); the worlds
# of a round start after every world of the rounds before it has ended
PARTS = {
    "tp_kernels": (0, dist_workers.WORLD_SIZES, lambda job, ws, rank: dist_workers._cases(ws, rank)),
    "tp_model": (0, (tp_model_workers.WORLD,), lambda job, ws, rank: tp_model_workers.world_cases(job["tp_model"], rank)),
    "tp_engine": (0, (tp_model_workers.WORLD,), lambda job, ws, rank: tp_engine_workers.world_cases(job["tp_model"], rank)),
    "tp_hybrid": (0, (tp_model_workers.WORLD,),
                  lambda job, ws, rank: tp_hybrid_workers.world_cases(job["tp_hybrid"], rank)),
    "tp_moe": (0, (tp_model_workers.WORLD,), lambda job, ws, rank: tp_moe_workers.world_cases(job["tp_moe"], rank)),
    "tp_moe_engine": (0, (tp_model_workers.WORLD,),
                      lambda job, ws, rank: tp_moe_engine_workers.world_cases(job["tp_moe"], rank)),
    "tp_native": (0, (tp_native_workers.WORLD,), lambda job, ws, rank: tp_native_workers.cases(job["tp_native"], rank)),
    "ep_model": (0, (ep_model_workers.WORLD,), lambda job, ws, rank: ep_model_workers.world_cases(job["ep_model"], rank)),
    "fsdp_trainer": (0, fsdp_workers.WORLD_SIZES, lambda job, ws, rank: fsdp_workers.plan_trainer(job["fsdp"], ws, rank)),
    "fsdp_determinism": (0, fsdp_workers.WORLD_SIZES,
                         lambda job, ws, rank: fsdp_workers.plan_determinism(job["fsdp"], ws, rank)),
    "fsdp_layers": (0, (fsdp_layer_workers.WORLD,),
                    lambda job, ws, rank: fsdp_layer_workers.plan(job["fsdp"], ws, rank)),
    "fsdp_moe": (0, (fsdp_moe_workers.WORLD,), lambda job, ws, rank: fsdp_moe_workers.plan(job["fsdp_moe"], ws, rank)),
    "fsdp_save": (0, (fsdp_workers.CHECKPOINT_DP,), lambda job, ws, rank: fsdp_workers.plan_save(job["fsdp"], ws, rank)),
    "fsdp_resume": (1, (fsdp_workers.CHECKPOINT_DP,),
                    lambda job, ws, rank: fsdp_workers.plan_resume(job["fsdp"], ws, rank)),
    "tp_vocab_triton": (2, (vocab_triton_workers.WORLD,), lambda job, ws, rank: vocab_triton_workers.world_cases(rank)),
}
# rounds whose worlds run Triton kernels in Triton's CPU interpreter: Triton must be imported with
# TRITON_INTERPRET=1 already set, so their ranks are spawned with it (and no other world is)
INTERPRETER_ROUNDS = {2}


def _entry(rank: int, world_size: int, port: int, out_dir: str, name: str, parts: list[str], job: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    res = {}
    try:
        for part in parts:
            try:
                res[part] = PARTS[part][2](job, world_size, rank)
            except Exception:
                res[part] = {"__error__": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(res, os.path.join(out_dir, f"{name}_rank{rank}.pt"))


def worlds_of(parts) -> list[tuple[str, int, list[str]]]:
    """(world name, size, parts) of every world that ``parts`` need, in the order they run."""
    out = []
    for rnd in sorted({PARTS[p][0] for p in parts}):
        mine = [p for p in PARTS if p in parts and PARTS[p][0] == rnd]
        for ws in sorted({ws for p in mine for ws in PARTS[p][1]}):
            out.append((f"r{rnd}_ws{ws}", ws, [p for p in mine if ws in PARTS[p][1]]))
    return out


def run(parts, job: dict, folder: Path) -> dict[str, float]:
    """Spawn every world ``parts`` need, in order; seconds per world."""
    times = {}
    for name, ws, mine in worlds_of(parts):
        t0 = time.monotonic()
        interpret = PARTS[mine[0]][0] in INTERPRETER_ROUNDS
        before = os.environ.get("TRITON_INTERPRET")
        try:
            if interpret:   # the spawned ranks inherit the environment
                os.environ["TRITON_INTERPRET"] = "1"
            mp.spawn(_entry, args=(ws, dist_workers._free_port(), str(folder), name, mine, job), nprocs=ws, join=True)
        except Exception:   # a rank died: its parts fail, the other worlds still run
            error = {p: {"__error__": f"world {name} failed:\n{traceback.format_exc()}"} for p in mine}
            for r in range(ws):
                if not (folder / f"{name}_rank{r}.pt").exists():
                    torch.save(error, folder / f"{name}_rank{r}.pt")
        finally:
            if interpret:
                os.environ.pop("TRITON_INTERPRET", None) if before is None else os.environ.update(TRITON_INTERPRET=before)
        times[name] = round(time.monotonic() - t0, 1)
    return times


def load(parts, folder: Path) -> dict[str, dict[int, list[dict]]]:
    """{part: {world size: [each rank's results of that part]}} (the world of round 1 under its
    own part, so sizes do not collide)."""
    out = {p: {} for p in parts}
    for name, ws, mine in worlds_of(parts):
        ranks = [torch.load(folder / f"{name}_rank{r}.pt", weights_only=False) for r in range(ws)]
        for p in mine:
            out[p][ws] = [r[p] for r in ranks]
    return out


def failure(part: str, by_size: dict[int, list[dict]]) -> str | None:
    """The first rank's traceback if ``part`` failed on any rank, else None."""
    for ws, ranks in by_size.items():
        for rank, res in enumerate(ranks):
            if "__error__" in res:
                return f"{part}, world of {ws}, rank {rank} failed:\n{res['__error__']}"
    return None


def make_job(parts, folder: Path) -> dict:
    """The ranks' inputs for ``parts`` (contracts and model configs built here, once)."""
    job = {}
    if any(p.startswith("fsdp") and p != "fsdp_moe" for p in parts):
        job["fsdp"] = fsdp_workers.make_job(str(folder / "checkpoint"))
    if "tp_model" in parts or "tp_engine" in parts:
        job["tp_model"] = tp_model_workers.make_job()
    if "tp_hybrid" in parts:
        job["tp_hybrid"] = tp_hybrid_workers.make_job()
    if "tp_moe" in parts or "tp_moe_engine" in parts:
        job["tp_moe"] = tp_moe_workers.make_job()
    if "tp_native" in parts:
        job["tp_native"] = tp_native_workers.make_job()
    if "ep_model" in parts:
        job["ep_model"] = ep_model_workers.make_job()
    if "fsdp_moe" in parts:
        job["fsdp_moe"] = fsdp_moe_workers.make_job()
    return job


if __name__ == "__main__":
    out, names = Path(sys.argv[1]), sys.argv[2:]
    print(f"world start-up and parts {names}, seconds per world: {run(names, make_job(names, out), out)}")
