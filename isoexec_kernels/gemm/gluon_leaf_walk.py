"""The K-leaf walk of the linear layer as a Gluon kernel for Hopper (sm_90), with 128 x 256 tiles.

What it computes: ``out = x @ w.T (+ bias) (+ residual)`` for bf16 x [M, K], w [N, K], with the
rounding schedule of ``api.py`` in this folder for L K leaves, and the bits of the Triton TMA
kernel (``_gemm_tma_persistent_kernel`` in ``triton_kernels.py``) for the same L:

  * K is cut into blocks of 64 columns (the last zero-padded: the TMA descriptor fills columns
    past K with zeros) and the nb = cdiv(K, 64) blocks into L leaves, leaf j holding blocks
    ``[j*nb//L, (j+1)*nb//L)`` (``reference.leaf_bounds``);
  * a leaf is one fp32 accumulator starting at +0 into which the wgmma k16 steps of its blocks
    are chained in K order (what ``tl.dot`` on a 64-column block lowers to);
  * the leaves are summed left to right in fp32, the first taken as it is;
  * the bias (if any) is added in fp32, then one round-to-nearest-even cast to bf16; the residual
    (if any) is added to that in fp32 and rounded once more (torch's add of two bf16 tensors).

Why a Gluon kernel: each program holds two fp32 tiles, the running sum of the leaves and the leaf
being accumulated. In Triton both live in registers, which caps the walk at 128 x 128 tiles. Here
the running sum lives in shared memory (128 x 256 fp32 = 128 KiB of the 227 KiB a block may
use) and only the leaf is in registers: two 128 x 128 accumulators, one per half of the tile's
columns, 64 + 64 fp32 registers a thread over the two warpgroups (each owns 64 rows). At a leaf's
end the MMAs drain and each half in turn is stored to (leaf 0) or added into (later leaves) its
half of the sum, so at most one half of the sum is in registers at a time; the finished sum is
read back in a row-major layout for the epilogue (bias, rounding, residual, masked stores), when
the accumulators are dead. The TMA loads run ahead through a ring of ``stages`` buffers
across leaf and tile ends; only the MMAs drain there.

Tile and instruction shapes, the column halves, the load width (``block_k`` 16, 32 or 64 columns
a stage: two 32-column loads chain the same k16 steps in the same order as one of 64), the ring,
persistence and the raster are scheduling: each output element gets the same sequence of fp32
operations whatever they are.

The accumulator's start: every leaf's first MMA adds its products to an accumulator zeroed in
registers (``use_acc=True`` on zeros), not ``use_acc=False``. That is what the Triton kernels do:
compiled for sm_90 with Triton 3.6 (the leaf-major walk, the loop per leaf, the one-leaf
128 x 256 launch and the split-K partial kernel), every ``wgmma.mma_async`` has its scale-d
predicate set to true and the accumulator is reset by a select to zeros. The two differ only in
the sign of an exact zero (a leaf whose products are all -0: +0 + -0 = +0, without the +0 it
may stay -0); ``first_use_acc=False`` in the launcher gives the other form, for the probe.

Runs where Gluon imports and the device has compute capability (9, 0)
(:func:`gluon_leaf_walk_supported`); the module imports without triton or a GPU.
"""

from __future__ import annotations

import torch

try:  # pragma: no cover - depends on the machine
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAS_GLUON = False
    gluon = gl = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None


class _Missing:
    """Stand-in for ``gl`` so the kernels' signatures (``X: gl.constexpr``) still evaluate
    without triton; nothing else of it is used then."""

    constexpr = None


if not HAS_GLUON:
    gl = _Missing()


def _jit(fn=None, **kwargs):
    """``gluon.jit`` where Gluon imports; otherwise the plain function, never launched (the
    launcher checks :data:`HAS_GLUON` first)."""
    if fn is None:
        return lambda f: _jit(f, **kwargs)
    return gluon.jit(fn, **kwargs) if HAS_GLUON else fn


BLOCK_M = 128
BLOCK_N = 256
NUM_WARPS = 8      # two warpgroups, 64 rows each
LEAF_BLOCK_K = 64  # the schedule's K block (reference.BLOCK_K): leaf bounds count these
GROUP_M = 8        # the Triton kernel's raster (scheduling only)
SHARED_MEMORY_LIMIT = 232448  # bytes a block may opt in to on sm_90

VARIANTS = ((64, 2), (32, 4), (16, 8))
"""(block_k, stages) pairs that fit beside the 128 KiB running sum: 48, 24 and 12 KiB a stage."""


