"""Probe for the MoE grouped GEMMs' launches at training sizes (a tuning tool, GPU only).

``scripts/moe_profile.py --train-m 4096`` shows the experts' forward + backward of one MoE layer
slower than the stock ``torch._grouped_mm`` path (CUTLASS). This times, at GLM-4.7-Flash and
Qwen3.5-35B-A3B layer dimensions with T tokens routed uniformly at random:

  fwd     the grouped GEMM (gate_up with the rows gathered by token, then down) per tile of
          ``triton_kernels.TILES``' form; each candidate must give the pinned tile's bits (the
          forward is the invariant path: a tile that changed bits could not replace it)
  dgrad   the input-gradient launches (the same kernel on the transposed weights)
  wgrad   the weight-gradient kernel per tile of ``WGRAD_TILES``' form (backward only: any
          deterministic tile may serve; error against an fp32 per-expert torch product)
  stock   torch._grouped_mm forward and forward + backward of the same two GEMMs

    python3 scripts/moe_grouped_probe.py [--tokens 4096] [--out probe.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from isoexec.bench.common import time_ms
from isoexec_kernels.activation import silu_and_mul
from isoexec_kernels.moe.reference import dispatch
from isoexec_kernels.moe.triton_kernels import WGRAD_TILES, _grouped, _wgrad, grouped_tile

SHAPES = [("glm47_flash", 64, 1536, 2048, 4), ("qwen35_35b_a3b", 256, 512, 2048, 8)]
FWD_TILES = [
    dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=256, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=4),
    dict(BLOCK_M=256, BLOCK_N=128, num_warps=8, num_stages=3),
]
WGRAD = [
    dict(BLOCK_N=64, BLOCK_KW=64, BLOCK_R=64, num_warps=4, num_stages=3),
    dict(BLOCK_N=128, BLOCK_KW=64, BLOCK_R=64, num_warps=4, num_stages=3),
    dict(BLOCK_N=64, BLOCK_KW=128, BLOCK_R=64, num_warps=4, num_stages=3),
    dict(BLOCK_N=128, BLOCK_KW=128, BLOCK_R=64, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BLOCK_KW=128, BLOCK_R=32, num_warps=8, num_stages=4),
    dict(BLOCK_N=128, BLOCK_KW=128, BLOCK_R=64, num_warps=4, num_stages=3),
    dict(BLOCK_N=128, BLOCK_KW=256, BLOCK_R=64, num_warps=8, num_stages=3),
]


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    T = a.tokens
    res = []

    def log(**r):
        res.append(r)
        print(json.dumps(r), flush=True)

    for name, E, inter, H, k in SHAPES:
        g = torch.Generator().manual_seed(0)
        ids = torch.rand(T, E, generator=g).argsort(-1)[:, :k].sort(-1).values.cuda()
        d = dispatch(ids, E)
        R = T * k
        bf = torch.bfloat16
        x = (torch.randn(T, H, generator=g)).to(bf).cuda()
        gate_up = (torch.randn(E, 2 * inter, H, generator=g) * 0.02).to(bf).cuda()
        down = (torch.randn(E, H, inter, generator=g) * 0.02).to(bf).cuda()
        g_out = torch.randn(R, H, generator=g).to(bf).cuda()
        g_h = torch.randn(R, 2 * inter, generator=g).to(bf).cuda()
        pinned = grouped_tile(R, bf)
        h_pin = _grouped(x, gate_up, d.offsets, d.token, R)
        act = silu_and_mul(h_pin)
        y_pin = _grouped(act, down, d.offsets, None, R)
        for tile in FWD_TILES:
            try:
                h = _grouped(x, gate_up, d.offsets, d.token, R, tile=tile)
                y = _grouped(act, down, d.offsets, None, R, tile=tile)
                same = bool(torch.equal(h.view(torch.int16), h_pin.view(torch.int16))
                            and torch.equal(y.view(torch.int16), y_pin.view(torch.int16)))
                ms_gu = time_ms(lambda: _grouped(x, gate_up, d.offsets, d.token, R, tile=tile), "cuda")
                ms_dn = time_ms(lambda: _grouped(act, down, d.offsets, None, R, tile=tile), "cuda")
                log(shape=name, part="fwd", tile=tile, pinned=tile == pinned, same_bits=same,
                    gate_up_ms=round(ms_gu, 4), down_ms=round(ms_dn, 4))
            except Exception as exc:  # a tile that does not fit (shared memory, registers)
                log(shape=name, part="fwd", tile=tile, error=str(exc).splitlines()[0][:160])
        for tile in FWD_TILES:
            try:
                ms_a = time_ms(lambda: _grouped(g_out, down.transpose(1, 2), d.offsets, None, R, tile=tile), "cuda")
                ms_x = time_ms(lambda: _grouped(g_h, gate_up.transpose(1, 2), d.offsets, None, R, torch.float32,
                                                tile=tile), "cuda")
                log(shape=name, part="dgrad", tile=tile, down_ms=round(ms_a, 4), gate_up_fp32_ms=round(ms_x, 4))
            except Exception as exc:
                log(shape=name, part="dgrad", tile=tile, error=str(exc).splitlines()[0][:160])
        xg = x[d.token]
        offs = d.offsets.tolist()
        want_dn = torch.stack([g_out[offs[e]:offs[e + 1]].float().T @ act[offs[e]:offs[e + 1]].float()
                               for e in range(E)])
        want_gu = torch.stack([g_h[offs[e]:offs[e + 1]].float().T @ xg[offs[e]:offs[e + 1]].float()
                               for e in range(E)])
        for tile in WGRAD:
            try:
                w_dn = _wgrad(g_out, act, d.offsets, None, E, bf, tile=tile)
                w_gu = _wgrad(g_h, x, d.offsets, d.token, E, bf, tile=tile)
                again = _wgrad(g_h, x, d.offsets, d.token, E, bf, tile=tile)
                ms_dn = time_ms(lambda: _wgrad(g_out, act, d.offsets, None, E, bf, tile=tile), "cuda")
                ms_gu = time_ms(lambda: _wgrad(g_h, x, d.offsets, d.token, E, bf, tile=tile), "cuda")
                log(shape=name, part="wgrad", tile=tile, pinned=tile == WGRAD_TILES[bf],
                    err_down=_err(w_dn, want_dn), err_gate_up=_err(w_gu, want_gu),
                    repeat_same=bool(torch.equal(again, w_gu)), down_ms=round(ms_dn, 4), gate_up_ms=round(ms_gu, 4))
            except Exception as exc:
                log(shape=name, part="wgrad", tile=tile, error=str(exc).splitlines()[0][:160])
        # stock: torch._grouped_mm over the expert-sorted rows (transformers' grouped_mm path)
        ends = d.offsets[1:].to(torch.int32)
        wgu_t, wdn_t = gate_up.transpose(1, 2), down.transpose(1, 2)

        def stock_fwd():
            hh = torch._grouped_mm(x[d.token], wgu_t, offs=ends)
            return torch._grouped_mm(act, wdn_t, offs=ends), hh

        wgu_l, wdn_l = wgu_t.detach().requires_grad_(), wdn_t.detach().requires_grad_()
        xs = x.detach().requires_grad_()
        actl = act.detach().requires_grad_()

        def stock_fwd_bwd():
            hh = torch._grouped_mm(xs[d.token], wgu_l, offs=ends)
            yy = torch._grouped_mm(actl, wdn_l, offs=ends)
            torch.autograd.backward([hh, yy], [g_h, g_out])

        log(shape=name, part="stock", fwd_ms=round(time_ms(stock_fwd, "cuda"), 4),
            fwd_bwd_ms=round(time_ms(stock_fwd_bwd, "cuda"), 4))
        del gate_up, down, want_dn, want_gu
        torch.cuda.empty_cache()
    if a.out:
        json.dump({"tokens": T, "rows": res, "device": torch.cuda.get_device_name(0),
                   "torch": torch.__version__}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
