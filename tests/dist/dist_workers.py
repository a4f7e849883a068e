"""What each rank of the tensor-parallel kernel tests runs, and the inputs both sides rebuild from
seeds; and the helpers every file of this folder shares (``bit_report``, ``_refusal``, ``_free_port``).

``_cases(tp, rank)`` runs every case below once in a world of ``tp`` gloo processes (worlds.py
spawns them); the tests compare the ranks' results with each other and with the single-process
kernels, computed in the test process from the same seeds. Every comparison is between two
computations on the same machine: no stored bit patterns.
"""

from __future__ import annotations

import socket
from pathlib import Path
import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from isoexec.bits import int_view  # noqa: E402
from isoexec.dist import (column_parallel_linear, column_shard_range, row_parallel_linear,  # noqa: E402
                          row_shard_range, vocab_parallel_token_logprobs, vocab_shard_range)
from isoexec_kernels.gemm import BLOCK_K, linear  # noqa: E402
from isoexec_kernels.logprob import shards  # noqa: E402

WORLD_SIZES = (1, 2, 4)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# (name, K, L, N, dtype, with bias): K = 337 is 6 blocks, the last 17 wide, in 4 uneven leaves
# (1, 2, 1, 2 blocks); K = 600 is 10 blocks in 8 leaves
ROW_CASES = [("k337_l4_fp32_bias", 337, 4, 24, "fp32", True), ("k337_l4_bf16_bias", 337, 4, 24, "bf16", True),
             ("k600_l8_fp32", 600, 8, 24, "fp32", False), ("k600_l8_bf16", 600, 8, 24, "bf16", False)]
ROW_LEAD = (2, 5)          # x is [2, 5, K]: leading dims are flattened and restored
# (name, K, N, unit, dtype): N = 203 in 1-column units gives shards of 50/51 columns
COL_CASES = [("n203_fp32", 40, 203, 1, "fp32"), ("n203_bf16", 40, 203, 1, "bf16"),
             ("n200_unit64_fp32", 40, 200, BLOCK_K, "fp32")]
# a column-parallel up projection (H -> I, 64-column units) into a row-parallel down projection
MLP = dict(H=48, I=200, L=4)   # I = 200 is 4 K blocks: one leaf each
# (name, V, dtype): V = 4396 is 5 leaves of 1024 (the last 300 wide), V = 9000 is 9
VOCAB_CASES = [("v4396_fp32", 4396, "fp32"), ("v4396_bf16", 4396, "bf16"), ("v9000_fp32", 9000, "fp32")]
VOCAB_LEAD = (4, 8)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spread(shape, g, dtype):
    """Normal values with per-element magnitudes over a few decades: sums that round."""
    v = torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g))
    return v.to(dtype)


def row_inputs(i: int):
    name, K, L, N, dt, with_bias = ROW_CASES[i]
    g = _gen(100 + i)
    x = _spread(ROW_LEAD + (K,), g, DTYPES[dt])
    w = _spread((N, K), g, DTYPES[dt])
    b = _spread((N,), g, DTYPES[dt]) if with_bias else None
    probe = torch.randn(ROW_LEAD + (N,), generator=g)   # the loss is sum(out * probe)
    return x, w, b, probe


def col_inputs(i: int):
    name, K, N, unit, dt = COL_CASES[i]
    g = _gen(200 + i)
    x = _spread((3, 7, K), g, DTYPES[dt])
    w = _spread((N, K), g, DTYPES[dt])
    b = _spread((N,), g, DTYPES[dt])
    probe = torch.randn((3, 7, N), generator=g)
    return x, w, b, probe


def mlp_inputs():
    g = _gen(300)
    H, I = MLP["H"], MLP["I"]
    return (_spread((9, H), g, torch.float32), _spread((I, H), g, torch.float32),
            _spread((I,), g, torch.float32), _spread((H, I), g, torch.float32), _spread((H,), g, torch.float32))