def shared_memory_bytes(block_k: int, stages: int) -> int:
    """Shared memory the kernel allocates: the fp32 running sum, the operand ring, its barriers."""
    return BLOCK_M * BLOCK_N * 4 + stages * (BLOCK_M + BLOCK_N) * block_k * 2 + stages * 8


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
def _issue_load(x_desc, w_desc, a_bufs, b_bufs, ready, p, total, steps, pid, tiles_m, tiles_n,
                STAGES: gl.constexpr, GROUP: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
    # The producer: load step p of this program's walk (its (p // steps)-th tile, K step
    # p % steps) into ring slot p % STAGES, if there is such a step. Steps run on across leaf
    # and tile ends, so the next leaf's and tile's operands arrive while the MMAs drain.
    if p < total:
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        tm, tn = _tile_coords(pid + (p // steps) * NUM_PROGRAMS, tiles_m, tiles_n, GROUP)
        k = (p % steps) * BK
        s = p % STAGES
        bar = ready.index(s)
        mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        # columns past K (the zero-padded last block) come back as zeros: the same k16 steps on
        # zeros as the Triton kernel's padded block (no load starts past K: whole_loads_past_k)
        tma.async_copy_global_to_shared(x_desc, [tm * BM, k], bar, a_bufs.index(s))
        tma.async_copy_global_to_shared(w_desc, [tn * BN, k], bar, b_bufs.index(s))


@_jit
def _add_leaf(acc, sum_half, leaf):
    # One column half at the end of a leaf, into the running sum: leaf 0 stored as it is (no
    # +0 + p0), a later leaf added. The sum is read in the accumulator's own layout: each thread
    # reads back what it wrote, an fp32 round trip that changes nothing.
    if leaf == 0:
        sum_half.store(acc)
    else:
        sum_half.store(sum_half.load(acc.type.layout) + acc)


@_jit
def _half_epilogue(sum_half, out_ptr, bias_ptr, res_ptr, M, N, stride_om, stride_rm, row0, col0,
                   HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr):
    # One column half of a finished tile, read from shared memory in a row-major layout of
    # 4-element vectors (no bank conflicts with the sum's swizzle; the accumulators are dead by
    # now, and per-element pointers and masks in the accumulator's layout spilled): the bias in
    # fp32, one rounding to bf16, the residual's add in fp32 and its rounding, masked stores at
    # the M / N edges.
    HM: gl.constexpr = sum_half.shape[0]
    HN: gl.constexpr = sum_half.shape[1]
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [8, 1], [1, 0])
    y = sum_half.load(rows_layout)
    rows = row0 + gl.arange(0, HM, layout=gl.SliceLayout(1, rows_layout))
    cols = col0 + gl.arange(0, HN, layout=gl.SliceLayout(0, rows_layout))
    col_ok = cols < N
    if HAS_BIAS:
        bias = gl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(gl.float32)
        y = y + gl.expand_dims(bias, 0)
    y = y.to(out_ptr.dtype.element_ty)
    rows64 = gl.expand_dims(rows.to(gl.int64), 1)
    cols2 = gl.expand_dims(cols, 0)
    ok = gl.expand_dims(rows < M, 1) & gl.expand_dims(col_ok, 0)
    if HAS_RES:
        r = gl.load(res_ptr + rows64 * stride_rm + cols2, mask=ok, other=0.0)
        y = (y.to(gl.float32) + r.to(gl.float32)).to(out_ptr.dtype.element_ty)
    gl.store(out_ptr + rows64 * stride_om + cols2, y, mask=ok)


# M, N and K only bound loops and masks: not specialising them on divisibility by 16 keeps one
# compiled kernel for every batch size (the strides stay specialised: they vectorise the stores)
@_jit(do_not_specialize=["M", "N", "K"])
def _leaf_walk_kernel(x_desc, w_desc, out_ptr, bias_ptr, res_ptr, M, N, K, stride_om, stride_rm,
                      HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, LEAVES: gl.constexpr,
                      STAGES: gl.constexpr, GROUP: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                      FIRST_USE_ACC: gl.constexpr):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    HN: gl.constexpr = BN // 2
    LOADS_PER_BLOCK: gl.constexpr = 64 // BK   # loads per 64-column block of the schedule
    gl.static_assert(BM == 128, "two warpgroups of 64 rows")
    gl.static_assert(LOADS_PER_BLOCK * BK == 64, "block_k must divide the schedule's 64-column block")

    # 8 warps down the rows: warpgroup g owns rows [64 g, 64 g + 64); one wgmma m64n128k16 a
    # warpgroup per k16 step and column half
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                         instr_shape=[16, HN, 16])
    # The running sum, [half, row, column] fp32. Any layout gives the same values (each thread
    # reads back what it wrote); this swizzle of 8-element vectors gives the accumulator layout's
    # loads and stores no bank conflicts (gl.bank_conflicts: 0; 2-element vectors: 3).
    sum_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    sum_smem = gl.allocate_shared_memory(gl.float32, [2, BM, HN], sum_layout)
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    pid = gl.program_id(0)
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    n_tiles = tiles_m * tiles_n
    n_blocks = gl.cdiv(K, 64)
    steps = n_blocks * LOADS_PER_BLOCK          # loads per tile, the zero-padded block included
    my_tiles = gl.cdiv(gl.maximum(n_tiles - pid, 0), NUM_PROGRAMS)
    total = my_tiles * steps

    for p in gl.static_range(STAGES - 1):
        _issue_load(x_desc, w_desc, a_bufs, b_bufs, ready, p, total, steps, pid, tiles_m, tiles_n,
                    STAGES, GROUP, NUM_PROGRAMS)

    g = 0   # this program's step count: ring slot g % STAGES, barrier phase (g // STAGES) & 1
    for t in range(my_tiles):
        tm, tn = _tile_coords(pid + t * NUM_PROGRAMS, tiles_m, tiles_n, GROUP)
        for leaf in range(LEAVES):
            k_lo = (leaf * n_blocks // LEAVES) * LOADS_PER_BLOCK
            k_hi = ((leaf + 1) * n_blocks // LEAVES) * LOADS_PER_BLOCK
            acc0 = gl.zeros([BM, HN], gl.float32, acc_layout)
            acc1 = gl.zeros([BM, HN], gl.float32, acc_layout)
            for ks in range(k_lo, k_hi):
                if FIRST_USE_ACC:
                    use_acc = True            # on the zeroed accumulator, as Triton does
                else:
                    use_acc = ks > k_lo       # the probe's other form: D = A B on the first
                s = g % STAGES
                mbarrier.wait(ready.index(s), (g // STAGES) & 1)
                a = a_bufs.index(s)
                b = b_bufs.index(s)
                # B = the w tile transposed: a permuted view of the K-contiguous [N, K] tile,
                # one view per column half
                acc0 = warpgroup_mma(a, b.slice(0, HN).permute((1, 0)), acc0, use_acc=use_acc,
                                     is_async=True)
                acc1 = warpgroup_mma(a, b.slice(HN, HN).permute((1, 0)), acc1, use_acc=use_acc,
                                     is_async=True)
                # the step before's two MMA groups are done: its slot can be refilled
                acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
                _issue_load(x_desc, w_desc, a_bufs, b_bufs, ready, g + STAGES - 1, total, steps, pid,
                            tiles_m, tiles_n, STAGES, GROUP, NUM_PROGRAMS)
                g += 1
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
            # one half at a time: at most one half of the sum is in registers beside the leaf
            _add_leaf(acc0, sum_smem.index(0), leaf)
            _add_leaf(acc1, sum_smem.index(1), leaf)
        for h in gl.static_range(2):
            _half_epilogue(sum_smem.index(h), out_ptr, bias_ptr, res_ptr, M, N, stride_om, stride_rm,
                           tm * BM, tn * BN + h * HN, HAS_BIAS, HAS_RES)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


def gluon_leaf_walk_supported(device) -> bool:
    """Whether :func:`linear_leaf_walk_gluon` can run on ``device``: Gluon imports and it is a
    CUDA device of compute capability (9, 0) (the kernel is wgmma and TMA, sm_90 only)."""
    device = torch.device(device)
    if not HAS_GLUON or device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def whole_loads_past_k(K: int, block_k: int) -> bool:
    """Whether loads of ``block_k`` columns would start at or past K (the last 64-column block
    less than ``64 - block_k`` full). Those would be boxes wholly outside the tensor, which the
    Triton kernels never load (their boxes at most overhang K); the launcher takes 64-column loads
    then (the same k16 steps on the same zeros: the same bits)."""
    return 0 < K % LEAF_BLOCK_K <= LEAF_BLOCK_K - block_k


def operand_layouts(block_k: int):
    """The NVMMA shared layouts of the x and w tiles (TMA destination and wgmma operand)."""
    return (gl.NVMMASharedLayout.get_default_for([BLOCK_M, block_k], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, block_k], gl.bfloat16))


def compile_sm90(leaves: int, block_k: int = 32, stages: int = 4, has_bias: bool = True,
                 has_res: bool = True, num_programs: int = 132, first_use_acc: bool = True):
    """The kernel compiled for sm_90 without a GPU (``triton.compile``; its ``asm`` holds the
    ttgir and ptx, ``metadata.shared`` the shared memory), specialised as a launch on 16-byte
    aligned tensors with row strides that are multiples of 16 would be."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    a_layout, b_layout = operand_layouts(block_k)
    signature = dict(x_desc=f"tensordesc<bf16[{BLOCK_M}, {block_k}],{a_layout!r}>",
                     w_desc=f"tensordesc<bf16[{BLOCK_N}, {block_k}],{b_layout!r}>",
                     out_ptr="*bf16", bias_ptr="*bf16", res_ptr="*bf16", M="i32", N="i32", K="i32",
                     stride_om="i32", stride_rm="i32")
    constexprs = dict(HAS_BIAS=has_bias, HAS_RES=has_res, LEAVES=leaves, STAGES=stages, GROUP=GROUP_M,
                      NUM_PROGRAMS=num_programs, FIRST_USE_ACC=first_use_acc)
    signature.update({k: "constexpr" for k in constexprs})
    aligned = {(i,): [["tt.divisibility", 16]] for i in (2, 3, 4, 8, 9)}   # the pointers and strides
    src = GluonASTSource(_leaf_walk_kernel, signature, constexprs, aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=NUM_WARPS))


def linear_leaf_walk_gluon(x2: torch.Tensor, w: torch.Tensor, leaves: int, bias: torch.Tensor | None = None,
                           residual: torch.Tensor | None = None, block_k: int = 32, stages: int = 4,
                           num_programs: int | None = None, first_use_acc: bool = True) -> torch.Tensor:
    """``x2 @ w.T (+ bias) (+ residual)`` as [M, N] bf16 with ``leaves`` K leaves: the bits of
    ``linear(x2, w, bias, leaves=leaves, residual=residual)`` (module docstring). x2 [M, K] and
    w [N, K] bf16 row-major with K * 2 a multiple of 16 (TMA strides); bias [N]; residual [M, N]
    with unit column stride. ``block_k`` x ``stages``: the operand ring (:data:`VARIANTS`);
    ``num_programs``: the persistent grid (default one per SM); ``first_use_acc``: module
    docstring (False only for the probe)."""
    if not HAS_GLUON:
        raise RuntimeError("linear_leaf_walk_gluon needs triton's Gluon (triton >= 3.6)")
    M, K = x2.shape
    N = w.shape[0]
    if x2.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or w.shape[1] != K:
        raise ValueError(f"linear_leaf_walk_gluon: bf16 x [M, K] and w [N, K], got {x2.dtype} "
                         f"{tuple(x2.shape)} and {w.dtype} {tuple(w.shape)}")
    if K == 0 or (K * 2) % 16:
        raise ValueError(f"linear_leaf_walk_gluon: K={K}: rows must be non-empty 16-byte multiples (TMA)")
    n_blocks = max(1, -(-K // LEAF_BLOCK_K))
    if not 1 <= leaves <= n_blocks:
        raise ValueError(f"linear_leaf_walk_gluon: {leaves} leaves for {n_blocks} K blocks")
    if LEAF_BLOCK_K % block_k or shared_memory_bytes(block_k, stages) > SHARED_MEMORY_LIMIT:
        raise ValueError(f"linear_leaf_walk_gluon: block_k={block_k} stages={stages} does not fit "
                         f"({shared_memory_bytes(block_k, stages)} bytes of shared memory)")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"linear_leaf_walk_gluon: bias must be [{N}], got {tuple(bias.shape)}")
    if whole_loads_past_k(K, block_k):
        block_k, stages = VARIANTS[0]
    out = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    if M == 0 or N == 0:
        return out
    if residual is not None:
        residual = residual.reshape(M, N)
        if N > 1 and residual.stride(1) != 1:
            residual = residual.contiguous()
    x2 = x2 if x2.is_contiguous() and x2.data_ptr() % 16 == 0 else x2.contiguous()
    w = w if w.is_contiguous() and w.data_ptr() % 16 == 0 else w.contiguous()
    a_layout, b_layout = operand_layouts(block_k)
    x_desc = TensorDescriptor(x2, [M, K], [K, 1], [BLOCK_M, block_k], a_layout)
    w_desc = TensorDescriptor(w, [N, K], [K, 1], [BLOCK_N, block_k], b_layout)
    if num_programs is None:
        num_programs = torch.cuda.get_device_properties(x2.device).multi_processor_count
    _leaf_walk_kernel[(num_programs,)](
        x_desc, w_desc, out, bias if bias is not None else out, residual if residual is not None else out,
        M, N, K, out.stride(0), residual.stride(0) if residual is not None else 0,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, LEAVES=leaves, STAGES=stages,
        GROUP=GROUP_M, NUM_PROGRAMS=num_programs, FIRST_USE_ACC=first_use_acc, num_warps=NUM_WARPS,
    )
    return out
