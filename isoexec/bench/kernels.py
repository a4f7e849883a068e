"""Kernel microbenchmarks: ours vs the stock path, same run, same inputs (docs/benchmarks.md).

- ``gemm``: bf16 ``x[M,K] @ W[N,K]^T`` vs ``torch.nn.functional.linear`` (cuBLAS), M in
  {1, 64, 256, 2048, 4096, 10240}, (K, N) of the dense family at Qwen3-0.6B and Qwen3-8B sizes.
- ``attention``: varlen causal prefill (trainer/prefill kernel) vs SDPA (flash backend) on the
  same equal-length batch; paged decode at context 2k/8k (CUDA-graph timing) vs SDPA with one query
  per sequence on K/V gathered beforehand, and vs the two stock paged paths of the native engine:
  page gather + FlashAttention-2 varlen, and flex_attention over the paged cache (CUDA only).
- ``rmsnorm``: rows x hidden vs the transformers formula in torch.
- ``logprob``: token logprobs over a 151,936 vocabulary vs ``log_softmax`` + ``gather``.
On CPU (no GPU) the same code runs small shapes and reports ratios only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from isoexec_kernels.attention import attention_native_paged_decode, paged_decode_attention, varlen_attention
from isoexec_kernels.attention.flex_paged import flex_paged_decode_compiled
from isoexec_kernels.gemm import linear
from isoexec_kernels.logprob import token_logprobs, token_logprobs_native
from isoexec_kernels.rmsnorm import rms_norm, rms_norm_native

from .common import print_rows, random_paged_kv, rotating, row, time_ms

# (name, K, N): the dense family's projections at Qwen3-0.6B and Qwen3-8B dimensions.
GEMM_SHAPES = [
    ("0.6b.qkv", 1024, 4096), ("0.6b.o", 2048, 1024), ("0.6b.gate_up", 1024, 6144), ("0.6b.down", 3072, 1024),
    ("8b.qkv", 4096, 6144), ("8b.o", 4096, 4096), ("8b.gate_up", 4096, 24576), ("8b.down", 12288, 4096),
    ("lm_head", 1024, 151936),
]
GEMM_M = [1, 64, 256, 2048, 4096, 10240]


def bench_gemm(device: str, quick: bool = False, log=print) -> list[dict]:
    """Ours vs cuBLAS per (shape, M). On CUDA both are timed as CUDA-graph replays (kernel time, as
    the engine's decode graphs and a busy trainer step see it; eager timing of a 10 us kernel
    measures Python launch overhead) and, for reference, eagerly (``eager_*`` fields)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = GEMM_SHAPES if device == "cuda" and not quick else [("tiny.qkv", 64, 128), ("tiny.down", 128, 64)]
    ms = GEMM_M if device == "cuda" and not quick else [1, 64, 256]
    timer = "cuda-graph" if device == "cuda" else device
    rows = []
    for name, k, n in shapes:
        w = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
        for m in ms:
            if name == "lm_head" and m > 4096:
                continue
            nxt = rotating(lambda: (torch.randn(m, k, device=device, dtype=dtype),), 4)
            with torch.no_grad():
                base = time_ms(lambda: F.linear(nxt()[0], w), timer)
                ours = time_ms(lambda: linear(nxt()[0], w), timer)
                extra = {}
                if device == "cuda":
                    extra = {"timing": "cuda_graph",
                             "eager_baseline_ms": round(time_ms(lambda: F.linear(nxt()[0], w), device), 6),
                             "eager_ours_ms": round(time_ms(lambda: linear(nxt()[0], w), device), 6)}
            tflops = 2 * m * n * k / (ours * 1e-3) / 1e12
            r = row({"shape": name, "M": m, "K": k, "N": n, "dtype": str(dtype).replace("torch.", ""),
                     "ours_tflops": round(tflops, 2), **extra}, "cublas" if device == "cuda" else "torch_cpu",
                    base, ours)
            rows.append(r)
            print_rows([r], ["shape", "M", "K", "N"], log)
    return rows


