"""scripts/gemm_tile_sweep.py --block-k (a GPU tuning mode) on CPU: the forced BLOCK_K reaches the GEMM
launch and is put back even when a candidate raises (else every later call, and the reference bits,
would run at 128), and every row has a candidate to time at every BLOCK_K."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")   # the launcher computes the grid with triton.cdiv

import isoexec_kernels.gemm.triton_kernels as tk  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("gemm_tile_sweep", ROOT / "scripts" / "gemm_tile_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Launches:
    """Stands in for the pointer kernel: records each launch's BLOCK_K instead of running it."""

    def __init__(self):
        self.block_k = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.block_k.append(kw["BLOCK_K_"])


def test_forced_block_k_reaches_the_launch_and_is_restored_after_an_exception(monkeypatch):
    sweep = _script()
    launches = _Launches()
    monkeypatch.setattr(tk, "_gemm_pointer_kernel", launches)
    x, w = torch.zeros(4, 512), torch.zeros(32, 512)
    pinned = tk.block_k_for
    with pytest.raises(RuntimeError, match="candidate failed"):
        with sweep.forced_block_k(128):
            tk.linear_triton(x, w, impl="pointer")
            raise RuntimeError("candidate failed")
    assert tk.block_k_for is pinned
    tk.linear_triton(x, w, impl="pointer")
    assert launches.block_k == [128, 64]


def test_every_row_has_a_candidate_to_time_at_every_block_k():
    sweep = _script()
    for name, M, K, N in sweep.BLOCK_K_SHAPES:
        tiles = sweep.block_k_tiles(M, N, K)
        assert tiles[0] == tk.tile_for_m(M, torch.bfloat16, N, K) and len(tiles) <= 8, (name, M)
        assert all(K % bk == 0 for bk in sweep.BLOCK_K_SMALL), (name, K)   # no masked last block
        for bk in sweep.BLOCK_K_SMALL if M <= 256 else sweep.BLOCK_K_LARGE:
            cands = [v for c in tiles for v in sweep.stage_variants(c, bk)]
            assert len(cands) == (len(tiles) if bk == 64 else 2 * len(tiles)), (name, M, bk)
            assert any(sweep.smem_floor(v, bk) <= sweep.SMEM_FALLBACK for v in cands), (name, M, bk)
