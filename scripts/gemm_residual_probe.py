"""Why the TMA kernel's residual epilogue failed on the H200 (a probe, GPU only).

The GPU test of ``linear(..., residual=)`` failed at (N, K) = (4096, 1024) at commit 5e63404, when
the TMA kernel added the residual in its own epilogue. For each M bucket that takes the TMA path
and each tile around the table's (warp specialisation on and off, 3 and 4 stages), this runs the
kernel's own epilogue (tile key ``tma_residual``) and prints whether it compiled, and how many
output elements differ from the same launch followed by torch's add.

    python3 scripts/gemm_residual_probe.py > $OUT/gemm_residual_probe.log
"""

from __future__ import annotations

import torch

from isoexec.bits import count_differing
from isoexec_kernels.gemm import linear_triton, tile_for_m


def main() -> None:
    g = torch.Generator().manual_seed(63)
    for N, K in ((4096, 1024), (1024, 3072), (4096, 4096)):
        w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16().cuda()
        for M in (300, 1000, 2048, 10240):
            x = torch.randn(M, K, generator=g).bfloat16().cuda()
            r = torch.randn(M, N, generator=g).bfloat16().cuda()
            table = tile_for_m(M, torch.bfloat16, N, K)
            tiles = [table] + [dict(table, warp_specialize=not table["warp_specialize"])] + [
                dict(path="tma", BLOCK_M=bm, BLOCK_N=bn, num_warps=8, num_stages=s, warp_specialize=False)
                for bm, bn, s in ((128, 128, 4), (128, 256, 3), (128, 256, 2))]
            for t in tiles:
                tile = {k: v for k, v in t.items() if k != "path"}
                want = r + linear_triton(x, w, impl="tma", tile=tile)
                try:
                    got = linear_triton(x, w, impl="tma", tile=dict(tile, tma_residual=True), residual=r)
                    torch.cuda.synchronize()
                    verdict = f"{count_differing(got, want)} of {got.numel()} differ"
                except Exception as exc:  # noqa: BLE001 - the point is to see what fails
                    verdict = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                print(f"N={N} K={K} M={M} {tile['BLOCK_M']}x{tile['BLOCK_N']} w{tile['num_warps']} "
                      f"s{tile['num_stages']} ws={tile.get('warp_specialize')}: {verdict}", flush=True)


if __name__ == "__main__":
    main()