def bench_attention(device: str, quick: bool = False, log=print) -> list[dict] | tuple[list[dict], dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hq, hkv, d = (16, 8, 128) if device == "cuda" else (4, 2, 16)
    scale = d ** -0.5
    rows = []
    prefill = [(8, 2048), (2, 8192), (32, 512)] if device == "cuda" and not quick else [(2, 64)]
    for b, s in prefill:
        def make():
            return (torch.randn(b * s, hq, d, device=device, dtype=dtype),
                    torch.randn(b * s, hkv, d, device=device, dtype=dtype),
                    torch.randn(b * s, hkv, d, device=device, dtype=dtype))
        nxt = rotating(make, 3)
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)

        def sdpa():
            q, k, v = nxt()
            with torch.nn.attention.sdpa_kernel(_flash_backends(device)):
                return F.scaled_dot_product_attention(q.view(b, s, hq, d).transpose(1, 2),
                                                      k.view(b, s, hkv, d).transpose(1, 2),
                                                      v.view(b, s, hkv, d).transpose(1, 2), is_causal=True,
                                                      scale=scale, enable_gqa=True)

        with torch.no_grad():
            base = time_ms(sdpa, device)
            ours = time_ms(lambda: varlen_attention(*nxt(), cu, s, scale), device)
        r = row({"stage": "prefill", "batch": b, "seqlen": s, "heads": hq, "kv_heads": hkv, "head_dim": d},
                "sdpa_flash" if device == "cuda" else "sdpa_cpu", base, ours)
        rows.append(r)
        print_rows([r], ["stage", "batch", "seqlen"], log)
    decode = [(64, 2048), (64, 8192), (256, 2048)] if device == "cuda" and not quick else [(4, 128)]
    page = 16
    timer = "cuda-graph" if device == "cuda" else device
    skipped = []
    for b, ctx in decode:
        kc, vc, bt, lens = random_paged_kv(b, ctx, page, hkv, d, device, dtype)
        kd = kc[bt.long()].reshape(b, ctx, hkv, d).transpose(1, 2).contiguous()
        vd = vc[bt.long()].reshape(b, ctx, hkv, d).transpose(1, 2).contiguous()
        nxt = rotating(lambda: (torch.randn(b, hq, d, device=device, dtype=dtype),), 3)

        def sdpa_dec():
            q = nxt()[0]
            with torch.nn.attention.sdpa_kernel(_flash_backends(device)):
                return F.scaled_dot_product_attention(q[:, :, None], kd, vd, scale=scale, enable_gqa=True)

        # the stock paths over the same paged cache: the native composition's engine decode
        # (torch_sdpa: page gather + FlashAttention-2 varlen) and flex_attention reading the pages
        # in place (torch_flex_decode, flex_paged.py)
        stock = {"sdpa_flash" if device == "cuda" else "sdpa_cpu": (sdpa_dec, None),
                 "native_gather_flash" if device == "cuda" else "native_gather_cpu":
                     (lambda: attention_native_paged_decode(nxt()[0], kc, vc, bt, lens, scale), None)}
        if device == "cuda":
            stock["native_flex"] = (lambda: flex_paged_decode_compiled(nxt()[0], kc, vc, bt, lens, scale), True)
        else:
            skipped.append({"stage": "decode", "batch": b, "context": ctx,
                            "baseline": ["native_flex"],
                            "reason": "flex_attention is a speed baseline only compiled on CUDA; on CPU it runs "
                                      "eagerly, dense over the whole cache (the correctness reference of the tests)"})
        with torch.no_grad():
            q0 = nxt()[0]
            gathered = attention_native_paged_decode(q0, kc, vc, bt, lens, scale).float()
            ours = time_ms(lambda: paged_decode_attention(nxt()[0], kc, vc, bt, lens, scale), timer)
            for name, (fn, is_flex) in stock.items():
                extra = {}
                if is_flex:   # the flex path computes the native function: max |diff| here
                    got = flex_paged_decode_compiled(q0, kc, vc, bt, lens, scale).float()
                    extra = {"max_abs_diff_vs_gather": float((got - gathered).abs().max())}
                shape = {"stage": "decode", "batch": b, "context": ctx, "heads": hq, "kv_heads": hkv, "head_dim": d,
                         "timing": "cuda_graph" if device == "cuda" else "cpu"}
                r = row({**shape, **extra}, name, time_ms(fn, timer), ours)
                rows.append(r)
                print_rows([r], ["stage", "batch", "context"], log)
    return (rows, {"skipped": skipped}) if skipped else rows


def _flash_backends(device: str):
    if device == "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]


def bench_rmsnorm(device: str, quick: bool = False, log=print) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = [(1, 1024), (256, 1024), (4096, 1024), (10240, 1024), (4096, 4096), (10240, 4096)] \
        if device == "cuda" and not quick else [(1, 64), (256, 64)]
    rows = []
    for m, h in shapes:
        w = torch.randn(h, device=device, dtype=dtype)
        nxt = rotating(lambda: (torch.randn(m, h, device=device, dtype=dtype),), 4)
        with torch.no_grad():
            base = time_ms(lambda: rms_norm_native(nxt()[0], w, 1e-6), device)
            ours = time_ms(lambda: rms_norm(nxt()[0], w, 1e-6), device)
        r = row({"M": m, "H": h}, "torch_eager", base, ours)
        rows.append(r)
        print_rows([r], ["M", "H"], log)
    return rows


def bench_logprob(device: str, quick: bool = False, log=print) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = [(1, 151936), (256, 151936), (2048, 151936), (8192, 151936)] if device == "cuda" and not quick \
        else [(1, 1000), (64, 1000)]
    rows = []
    for t, v in shapes:
        nxt = rotating(lambda: (torch.randn(t, v, device=device, dtype=dtype) * 3,
                                torch.randint(0, v, (t,), device=device)), 2)
        with torch.no_grad():
            base = time_ms(lambda: token_logprobs_native(*nxt()), device)
            ours = time_ms(lambda: token_logprobs(*nxt()), device)
        r = row({"T": t, "V": v}, "torch_log_softmax", base, ours)
        rows.append(r)
        print_rows([r], ["T", "V"], log)
    return rows

