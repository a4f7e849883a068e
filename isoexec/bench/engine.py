"""Engine throughput: output tokens/s of the same engine under the IsoExec and the native
composition, on the same prompts and sampling, plus transformers' ``generate`` on the same
weights as a third reference (docs/benchmarks.md: "engine throughput, IsoExec vs native").

Greedy decoding with ``min == max`` new tokens keeps the work identical across the three (random
weights rarely emit EOS, and EOS is not used as a stop token here).

Two absolute yardsticks besides the ratio:
* **decode roofline**: each batch row also reports the decode-only throughput (the same run with
  one new token gives the prefill time, subtracted) and the HBM roofline of decode at that batch:
  every decode step must read all weights once plus each sequence's KV cache, so
  ``roofline tok/s = batch / ((weight bytes + mean KV bytes per step) / HBM_BYTES_PER_S)``;
  ``decode_roofline_frac`` = decode tok/s / roofline tok/s. The batch rows with CUDA graphs time
  ``GRAPH_REPEATS`` runs on one engine and report the median (every run's ms kept in the row).
* **staggered arrivals**: requests with random prompts (1..300 tokens) and random lengths arrive
  over the steps (``Engine.add_request`` + ``Engine.step``, chunked prefill, top-p sampling), at
  most 64 running; the row reports tok/s and the host's share of each ``Engine.step`` (time until
  the step's launches returned vs until the device finished). With CUDA graphs it runs twice: at
  the engine's default prefill interval (4: prefill chunks join a step after 4 decode-only steps)
  and with prefills admitted on every step (interval 0).
* **decode lookahead** (``EngineConfig.overlap_decode``, the engine's default for both
  compositions): both engines run the batch and staggered workloads once more (on every device;
  with CUDA graphs where the other runs have them) with the next decode step launched before the
  current one's tokens are read (rows with ``overlap_decode: true``: IsoExec with lookahead against
  native with lookahead). Those staggered runs do not synchronise after every step (that would
  undo the overlap), so they report no host share.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch

from ..assembly import installed_model
from ..engine import Engine, EngineConfig, SamplingParams
from ..model.loading import to_hf_state_dict
from .common import row

SIZES = {"cuda": dict(model="dense_qwen3_0p6b", requests=64, prompt_len=256, max_tokens=128),
         "cpu": dict(model="dense_tiny", requests=8, prompt_len=32, max_tokens=16)}
STAGGERED = {"cuda": dict(requests=192, max_prompt=300, min_tokens=16, max_tokens=256, max_num_seqs=64, arrivals=4),
             "cpu": dict(requests=12, max_prompt=40, min_tokens=2, max_tokens=12, max_num_seqs=4, arrivals=2)}
GRAPH_REPEATS = 5
"""Timed runs per batch row with CUDA graphs (the median is reported, every run kept): these rows
are host-bound and a single run moved by up to 25% between runs of one commit."""
HBM_BYTES_PER_S = 4.3e12
"""H200 device-to-device copy bandwidth measured on this workplace's machines (read + write)."""


def _model(name: str, composition: str, device: str, dtype):
    got = installed_model("dense", composition, "cpu" if device == "cpu" else "sm90", name, dtype=dtype,
                          device=device, seed=0)
    return got.model, got.contract, got.hf_config


def _engine_run(model, contract, prompts, max_tokens: int, device: str, graphs: bool,
                overlap: bool = False, repeats: int = 1) -> tuple[float, int, list[float]]:
    """(median ms, tokens, every run's ms) of ``repeats`` timed runs of the batch on one engine,
    after a warm-up run."""
    pages = len(prompts) * (-(-(len(prompts[0]) + max_tokens) // 16)) + 8
    # max_model_len bounds the block-table width the decode graphs are captured with (the native
    # attention gathers that many keys per sequence); the same for both compositions.
    cfg = EngineConfig(max_num_batched_tokens=8192, max_num_seqs=len(prompts), num_pages=pages,
                       max_model_len=len(prompts[0]) + max_tokens + 16, cuda_graphs=graphs and device == "cuda",
                       overlap_decode=overlap)
    engine = Engine(model, contract, cfg, trainer_contract=contract)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engine.generate(prompts[:2], params)            # warm-up: compile kernels, capture graphs
    runs = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        results = engine.generate(prompts, params)
        if device == "cuda":
            torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) * 1000)
    return statistics.median(runs), sum(len(r.ids) for r in results), runs


