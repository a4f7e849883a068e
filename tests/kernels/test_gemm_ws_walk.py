"""Gates for the warp-specialised Gluon K-leaf walk (isoexec_kernels/gemm/gluon_ws_walk.py): on an
sm_90 GPU its bits equal the Triton walk's (``gemm.linear(..., leaves=L)``) and ``linear`` routes
large batches of several leaves to it; on any machine the module imports, and with Gluon installed
the kernel compiles for sm_90 without a GPU, within shared memory, without spilling, and with
register asks the register file can meet (an ask it cannot meet waits forever)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from isoexec_kernels import gemm
from isoexec_kernels.gemm import gluon_ws_walk as ws


def test_module_says_unsupported_on_cpu_and_every_ring_depth_it_allows_fits():
    assert ws.gluon_ws_walk_supported(torch.device("cpu")) is False
    assert ws.gluon_ws_walk_supported("cpu") is False
    assert [s for s in range(2, 10) if ws.shared_memory_bytes(s) <= ws.SHARED_MEMORY_LIMIT] == [2, 3, 4, 5, 6]


def test_module_imports_without_triton():
    # a fresh interpreter in which importing triton fails: the module still imports and says no
    code = ("import sys; sys.modules['triton'] = None\n"
            "from isoexec_kernels.gemm import gluon_ws_walk as m\n"
            "assert not m.HAS_GLUON and not m.gluon_ws_walk_supported('cpu')\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_register_plan_leaves_the_pool_enough_for_every_ask():
    launch, second = ws.register_budget()
    # three warpgroups launched at `launch` a thread; the asks after reallocation: Gluon's default
    # partition 256, the second MMA warpgroup `second`, the producer PRODUCER_REGS
    assert 256 + second + ws.PRODUCER_REGS <= 3 * launch
    assert 3 * 128 * launch <= ws.REGISTER_FILE
    assert second >= 2 * 64 + 64   # the leaf and the sum (64 each) and room for the loop


def _cuobjdump():
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("triton's bundled cuobjdump is missing")
    return str(tool)


@pytest.mark.skipif(not ws.HAS_GLUON, reason="needs triton's Gluon")
@pytest.mark.parametrize("leaves,stages", [(4, 6), (4, 5), (1, 4)])
def test_kernel_compiles_for_sm90_within_shared_memory_without_spills_and_meetable_register_asks(
        tmp_path, leaves, stages):
    c = ws.compile_sm90(leaves, stages=stages, has_bias=True, has_res=True)   # the most registers
    assert c.metadata.shared <= ws.SHARED_MEMORY_LIMIT
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(c.asm["cubin"])
    tool = _cuobjdump()
    usage = subprocess.run([tool, "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage          # nothing spilled
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    asks = {int(v, 16) for v in re.findall(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, (0x[0-9a-f]+)", sass)}
    gives = {int(v, 16) for v in re.findall(r"USETMAXREG\.DEALLOC\.CTAPOOL (0x[0-9a-f]+)", sass)}
    launch, second = ws.register_budget()
    # the plan register_budget assumes: the default partition asks 256, the second MMA warpgroup
    # `second`, the producer gives back down to PRODUCER_REGS (if Gluon changes how it asks, the
    # budget must be worked out again)
    assert max(asks) == 256 and second in asks and ws.PRODUCER_REGS in gives, (asks, gives)
    assert "HGMMA.64x128x16.F32.BF16" in sass


def test_ws_walk_is_chosen_only_for_several_leaves_bf16_large_m_on_sm90():
    from isoexec_kernels.gemm.triton_kernels import ws_walk_for

    assert ws_walk_for(8192, 4096, 4096, 4, torch.bfloat16, torch.device("cpu")) is None    # no sm_90 here
    cuda = torch.device("cuda")
    for args in ((8192, 4096, 4096, 1, torch.bfloat16), (8192, 4096, 4096, 4, torch.float32),
                 (1023, 4096, 4096, 4, torch.bfloat16), (1024, 1024, 2048, 4, torch.bfloat16),
                 (8192, 1020, 2048, 4, torch.bfloat16)):      # N * 2 not a multiple of 16 (TMA)
        assert ws_walk_for(*args, cuda) is None, args
    if ws.gluon_ws_walk_supported(cuda):
        assert ws_walk_for(8192, 4096, 4096, 4, torch.bfloat16, cuda) == {"stages": 5}
        assert ws_walk_for(1024, 4096, 4096, 4, torch.bfloat16, cuda) == {"stages": 5}
        assert ws_walk_for(1025, 1024, 2048, 4, torch.bfloat16, cuda) == {"stages": 6}


# --------------------------------------------------------------------------- CUDA (sm_90)


def _sm90():
    if not ws.gluon_ws_walk_supported(torch.device("cuda")):
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
@pytest.mark.parametrize("M,N,K", [(256, 1024, 2048), (1000, 1000, 3072), (2048, 4096, 4096), (129, 520, 2080),
                                   (77, 136, 4160)])
@pytest.mark.parametrize("leaves", [1, 4])
def test_ws_walk_equals_triton_walk_bitwise(kb, M, N, K, leaves):
    _sm90()
    x, w, g = _inputs(M, N, K, 71)
    b = torch.randn(N, generator=g).bfloat16().cuda()
    r = torch.randn(M, N, generator=g).bfloat16().cuda()
    for stages in (4, 5, 6):
        tag = f"M={M} N={N} K={K} leaves={leaves} stages={stages}"
        kb.assert_bitwise(ws.linear_ws_walk_gluon(x, w, leaves, stages=stages), gemm.linear(x, w, leaves=leaves), tag)
        kb.assert_bitwise(ws.linear_ws_walk_gluon(x, w, leaves, bias=b, residual=r, stages=stages),
                          gemm.linear(x, w, b, leaves=leaves, residual=r), tag + " bias, residual")


@pytest.mark.gpu
def test_ws_walk_rows_do_not_depend_on_the_batch(kb):
    # a row alone and in batches of every tile edge: the walk is one schedule per element
    _sm90()
    x, w, _ = _inputs(300, 1024, 3072, 72)
    alone = ws.linear_ws_walk_gluon(x[7:8], w, 4)
    for m in (9, 64, 65, 128, 129, 300):
        kb.assert_bitwise(ws.linear_ws_walk_gluon(x[:m], w, 4)[7:8], alone, f"M={m}")


@pytest.mark.gpu
def test_linear_routes_large_batches_of_several_leaves_to_the_ws_walk_with_the_triton_bits(kb):
    _sm90()
    x, w, g = _inputs(4096, 4096, 4096, 73)
    r = torch.randn(4096, 4096, generator=g).bfloat16().cuda()
    got = gemm.linear(x, w, leaves=4, residual=r)                        # routed (ws_walk_for)
    want = gemm.linear_triton(x, w, impl="tma", leaves=4, residual=r)   # the Triton walk, forced
    kb.assert_bitwise(got, want, "linear(leaves=4) at M=4096")


@pytest.mark.gpu
def test_ws_walk_replays_from_a_cuda_graph_bitwise(kb):
    # the engine replays its decode and prefill steps from CUDA graphs
    _sm90()
    x, w, _ = _inputs(2048, 1024, 3072, 74)
    want = ws.linear_ws_walk_gluon(x, w, 4)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ws.linear_ws_walk_gluon(static, w, 4)
    graph.replay()
    torch.cuda.synchronize()
    kb.assert_bitwise(out, want, "graph replay")
