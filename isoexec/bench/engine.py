"""Engine throughput: output tokens/s of the same engine under the IsoExec and the native
composition, on the same prompts and sampling, plus transformers' ``generate`` on the same
weights as a third reference (BENCHMARKS.md: "engine throughput, IsoExec vs native").

Greedy decoding with ``min == max`` new tokens keeps the work identical across the three (random
weights rarely emit EOS, and EOS is not used as a stop token here).
"""

from __future__ import annotations

import sys
import time

import torch

from .common import row

SIZES = {"cuda": dict(model="dense_qwen3_0p6b", requests=64, prompt_len=256, max_tokens=128),
         "cpu": dict(model="dense_tiny", requests=8, prompt_len=32, max_tokens=16)}


def _model(name: str, composition: str, device: str, dtype):
    from ..compose import build_contract, load_model_config
    from ..model import build_model

    cfg = load_model_config(name)["hf_config"]
    arch = "cpu" if device == "cpu" else "sm90"
    contract = build_contract("dense", composition, arch, model=name)
    m = build_model("dense", cfg, dtype=dtype, device=device).init_random(0)
    m.install(contract)
    return m, contract, cfg


def _engine_run(model, contract, prompts, max_tokens: int, device: str, graphs: bool) -> tuple[float, int]:
    from ..engine import Engine, EngineConfig, SamplingParams

    pages = len(prompts) * (-(-(len(prompts[0]) + max_tokens) // 16)) + 8
    # max_model_len bounds the block-table width the decode graphs are captured with (the native
    # attention gathers that many keys per sequence); the same for both compositions.
    cfg = EngineConfig(max_num_batched_tokens=8192, max_num_seqs=len(prompts), num_pages=pages,
                       max_model_len=len(prompts[0]) + max_tokens + 16, cuda_graphs=graphs and device == "cuda")
    engine = Engine(model, contract, cfg, trainer_contract=contract)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engine.generate(prompts[:2], params)            # warm-up: compile kernels, capture graphs
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000, sum(len(r.ids) for r in results)


def _hf_run(model, cfg: dict, prompts, max_tokens: int, device: str, dtype) -> tuple[float, int]:
    sys.modules.setdefault("fla", None)
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..model.loading import to_hf_state_dict

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
    rows = []
    variants = [False, True] if device == "cuda" else [False]
    for graphs in variants:
        ours_ms, ours_tok = _engine_run(iso, iso_c, prompts, size["max_tokens"], device, graphs)
        nat_ms, nat_tok = _engine_run(nat, nat_c, prompts, size["max_tokens"], device, graphs)
        r = row({**shape, "cuda_graphs": graphs, "ours_tok_s": round(ours_tok / ours_ms * 1000, 1),
                 "baseline_tok_s": round(nat_tok / nat_ms * 1000, 1)}, "native_engine", nat_ms, ours_ms)
        rows.append(r)
        log(f"engine isoexec vs native (graphs={graphs}): {r['ours_tok_s']} vs {r['baseline_tok_s']} tok/s, "
            f"ratio {r['speed_ratio']:.3f}")
    hf_ms, hf_tok = _hf_run(iso, cfg, prompts, size["max_tokens"], device, dtype)
    r = row({**shape, "cuda_graphs": variants[-1], "ours_tok_s": rows[-1]["ours_tok_s"],
             "baseline_tok_s": round(hf_tok / hf_ms * 1000, 1)}, "transformers_generate", hf_ms,
            rows[-1]["ours_ms"])
    rows.append(r)
    log(f"engine isoexec vs transformers generate: {r['ours_tok_s']} vs {r['baseline_tok_s']} tok/s, "
        f"ratio {r['speed_ratio']:.3f}")
    return rows
