"""The K-leaf walk of the linear layer as a warp-specialised Gluon kernel for Hopper (sm_90),
with the running sum and the leaf both in registers.

What it computes: ``out = x @ w.T (+ bias) (+ residual)`` for bf16 x [M, K], w [N, K], with the
rounding schedule of ``api.py`` in this folder for L K leaves, and the bits of the Triton TMA
kernel (``_gemm_tma_persistent_kernel`` in ``triton_kernels.py``) for the same L:

  * K is cut into blocks of 64 columns (the last zero-padded: the TMA descriptor fills columns
    past K with zeros) and the nb = cdiv(K, 64) blocks into L leaves, leaf j holding blocks
    ``[j*nb//L, (j+1)*nb//L)`` (``reference.leaf_bounds``);
  * a leaf is one fp32 accumulator starting at +0 (zeros in registers, every MMA accumulating,
    as the Triton kernels compile) into which the wgmma k16 steps of its blocks are chained in K
    order (what ``tl.dot`` on a 64-column block lowers to);
  * the leaves are summed left to right in fp32, the first taken as it is;
  * the bias (if any) is added in fp32, then one round-to-nearest-even cast to bf16; the residual
    (if any) is added to that in fp32 and rounded once more (torch's add of two bf16 tensors).

Why this kernel: the walk holds two fp32 tiles a program, the sum so far and the leaf. The
Triton walk keeps both in registers at 128 x 128 tiles, and its K loop, written for all eight
warps at once, joins them at a block-wide barrier around every load it issues and drains all
MMAs at each leaf's end. Here the work is split by warps (``gl.warp_specialize``):

  * one producer warp issues the TMA loads of a ring of ``STAGES`` operand buffers, running on
    across leaf and tile ends, and waits only for a buffer to be released;
  * two MMA warpgroups, each a partition of its own that owns 64 rows of the 128 x 128 tile:
    it waits for a buffer, issues its wgmma, and once the step before is done releases that
    step's buffer with one arrive of its own (the release barrier counts one arrive per
    warpgroup). Neither waits for the other: at a leaf's end one warpgroup drains its MMAs and
    adds its leaf while the other's MMAs may run;
  * each warpgroup stores its rows through a bf16 staging tile and a TMA store; the residual
    (if any) arrives in that tile by a TMA load issued at the tile's start.

Registers: a warpgroup holds its 64 x 128 leaf and sum, 128 fp32 registers a thread, within what
``setmaxnreg`` gives it (:func:`register_budget`; the producer runs on 24). Why not 128 x 256:
the leaf and the sum would need 256 registers a thread, the most a thread can have.
Tile shape, ring depth, the producer's run-ahead, persistence and the raster are scheduling:
each output element gets the same sequence of fp32 operations whatever they are.

Runs where Gluon imports and the device has compute capability (9, 0)
(:func:`gluon_ws_walk_supported`); the module imports without triton or a GPU.
"""

from __future__ import annotations

import functools

import torch

from .._triton_util import num_sms
from .reference import BLOCK_K   # the schedule's K block: one TMA load and one wgmma chain a step

try:  # pragma: no cover - depends on the machine
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAS_GLUON = False
    gluon = gl = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None
    fence_async_shared = None


class _Missing:
    """Stand-in for ``gl`` so the kernels' signatures (``X: gl.constexpr``) still evaluate
    without triton; nothing else of it is used then."""

    constexpr = None


if not HAS_GLUON:
    gl = _Missing()


def _jit(fn=None, **kwargs):
    """``gluon.jit`` where Gluon imports; otherwise the plain function, never launched."""
    if fn is None:
        return lambda f: _jit(f, **kwargs)
    return gluon.jit(fn, **kwargs) if HAS_GLUON else fn


