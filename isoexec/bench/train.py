"""``isoexec bench train``: where the training step's time goes, ours vs stock, forward + backward.

Three parts, all at training shapes (packed tokens of the Qwen3-0.6B dimensions on a GPU, tiny
shapes on a CPU or with ``--quick``):

* **regions**: every region of the dense model timed forward + backward (``torch.autograd.grad``
  with a fixed upstream gradient): each projection GEMM, the model norm and the per-head q/k
  norm, RoPE on q and k, varlen attention, SiLU-and-mul, the embedding gather and the fp32
  token logprob over the vocabulary. Rows follow docs/benchmarks.md: ``baseline`` is the stock path,
  ``speed_ratio = baseline_ms / ours_ms``.
* **model.trainer_step**: the whole trainer step (forward with autograd, token logprobs,
  backward to every parameter) under the native and the IsoExec composition, each timed in a
  fresh process of its own (two rounds in alternating order on a GPU; :func:`_fresh_process`
  says why).
* **profile**: one trainer step of each composition under ``torch.profiler``: the step's host
  (wall) time, the device time, and the kernels that took the most device time (name, calls,
  total ms), so the next regression is found in one run (returned as the result's ``profile``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from isoexec_kernels.activation import silu_and_mul, silu_and_mul_native
from isoexec_kernels.attention import attention_native_varlen, varlen_attention
from isoexec_kernels.embedding import embedding, embedding_native
from isoexec_kernels.gemm import linear, linear_native
from isoexec_kernels.logprob import token_logprobs, token_logprobs_native
from isoexec_kernels.rmsnorm import rms_norm, rms_norm_native
from isoexec_kernels.rope import apply_rope, apply_rope_native, rope_cache

from ..assembly import installed_model
from ..compose import load_model_config
from ..envinfo import runtime_arch
from ..model import ForwardBatch
from .common import fwd_bwd, leaf, print_rows, rotating, row, time_ms

# Qwen3-0.6B projections (K, N) and its attention / vocabulary shapes
_LINEARS = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024),
            "lm_head": (1024, 151936)}
_TINY_LINEARS = {"qkv": (64, 128), "o": (64, 64), "lm_head": (64, 512)}
_TOP_KERNELS = 15
_RESULT = "TRAINER_STEP_RESULT "   # prefix of the one stdout line a step process prints


def bench_train_regions(device: str, quick: bool, log=print) -> list[dict]:
    big = device == "cuda" and not quick
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    T = 8192 if big else 64
    rows = []

    def rnd(*shape, scale=1.0, dt=dtype):
        return torch.randn(*shape, device=device, dtype=dt) * scale

    # quick runs are format checks: one timed call after one warm-up
    reps = dict(rep_ms=0, min_reps=1) if quick else {}

    def timed(stage: str, fields: dict, ours, base):
        r = row({"stage": stage, "pass": "fwd+bwd", **fields}, "torch", time_ms(base, device, **reps),
                time_ms(ours, device, **reps))
        rows.append(r)
        print_rows([r], ["stage", "T", "K", "N", "V"], log)

    for name, (K, N) in (_LINEARS if big else _TINY_LINEARS).items():
        x, w = leaf(rnd(T, K)), leaf(rnd(N, K, scale=0.02))
        g = rnd(T, N)
        timed(f"linear.{name}", {"T": T, "K": K, "N": N}, fwd_bwd(linear, (x, w), g), fwd_bwd(linear_native, (x, w), g))

    H = 1024 if big else 64
    nh, nkv, hd, seqs = (16, 8, 128, 8) if big else (4, 2, 16, 4)
    x, w = leaf(rnd(T, H)), leaf(torch.ones(H, device=device, dtype=dtype))
    g = rnd(T, H)
    timed("rmsnorm", {"T": T, "K": H}, fwd_bwd(lambda a, b: rms_norm(a, b, 1e-6), (x, w), g),
          fwd_bwd(lambda a, b: rms_norm_native(a, b, 1e-6), (x, w), g))
    # q/k norm: the same op over [T, heads, head_dim] (many short rows)
    x, w = leaf(rnd(T, nh, hd)), leaf(torch.ones(hd, device=device, dtype=dtype))
    g = rnd(T, nh, hd)
    timed("rmsnorm.qk_head", {"T": T, "heads": nh, "K": hd}, fwd_bwd(lambda a, b: rms_norm(a, b, 1e-6), (x, w), g),
          fwd_bwd(lambda a, b: rms_norm_native(a, b, 1e-6), (x, w), g))

    pos = torch.arange(T, device=device) % (T // seqs)
    table = rope_cache(T, hd, 1e6, device)
    x, g = leaf(rnd(T, nh, hd)), rnd(T, nh, hd)
    timed("rope", {"T": T, "heads": nh, "head_dim": hd},
          fwd_bwd(lambda a: apply_rope(a, pos, table), (x,), g),
          fwd_bwd(lambda a: apply_rope_native(a, pos, theta=1e6), (x,), g))

    lens = [T // seqs] * seqs
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(seqs)], dtype=torch.int32, device=device)
    q, k, v = leaf(rnd(T, nh, hd)), leaf(rnd(T, nkv, hd)), leaf(rnd(T, nkv, hd))
    g = rnd(T, nh, hd)
    scale = hd ** -0.5
    timed("attention.varlen", {"T": T, "seqs": seqs, "heads": nh, "kv_heads": nkv, "head_dim": hd},
          fwd_bwd(lambda a, b, c: varlen_attention(a, b, c, cu, max(lens), scale), (q, k, v), g),
          fwd_bwd(lambda a, b, c: attention_native_varlen(a, b, c, cu, max(lens), scale), (q, k, v), g))

    inter = 3072 if big else 96
    gu, g = leaf(rnd(T, 2 * inter)), rnd(T, inter)
    timed("act.silu_mul", {"T": T, "N": inter}, fwd_bwd(silu_and_mul, (gu,), g), fwd_bwd(silu_and_mul_native, (gu,), g))

    V = 151936 if big else 512
    ids = torch.randint(0, V, (T,), device=device)
    table_e, g = leaf(rnd(V, H, scale=0.02)), rnd(T, H)
    timed("embed", {"T": T, "V": V, "K": H}, fwd_bwd(lambda t: embedding(ids, t), (table_e,), g),
          fwd_bwd(lambda t: embedding_native(ids, t), (table_e,), g))

    Tl = 2048 if big else 64
    nxt = rotating(lambda: (leaf(rnd(Tl, V, scale=3.0)), torch.randint(0, V, (Tl,), device=device)), 2)
    g = torch.randn(Tl, device=device, dtype=torch.float32)

    def lp(fn):
        def run():
            logits, tgt = nxt()
            torch.autograd.grad(fn(logits, tgt), [logits], g)
        return run

    timed("logprob", {"T": Tl, "V": V}, lp(token_logprobs), lp(token_logprobs_native))
    return rows


def _model_steps(device: str, quick: bool):
    """(name, T, seqs, {composition: step function}) for the whole trainer step."""
    name = "dense_qwen3_0p6b" if device == "cuda" and not quick else "dense_tiny"
    arch = "cpu" if device == "cpu" else runtime_arch()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = load_model_config(name)["hf_config"]
    lens = [512] * 8 if name == "dense_qwen3_0p6b" else [12] * 2
    T = sum(lens)
    ids = torch.randint(0, cfg["vocab_size"], (T,), device=device)
    targets = torch.roll(ids, -1)

    def make(comp: str):
        m = installed_model("dense", comp, arch, name, dtype=dtype, device=device, seed=0).model
        params = list(m.parameters())
        batch = ForwardBatch.packed(lens, "trainer_fwd", device)

        def step():
            lp = m.token_logprobs(m.hidden_states(ids, batch), targets, "trainer_fwd")
            torch.autograd.grad(lp.sum(), params)

        return step

    return name, T, len(lens), make


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_step(step, device: str, top: int = _TOP_KERNELS, warmup: bool = True) -> dict:
    """One step under torch.profiler (after one warm-up step unless ``warmup`` is False): host
    time of the step (until the last launch returns), wall time (until the device is done), total
    device time, and the ``top`` kernels by device time (on a CPU: ops by self CPU time)."""
    if warmup:
        step()
    _sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        host_ms = (time.perf_counter() - t0) * 1000
        _sync(device)
        wall_ms = (time.perf_counter() - t0) * 1000
    events = prof.key_averages()
    if device == "cuda":
        # device-side events are the kernels (and memcpy/memset); host ops have no self device time
        kernels = [e for e in events if getattr(e, "device_type", None) is not None
                   and str(e.device_type).endswith("CUDA") and e.self_device_time_total > 0]
        key = "self_device_time_total"
    else:
        kernels = [e for e in events if e.self_cpu_time_total > 0]
        key = "self_cpu_time_total"
    total = sum(getattr(e, key) for e in kernels) / 1000
    kernels.sort(key=lambda e: -getattr(e, key))
    return {
        "host_ms": round(host_ms, 3),
        "wall_ms": round(wall_ms, 3),
        "device_ms": round(total, 3) if device == "cuda" else None,
        "kernel_launches": int(sum(e.count for e in kernels)) if device == "cuda" else None,
        "top": [{"name": e.key[:160], "calls": int(e.count), "total_ms": round(getattr(e, key) / 1000, 4)}
                for e in kernels[:top]],
    }


def _time_and_profile(comp: str, device: str, quick: bool) -> dict:
    """Build one composition's trainer step, time it and profile one step (in this process)."""
    _, _, _, make = _model_steps(device, quick)
    step = make(comp)
    # quick runs are format checks: one timed step (the CPU reference path is slow)
    ms = time_ms(step, device, warmup_ms=200, rep_ms=0 if quick else 1000, min_reps=1 if quick else 5)
    return {"ms": ms, "profile": profile_step(step, device, warmup=False)}  # time_ms warmed it up


