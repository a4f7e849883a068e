"""The engine under tensor parallelism against one process, on N ranks (the 2-GPU run's gate).

    torchrun --nproc_per_node=2 scripts/tp_engine_check.py --out tp_engine.json            # GPUs: NCCL
    torchrun --nproc_per_node=2 scripts/tp_engine_check.py --device cpu --out x.json       # CPU: gloo

Every rank builds the same random model (``--model``, default Qwen3-0.6B dimensions on a GPU and
``dense_tp_tiny`` on the CPU) under a contract that claims the world's tp (``--composition``,
default ``isoexec_tp4``: K_LEAVES = 4 on o_proj and down_proj, tp 1/2/4), and on its own device:

1. **trainer logits**: ``TensorParallelDense`` over the whole world, ``trainer_score`` logits of a
   packed batch, each rank's vocabulary slice against those columns of the one-process model's;
2. **engine**: ``Engine`` on the rank's shards serving random requests (prompts 1-300 tokens,
   greedy / top-p / top-k, seeded; chunked prefill, CUDA graphs on a GPU, decode lookahead) against
   the one-process engine on the whole model (tokens, finish reasons, logprob bits), and
   generate-then-verify: the one-process trainer recomputes every token the TP engine served;
3. **negative control**: the same TP engine with each rank's row-parallel partial all-reduced (the
   stock path), whose logprobs should differ;
4. **throughput**: generated tokens per second of the TP engine and of the one-process engine.

Rank 0 writes one JSON (device, versions, commit, every count) and prints a summary; the exit code
is 0 when every IsoExec comparison has 0 differing elements (the control may agree by chance on a
small model: it is reported, not required). ``tests/dist/test_tp_engine_check_script.py`` runs it
on two gloo ranks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    from isoexec.gates.compare import compare_bits

    return compare_bits(a.cpu(), b.cpu()).differing


def _requests(vocab: int, n: int, max_prompt: int, max_tokens: int, seed: int):
    from isoexec.engine import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (int(torch.randint(1, max_prompt + 1, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(n)]
    params = [SamplingParams(temperature=[0.0, 1.0, 0.7][i % 3], top_p=[1.0, 0.9, 1.0][i % 3],
                             top_k=[0, 0, 20][i % 3], seed=seed * 1000 + i,
                             max_tokens=int(torch.randint(max_tokens // 2, max_tokens + 1, (1,), generator=g)))
              for i in range(n)]
    return prompts, params


def _serve(model, contract, engine_cfg, prompts, params, device):
    from isoexec.engine import Engine

    engine = Engine(model, contract, engine_cfg, trainer_contract=contract)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return results, {"seconds": round(seconds, 4), "tokens": sum(len(r.ids) for r in results),
                     "tok_s": round(sum(len(r.ids) for r in results) / seconds, 1), "steps": engine.num_steps,
                     "preemptions": engine.scheduler.num_preemptions, "graph_replays": engine.runner.graph_replays}


def _compare(want, got) -> dict:
    out = {"requests": len(want), "token_mismatches": 0, "logprobs_compared": 0, "logprobs_differing": 0}
    for x, y in zip(want, got, strict=True):
        if (x.ids, x.finish_reason) != (y.ids, y.finish_reason):
            out["token_mismatches"] += 1
            continue
        out["logprobs_compared"] += x.logprobs.numel()
        out["logprobs_differing"] += _differing(x.logprobs, y.logprobs)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="model config (default: dense_qwen3_0p6b on cuda, dense_tp_tiny on cpu)")
    ap.add_argument("--composition", default="isoexec_tp4")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: bfloat16 on cuda")
    ap.add_argument("--requests", type=int, default=None, help="default: 64 on cuda, 8 on cpu")
    ap.add_argument("--max-prompt", type=int, default=None, help="default: 300 on cuda, 40 on cpu")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: 128 on cuda, 10 on cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    model_name = a.model or ("dense_qwen3_0p6b" if cuda else "dense_tp_tiny")
    dtype = getattr(torch, a.dtype or ("bfloat16" if cuda else "float32"))
    n_req, max_prompt, max_tokens = (a.requests or (64 if cuda else 8), a.max_prompt or (300 if cuda else 40),
                                     a.max_tokens or (128 if cuda else 10))

    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    tp, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    from isoexec.compose import build_contract, load_model_config
    from isoexec.engine import EngineConfig
    from isoexec.envinfo import env_info, runtime_arch
    from isoexec.gates.engine_gates import verify_engine_logprobs
    from isoexec.model import DenseConfig, DenseModel, ForwardBatch, tp_dense

    arch = runtime_arch() if cuda else "cpu"
    contract = build_contract("dense", a.composition, arch, model_name)
    cfg = DenseConfig.from_hf(load_model_config(model_name)["hf_config"])

    def whole_model():
        m = DenseModel(cfg, dtype=dtype, device=device)
        m.init_random(a.seed)
        m.install(contract)
        return m

    model = whole_model()
    res: dict = {"model": model_name, "composition": a.composition, "dtype": str(dtype).replace("torch.", ""),
                 "tp": tp, "backend": dist.get_backend(), "env": env_info(arch)}
    t_start = time.perf_counter()

    # 1. trainer logits: the rank's vocabulary slice of the one-process logits
    tpm = tp_dense.TensorParallelDense(model, None)
    lens = [37, 5, 64, 1] if not cuda else [512, 200, 33, 1]
    g = torch.Generator().manual_seed(a.seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=g).to(device)
    batch = ForwardBatch.packed(lens, "trainer_score", device)
    with torch.no_grad():
        one = model.logits(model.hidden_states(ids, batch), "trainer_score")
        part = tpm.logits(tpm.hidden_states(ids, batch), "trainer_score")
    v0, v1 = tpm.vocab_range
    res["trainer_logits"] = {"compared": part.numel(), "differing": _differing(part, one[:, v0:v1])}
    del one, part

    # 2. the engine on the shards vs the one-process engine
    engine_cfg = EngineConfig(max_num_batched_tokens=512 if cuda else 32, max_num_seqs=min(n_req, 64),
                              num_pages=4096 if cuda else 64, chunk_align=64 if cuda else 16, cuda_graphs=cuda)
    prompts, params = _requests(cfg.vocab_size, n_req, max_prompt, max_tokens, a.seed + 2)
    want, t_one = _serve(model, contract, engine_cfg, prompts, params, device)
    got, t_tp = _serve(tpm, contract, engine_cfg, prompts, params, device)
    res["engine"] = _compare(want, got)
    rep = verify_engine_logprobs(model, got)
    res["generate_then_verify"] = {"compared": rep.compared, "differing": rep.differing}
    res["throughput"] = {"one_process": t_one, f"tp{tp}": t_tp}

    # 3. negative control: the stock all-reduce of each rank's row-parallel partial, chosen as every
    # run chooses it, by the contract (the gates' control contract: no K_LEAVES pinned there)
    from isoexec.gates.topology_gates import all_reduce_control, under_contract

    control = all_reduce_control(contract)
    ctrl_tpm = tp_dense.TensorParallelDense(under_contract(model, control), None)
    ctrl, _ = _serve(ctrl_tpm, control, EngineConfig(**{**engine_cfg.__dict__, "cuda_graphs": False}),
                     prompts, params, device)   # eager, as the committed H200 control ran
    del ctrl_tpm
    res["negative_control_all_reduce"] = _compare(want, ctrl)
    res["seconds"] = round(time.perf_counter() - t_start, 1)

    ok = (res["trainer_logits"]["differing"] == 0 and res["engine"]["token_mismatches"] == 0
          and res["engine"]["logprobs_differing"] == 0 and res["generate_then_verify"]["differing"] == 0)
    res["passed"] = ok
    every = [None] * tp
    dist.all_gather_object(every, {k: res[k] for k in ("trainer_logits", "engine", "generate_then_verify", "passed")})
    res["ranks"] = every
    passed = all(r["passed"] for r in every)
    if rank == 0:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        print(f"tp={tp} ({res['backend']}, {model_name}, {res['dtype']}): trainer logits differing "
              f"{res['trainer_logits']['differing']}/{res['trainer_logits']['compared']}; engine token mismatches "
              f"{res['engine']['token_mismatches']}/{n_req}, logprobs differing {res['engine']['logprobs_differing']}/"
              f"{res['engine']['logprobs_compared']}; generate-then-verify {rep.differing}/{rep.compared}; "
              f"all-reduce control: {res['negative_control_all_reduce']['token_mismatches']} token mismatches, "
              f"{res['negative_control_all_reduce']['logprobs_differing']} logprobs differ; "
              f"{t_tp['tok_s']} tok/s at tp={tp} vs {t_one['tok_s']} in one process; "
              + ("PASSED on every rank" if passed else "FAILED"), flush=True)
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
