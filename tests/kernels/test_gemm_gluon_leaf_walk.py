"""Gates for the Gluon K-leaf walk (isoexec_kernels/gemm/gluon_leaf_walk.py): on an sm_90 GPU its
bits equal the Triton walk's (``gemm.linear(..., leaves=L)``); on any machine the module imports,
and with Gluon installed the kernel compiles for sm_90 without a GPU, within shared memory and
without spilling registers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from isoexec_kernels import gemm
from isoexec_kernels.gemm import gluon_leaf_walk as glw


def test_module_imports_and_says_unsupported_on_cpu():
    assert glw.gluon_leaf_walk_supported(torch.device("cpu")) is False
    assert glw.gluon_leaf_walk_supported("cpu") is False
    for block_k, stages in glw.VARIANTS:
        assert glw.shared_memory_bytes(block_k, stages) <= glw.SHARED_MEMORY_LIMIT


def test_no_load_starts_past_k():
    # a load wholly past K happens only with narrow loads and a short last block
    assert [K for K in range(8, 257, 8) if glw.whole_loads_past_k(K, 32)] == [8, 16, 24, 32, 72, 80, 88, 96,
                                                                           136, 144, 152, 160, 200, 208, 216, 224]
    assert not any(glw.whole_loads_past_k(K, 64) for K in range(8, 257, 8))
    assert glw.whole_loads_past_k(2096, 16) and not glw.whole_loads_past_k(2104, 16)


def test_module_imports_without_triton():
    # a fresh interpreter in which importing triton fails: the module still imports and says no
    code = ("import sys; sys.modules['triton'] = None\n"
            "from isoexec_kernels.gemm import gluon_leaf_walk as m\n"
            "assert not m.HAS_GLUON and not m.gluon_leaf_walk_supported('cpu')\n")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def _ptxas_usage(ptx: str, tmp_path) -> dict:
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("triton's bundled ptxas is missing")
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    res = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True)
    import re

    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", res.stderr)]
    return {"registers": regs, "spill_bytes": sum(spills)}


@pytest.mark.skipif(not glw.HAS_GLUON, reason="needs triton's Gluon")
@pytest.mark.parametrize("block_k,stages", [(32, 4)])
@pytest.mark.parametrize("leaves", [1, 4])
def test_kernel_compiles_for_sm90_within_shared_memory_without_spills(tmp_path, block_k, stages, leaves):
    # the default variant with bias and residual (the most registers); scripts/gluon_leaf_walk_probe.py
    # reports every variant's usage
    c = glw.compile_sm90(leaves, block_k, stages, has_bias=True, has_res=True)
    assert c.metadata.shared <= glw.SHARED_MEMORY_LIMIT
    usage = _ptxas_usage(c.asm["ptx"], tmp_path)
    assert usage["spill_bytes"] == 0, usage
    assert "wgmma.mma_async" in c.asm["ptx"]


# --------------------------------------------------------------------------- CUDA (sm_90)


def _sm90():
    if not glw.gluon_leaf_walk_supported(torch.device("cuda")):
        pytest.skip("needs an sm_90 GPU and Gluon")


def _inputs(M, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16()
    # a zero row of x against a row of w whose entries are all negative: every product is -0, so
    # the sign of that output zero shows how each leaf's accumulator starts
    x[min(3, M - 1)] = 0
    w[min(5, N - 1)] = -w[min(5, N - 1)].abs() - 0.01
    return x.cuda(), w.cuda(), g


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(256, 1024, 2048), (1000, 1000, 3072), (2048, 4096, 4096), (129, 520, 2080)])
@pytest.mark.parametrize("leaves", [1, 4])
def test_gluon_leaf_walk_equals_triton_walk_bitwise(kb, M, N, K, leaves):
    _sm90()
    x, w, g = _inputs(M, N, K, 71)
    b = torch.randn(N, generator=g).bfloat16().cuda()
    r = torch.randn(M, N, generator=g).bfloat16().cuda()
    for block_k, stages in glw.VARIANTS:
        tag = f"M={M} N={N} K={K} leaves={leaves} block_k={block_k}"
        kb.assert_bitwise(glw.linear_leaf_walk_gluon(x, w, leaves, block_k=block_k, stages=stages),
                          gemm.linear(x, w, leaves=leaves), tag)
        kb.assert_bitwise(glw.linear_leaf_walk_gluon(x, w, leaves, bias=b, residual=r, block_k=block_k,
                                                     stages=stages),
                          gemm.linear(x, w, b, leaves=leaves, residual=r), tag + " bias, residual")


@pytest.mark.gpu
def test_gluon_leaf_walk_rows_do_not_depend_on_the_batch(kb):
    # a row alone and in batches of every tile edge: the walk is one schedule per element
    _sm90()
    x, w, _ = _inputs(300, 1024, 3072, 72)
    alone = glw.linear_leaf_walk_gluon(x[7:8], w, 4)
    for m in (9, 128, 129, 300):
        kb.assert_bitwise(glw.linear_leaf_walk_gluon(x[:m], w, 4)[7:8], alone, f"M={m}")


def test_gluon_walk_is_chosen_only_for_several_leaves_bf16_large_m_on_sm90():
    from isoexec_kernels.gemm.triton_kernels import gluon_walk_for

    cpu = torch.device("cpu")
    assert gluon_walk_for(8192, 4096, 4096, 4, torch.bfloat16, cpu) is None          # no sm_90 here
    if glw.gluon_leaf_walk_supported(torch.device("cuda")):
        cuda = torch.device("cuda")
        assert gluon_walk_for(8192, 4096, 4096, 4, torch.bfloat16, cuda) is not None
        assert gluon_walk_for(2048, 4096, 4096, 4, torch.bfloat16, cuda) is not None
        assert gluon_walk_for(2048, 1024, 2048, 4, torch.bfloat16, cuda) is None       # too few 128 x 256 tiles
    for args in ((8192, 4096, 4096, 1, torch.bfloat16), (8192, 4096, 4096, 4, torch.float32),
                 (256, 4096, 4096, 4, torch.bfloat16)):
        assert gluon_walk_for(*args, torch.device("cuda")) is None, args


@pytest.mark.gpu
def test_linear_routes_large_batches_of_several_leaves_to_the_gluon_walk_with_the_triton_bits(kb):
    _sm90()
    x, w, g = _inputs(4096, 4096, 4096, 73)
    r = torch.randn(4096, 4096, generator=g).bfloat16().cuda()
    got = gemm.linear(x, w, leaves=4, residual=r)                    # routed to Gluon (gluon_walk_for)
    want = gemm.linear_triton(x, w, impl="tma", leaves=4, residual=r)   # the Triton walk, forced
    kb.assert_bitwise(got, want, "linear(leaves=4) at M=4096")