WG_ROWS = 64        # rows of the tile one MMA warpgroup owns (wgmma's M)
CONSUMERS = 2       # MMA warpgroups: the tile is 128 x BLOCK_N
BLOCK_N = 128       # a warpgroup's leaf and sum: 2 x 64 fp32 registers a thread
GROUP_M = 8         # the Triton kernel's raster (scheduling only)
SHARED_MEMORY_LIMIT = 232448   # bytes a block may opt in to on sm_90
REGISTER_FILE = 65536          # 32-bit registers of an SM
PRODUCER_REGS = 24             # setmaxnreg's floor: the producer holds indices only


def shared_memory_bytes(stages: int) -> int:
    """Shared memory the kernel allocates: the operand ring, one bf16 output tile per MMA
    warpgroup (the TMA store's staging, and the residual's), the barriers."""
    ring = stages * (CONSUMERS * WG_ROWS + BLOCK_N) * BLOCK_K * 2
    return ring + CONSUMERS * WG_ROWS * BLOCK_N * 2 + (2 * stages + CONSUMERS) * 8


def register_budget() -> tuple[int, int]:
    """(maxnreg at launch, registers the second MMA warpgroup asks for). The launch spreads the
    register file over the three warpgroups (the producer's one warp counts as a whole one), 168
    a thread; the partitions then reallocate from that pool, and an ask the pool cannot meet waits
    forever. Gluon's default partition (the first MMA warpgroup) asks for 256 and the producer
    gives back all but :data:`PRODUCER_REGS`, so the second warpgroup may ask for at most
    3 * 168 - 256 - 24 = 224 (compiled for sm_90: no spills at 224, bias and residual included)."""
    launch = (REGISTER_FILE // (3 * 128)) // 8 * 8
    return launch, (3 * launch - 256 - PRODUCER_REGS) // 8 * 8


@_jit
def _tile_coords(tile, tiles_m, tiles_n, GROUP: gl.constexpr):
    # GROUP_M raster: the Triton kernel's tile order (which tile a program takes never changes
    # an element's arithmetic)
    group_span = GROUP * tiles_n
    first_m = (tile // group_span) * GROUP
    rows_in_group = gl.minimum(tiles_m - first_m, GROUP)
    tm = first_m + tile % rows_in_group
    tn = (tile % group_span) // rows_in_group
    return tm, tn


@_jit
def _producer(x_desc, w_desc, a_bufs, b_bufs, ready, empty, M, N, K,
              CONSUMERS: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
              NUM_PROGRAMS: gl.constexpr):
    BN: gl.constexpr = w_desc.block_type.shape[0]
    WG: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BM: gl.constexpr = WG * CONSUMERS
    pid = gl.program_id(0)
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    my_tiles = gl.cdiv(gl.maximum(tiles_m * tiles_n - pid, 0), NUM_PROGRAMS)
    steps = gl.cdiv(K, BK)
    nbytes: gl.constexpr = CONSUMERS * x_desc.block_type.nbytes + w_desc.block_type.nbytes
    g = 0
    for t in range(my_tiles):
        tm, tn = _tile_coords(pid + t * NUM_PROGRAMS, tiles_m, tiles_n, GROUP)
        for ks in range(steps):
            s = g % STAGES
            # a buffer is free once every consumer released it (barriers start with phase 1
            # complete, so the first lap does not wait)
            mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            for c in gl.static_range(CONSUMERS):
                # rows past M and columns past K come back as zeros
                tma.async_copy_global_to_shared(x_desc, [tm * BM + c * WG, ks * BK], bar,
                                                a_bufs.index(s * CONSUMERS + c))
            tma.async_copy_global_to_shared(w_desc, [tn * BN, ks * BK], bar, b_bufs.index(s))
            g += 1


@_jit
def _consumer(x_desc, w_desc, o_desc, r_desc, a_bufs, b_bufs, o_bufs, ready, empty, res_bars, bias_ptr,
              M, N, K, C: gl.constexpr, CONSUMERS: gl.constexpr, STAGES: gl.constexpr,
              GROUP: gl.constexpr, NUM_PROGRAMS: gl.constexpr, LEAVES: gl.constexpr,
              HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr):
    BN: gl.constexpr = w_desc.block_type.shape[0]
    WG: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BM: gl.constexpr = WG * CONSUMERS
    # one warpgroup (4 warps): wgmma m64nBNk16 per k16 step
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    pid = gl.program_id(0)
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    my_tiles = gl.cdiv(gl.maximum(tiles_m * tiles_n - pid, 0), NUM_PROGRAMS)
    nb = gl.cdiv(K, BK)
    o_buf = o_bufs.index(C)
    res_bar = res_bars.index(C)
    g = 0
    for t in range(my_tiles):
        tm, tn = _tile_coords(pid + t * NUM_PROGRAMS, tiles_m, tiles_n, GROUP)
        row0 = tm * BM + C * WG
        col0 = tn * BN
        # the previous tile's store has read the staging buffer: the residual's tile goes there
        # now, under this tile's MMAs (rows and columns past M / N come back as zeros)
        tma.store_wait(pendings=0)
        if HAS_RES:
            mbarrier.expect(res_bar, r_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(r_desc, [row0, col0], res_bar, o_buf)
        for leaf in gl.static_range(LEAVES):
            k_lo = leaf * nb // LEAVES
            k_hi = (leaf + 1) * nb // LEAVES
            part = gl.zeros([WG, BN], gl.float32, acc_layout)
            for ks in range(k_lo, k_hi):
                s = g % STAGES
                mbarrier.wait(ready.index(s), (g // STAGES) & 1)
                # B = the w tile transposed: a permuted view of the K-contiguous [BN, BK] tile
                part = warpgroup_mma(a_bufs.index(s * CONSUMERS + C), b_bufs.index(s).permute((1, 0)), part,
                                     use_acc=True, is_async=True)
                # the step before is done: release its buffer (not across a leaf's start: the
                # leaf before released its last buffer at its end)
                part = warpgroup_mma_wait(num_outstanding=1, deps=(part, ))
                mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), pred=ks > k_lo)
                g += 1
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES))
            # leaf 0 as it is (not +0 + part: -0 stays -0), later leaves added in order
            if leaf == 0:
                acc = part
            else:
                acc = acc + part
        if HAS_BIAS:
            cols = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
            bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
            acc = acc + gl.expand_dims(bias, 0)
        y = acc.to(o_desc.dtype)
        if HAS_RES:
            # read through shared memory: per-element pointers in the accumulator's layout would
            # spill beside the sum
            mbarrier.wait(res_bar, t & 1)
            r = o_buf.load(acc_layout)
            y = (y.to(gl.float32) + r.to(gl.float32)).to(o_desc.dtype)
            gl.thread_barrier()   # every warp has read the residual before the tile overwrites it
        # rows and columns past M / N are clipped by the TMA store
        o_buf.store(y)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [row0, col0], o_buf)
    tma.store_wait(pendings=0)