def decode_roofline_tok_s(model, batch: int, mean_context: float) -> float:
    """HBM roofline of one decode step at ``batch`` sequences of ``mean_context`` tokens: all
    weights read once plus every sequence's K and V for each layer (module docstring)."""
    cfg = model.cfg
    es = model.embed.element_size()
    weight_bytes = sum(p.numel() for p in model.parameters()) * es
    if model.lm_head is None:   # tied: the embedding table is read again as the lm_head
        weight_bytes += model.embed.numel() * es
    kv_bytes = batch * mean_context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * es
    return batch / ((weight_bytes + kv_bytes) / HBM_BYTES_PER_S)


def _staggered_run(model, contract, device: str, graphs: bool, size: dict, vocab: int, seed: int = 0,
                   prefill_interval=None, overlap: bool = False) -> dict:
    """Random-traffic workload (module docstring): tok/s and the host share of Engine.step."""

    rng = random.Random(seed)
    reqs = []
    for i in range(size["requests"]):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, size["max_prompt"]))]
        params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=rng.randint(size["min_tokens"], size["max_tokens"]),
                                seed=seed + i)
        reqs.append((i // size["arrivals"], prompt, params, i))
    max_len = size["max_prompt"] + size["max_tokens"] + 16
    pages = size["max_num_seqs"] * (-(-max_len // 16)) + 8
    cfg = EngineConfig(max_num_batched_tokens=2048, max_num_seqs=size["max_num_seqs"], num_pages=pages,
                       max_model_len=max_len, cuda_graphs=graphs and device == "cuda",
                       prefill_interval=prefill_interval, overlap_decode=overlap)
    engine = Engine(model, contract, cfg, trainer_contract=contract)
    engine.generate([reqs[0][1]], reqs[0][2])      # warm-up: compile kernels, capture graphs
    sync = (torch.cuda.synchronize if device == "cuda" else (lambda: None))
    step_sync = (lambda: None) if overlap else sync  # a sync per step would undo the lookahead
    sync()
    pending = list(reqs)
    tokens = steps = 0
    host = wall = 0.0
    t_start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= steps:
            _, prompt, params, rid = pending.pop(0)
            engine.add_request(prompt, params, 1_000_000 + rid)   # ids apart from the warm-up's
        t0 = time.perf_counter()
        done = engine.step()
        host += time.perf_counter() - t0
        step_sync()
        wall += time.perf_counter() - t0
        tokens += sum(len(r.ids) for r in done)
        steps += 1
    sync()
    total = time.perf_counter() - t_start
    return {"ms": total * 1000, "tokens": tokens, "steps": steps,
            "host_frac": round(host / wall, 3) if wall and not overlap else None,
            "prefill_interval": engine.scheduler.prefill_interval}


def _hf_run(model, cfg: dict, prompts, max_tokens: int, device: str, dtype) -> tuple[float, int]:
    sys.modules.setdefault("fla", None)
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**cfg)
    hf = AutoModelForCausalLM.from_config(hf_cfg).to(device=device, dtype=dtype).eval()
    hf.load_state_dict(to_hf_state_dict(model), strict=True)
    ids = torch.tensor(prompts, device=device)
    kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids[:2], **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate(ids, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000, int((out.shape[1] - ids.shape[1]) * ids.shape[0])


def bench_engine(device: str, quick: bool = False, log=print) -> list[dict]:
    size = SIZES["cpu" if device == "cpu" or quick else "cuda"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    iso, iso_c, cfg = _model(size["model"], "isoexec", device, dtype)
    nat, nat_c, _ = _model(size["model"], "native", device, dtype)
    prompts = torch.randint(0, cfg["vocab_size"], (size["requests"], size["prompt_len"]), generator=gen).tolist()
    shape = {"model": size["model"], "requests": size["requests"], "prompt_len": size["prompt_len"],
             "max_tokens": size["max_tokens"], "dtype": str(dtype).replace("torch.", "")}
    n, mt = size["requests"], size["max_tokens"]
    # the roofline is the H200's HBM bound: meaningless on a CPU
    roofline = decode_roofline_tok_s(iso, n, size["prompt_len"] + mt / 2) if device == "cuda" else None
    rows = []
    variants = [False, True] if device == "cuda" else [False]
    for graphs in variants:
        # the host-bound graph runs move from run to run: the median of GRAPH_REPEATS
        reps = GRAPH_REPEATS if graphs else 1
        ours_ms, ours_tok, ours_runs = _engine_run(iso, iso_c, prompts, mt, device, graphs, repeats=reps)
        nat_ms, nat_tok, nat_runs = _engine_run(nat, nat_c, prompts, mt, device, graphs, repeats=reps)
        # decode only: the same run with one new token is the prefill (and the first token)
        ours_pre, _, _ = _engine_run(iso, iso_c, prompts, 1, device, graphs, repeats=reps)
        nat_pre, _, _ = _engine_run(nat, nat_c, prompts, 1, device, graphs, repeats=reps)
        ours_dec = n * (mt - 1) / max(ours_ms - ours_pre, 1e-9) * 1000
        nat_dec = n * (mt - 1) / max(nat_ms - nat_pre, 1e-9) * 1000
        r = row({**shape, "workload": "batch", "cuda_graphs": graphs, "ours_tok_s": round(ours_tok / ours_ms * 1000, 1),
                 "baseline_tok_s": round(nat_tok / nat_ms * 1000, 1),
                 "ours_decode_tok_s": round(ours_dec, 1), "baseline_decode_tok_s": round(nat_dec, 1),
                 "decode_roofline_tok_s": round(roofline, 1) if roofline else None,
                 "decode_roofline_frac": round(ours_dec / roofline, 4) if roofline else None,
                 "repeats": reps, "ours_ms_runs": [round(t, 2) for t in ours_runs],
                 "baseline_ms_runs": [round(t, 2) for t in nat_runs]},
                "native_engine", nat_ms, ours_ms)
        rows.append(r)
        roof = (f" = {r['decode_roofline_frac']:.1%} of the HBM roofline ({r['decode_roofline_tok_s']} tok/s)"
                if roofline else "")
        log(f"engine isoexec vs native (graphs={graphs}): {r['ours_tok_s']} vs {r['baseline_tok_s']} tok/s, "
            f"ratio {r['speed_ratio']:.3f}; decode only {r['ours_decode_tok_s']} vs {r['baseline_decode_tok_s']} "
            f"tok/s{roof}")
    plain = rows[-1]
    # IsoExec again with decode lookahead (module docstring); prefill is unchanged by it
    reps = GRAPH_REPEATS if variants[-1] else 1
    ov_ms, ov_tok, ov_runs = _engine_run(iso, iso_c, prompts, mt, device, variants[-1], overlap=True, repeats=reps)
    ov_dec = n * (mt - 1) / max(ov_ms - ours_pre, 1e-9) * 1000
    # the native engine with lookahead too (its default as well): the row's baseline
    nov_ms, nov_tok, nov_runs = _engine_run(nat, nat_c, prompts, mt, device, variants[-1], overlap=True, repeats=reps)
    nov_dec = n * (mt - 1) / max(nov_ms - nat_pre, 1e-9) * 1000
    r = row({**shape, "workload": "batch", "cuda_graphs": variants[-1], "overlap_decode": True,
             "ours_tok_s": round(ov_tok / ov_ms * 1000, 1), "baseline_tok_s": round(nov_tok / nov_ms * 1000, 1),
             "ours_decode_tok_s": round(ov_dec, 1), "baseline_decode_tok_s": round(nov_dec, 1),
             "decode_roofline_tok_s": round(roofline, 1) if roofline else None,
             "decode_roofline_frac": round(ov_dec / roofline, 4) if roofline else None,
             "repeats": reps, "ours_ms_runs": [round(t, 2) for t in ov_runs],
             "baseline_ms_runs": [round(t, 2) for t in nov_runs]},
            "native_engine", nov_ms, ov_ms)
    rows.append(r)
    log(f"engine with decode lookahead, isoexec vs native: {r['ours_tok_s']} vs "
        f"{r['baseline_tok_s']} tok/s (graphs={variants[-1]}); decode only {r['ours_decode_tok_s']} vs "
        f"{r['baseline_decode_tok_s']} tok/s"
        + (f" = {r['decode_roofline_frac']:.1%} of the HBM roofline" if roofline else ""))
    hf_ms, hf_tok = _hf_run(iso, cfg, prompts, size["max_tokens"], device, dtype)
    r = row({**shape, "workload": "batch", "cuda_graphs": variants[-1], "ours_tok_s": plain["ours_tok_s"],
             "baseline_tok_s": round(hf_tok / hf_ms * 1000, 1)}, "transformers_generate", hf_ms,
            plain["ours_ms"])
    rows.append(r)
    log(f"engine isoexec vs transformers generate: {r['ours_tok_s']} vs {r['baseline_tok_s']} tok/s, "
        f"ratio {r['speed_ratio']:.3f}")
    st = STAGGERED["cpu" if device == "cpu" or quick else "cuda"]
    # the engine's default prefill interval (4 with CUDA graphs), and prefills admitted every step
    for interval in (None, 0) if variants[-1] else (None,):
        ours = _staggered_run(iso, iso_c, device, variants[-1], st, cfg["vocab_size"], prefill_interval=interval)
        nat_r = _staggered_run(nat, nat_c, device, variants[-1], st, cfg["vocab_size"], prefill_interval=interval)
        r = row({"model": size["model"], "workload": "staggered", "requests": st["requests"],
                 "prompt_len": f"1-{st['max_prompt']}", "max_tokens": f"{st['min_tokens']}-{st['max_tokens']}",
                 "max_num_seqs": st["max_num_seqs"], "dtype": shape["dtype"], "cuda_graphs": variants[-1],
                 "prefill_interval": ours["prefill_interval"],
                 "ours_tok_s": round(ours["tokens"] / ours["ms"] * 1000, 1),
                 "baseline_tok_s": round(nat_r["tokens"] / nat_r["ms"] * 1000, 1), "ours_steps": ours["steps"],
                 "ours_host_frac": ours["host_frac"], "baseline_host_frac": nat_r["host_frac"]},
                "native_engine", nat_r["ms"], ours["ms"])
        rows.append(r)
        log(f"engine staggered arrivals (prefill interval {ours['prefill_interval']}): {r['ours_tok_s']} vs "
            f"{r['baseline_tok_s']} tok/s (native) in {ours['steps']} steps, host share of Engine.step "
            f"{ours['host_frac']} vs {nat_r['host_frac']}")
        ov = _staggered_run(iso, iso_c, device, variants[-1], st, cfg["vocab_size"], prefill_interval=interval,
                            overlap=True)
        nov = _staggered_run(nat, nat_c, device, variants[-1], st, cfg["vocab_size"], prefill_interval=interval,
                             overlap=True)
        r = row({**{k: v for k, v in r.items() if k in ("model", "workload", "requests", "prompt_len",
                                                        "max_tokens", "max_num_seqs", "dtype", "cuda_graphs",
                                                        "prefill_interval")},
                 "overlap_decode": True, "ours_tok_s": round(ov["tokens"] / ov["ms"] * 1000, 1),
                 "baseline_tok_s": round(nov["tokens"] / nov["ms"] * 1000, 1),
                 "ours_steps": ov["steps"]}, "native_engine", nov["ms"], ov["ms"])
        rows.append(r)
        log(f"engine staggered arrivals with decode lookahead (prefill interval {ov['prefill_interval']}): "
            f"{r['ours_tok_s']} vs {r['baseline_tok_s']} tok/s (native, lookahead too) in {ov['steps']} steps")
    return rows
