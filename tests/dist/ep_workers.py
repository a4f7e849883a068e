"""What each rank of the expert-parallel tests runs (test_expert_parallel.py).

The test process builds the two MoE families' tiny models once, takes one MoE layer of each (its
weights and router settings) and writes them with the inputs of every case to ``cases.pt``; then
``run_world(out_dir)`` starts one world of 4 gloo processes that each load that file and run every
case three times: at EP = 1 in a group of its own, at EP = 2 in its pair's group ([0, 1] or [2, 3])
and at EP = 4 in the whole world (one start-up for the three sizes: each process's imports take
most of the test's time on a small CPU), and the backward of ``GRAD_CASES`` twice; each saves
``{ep: results}`` to ``out_dir/rank{r}.pt``.
The workers do not build models or contracts (that start-up would dominate the test's time on a
small CPU): they call the invariant MoE regions of ``isoexec_kernels.moe.regions`` and, for the
shared expert, the invariant ``linear`` and ``silu_and_mul`` - the impls the ``isoexec`` CPU
contract binds. The test compares their outputs with the model's own ``moe_layer`` under its
installed plan, so a difference in that binding would show as differing bits.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from pathlib import Path

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from dist_workers import _free_port, _refusal  # noqa: E402
from isoexec.dist.collectives import group_size_rank  # noqa: E402
from isoexec.dist.expert_parallel import expert_parallel_moe  # noqa: E402
from isoexec.dist.partition import expert_shard_range  # noqa: E402
from isoexec_kernels.activation import silu_and_mul  # noqa: E402
from isoexec_kernels.gemm import linear  # noqa: E402
from isoexec_kernels.moe import Dispatch, RouterSpec, regions  # noqa: E402

REGIONS = {"router": regions.moe_route, "dispatch": regions.moe_dispatch, "experts": regions.moe_experts,
           "combine": regions.moe_combine}


def token_split(T: int, ep: int, rank: int, empty_last: bool) -> tuple[int, int]:
    """Tokens ``[t0, t1)`` of rank ``rank``: contiguous slices; with ``empty_last`` (ep > 1) the
    last rank holds none and the others share the batch."""
    if empty_last and ep > 1:
        if rank == ep - 1:
            return T, T
        return rank * T // (ep - 1), (rank + 1) * T // (ep - 1)
    return rank * T // ep, (rank + 1) * T // ep


def shared_rows(x: torch.Tensor, w: dict) -> torch.Tensor | None:
    """The shared expert's rows on ``x`` (replicated weights): SwiGLU by the invariant linear and
    activation, as the model's ``shared_*`` regions under the isoexec contract."""
    if w.get("shared_gate_up") is None:
        return None
    return linear(silu_and_mul(linear(x, w["shared_gate_up"])), w["shared_down"])


def ep_layer(x: torch.Tensor, w: dict, spec: RouterSpec, group, ep: int, rank: int) -> torch.Tensor:
    """This rank's tokens through ``expert_parallel_moe``, holding only its experts' weights."""
    E = w["router"].shape[0]
    e0, e1 = expert_shard_range(E, ep, rank)
    return expert_parallel_moe(x, REGIONS, spec, num_experts=E, router_weight=w["router"],
                               gate_up=w["gate_up"][e0:e1], down=w["down"][e0:e1],
                               correction_bias=w.get("correction_bias"), shared_gate=w.get("shared_gate"),
                               shared=shared_rows(x, w), group=group)


def stock_all_reduce_moe(x: torch.Tensor, regions, spec: RouterSpec, *, num_experts: int, router_weight, gate_up,
                         down, correction_bias=None, shared_gate=None, shared=None, group=None) -> torch.Tensor:
    """Negative control, a stock expert-parallel combine (an all-gather dispatcher with a summing
    combine), with ``expert_parallel_moe``'s signature (``gate_up``, ``down``: this rank's experts)
    so that it can stand in for it inside a model: every rank holds the same tokens ``x`` (the whole
    batch), routes them all, runs its own experts on their pairs, sums each token's weighted rows
    of its experts in fp32 from +0 (ascending expert index), and the ranks' partial sums are added
    by ``all_reduce(SUM)``; then the shared expert and one rounding, as the invariant combine. A
    token's k terms are grouped by owner rank before they are added."""
    ep, rank = group_size_rank(group)
    e0, e1 = expert_shard_range(num_experts, ep, rank)
    routing = regions["router"](x, router_weight, spec, correction_bias, shared_gate)
    disp = regions["dispatch"](routing.ids, num_experts)
    r0, r1 = int(disp.offsets[e0]), int(disp.offsets[e1])
    mine = Dispatch(token=disp.token[r0:r1], offsets=disp.offsets[e0:e1 + 1] - r0,
                    row_of_pair=torch.arange(r1 - r0), num_tokens=r1 - r0, top_k=1)
    rows = regions["experts"](x, mine, gate_up, down)
    T, k = routing.ids.shape
    partial = torch.zeros((T, x.shape[1]), dtype=torch.float32)
    for j in range(k):   # slots in ascending expert index; a token's slots on this rank only
        e = routing.ids[:, j]
        own = (e >= e0) & (e < e1)
        row = disp.row_of_pair.view(T, k)[:, j] - r0
        y = torch.zeros_like(partial)
        y[own] = rows[row[own]].float()
        partial = torch.where(own[:, None], partial + routing.weights[:, j:j + 1] * y, partial)
    if ep > 1:
        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
    if shared is not None:
        partial = partial + (shared.float() if routing.shared_gate is None else routing.shared_gate * shared.float())
    return partial.to(x.dtype)