@_jit
def _partition(x_desc, w_desc, o_desc, r_desc, a_bufs, b_bufs, o_bufs, ready, empty, res_bars, bias_ptr,
               M, N, K, ROLE: gl.constexpr, CONSUMERS: gl.constexpr, STAGES: gl.constexpr,
               GROUP: gl.constexpr, NUM_PROGRAMS: gl.constexpr, LEAVES: gl.constexpr,
               HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr):
    # one signature for every partition (warp_specialize asks it of the workers): ROLE
    # 0 .. CONSUMERS-1 are the MMA warpgroups, CONSUMERS the producer
    if ROLE == CONSUMERS:
        _producer(x_desc, w_desc, a_bufs, b_bufs, ready, empty, M, N, K, CONSUMERS, STAGES, GROUP,
                  NUM_PROGRAMS)
    else:
        _consumer(x_desc, w_desc, o_desc, r_desc, a_bufs, b_bufs, o_bufs, ready, empty, res_bars, bias_ptr,
                  M, N, K, ROLE, CONSUMERS, STAGES, GROUP, NUM_PROGRAMS, LEAVES,
                  HAS_BIAS, HAS_RES)


# M, N and K only bound loops and masks: not specialising them keeps one compiled kernel for
# every batch size
@_jit(do_not_specialize=["M", "N", "K"])
def _ws_walk_kernel(x_desc, w_desc, o_desc, r_desc, bias_ptr, M, N, K,
                    CONSUMERS: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
                    NUM_PROGRAMS: gl.constexpr, LEAVES: gl.constexpr, HAS_BIAS: gl.constexpr,
                    HAS_RES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS_: gl.constexpr):
    BN: gl.constexpr = w_desc.block_type.shape[0]
    WG: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES * CONSUMERS, WG, BK], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    o_bufs = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS, WG, BN], o_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    res_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)   # one release per MMA warpgroup
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(res_bars.index(i), count=1)
    fence_async_shared()
    # the partitions' arguments written out in each tuple: constexprs passed through a tuple
    # built in the kernel reach the workers as i32 values
    gl.static_assert(CONSUMERS == 2, "two MMA warpgroups (register_budget)")
    gl.warp_specialize([
        (_partition, (x_desc, w_desc, o_desc, r_desc, a_bufs, b_bufs, o_bufs, ready, empty, res_bars, bias_ptr, M,
                      N, K, 0, CONSUMERS, STAGES, GROUP, NUM_PROGRAMS, LEAVES, HAS_BIAS, HAS_RES)),
        (_partition, (x_desc, w_desc, o_desc, r_desc, a_bufs, b_bufs, o_bufs, ready, empty, res_bars, bias_ptr, M,
                      N, K, 1, CONSUMERS, STAGES, GROUP, NUM_PROGRAMS, LEAVES, HAS_BIAS, HAS_RES)),
        (_partition, (x_desc, w_desc, o_desc, r_desc, a_bufs, b_bufs, o_bufs, ready, empty, res_bars, bias_ptr, M,
                      N, K, 2, CONSUMERS, STAGES, GROUP, NUM_PROGRAMS, LEAVES, HAS_BIAS, HAS_RES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS_])


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def gluon_ws_walk_supported(device) -> bool:
    """Whether :func:`linear_ws_walk_gluon` can run on ``device``: Gluon imports and it is a CUDA
    device of compute capability (9, 0) (wgmma and TMA, sm_90 only). Asked on every large
    ``linear`` call: the capability is read once per device."""
    device = torch.device(device)
    if not HAS_GLUON or device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


def _layouts():
    """The NVMMA shared layouts of the x, w and output tiles (TMA boxes, wgmma operands)."""
    return (gl.NVMMASharedLayout.get_default_for([WG_ROWS, BLOCK_K], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([WG_ROWS, BLOCK_N], gl.bfloat16))


def _constexprs(leaves, stages, has_bias, has_res, num_programs, group_m=GROUP_M):
    return dict(CONSUMERS=CONSUMERS, STAGES=stages, GROUP=group_m, NUM_PROGRAMS=num_programs, LEAVES=leaves,
                HAS_BIAS=has_bias, HAS_RES=has_res, CONSUMER_REGS=register_budget()[1],
                PRODUCER_REGS_=PRODUCER_REGS)


def compile_sm90(leaves: int, stages: int = 4, has_bias: bool = True, has_res: bool = True,
                 num_programs: int = 132):
    """The kernel compiled for sm_90 without a GPU (``triton.compile``; ``asm`` holds the ptx and
    cubin), specialised as a launch on 16-byte aligned tensors would be."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    a_l, b_l, o_l = _layouts()
    signature = dict(x_desc=f"tensordesc<bf16[{WG_ROWS}, {BLOCK_K}],{a_l!r}>",
                     w_desc=f"tensordesc<bf16[{BLOCK_N}, {BLOCK_K}],{b_l!r}>",
                     o_desc=f"tensordesc<bf16[{WG_ROWS}, {BLOCK_N}],{o_l!r}>",
                     r_desc=f"tensordesc<bf16[{WG_ROWS}, {BLOCK_N}],{o_l!r}>",
                     bias_ptr="*bf16", M="i32", N="i32", K="i32")
    constexprs = _constexprs(leaves, stages, has_bias, has_res, num_programs)
    signature.update({k: "constexpr" for k in constexprs})
    aligned = {(4, ): [["tt.divisibility", 16]]}
    src = GluonASTSource(_ws_walk_kernel, signature, constexprs, aligned)
    launch_regs = register_budget()[0]
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=launch_regs))


def linear_ws_walk_gluon(x2: torch.Tensor, w: torch.Tensor, leaves: int, bias: torch.Tensor | None = None,
                         residual: torch.Tensor | None = None, stages: int = 4,
                         num_programs: int | None = None, group_m: int = GROUP_M) -> torch.Tensor:
    """``x2 @ w.T (+ bias) (+ residual)`` as [M, N] bf16 with ``leaves`` K leaves: the bits of
    ``linear(x2, w, bias, leaves=leaves, residual=residual)`` (module docstring). x2 [M, K] and
    w [N, K] bf16 with K * 2 and N * 2 multiples of 16 (TMA strides); bias [N]; residual [M, N].
    ``stages`` operand buffers, ``num_programs`` (default one per SM) and ``group_m`` (row tiles
    a raster group walks before the next columns): scheduling only."""
    if not HAS_GLUON:
        raise RuntimeError("linear_ws_walk_gluon needs triton's Gluon (triton >= 3.6)")
    M, K = x2.shape
    N = w.shape[0]
    if x2.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or w.shape[1] != K:
        raise ValueError(f"linear_ws_walk_gluon: bf16 x [M, K] and w [N, K], got {x2.dtype} "
                         f"{tuple(x2.shape)} and {w.dtype} {tuple(w.shape)}")
    if K == 0 or (K * 2) % 16 or (N * 2) % 16:
        raise ValueError(f"linear_ws_walk_gluon: K={K}, N={N}: rows must be non-empty 16-byte multiples (TMA)")
    n_blocks = -(-K // BLOCK_K)
    if not 1 <= leaves <= n_blocks:
        raise ValueError(f"linear_ws_walk_gluon: {leaves} leaves for {n_blocks} K blocks")
    if not 2 <= stages or shared_memory_bytes(stages) > SHARED_MEMORY_LIMIT:
        raise ValueError(f"linear_ws_walk_gluon: {stages} stages do not fit "
                         f"({shared_memory_bytes(stages)} bytes of shared memory)")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"linear_ws_walk_gluon: bias must be [{N}], got {tuple(bias.shape)}")
    out = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    if M == 0 or N == 0:
        return out
    if residual is not None:
        residual = residual.reshape(M, N)
        if residual.stride(1) != 1 or (residual.stride(0) * 2) % 16 or residual.data_ptr() % 16:
            residual = residual.contiguous()   # TMA: unit column stride, 16-byte rows and base
    x2 = x2 if x2.is_contiguous() and x2.data_ptr() % 16 == 0 else x2.contiguous()
    w = w if w.is_contiguous() and w.data_ptr() % 16 == 0 else w.contiguous()
    a_l, b_l, o_l = _layouts()
    x_desc = TensorDescriptor(x2, [M, K], [K, 1], [WG_ROWS, BLOCK_K], a_l)
    w_desc = TensorDescriptor(w, [N, K], [K, 1], [BLOCK_N, BLOCK_K], b_l)
    o_desc = TensorDescriptor(out, [M, N], [N, 1], [WG_ROWS, BLOCK_N], o_l)
    r_desc = o_desc if residual is None else \
        TensorDescriptor(residual, [M, N], [residual.stride(0), 1], [WG_ROWS, BLOCK_N], o_l)
    if num_programs is None:
        num_programs = num_sms(x2.device)
    _ws_walk_kernel[(num_programs, )](
        x_desc, w_desc, o_desc, r_desc, bias if bias is not None else out, M, N, K,
        num_warps=4, maxnreg=register_budget()[0],
        **_constexprs(leaves, stages, bias is not None, residual is not None, num_programs, group_m),
    )
    return out
