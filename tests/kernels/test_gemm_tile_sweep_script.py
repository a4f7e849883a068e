"""scripts/gemm_tile_sweep.py --block-k (a GPU tuning mode) on CPU: a candidate's K tile reaches the
GEMM launch (and only where ``k_tile_for`` allows it), the table's own K tile is dropped from the
candidates, and every row has a candidate to time at every K tile."""

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
    """Stands in for the pointer kernel: records each launch's K tile instead of running it."""

    def __init__(self):
        self.block_k = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.block_k.append(kw["BLOCK_K_"])


def test_a_candidates_k_tile_reaches_the_launch_only_where_k_tile_for_allows_it(monkeypatch):
    sweep = _script()
    launches = _Launches()
    monkeypatch.setattr(tk, "_gemm_pointer_kernel", launches)
    x, w = torch.zeros(4, 512, dtype=torch.float16), torch.zeros(32, 512, dtype=torch.float16)
    row = {"path": "pointer", "BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 4, "BLOCK_K": 128}
    xs = [x]
    sweep._time(row, xs, w, lambda: x, None, 1.0)   # torch.equal on None fails after the launch
    tk.linear_triton(x, w, impl="pointer", tile={"K_TILE": 256})
    tk.linear_triton(x.float(), w.float(), impl="pointer", tile={"K_TILE": 256})   # fp32: BLOCK_K
    tk.linear_triton(x[:, :448], w[:, :448], impl="pointer", tile={"K_TILE": 128})   # 448 % 128: BLOCK_K
    tk.linear_triton(x, w, impl="pointer", tile={"K_TILE": 128}, leaves=2)   # leaves at blocks 0, 4: 128
    tk.linear_triton(x, w, impl="pointer", tile={"K_TILE": 128}, leaves=3)   # blocks 0, 2, 5: BLOCK_K
    x10, w10 = torch.zeros(4, 640, dtype=torch.float16), torch.zeros(32, 640, dtype=torch.float16)
    tk.linear_triton(x10, w10, impl="pointer", tile={"K_TILE": 128}, leaves=4)   # blocks 0, 2, 5, 7: BLOCK_K
    tk.linear_triton(x10, w10, impl="pointer", tile={"K_TILE": 128}, leaves=5)   # blocks 0, 2, 4, 6, 8: 128
    tk.linear_triton(x, w, impl="pointer")   # the table's own K tile
    table = tk.tile_for_m(4, torch.float16, 32, 512)["K_TILE"]
    assert launches.block_k == [128, 256, 64, 64, 128, 64, 64, 128, table]


def test_every_row_has_a_candidate_to_time_at_every_block_k():
    sweep = _script()
    for name, M, K, N in sweep.BLOCK_K_SHAPES + sweep.BLOCK_K_ALL_SHAPES:
        tiles = sweep.block_k_tiles(M, N, K)
        table = {k: v for k, v in tk.tile_for_m(M, torch.bfloat16, N, K).items() if k != "K_TILE"}
        assert tiles[0] == table and len(tiles) <= 8 and all("K_TILE" not in t for t in tiles), (name, M)
        assert all(K % bk == 0 for bk in sweep.BLOCK_K_SMALL), (name, K)   # no masked last block
        for bk in sweep.BLOCK_K_SMALL if M <= 256 else sweep.BLOCK_K_LARGE:
            cands = [v for c in tiles for v in sweep.stage_variants(c, bk)]
            assert len(cands) == (len(tiles) if bk == 64 else 2 * len(tiles)), (name, M, bk)
            assert any(sweep.smem_floor(v, bk) <= sweep.SMEM_FALLBACK for v in cands), (name, M, bk)


def test_rows_selects_named_rows_and_refuses_an_unknown_one_before_any_work():
    sweep = _script()
    rows = sweep.select_rows(sweep.BLOCK_K_ALL_SHAPES, "0.6b.gate_up:256, 8b.down:64")
    assert [(n, m) for n, m, _, _ in rows] == [("0.6b.gate_up", 256), ("8b.down", 64)]
    assert sweep.select_rows(sweep.BLOCK_K_SHAPES, "") == sweep.BLOCK_K_SHAPES
    with pytest.raises(SystemExit, match="no such row 0.6b.gate_up:300"):
        sweep.select_rows(sweep.BLOCK_K_ALL_SHAPES, "0.6b.gate_up:300")
    with pytest.raises(SystemExit, match="expected name:M"):
        sweep.select_rows(sweep.BLOCK_K_ALL_SHAPES, "0.6b.gate_up")
    wide = sweep.block_k_tiles(256, 6144, 1024, wide=True)
    assert len(wide) == len({tuple(sorted(t.items())) for t in wide}) > len(sweep.block_k_tiles(256, 6144, 1024))


def test_rows_select_large_m_rows_and_refuse_unknown_ones():
    sweep = _script()
    large = [(n, m, K, N) for n, K, N in sweep.LARGE_SHAPES for m in sweep.LARGE_M]
    assert sweep.select_rows(large, "0.6b.o:2048") == [("0.6b.o", 2048, 2048, 1024)]
    with pytest.raises(SystemExit, match="no such row 0.6b.o:256"):
        sweep.select_rows(large, "0.6b.o:256")
    # a row filter that names none of a mode's shapes sweeps nothing (and touches no GPU)
    assert sweep.sweep(sweep.LARGE_SHAPES, sweep.LARGE_M, [], print, only={("8b.o", 2048)}) == []
