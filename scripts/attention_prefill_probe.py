"""Where the trainer's varlen attention forward loses time on short sequences (H200 probe).

`isoexec bench attention` measured the varlen prefill at 32 x 512 tokens (16 q / 8 kv heads,
head dim 128) at 0.60x SDPA flash while 8 x 2048 ran at 1.16x. This probe separates the causes
for each shape: eager time (what the bench measures), the kernel's device time alone (torch
profiler), the time replayed from a CUDA graph (no host launch cost), and the same kernel with
pointer loads instead of in-kernel TMA descriptors (each program builds two descriptors; at
32 x 512 there are 4,096 programs with about 4 key blocks each). It also checks that the pointer
and TMA variants give the same bits. Usage on the GPU machine:

    python3 scripts/attention_prefill_probe.py --out $OUT/attention_prefill_probe.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from isoexec.bench.common import graph_time_ms, time_ms
from isoexec.envinfo import env_info
from isoexec_kernels.attention import varlen_attention
from isoexec_kernels.attention import triton_kernels as tk


def kernel_ms(fn, calls: int = 20) -> dict:
    """Device milliseconds per call of each kernel of ``fn`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dev > 0 and e.count >= calls:
            out[e.key[:60]] = round(dev / calls / 1000, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:6])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    hq, hkv, d = 16, 8, 128
    scale = d ** -0.5
    rows = []
    for b, s in ((32, 512), (8, 512), (8, 2048)):
        g = torch.Generator(device="cuda").manual_seed(5)
        q = torch.randn(b * s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(b * s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b * s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")

        def sdpa():
            with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(
                    q.view(b, s, hq, d).transpose(1, 2), k.view(b, s, hkv, d).transpose(1, 2),
                    v.view(b, s, hkv, d).transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True)

        def ours():
            return varlen_attention(q, k, v, cu, s, scale)

        # the launcher with the packed K/V as a one-page-per-sequence cache, pointer loads
        t, _, _ = k.shape
        k_pages = k.as_strided((t, 1, hkv, d), (k.stride(0), k.stride(0), k.stride(1), 1))
        v_pages = v.as_strided((t, 1, hkv, d), (v.stride(0), v.stride(0), v.stride(1), 1))
        bt = cu[:-1].reshape(-1, 1).contiguous()
        lens = (cu[1:] - cu[:-1]).contiguous()

        def ours_launch(kv_tma):
            return lambda: tk._launch(q, k_pages, v_pages, bt, cu, lens, scale, s, True,
                                      tk.VARLEN_PAGE_SIZE, kv_tma=kv_tma)[0]

        with torch.no_grad():
            same = int((ours_launch(True)().view(torch.int16) != ours_launch(False)().view(torch.int16)).sum())
            same_api = int((ours_launch(True)().view(torch.int16) != ours().view(torch.int16)).sum())
            r = {"batch": b, "seqlen": s,
                 "sdpa_eager_ms": time_ms(sdpa, "cuda"), "ours_eager_ms": time_ms(ours, "cuda"),
                 "sdpa_graph_ms": graph_time_ms(sdpa), "ours_graph_ms": graph_time_ms(ours),
                 "ours_launch_tma_graph_ms": graph_time_ms(ours_launch(True)),
                 "ours_launch_pointer_graph_ms": graph_time_ms(ours_launch(False)),
                 "tma_vs_pointer_differ": same, "launch_vs_api_differ": same_api,
                 "ours_kernels_ms": kernel_ms(ours), "sdpa_kernels_ms": kernel_ms(sdpa)}
        r["eager_ratio"] = round(r["sdpa_eager_ms"] / r["ours_eager_ms"], 4)
        r["graph_ratio"] = round(r["sdpa_graph_ms"] / r["ours_graph_ms"], 4)
        r["pointer_graph_ratio"] = round(r["sdpa_graph_ms"] / r["ours_launch_pointer_graph_ms"], 4)
        print(json.dumps(r), flush=True)
        rows.append(r)
    with open(args.out, "w") as f:
        json.dump({"name": "attention_prefill_probe", "env": env_info("sm90"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