def vocab_inputs(i: int):
    """Logits with the hazards of the reference schedule: the first and last token as targets, a
    target at the row max (z_t - m = +0), masked (-inf) entries, a row whose max is +0 on the last
    leaf with a -0 target on the first (z_t - m = -0)."""
    name, V, dt = VOCAB_CASES[i]
    g = _gen(400 + i)
    rows = VOCAB_LEAD[0] * VOCAB_LEAD[1]
    z = torch.randn((rows, V), generator=g) * 4.0
    t = torch.randint(0, V, (rows,), generator=g)
    t[0], t[1] = 0, V - 1
    t[2] = int(z[2].argmax())
    z[3, ::7] = float("-inf")
    t[3] = 1   # not masked: 1 % 7 != 0
    z[4] = -z[4].abs() - 1.0
    z[4, 5], z[4, V - 2] = -0.0, 0.0
    t[4] = 5
    dy = torch.randn((rows,), generator=g)
    return z.to(DTYPES[dt]).reshape(VOCAB_LEAD + (V,)), t.reshape(VOCAB_LEAD), dy.reshape(VOCAB_LEAD)


def _row_case(i: int, tp: int, rank: int) -> dict:
    name, K, L, N, dt, with_bias = ROW_CASES[i]
    x, w, b, probe = row_inputs(i)
    k0, k1 = row_shard_range(K, L, tp, rank)
    out = {"out": row_parallel_linear(x[..., k0:k1], w[:, k0:k1], b, in_features=K, leaves=L),
           "owners": row_parallel_linear(x[..., k0:k1], w[:, k0:k1], b, in_features=K, leaves=L, combine="owners")}
    # the column owners' combine through autograd: the same gradients as the gather's (run 0 below)
    xs = x[..., k0:k1].clone().requires_grad_()
    ws = w[:, k0:k1].clone().requires_grad_()
    (row_parallel_linear(xs, ws, b, in_features=K, leaves=L, combine="owners").float() * probe).sum().backward()
    out["owners_gx"], out["owners_gw"] = xs.grad, ws.grad
    for run in (0, 1):   # the backward twice: deterministic
        xs = x[..., k0:k1].clone().requires_grad_()
        ws = w[:, k0:k1].clone().requires_grad_()
        bs = None if b is None else b.clone().requires_grad_()
        y = row_parallel_linear(xs, ws, bs, in_features=K, leaves=L)
        (y.float() * probe).sum().backward()
        out[f"gx{run}"], out[f"gw{run}"] = xs.grad, ws.grad
        if bs is not None:
            out[f"gb{run}"] = bs.grad
    # negative control: each rank's K shard as one fp32 partial, then a plain all_reduce(SUM)
    part = linear(x[..., k0:k1], w[:, k0:k1], None, out_dtype=torch.float32)
    if tp > 1:
        dist.all_reduce(part, op=dist.ReduceOp.SUM)
    out["all_reduce"] = (part if b is None else part + b.float()).to(x.dtype)
    return out


def _col_case(i: int, tp: int, rank: int) -> dict:
    name, K, N, unit, dt = COL_CASES[i]
    x, w, b, probe = col_inputs(i)
    n0, n1 = column_shard_range(N, tp, rank, unit)
    out = {"out": column_parallel_linear(x, w[n0:n1], b[n0:n1], out_features=N, unit=unit)}
    for run in (0, 1):
        xs = x.clone().requires_grad_()
        ws = w[n0:n1].clone().requires_grad_()
        y = column_parallel_linear(xs, ws, b[n0:n1], out_features=N, unit=unit)
        (y.float() * probe).sum().backward()
        out[f"gx{run}"], out[f"gw{run}"] = xs.grad, ws.grad
    return out


def _mlp_case(tp: int, rank: int) -> dict:
    x, w1, b1, w2, b2 = mlp_inputs()
    n0, n1 = column_shard_range(MLP["I"], tp, rank, BLOCK_K)
    h = column_parallel_linear(x, w1[n0:n1], b1[n0:n1], out_features=MLP["I"], unit=BLOCK_K, gather_output=False)
    return {"out": row_parallel_linear(h, w2[:, n0:n1], b2, in_features=MLP["I"], leaves=MLP["L"]),
            "shard_matches_row_range": (n0, n1) == row_shard_range(MLP["I"], MLP["L"], tp, rank)}