def stock_all_reduce_layer(x_all: torch.Tensor, w: dict, spec: RouterSpec, group, ep: int, rank: int):
    """``stock_all_reduce_moe`` on the case's layer, this rank holding its experts' weights."""
    E = w["router"].shape[0]
    e0, e1 = expert_shard_range(E, ep, rank)
    return stock_all_reduce_moe(x_all, REGIONS, spec, num_experts=E, router_weight=w["router"],
                                gate_up=w["gate_up"][e0:e1], down=w["down"][e0:e1],
                                correction_bias=w.get("correction_bias"), shared_gate=w.get("shared_gate"),
                                shared=shared_rows(x_all, w), group=group)


def _cases(data: dict, ep: int, rank: int, group) -> dict:
    res = {}
    with torch.no_grad():
        for name, case in data["cases"].items():
            w, spec, x = case["weights"], case["spec"], case["x"]
            t0, t1 = token_split(x.shape[0], ep, rank, case["empty_last"])
            if case.get("refuse_above") is not None and ep > case["refuse_above"]:
                res[name] = {"refusal": _refusal(lambda: ep_layer(x[t0:t1], w, spec, group, ep, rank))}
                continue
            out = {"out": ep_layer(x[t0:t1], w, spec, group, ep, rank), "tokens": (t0, t1)}
            if case.get("control"):
                out["stock_all_reduce"] = stock_all_reduce_layer(x, w, spec, group, ep, rank)
            res[name] = out
    for name in GRAD_CASES:   # the backward, twice (determinism)
        case = data["cases"][name]
        t0, t1 = token_split(case["x"].shape[0], ep, rank, case["empty_last"])
        first = layer_gradients(case, group, ep, rank, t0, t1)
        again = layer_gradients(case, group, ep, rank, t0, t1)
        res[f"grad/{name}"] = {"grads": first, "deterministic": all(
            torch.equal(first[k].view(torch.uint8), again[k].view(torch.uint8)) for k in first)}
    return res


GRAD_CASES = ("glm/top4/fp32", "qwen/uneven/fp32")


def upstream(shape, dtype) -> torch.Tensor:
    """The gradient fed to the layer's output (fixed, signs mixed)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(99)).to(dtype)


def layer_gradients(case: dict, group, ep: int, rank: int, t0: int, t1: int) -> dict:
    """This rank's gradients of ``sum(upstream * output)`` over its tokens ``[t0, t1)``, through
    ``expert_parallel_moe`` with every tensor requiring grad (the correction bias takes none, as in
    the model): its rows of x, its experts' slices, its share of the replicated weights'."""
    w, x = case["weights"], case["x"]
    E = w["router"].shape[0]
    e0, e1 = expert_shard_range(E, ep, rank)
    mine = {k: (v[e0:e1] if k in ("gate_up", "down") else v).detach().clone().requires_grad_(k != "correction_bias")
            for k, v in w.items()}
    xs = x[t0:t1].detach().clone().requires_grad_()
    out = expert_parallel_moe(xs, REGIONS, case["spec"], num_experts=E, router_weight=mine["router"],
                              gate_up=mine["gate_up"], down=mine["down"],
                              correction_bias=mine.get("correction_bias"), shared_gate=mine.get("shared_gate"),
                              shared=shared_rows(xs, mine), group=group)
    out.backward(upstream(x.shape, out.dtype)[t0:t1])
    return {"x": xs.grad, **{k: v.grad for k, v in mine.items() if k != "correction_bias"}}


WORLD = 4
EP_SIZES = (1, 2, 4)


def ep_groups(world: int = WORLD) -> dict[int, list[list[int]]]:
    """{ep: the groups of that size}: consecutive ranks."""
    return {ep: [list(range(g, g + ep)) for g in range(0, world, ep)] for ep in EP_SIZES}


def _entry(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    res = {}
    try:
        data = torch.load(os.path.join(out_dir, "cases.pt"), weights_only=False)
        for ep, groups in ep_groups(world_size).items():
            mine = None
            for members in groups:   # every rank creates every group, in the same order
                g = dist.new_group(members) if ep < world_size else dist.group.WORLD
                if rank in members:
                    mine = g
            res[ep] = _cases(data, ep, dist.get_rank(mine), mine)
    except Exception:
        res = {"__error__": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def run_world(out_dir: Path, world_size: int = WORLD) -> list[dict]:
    """Every rank's ``{ep: results}`` of one world of gloo processes; the cases are read from
    ``out_dir/cases.pt``."""
    mp.spawn(_entry, args=(world_size, _free_port(), str(out_dir)), nprocs=world_size, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
