"""``isoexec bench train``: where the training step's time goes, ours vs stock, forward + backward.

The H200 DAPO run showed IsoExec's policy-training time at about 3x native while generation and
scoring were at parity or faster. This benchmark splits a training step into its regions at
training shapes (packed tokens of the Qwen3-0.6B dimensions): each projection GEMM, varlen
attention, RMSNorm and the fp32 token logprob over the vocabulary, each timed forward + backward
(``torch.autograd.grad`` with a fixed upstream gradient), plus the whole model's trainer step
(forward with autograd, token logprobs, backward) under the IsoExec and the native composition.
Rows follow BENCHMARKS.md: ``baseline`` is the stock path, ``speed_ratio = baseline_ms / ours_ms``.
"""

from __future__ import annotations

import torch

from .common import print_rows, rotating, row, time_ms

# Qwen3-0.6B projections (K, N) and its attention / vocabulary shapes
_LINEARS = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024),
            "lm_head": (1024, 151936)}
_TINY_LINEARS = {"qkv": (64, 128), "o": (64, 64), "lm_head": (64, 512)}


def _fwd_bwd(fn, inputs: tuple, grad_out: torch.Tensor):
    """One forward + backward of ``fn(*inputs)`` w.r.t. every input that requires grad."""
    def run():
        out = fn(*inputs)
        torch.autograd.grad(out, [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad], grad_out)
    return run


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def bench_train_regions(device: str, quick: bool, log=print) -> list[dict]:
    from isoexec_kernels.attention import varlen_attention
    from isoexec_kernels.attention_native import attention_native_varlen
    from isoexec_kernels.gemm import linear
    from isoexec_kernels.logprob import token_logprobs
    from isoexec_kernels.native import linear_native, rms_norm_native, token_logprobs_native
    from isoexec_kernels.rmsnorm import rms_norm

    big = device == "cuda" and not quick
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    T = 8192 if big else 64
    rows = []

    def timed(stage: str, fields: dict, ours, base):
        r = row({"stage": stage, "pass": "fwd+bwd", **fields}, "torch", time_ms(base, device), time_ms(ours, device))
        rows.append(r)
        print_rows([r], ["stage", "T", "K", "N", "V"], log)

    for name, (K, N) in (_LINEARS if big else _TINY_LINEARS).items():
        x, w = _leaf(torch.randn(T, K, device=device, dtype=dtype)), _leaf(torch.randn(N, K, device=device, dtype=dtype) * 0.02)
        g = torch.randn(T, N, device=device, dtype=dtype)
        timed(f"linear.{name}", {"T": T, "K": K, "N": N}, _fwd_bwd(linear, (x, w), g), _fwd_bwd(linear_native, (x, w), g))

    H = 1024 if big else 64
    x, w = _leaf(torch.randn(T, H, device=device, dtype=dtype)), _leaf(torch.ones(H, device=device, dtype=dtype))
    g = torch.randn(T, H, device=device, dtype=dtype)
    timed("rmsnorm", {"T": T, "K": H}, _fwd_bwd(lambda a, b: rms_norm(a, b, 1e-6), (x, w), g),
          _fwd_bwd(lambda a, b: rms_norm_native(a, b, 1e-6), (x, w), g))

    nh, nkv, hd, seqs = (16, 8, 128, 8) if big else (4, 2, 16, 4)
    lens = [T // seqs] * seqs
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(seqs)], dtype=torch.int32, device=device)
    q = _leaf(torch.randn(T, nh, hd, device=device, dtype=dtype))
    k, v = (_leaf(torch.randn(T, nkv, hd, device=device, dtype=dtype)) for _ in range(2))
    g = torch.randn(T, nh, hd, device=device, dtype=dtype)
    scale = hd ** -0.5
    timed("attention.varlen", {"T": T, "seqs": seqs, "heads": nh, "kv_heads": nkv, "head_dim": hd},
          _fwd_bwd(lambda a, b, c: varlen_attention(a, b, c, cu, max(lens), scale), (q, k, v), g),
          _fwd_bwd(lambda a, b, c: attention_native_varlen(a, b, c, cu, max(lens), scale), (q, k, v), g))

    V = 151936 if big else 512
    Tl = 2048 if big else 64
    nxt = rotating(lambda: (_leaf(torch.randn(Tl, V, device=device, dtype=dtype) * 3),
                            torch.randint(0, V, (Tl,), device=device)), 2)
    g = torch.randn(Tl, device=device, dtype=torch.float32)

    def lp(fn):
        def run():
            logits, tgt = nxt()
            torch.autograd.grad(fn(logits, tgt), [logits], g)
        return run

    timed("logprob", {"T": Tl, "V": V}, lp(token_logprobs), lp(token_logprobs_native))
    return rows


def bench_train_model(device: str, quick: bool, log=print) -> list[dict]:
    """The whole trainer step (forward with autograd, token logprobs, backward to every parameter)."""
    from ..compose import build_contract, load_model_config
    from ..envinfo import runtime_arch
    from ..model import ForwardBatch, build_model

    name = "dense_qwen3_0p6b" if device == "cuda" and not quick else "dense_tiny"
    arch = "cpu" if device == "cpu" else runtime_arch()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = load_model_config(name)["hf_config"]
    lens = [512] * 8 if name == "dense_qwen3_0p6b" else [24] * 3
    T = sum(lens)
    ids = torch.randint(0, cfg["vocab_size"], (T,), device=device)
    targets = torch.roll(ids, -1)
    times = {}
    for comp in ("native", "isoexec"):
        m = build_model("dense", cfg, dtype=dtype, device=device).init_random(0)
        m.install(build_contract("dense", comp, arch, name))
        params = list(m.parameters())
        batch = ForwardBatch.packed(lens, "trainer_fwd", device)

        def step():
            lp = m.token_logprobs(m.hidden_states(ids, batch), targets, "trainer_fwd")
            torch.autograd.grad(lp.sum(), params)

        times[comp] = time_ms(step, device, warmup_ms=200, rep_ms=1000)
        del m, params
    r = row({"stage": "model.trainer_step", "pass": "fwd+bwd", "model": name, "T": T, "seqs": len(lens)},
            "native_composition", times["native"], times["isoexec"])
    print_rows([r], ["stage", "model", "T"], log)
    return [r]


def bench_train(device: str, quick: bool = False, log=print) -> list[dict]:
    return bench_train_regions(device, quick, log) + bench_train_model(device, quick, log)