def _vocab_case(i: int, tp: int, rank: int) -> dict:
    name, V, dt = VOCAB_CASES[i]
    z, t, dy = vocab_inputs(i)
    v0, v1 = vocab_shard_range(V, tp, rank)
    zs = z[..., v0:v1].clone().requires_grad_()
    lp = vocab_parallel_token_logprobs(zs, t, vocab_size=V)
    lp.backward(dy)
    return {"out": lp.detach(), "grad": zs.grad, "all_reduce": _vocab_all_reduce(zs.detach(), t, v0, v1)}


def _vocab_all_reduce(zs, t, v0, v1):
    """Negative control, a stock vocabulary-parallel logprob: the exact max, then each rank's
    sum-exp over its own slice (its leaves left to right) and the target's logit summed over ranks
    with all_reduce(SUM)."""
    z = zs.reshape(-1, v1 - v0).float()
    tg = t.reshape(-1)
    m = z.max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    m = m + 0.0
    s = torch.zeros_like(m)
    for leaf in shards.leaf_sums(z, m):
        s = s + leaf
    own = (tg >= v0) & (tg < v1)
    zt = torch.where(own, z.gather(1, (tg - v0).clamp(0, v1 - v0 - 1)[:, None])[:, 0] - m, torch.zeros_like(m))
    dist.all_reduce(s, op=dist.ReduceOp.SUM)
    dist.all_reduce(zt, op=dist.ReduceOp.SUM)
    return (zt - shards.lse_from_leaf_sums(s[None])).reshape(t.shape)


def _refusal(fn, errors=(ValueError,)) -> str:
    """``"<error type>: <message>"`` if ``fn()`` raises one of ``errors``, else ``"accepted"``."""
    try:
        fn()
    except errors as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


def _cases(tp: int, rank: int) -> dict:
    res = {}
    for i, case in enumerate(ROW_CASES):
        res[f"row/{case[0]}"] = _row_case(i, tp, rank)
    for i, case in enumerate(COL_CASES):
        res[f"col/{case[0]}"] = _col_case(i, tp, rank)
    res["mlp"] = _mlp_case(tp, rank)
    for i, case in enumerate(VOCAB_CASES):
        res[f"vocab/{case[0]}"] = _vocab_case(i, tp, rank)
    # refusals inside a real group: every rank refuses before any collective, so none waits
    x, w, b, _ = row_inputs(0)
    res["refuse/row_l3"] = _refusal(lambda: row_parallel_linear(
        x[..., :x.shape[-1] // tp], w[:, :x.shape[-1] // tp], b, in_features=x.shape[-1], leaves=3))
    res["refuse/vocab_3_leaves"] = _refusal(lambda: vocab_parallel_token_logprobs(
        torch.zeros(2, 3000 // tp), torch.zeros(2, dtype=torch.long), vocab_size=3000))
    return res


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan_entry(rank: int, world_size: int, port: int, out_dir: str, plan, job: dict) -> None:
    """One rank of a world spawned by :func:`spawn_plan_world`: one torch thread, a gloo group,
    ``plan(job, world_size, rank, out_dir)`` (a dict with a ``times`` dict of monotonic stamps, kept
    relative to the rank's start) or the traceback, saved as ``rank<r>.pt``."""
    import datetime
    import os
    import time
    import traceback

    t0 = time.monotonic()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        res = plan(job, world_size, rank, out_dir)
        res["times"] = {k: round(v - t0, 2) for k, v in res["times"].items()}
    except Exception:
        res = {"__error__": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def spawn_plan_world(plan, world_size: int, out_dir, job: dict) -> list[dict]:
    """Every rank's result of ``plan`` (a module-level function, so the spawned ranks can import it)
    in one world of ``world_size`` gloo processes."""
    import torch.multiprocessing as mp

    mp.spawn(_plan_entry, args=(world_size, _free_port(), str(out_dir), plan, job), nprocs=world_size, join=True)
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def bit_report(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Elements and differing elements of two same-shape, same-dtype tensors, through integer views."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    ia, ib = int_view(a).long(), int_view(b).long()
    rep = {"elements": a.numel(), "differing": int((ia != ib).sum())}
    if rep["differing"]:
        rep["max_ulp"] = int((ia - ib).abs().max())
    return rep