def _fresh_process(comp: str, device: str, quick: bool) -> dict:
    """:func:`_time_and_profile` in a new Python process. Each composition gets a process of its
    own because on the H200 the composition timed second in one process came out slower whichever
    it was (isoexec 76 ms first, 139 ms second; native 88 first, 115 second): the step is
    host-bound, and the host state the first one leaves behind is not what a training run, one
    composition per process, sees."""
    cmd = [sys.executable, "-m", "isoexec.bench.train", "--step", comp, "--device", device] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the {comp} trainer-step process exited {proc.returncode}: {tail}")
    return json.loads(lines[-1][len(_RESULT):])


def bench_train_model(device: str, quick: bool, log=print) -> tuple[list[dict], dict]:
    """The whole trainer step (forward with autograd, token logprobs, backward to every parameter),
    timed and profiled under each composition, each in a fresh process, in alternating order over
    rounds (two on a GPU); the row's time is the median over rounds, and ``rounds_ms`` keeps each."""
    name, T, seqs, _ = _model_steps(device, quick)
    rounds = 1 if quick else 2
    times: dict[str, list[float]] = {"native": [], "isoexec": []}
    profiles = {}
    for r in range(rounds):
        for comp in (("native", "isoexec") if r % 2 == 0 else ("isoexec", "native")):
            res = _fresh_process(comp, device, quick)
            times[comp].append(res["ms"])
            profiles[comp] = res["profile"]
            p = res["profile"]
            log(f"round {r} {comp}: {res['ms']:.1f} ms; profile: host {p['host_ms']:.1f} ms, wall {p['wall_ms']:.1f} ms"
                + (f", device {p['device_ms']:.1f} ms in {p['kernel_launches']} launches" if p["device_ms"] is not None else ""))
            for k in p["top"][:5]:
                log(f"    {k['total_ms']:9.3f} ms  x{k['calls']:<6} {k['name'][:90]}")
    r = row({"stage": "model.trainer_step", "pass": "fwd+bwd", "model": name, "T": T, "seqs": seqs},
            "native_composition", statistics.median(times["native"]), statistics.median(times["isoexec"]))
    r["rounds_ms"] = {c: [round(t, 6) for t in v] for c, v in times.items()}
    r["timing"] = "one fresh process per composition and round, alternating order"
    print_rows([r], ["stage", "model", "T"], log)
    return [r], {"model": name, "T": T, "compositions": profiles}


def bench_train(device: str, quick: bool = False, log=print) -> tuple[list[dict], dict]:
    """(rows, extra): the region rows and the whole-step row, and ``{"profile": ...}``."""
    rows = bench_train_regions(device, quick, log)
    model_rows, prof = bench_train_model(device, quick, log)
    return rows + model_rows, {"profile": prof}


def _main(argv=None) -> int:
    """One composition's trainer step in this process (the worker of :func:`_fresh_process`)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m isoexec.bench.train")
    ap.add_argument("--step", choices=["native", "isoexec"], required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    print(_RESULT + json.dumps(_time_and_profile(a.step, a.device, a.quick)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
